"""GPU time per 1,000 tokens of a Qwen3 attention's QK-norm and RoPE at the token counts a batch has:
SGLang 0.5.17's dense Qwen3 path (two in-place kernels: ``fused_inplace_qknorm``, then
``apply_rope_with_cos_sin_cache_inplace``) against the one function ``engine.compiled_qk_norm_rope``
runs (``embedserve.engines.compiled_qk.qk_norm_rope``), compiled by torch inductor into fused
Triton kernels; the kernels each launches per call, and how far the outputs differ. Prints one
JSON document; GPU only.

    python3 bench/qk_rope.py --out qk_rope.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from gemm_tiles import kernels, time_ms

from embedserve.engines.compiled_qk import compiled, tokens_dynamic

HEAD_DIM, THETA, EPS, MAX_POSITION = 128, 1_000_000.0, 1e-6, 8193
SHAPES = {"0.6b": (16, 8), "4b": (32, 8)}  # query and key heads (head_dim 128)


def cos_sin_cache(device: torch.device | str = "cpu") -> torch.Tensor:
    """SGLang's RotaryEmbedding cache: per position the cosines, then the sines (float32)."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM)
    freqs = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def sglang_pair(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang 0.5.17's two kernels, in place, as its Qwen3Attention calls them."""
    from sglang.kernels.ops.attention.rope import apply_rope_with_cos_sin_cache_inplace
    from sglang.kernels.ops.layernorm.norm import fused_inplace_qknorm

    heads_q, heads_k = q.view(q.size(0), -1, HEAD_DIM), k.view(k.size(0), -1, HEAD_DIM)
    fused_inplace_qknorm(heads_q, heads_k, q_weight, k_weight, eps, head_dim=HEAD_DIM)
    apply_rope_with_cos_sin_cache_inplace(heads_q, heads_k, cache, positions, is_neox=True)
    return q, k


def inputs(tokens: int, heads: tuple[int, int], seed: int = 0) -> tuple[Any, ...]:
    """A QKV projection's output (q and k as its column views), the norms' weights, the cache and
    positions of 264-token sequences (the short loads' mean)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_width, k_width = heads[0] * HEAD_DIM, heads[1] * HEAD_DIM
    qkv = torch.randn(tokens, q_width + 2 * k_width, device="cuda", generator=g).to(torch.bfloat16)
    weights = [1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16) for _ in "qk"]
    positions = torch.arange(tokens, device="cuda") % 264
    q, k = qkv[:, :q_width], qkv[:, q_width:q_width + k_width]
    return q, k, *weights, EPS, cos_sin_cache("cuda"), positions


def engine_form(q: torch.Tensor, k: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled function as the engine's hook calls it (only the token count symbolic)."""
    return compiled()(*tokens_dynamic(q, k), *rest[:-1], *tokens_dynamic(rest[-1]))


def deviation(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Largest absolute difference and the lowest per-head cosine between two outputs."""
    a, b = a.float().unflatten(-1, (-1, HEAD_DIM)), b.float().unflatten(-1, (-1, HEAD_DIM))
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {"max_abs": round(float((a - b).abs().max()), 6), "min_cosine": round(float(cos.min()), 6)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="4b", choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    rows = []
    for tokens in (256, 1024, 2048, 4096, 8192, 16384):
        args = inputs(tokens, SHAPES[a.shape])
        ours = [t.clone() for t in engine_form(*args)]
        theirs = sglang_pair(args[0].clone(), args[1].clone(), *args[2:])
        pair_ms, pair_kernels = time_ms(sglang_pair, *args, iters=a.iters), len(kernels(sglang_pair, *args))
        fused_ms, fused_kernels = time_ms(engine_form, *args, iters=a.iters), len(kernels(engine_form, *args))
        rows.append({"tokens": tokens, "sglang_ms_per_1k": round(1000 * pair_ms / tokens, 5),
                     "compiled_ms_per_1k": round(1000 * fused_ms / tokens, 5), "sglang_kernels": pair_kernels,
                     "compiled_kernels": fused_kernels, "q": deviation(ours[0], theirs[0]),
                     "k": deviation(ours[1], theirs[1])})
        print(json.dumps(rows[-1]), flush=True)
    doc = {"shape": a.shape, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "per_call": "q and k of one attention layer; a forward calls it once per layer", "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
