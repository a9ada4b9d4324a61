"""What the gateway knows about the served model, read once from its folder."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from service.settings import ModelSettings


@dataclass(frozen=True)
class ModelCard:
    name: str
    aliases: tuple[str, ...]
    dimension: int
    max_seq_len: int
    query_template: str | None
    default_task: str
    matryoshka_dimensions: tuple[int, ...] | None
    created: int

    def serves(self, model: str) -> bool:
        return model == self.name or model in self.aliases

    @classmethod
    def from_settings(cls, m: ModelSettings) -> ModelCard:
        folder = m.resolved_path
        pooling = folder / "1_Pooling" / "config.json"
        dim = None
        if pooling.exists():
            dim = json.loads(pooling.read_text()).get("word_embedding_dimension")
        if not isinstance(dim, int):
            hidden = m.model_config_json().get("hidden_size")
            if not isinstance(hidden, int):
                raise ValueError(f"cannot tell the embedding size of {folder}")
            dim = hidden
        return cls(
            name=m.served_name,
            aliases=tuple(m.aliases),
            dimension=dim,
            max_seq_len=m.effective_max_seq_len(),
            query_template=m.effective_query_template(),
            default_task=m.default_query_task,
            matryoshka_dimensions=tuple(m.matryoshka_dimensions) if m.matryoshka_dimensions else None,
            created=int(time.time()),
        )
