"""Random-weight models with sparse and ColBERT outputs, built offline like ``synth_model``'s
checkpoints (no model hub here): speed and memory depend on shapes, not weight values, and tests
check each output against its reference formula on the same checkpoint.

- ``build_bge_m3``: an ``XLMRobertaModel`` with sentence-transformers' CLS pooling and
  normalisation, and FlagEmbedding's two heads beside it (``sparse_linear.pt``: hidden -> 1,
  ``colbert_linear.pt``: hidden -> hidden), as BAAI/bge-m3 ships them (``bge-m3``: its shape,
  XLM-R large with 8,194 positions). The tokenizer is the bundled model's WordPiece, with
  ``[SEP]`` as its end-of-sequence token as XLM-R's ``</s>`` is: the tokens FlagEmbedding drops
  from a sparse vector (cls, eos, pad, unk) are then its frame, as with BGE-M3's own.
- ``build_splade``: a ``BertForMaskedLM`` with sentence-transformers' SparseEncoder files
  (``MLMTransformer`` + ``SpladePooling``: max over positions of log(1 + relu(logits))) and the
  bundled model's tokenizer (bert-base-uncased's vocabulary), as naver/splade-* ship
  (``splade-cocondenser``: bert-base, naver/splade-cocondenser-ensembledistil's shape).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from embedserve.runtime.synth_rerank import BERT, XLMR, copy_tokenizer, scale_weights

M3_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(XLMR, max_position_embeddings=514, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=64),
    "bge-m3": dict(XLMR, max_position_embeddings=8194, hidden_size=1024, num_hidden_layers=24,
                   num_attention_heads=16, intermediate_size=4096),
}
SPLADE_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(BERT, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "splade-cocondenser": dict(BERT, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=3072),
}

SPLADE_BIAS = -4.0


def _module(idx: int, path: str, kind: str) -> dict[str, Any]:
    return {"idx": idx, "name": str(idx), "path": path, "type": kind}


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def build_bge_m3(out: Path, shape: str = "tiny", seed: int = 0) -> Path:
    from transformers import XLMRobertaConfig, XLMRobertaModel

    dims = M3_SHAPES[shape]
    copy_tokenizer(out, one_segment=True, eos="[SEP]")
    config = XLMRobertaConfig(**dims)
    config.architectures = ["XLMRobertaModel"]
    torch.manual_seed(seed)
    model = XLMRobertaModel(config)
    width = dims["hidden_size"]
    scale_weights(model, width)
    model.save_pretrained(out, safe_serialization=True)
    for name, rows in (("sparse_linear", 1), ("colbert_linear", width)):
        head = torch.nn.Linear(width, rows)
        scale_weights(head, width)
        torch.save(head.state_dict(), out / f"{name}.pt")
    st = "sentence_transformers.models."
    _write(out / "modules.json", [_module(0, "", st + "Transformer"), _module(1, "1_Pooling", st + "Pooling"),
                                  _module(2, "2_Normalize", st + "Normalize")])
    _write(out / "sentence_bert_config.json", {"max_seq_length": dims["max_position_embeddings"] - 2,
                                               "do_lower_case": False})
    _write(out / "1_Pooling" / "config.json",
           {"word_embedding_dimension": width, "pooling_mode_cls_token": True,
            "pooling_mode_mean_tokens": False})
    (out / "2_Normalize").mkdir(exist_ok=True)
    return out


def build_splade(out: Path, shape: str = "tiny", seed: int = 0) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    dims = SPLADE_SHAPES[shape]
    copy_tokenizer(out)
    config = BertConfig(**dims)
    config.architectures = ["BertForMaskedLM"]
    torch.manual_seed(seed)
    model = BertForMaskedLM(config)
    scale_weights(model, dims["hidden_size"])
    # logits then spread about 1 around the output bias: at -4, few are above 0 and an input of
    # 64 tokens keeps a few dozen ids, as trained SPLADE models do (at 0: nine in ten of the vocabulary)
    torch.nn.init.constant_(model.cls.predictions.bias, SPLADE_BIAS)
    model.save_pretrained(out, safe_serialization=True)
    sparse = "sentence_transformers.sparse_encoder.models."
    _write(out / "modules.json", [_module(0, "", sparse + "MLMTransformer"),
                                  _module(1, "1_SpladePooling", sparse + "SpladePooling")])
    _write(out / "sentence_bert_config.json", {"max_seq_length": dims["max_position_embeddings"],
                                               "do_lower_case": False})
    _write(out / "1_SpladePooling" / "config.json", {"pooling_strategy": "max", "activation_function": "relu",
                                                     "word_embedding_dimension": dims["vocab_size"]})
    _write(out / "config_sentence_transformers.json", {"model_type": "SparseEncoder",
                                                       "similarity_fn_name": "dot"})
    return out
