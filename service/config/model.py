"""What is served: ``EMBEDSERVE_MODEL__<FIELD>``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from embedserve.contracts.models import BUNDLED_MODEL, resolve_model_path


class ModelSettings(BaseModel):
    """What is served, and how its inputs are shaped."""

    model_config = ConfigDict(extra="forbid")

    path: str = BUNDLED_MODEL
    name: str | None = Field(None, description="model id clients send; default: folder name")
    aliases: list[str] = Field(default_factory=list, description="other ids accepted for it")
    max_seq_len: int | None = Field(
        None,
        ge=8,
        description="longest input in tokens, special tokens included; drives gateway "
        "truncation, SGLang --context-length, prefill sizes and the KV pool. Default: "
        "sentence-transformers' max_seq_length, else the model's positions, capped at 8192",
    )
    default_query_task: str = "Given a web search query, retrieve relevant passages that answer the query"
    query_template: str | None = Field(
        None,
        description="instruction format for queries; default: Qwen3-Embedding's "
        "'Instruct: {task}\\nQuery:{text}' for Qwen3 models, none otherwise",
    )
    matryoshka_dimensions: list[int] | None = None
    long_inputs: Literal["truncate", "chunk"] = Field(
        "truncate",
        description="what /v1/embeddings does with an input over max_seq_len when the request sends "
        "no truncate: cut it, or embed it whole in windows of the cap pooled into one vector (chunk)",
    )
    chunk_overlap_tokens: int = Field(
        0, ge=0, description="tokens neighbouring windows share when an input is embedded whole"
    )

    @property
    def resolved_path(self) -> Path:
        return resolve_model_path(self.path)

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.path == BUNDLED_MODEL:
            return "all-MiniLM-L6-v2"
        return Path(self.path).name or self.path
