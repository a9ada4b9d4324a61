"""What the gateway serves beyond ``/v1/embeddings``: the limits of the rerank and score routes
(``EMBEDSERVE_SERVED__RERANK__<FIELD>``).

One field of ``Settings`` (``served``) holds it, so the main configuration module stays as it is.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class RerankLimits(BaseModel):
    """Per request of ``/v1/rerank``, ``/rerank``, ``/v2/rerank`` and ``/v1/score``."""

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


class ServedSettings(BaseModel):
    """The routes beside ``/v1/embeddings`` and their limits."""

    rerank: RerankLimits = Field(default_factory=RerankLimits)
