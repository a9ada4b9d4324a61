"""Random-weight rerankers, built offline like ``synth_model``'s embedding checkpoints (no model
hub here): speed and memory depend on shapes, not weight values, and tests compare the service's
scores with a plain transformers forward of the same checkpoint.

- ``build_cross_encoder``: a cross-encoder with one label and the bundled all-MiniLM-L6-v2's
  tokenizer: a ``BertForSequenceClassification`` (``tiny``; ``minilm-l6`` is
  ms-marco-MiniLM-L-6-v2's shape) or an ``XLMRobertaForSequenceClassification`` with one segment
  type, as the bge-rerankers are (``tiny-xlmr``; ``bge-reranker-v2-m3``, XLM-R large with 8,194
  positions), which SGLang serves from token ids (it takes segment types only from text);
- Qwen3-Reranker: ``synth_model.build_qwen3_reranker``;
- models with sparse and ColBERT outputs (BGE-M3, SPLADE): ``synth_hybrid``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from embedserve.contracts.models import BUNDLED_MODEL, resolve_model_path

BERT = dict(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)
#: XLM-R's vocabulary (so the embedding table weighs what the real one does), one segment type;
#: positions count from the pad id + 1, so 8,194 hold 8,192 tokens; SGLang 0.5.17 reads
#: position_embedding_type, which transformers 5 no longer writes by default
XLMR = dict(vocab_size=250002, type_vocab_size=1, pad_token_id=0, position_embedding_type="absolute")
CROSS_ENCODER_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(BERT, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "minilm-l6": dict(BERT, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                      intermediate_size=1536),
    "tiny-xlmr": dict(XLMR, max_position_embeddings=514, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64),
    "bge-reranker-v2-m3": dict(XLMR, max_position_embeddings=8194, hidden_size=1024, num_hidden_layers=24,
                               num_attention_heads=16, intermediate_size=4096),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def build_cross_encoder(out: Path, shape: str = "tiny", seed: int = 0) -> Path:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    dims = CROSS_ENCODER_SHAPES[shape]
    xlmr = dims["type_vocab_size"] == 1
    copy_tokenizer(out, one_segment=xlmr)
    classes: tuple[Any, Any] = (
        (XLMRobertaConfig, XLMRobertaForSequenceClassification)
        if xlmr
        else (BertConfig, BertForSequenceClassification)
    )
    config = classes[0](**{"num_labels": 1, **dims})
    config.architectures = [classes[1].__name__]
    torch.manual_seed(seed)
    model = classes[1](config)
    scale_weights(model, dims["hidden_size"])
    model.save_pretrained(out, safe_serialization=True)
    return out


def copy_tokenizer(out: Path, one_segment: bool = False, eos: str | None = None) -> None:
    """The bundled model's tokenizer files into ``out``; ``one_segment``: the tokenizer hands out
    no token types (a model with one segment type must not get type 1 for a second text);
    ``eos``: the token it names its end of sequence."""
    source = resolve_model_path(BUNDLED_MODEL)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    if one_segment:
        tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"]
    if eos is not None:
        tokenizer_config["eos_token"] = eos
        special = json.loads((out / "special_tokens_map.json").read_text())
        (out / "special_tokens_map.json").write_text(json.dumps({**special, "eos_token": eos}, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def scale_weights(model: torch.nn.Module, width: int) -> None:
    """Every matrix drawn at 1/sqrt(width): larger than the default init, so that scores spread,
    and small enough that each layer keeps the activations' scale: deeper and wider at 0.2, the
    network turned chaotic and bf16 scores differed from fp32 ones by up to 0.36 (after the sigmoid)."""
    std = float(width) ** -0.5
    for name, p in model.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
