"""Build Qwen3-Embedding-style checkpoints offline: a real byte-level BPE tokenizer that
appends ``<|endoftext|>`` like Qwen3-Embedding's, a random-weight ``Qwen3ForCausalLM`` and
the sentence-transformers files (last-token pooling, normalise) the real repos ship.

Used by tests (tiny shapes, CPU) and by the GPU benchmarks (the real 0.6B / 4B shapes), where no
model hub is reachable. Speed and memory depend on shapes, not weight values.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"

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

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "be",
    "are",
    "was",
    "an",
    "or",
    "not",
    "memory",
    "model",
    "token",
    "embedding",
    "query",
    "passage",
    "search",
    "retrieve",
    "document",
    "vector",
    "server",
    "gpu",
    "cache",
    "batch",
    "length",
    "kernel",
    "attention",
    "layer",
    "weight",
    "normal",
    "pool",
    "request",
    "response",
    "error",
    "limit",
    "health",
    "probe",
    "restart",
    "pod",
    "cluster",
    "graph",
    "index",
    "score",
    "rank",
    "answer",
    "question",
    "def",
    "return",
    "import",
    "class",
    "self",
    "print",
    "value",
    "list",
    "dict",
    "string",
    "number",
    "time",
    "data",
    "file",
]
_EXTRA = ["数据", "模型", "向量", "检索", "你好", "世界", "😀", "🚀", "naïve", "café", "{}", "()"]


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = _WORDS + _EXTRA
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 24))) for _ in range(n_lines)]


def build_tokenizer(vocab_size: int = 4096) -> Any:
    """A byte-level BPE (any text encodes) whose post-processor appends EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {EOS}:0", pair=f"$A:0 {EOS}:0 $B:1 {EOS}:1", special_tokens=[(EOS, eos_id)]
    )
    return tok


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


def write_tokenizer_files(out: Path, vocab_size: int = 4096, model_max_length: int = 32768) -> int:
    """Write tokenizer.json + tokenizer_config.json; returns the EOS id."""
    tok = build_tokenizer(vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "model_max_length": model_max_length,
                "padding_side": "left",
            }
        )
    )
    return int(tok.token_to_id(EOS))


def build_model(
    out: Path,
    shape: str = "tiny",
    seed: int = 0,
    max_seq_length: int = 512,
    device: str = "cpu",
    tokenizer_vocab: int = 4096,
) -> Path:
    """A complete model folder: weights (bf16 on GPU, fp32 on CPU), tokenizer, ST config."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    eos_id = write_tokenizer_files(out, tokenizer_vocab)
    dims = dict(SHAPES[shape])
    vocab = tokenizer_vocab if shape == "tiny" else (151669 if shape == "0.6b" else 151665)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
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
    write_sentence_transformers_files(out, max_seq_length, dims["hidden_size"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="embedserve synth-model", description=__doc__)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seq-length", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    build_model(a.out, a.shape, a.seed, a.max_seq_length, a.device)
    print(f"wrote {a.shape} model to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
