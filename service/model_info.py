"""What the service knows about the model it serves, read from its folder once at start
and passed down (the gateway, the launchers and the CPU engine all use the same figures)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from embedserve.config import ModelSettings
from embedserve.contracts.wire import Output
from embedserve.settings_errors import ConfigError

#: How a model mistake names the setting (``up``, ``gateway`` and ``config`` take the flags); a
#: model of ``served.models`` names its entry's field instead (``catalog.py``).
MODEL_SETTINGS = {
    "path": "EMBEDSERVE_MODEL__PATH (--model)",
    "max_seq_len": "EMBEDSERVE_MODEL__MAX_SEQ_LEN (--max-seq-len)",
}
Setting = Callable[[str], str]
MODEL_ACCEPTS = "a sentence-transformers or Hugging Face model folder, or bundled:all-MiniLM-L6-v2"

#: The longest context we default to: Qwen3-Embedding accepts 32k, but 8192 keeps the
#: activation memory of one sequence bounded; raise ``model.max_seq_len`` to go further.
DEFAULT_MAX_SEQ_LEN_CAP = 8192
QWEN3_QUERY_TEMPLATE = "Instruct: {task}\nQuery:{text}"

#: How a model scores a query-document pair: ``cosine`` (an embedding model's vectors),
#: ``cross-encoder`` (a ``*ForSequenceClassification`` with one label: its logit) or
#: ``qwen3-reranker`` (Qwen3-Reranker, a causal LM: the logit of "yes" over "no" after its prompt).
Scoring = Literal["cosine", "cross-encoder", "qwen3-reranker"]
#: Sequence-classification models read as cross-encoders (their tokenizers frame a pair).
CROSS_ENCODER_TYPES = ("bert", "xlm-roberta", "roberta", "distilbert", "electra", "camembert")
#: BGE-M3's sparse and ColBERT heads, state dicts of a ``torch.nn.Linear`` each, beside the model
#: as BAAI/bge-m3 ships them and FlagEmbedding loads them (both, or neither)
M3_HEAD_FILES = ("sparse_linear.pt", "colbert_linear.pt")


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
    created: int
    scoring: Scoring = "cosine"
    #: what the model gives for an input (``outputs_of``)
    outputs: tuple[Output, ...] = ("dense",)
    #: config.json as read at start, so that no later check opens it again
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def serves(self, model: str) -> bool:
        return model == self.name or model in self.aliases

    @property
    def model_type(self) -> str:
        """config.json's ``model_type`` ("" where it names none)."""
        return str(self.config.get("model_type", ""))

    @property
    def is_qwen3(self) -> bool:
        """Any Qwen3 family member (dense or MoE), which takes Qwen3-Embedding's query template."""
        return self.model_type.startswith("qwen3")

    @property
    def embeds(self) -> bool:
        """An embedding model (it also scores pairs, by cosine); else a reranker."""
        return self.scoring == "cosine"

    @classmethod
    def load(cls, m: ModelSettings, setting: Setting = MODEL_SETTINGS.__getitem__) -> ModelInfo:
        """``setting``: how a mistake names a field of ``m`` (``"path"`` -> its variable)."""
        folder = model_folder(m, setting)
        config = _read_json(folder / "config.json", setting)
        dim = _read_json(folder / "1_Pooling" / "config.json", setting).get("word_embedding_dimension")
        if not isinstance(dim, int):
            dim = config.get("hidden_size")
        if not isinstance(dim, int):
            raise ConfigError(
                f"{setting('path')} must be {MODEL_ACCEPTS}, but {folder} holds no model (no "
                "config.json with hidden_size, nor 1_Pooling/config.json)"
            )
        scoring = scoring_of(folder, config, setting)
        positions = model_positions(config)
        if m.max_seq_len is not None and positions is not None and m.max_seq_len > positions:
            raise ConfigError(
                f"{setting('max_seq_len')} must be at most {positions}, the longest input the model has "
                f"positions for (max_position_embeddings in {folder / 'config.json'}), got {m.max_seq_len}"
            )
        outputs = outputs_of(folder, config) if scoring == "cosine" else ("dense",)
        if scoring != "cosine":
            dim = 1  # an engine answers one score per input
        elif "dense" not in outputs:
            dim = int(config.get("vocab_size") or dim)  # SPLADE: a weight per vocabulary id
        if m.query_template is not None:
            template = m.query_template or None
        else:
            qwen3 = str(config.get("model_type", "")).startswith("qwen3")  # is_qwen3, before self exists
            template = QWEN3_QUERY_TEMPLATE if qwen3 else None
        return cls(
            path=folder,
            name=m.served_name,
            aliases=tuple(m.aliases),
            dimension=dim,
            max_seq_len=m.max_seq_len or _default_max_seq_len(folder, config, setting),
            query_template=template,
            default_task=m.default_query_task,
            matryoshka_dimensions=tuple(m.matryoshka_dimensions) if m.matryoshka_dimensions else None,
            created=int(time.time()),
            scoring=scoring,
            outputs=outputs,
            config=config,
        )


def scoring_of(
    folder: Path, config: dict[str, Any], setting: Setting = MODEL_SETTINGS.__getitem__
) -> Scoring:
    """From the folder: a ``*ForSequenceClassification`` of a BERT-like type is a cross-encoder (one
    label, its logit); a Qwen3 causal LM without sentence-transformers' pooling is Qwen3-Reranker;
    the rest are embedding models. ``ConfigError`` for a classifier that cannot rank."""
    archs = [str(a) for a in config.get("architectures") or []]
    model_type = str(config.get("model_type", ""))
    if any(a.endswith("ForSequenceClassification") for a in archs):
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels") or 1)
        if model_type not in CROSS_ENCODER_TYPES or labels != 1:
            raise ConfigError(
                f"{setting('path')}: {folder} is a {archs[0]} with {labels} label(s); a reranker here is a "
                f"cross-encoder of type {', '.join(CROSS_ENCODER_TYPES)} with one label (its relevance logit)"
            )
        return "cross-encoder"
    pooled = (folder / "modules.json").exists() or (folder / "1_Pooling").exists()
    if model_type == "qwen3" and "Qwen3ForCausalLM" in archs and not pooled:
        return "qwen3-reranker"
    return "cosine"


def outputs_of(folder: Path, config: dict[str, Any]) -> tuple[Output, ...]:
    """BGE-M3 (its two head files beside the model): dense, sparse and ColBERT from one forward;
    SPLADE (sentence-transformers' ``SpladePooling`` in modules.json, or a ``*ForMaskedLM`` with no
    sentence-transformers files): sparse only; any other embedding model: dense. A masked LM with
    sentence-transformers pooling (all-mpnet-base-v2 is saved as ``MPNetForMaskedLM``) is dense."""
    if all((folder / name).is_file() for name in M3_HEAD_FILES):
        return ("dense", "sparse", "colbert")
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        modules = None
    listed = modules if isinstance(modules, list) else []
    kinds = [str(m.get("type", "")) for m in listed if isinstance(m, dict)]
    archs = [str(a) for a in config.get("architectures") or []]
    plain_mlm = modules is None and not (folder / "1_Pooling").exists()
    if any(k.endswith("SpladePooling") for k in kinds) or (
        plain_mlm and any(a.endswith("ForMaskedLM") for a in archs)
    ):
        return ("sparse",)
    return ("dense",)


def model_folder(m: ModelSettings, setting: Setting = MODEL_SETTINGS.__getitem__) -> Path:
    """The folder ``model.path`` names; ``ConfigError`` when there is none."""
    try:
        folder = m.resolved_path
    except FileNotFoundError as exc:
        raise ConfigError(f"{setting('path')}: {exc}") from None
    if not folder.exists():
        raise ConfigError(f"{setting('path')} must be {MODEL_ACCEPTS}, but {folder} does not exist")
    if not folder.is_dir():
        raise ConfigError(f"{setting('path')} must be {MODEL_ACCEPTS}, but {folder} is not a folder")
    return folder


def _read_json(path: Path, setting: Setting) -> dict[str, Any]:
    """A JSON object file; ``{}`` when absent; ``ConfigError`` when it is not JSON."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{setting('path')}: {path} cannot be read as JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def model_positions(config: dict[str, Any]) -> int | None:
    """The longest input the model has position embeddings for, where its config says."""
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        positions -= 2  # RoBERTa's positions start after the padding index (514 rows, 512 tokens)
    return positions


def _default_max_seq_len(folder: Path, config: dict[str, Any], setting: Setting) -> int:
    """sentence-transformers' max_seq_length, else the model's positions capped at 8192."""
    st_max = _read_json(folder / "sentence_bert_config.json", setting).get("max_seq_length")
    if isinstance(st_max, int):
        return st_max
    positions = model_positions(config)
    return 512 if positions is None else min(positions, DEFAULT_MAX_SEQ_LEN_CAP)
