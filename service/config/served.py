"""What the gateway serves: the limits of the rerank and score routes
(``EMBEDSERVE_SERVED__RERANK__<FIELD>``), and several models behind one gateway
(``EMBEDSERVE_SERVED__MODELS``, a JSON list).

The ``served`` section of ``Settings``.
``service/catalog.py`` turns the list into one ``Settings`` per model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from embedserve.config.engine import EngineSettings
from embedserve.settings_errors import nearest


class RerankLimits(BaseModel):
    """Per request of ``/v1/rerank``, ``/rerank``, ``/v2/rerank`` and ``/v1/score``."""

    model_config = ConfigDict(extra="forbid")

    max_documents: int = Field(
        1000,
        ge=1,
        description="documents of one rerank request (pairs of one score request); Cohere's limit. "
        "More: 400 too_many_documents",
    )
    max_tokens_per_request: int = Field(
        300_000,
        ge=1,
        description="tokens one request may send to the engines, all its pairs together (a cross-encoder "
        "reads the query once per document; an embedding model embeds it once). More: 400",
    )


class ServedModel(BaseModel):
    """One model of several: what it is, where it lies, its cap and its engines."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["embed", "rerank"] = Field(
        description="embed: /v1/embeddings (and rerank by cosine); rerank: a cross-encoder or "
        "Qwen3-Reranker, /v1/rerank and /v1/score only"
    )
    path: str = Field(description="its folder (or bundled:all-MiniLM-L6-v2)")
    name: str | None = Field(None, description="the id clients send; default: the folder's name")
    aliases: list[str] = Field(default_factory=list)
    max_seq_len: int | None = Field(None, ge=8, description="its cap (default: from the folder)")
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="its engines: any engine.* setting (kind, port, urls, replicas, engines_per_gpu, "
        "batch_token_budget, kv_pool_tokens, ...), over the engine section's. Ports default to the "
        "next free ones after the model before",
    )
    max_tokens_in_flight: int | None = Field(
        None, ge=1, description="its admission bound (default: gateway.max_tokens_in_flight's rule)"
    )
    long_inputs: Literal["truncate", "chunk"] = Field(
        "truncate", description="an over-long input without truncate in the request: cut, or embedded whole"
    )
    chunk_overlap_tokens: int = Field(0, ge=0, description="tokens neighbouring windows share")

    @field_validator("engine")
    @classmethod
    def _engine_settings_only(cls, engine: dict[str, Any]) -> dict[str, Any]:
        """A misspelt key would otherwise be dropped and its engine started with the default;
        the values are checked when the entry's engine settings are built (``catalog.py``)."""
        known = EngineSettings.model_fields
        for key in engine:
            if key not in known:
                raise ValueError(f"has no setting {key!r}; it takes engine.* settings{nearest(key, known)}")
        return engine


class ServedSettings(BaseModel):
    """The routes beside ``/v1/embeddings``, their limits, and the models."""

    model_config = ConfigDict(extra="forbid")

    rerank: RerankLimits = Field(default_factory=RerankLimits)
    models: list[ServedModel] = Field(
        default_factory=list,
        description="several models behind one gateway, routed by the request's model; empty: the "
        "one of the model and engine sections. Rerank requests without a model go to the first rerank one",
    )
