"""Random-weight rerankers, built offline like ``synth_model``'s embedding checkpoints (no model
hub here): speed and memory depend on shapes, not weight values, and tests compare the service's
scores with a plain transformers forward of the same checkpoint.

- ``build_cross_encoder``: a ``BertForSequenceClassification`` with one label and the bundled
  all-MiniLM-L6-v2's tokenizer; the ``minilm-l6`` shape is ms-marco-MiniLM-L-6-v2's;
- Qwen3-Reranker: ``synth_model.build_qwen3_reranker``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from embedserve.contracts.models import BUNDLED_MODEL, resolve_model_path

CROSS_ENCODER_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "minilm-l6": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def build_cross_encoder(out: Path, shape: str = "tiny", seed: int = 0) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    source = resolve_model_path(BUNDLED_MODEL)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    dims: dict[str, Any] = dict(
        vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, num_labels=1,
        **CROSS_ENCODER_SHAPES[shape],
    )
    config = BertConfig(**dims)
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(seed)
    model: Any = BertForSequenceClassification(config)
    for name, p in model.named_parameters():  # larger than the default init, so scores spread
        if name.endswith("weight") and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out
