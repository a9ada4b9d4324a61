"""What the service knows about the model it serves, read from its folder once at start
and passed down (the gateway, the launchers and the CPU engine all use the same figures)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedserve.config import ModelSettings
from embedserve.settings_errors import ConfigError

#: How a model-folder mistake names the setting (``up``, ``gateway`` and ``config`` take the flag).
MODEL_SETTING = "EMBEDSERVE_MODEL__PATH (--model)"
MODEL_ACCEPTS = "a sentence-transformers or Hugging Face model folder, or bundled:all-MiniLM-L6-v2"

#: The longest context we default to: Qwen3-Embedding accepts 32k, but 8192 keeps the
#: activation memory of one sequence bounded; raise ``model.max_seq_len`` to go further.
DEFAULT_MAX_SEQ_LEN_CAP = 8192
QWEN3_QUERY_TEMPLATE = "Instruct: {task}\nQuery:{text}"


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    aliases: tuple[str, ...]
    dimension: int
    max_seq_len: int
    query_template: str | None
    default_task: str
    matryoshka_dimensions: tuple[int, ...] | None
    is_qwen3: bool
    created: int

    def serves(self, model: str) -> bool:
        return model == self.name or model in self.aliases

    @classmethod
    def load(cls, m: ModelSettings) -> ModelInfo:
        folder = model_folder(m)
        config = _read_json(folder / "config.json")
        dim = _read_json(folder / "1_Pooling" / "config.json").get("word_embedding_dimension")
        if not isinstance(dim, int):
            dim = config.get("hidden_size")
        if not isinstance(dim, int):
            raise ConfigError(
                f"{MODEL_SETTING} must be {MODEL_ACCEPTS}, but {folder} holds no model (no "
                "config.json with hidden_size, nor 1_Pooling/config.json)"
            )
        is_qwen3 = str(config.get("model_type", "")).startswith("qwen3")
        if m.query_template is not None:
            template = m.query_template or None
        else:
            template = QWEN3_QUERY_TEMPLATE if is_qwen3 else None
        return cls(
            path=folder,
            name=m.served_name,
            aliases=tuple(m.aliases),
            dimension=dim,
            max_seq_len=m.max_seq_len or _default_max_seq_len(folder, config),
            query_template=template,
            default_task=m.default_query_task,
            matryoshka_dimensions=tuple(m.matryoshka_dimensions) if m.matryoshka_dimensions else None,
            is_qwen3=is_qwen3,
            created=int(time.time()),
        )


def model_folder(m: ModelSettings) -> Path:
    """The folder ``model.path`` names; ``ConfigError`` when there is none."""
    try:
        folder = m.resolved_path
    except FileNotFoundError as exc:
        raise ConfigError(f"{MODEL_SETTING}: {exc}") from None
    if not folder.exists():
        raise ConfigError(f"{MODEL_SETTING} must be {MODEL_ACCEPTS}, but {folder} does not exist")
    if not folder.is_dir():
        raise ConfigError(f"{MODEL_SETTING} must be {MODEL_ACCEPTS}, but {folder} is not a folder")
    return folder


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; ``{}`` when absent; ``ConfigError`` when it is not JSON."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{MODEL_SETTING}: {path} cannot be read as JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _default_max_seq_len(folder: Path, config: dict[str, Any]) -> int:
    """sentence-transformers' max_seq_length, else the model's positions capped at 8192."""
    st_max = _read_json(folder / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(st_max, int):
        return st_max
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int):
        return min(positions, DEFAULT_MAX_SEQ_LEN_CAP)
    return 512
