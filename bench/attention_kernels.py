"""Why FlashInfer and FA3 give the 4B the same vectors: the two prefill kernels side by side.

    FLASHINFER_WORKSPACE_BASE=/tmp/fi-cache python bench/attention_kernels.py --out kernels.json

SGLang's flashinfer backend runs FlashInfer's prefill (backend "auto", which on Hopper picks
FlashInfer's own FA3-derived sm90 kernels); its fa3 backend runs sgl-kernel's FlashAttention-3.
Both get the same bf16 q/k/v here, with the Qwen3-Embedding-4B's heads (32 query, 8 KV, dim 128),
causal, over a batch of the seed mix's lengths. Printed: which backend FlashInfer chose, whether
the outputs are bitwise equal, and each kernel's largest difference from an fp32 reference.
Needs a CUDA GPU, flashinfer and sgl_kernel; a part that fails is recorded with its error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-Embedding-4B
LENGTHS = (37, 190, 511, 1024, 2047, 4096)
SCALE = 1 / math.sqrt(HEAD_DIM)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Causal attention in fp32, one sequence at a time."""
    outs = []
    for a, b in itertools.pairwise(cu):
        qs, ks, vs = (x[a:b].float().transpose(0, 1) for x in (q, k, v))  # heads first
        ks, vs = (x.repeat_interleave(Q_HEADS // KV_HEADS, dim=0) for x in (ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


def flashinfer_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_t: torch.Tensor) -> torch.Tensor:
    import flashinfer

    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="auto")
    wrapper.plan(cu_t, cu_t, Q_HEADS, KV_HEADS, HEAD_DIM, causal=True, sm_scale=SCALE, q_data_type=q.dtype,
                 kv_data_type=k.dtype)
    return wrapper.run(q, k, v)


def flashinfer_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_t: torch.Tensor) -> torch.Tensor:
    """Page size 1, as SGLang's token-to-KV pool lays it out (the path inside its CUDA graphs)."""
    import flashinfer

    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="auto")
    indices = torch.arange(k.shape[0], dtype=torch.int32, device=q.device)
    last = torch.ones(cu_t.numel() - 1, dtype=torch.int32, device=q.device)
    wrapper.plan(cu_t, cu_t, indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, 1, causal=True, sm_scale=SCALE,
                 q_data_type=q.dtype, kv_data_type=k.dtype)
    return wrapper.run(q, (k.unsqueeze(1), v.unsqueeze(1)))


def fa3_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_t: torch.Tensor) -> torch.Tensor:
    from sgl_kernel.flash_attn import flash_attn_varlen_func

    longest = int((cu_t[1:] - cu_t[:-1]).max())
    out = flash_attn_varlen_func(q, k, v, cu_t, cu_t, max_seqlen_q=longest, max_seqlen_k=longest,
                                 softmax_scale=SCALE, causal=True)
    return out[0] if isinstance(out, tuple) else out


def fa3_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_t: torch.Tensor) -> torch.Tensor:
    """Page size 1 with a page table, as SGLang's fa3 backend calls it for an extend batch."""
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    lens = cu_t[1:] - cu_t[:-1]
    table = torch.zeros(lens.numel(), int(lens.max()), dtype=torch.int32, device=q.device)
    for i, (a, n) in enumerate(zip(cu_t[:-1].tolist(), lens.tolist(), strict=False)):
        table[i, :n] = torch.arange(a, a + n, dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(q, k.unsqueeze(1), v.unsqueeze(1), page_table=table,
                                  cache_seqlens=lens.int(), cu_seqlens_q=cu_t, max_seqlen_q=int(lens.max()),
                                  softmax_scale=SCALE, causal=True)
    return out[0] if isinstance(out, tuple) else out


KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "flashinfer-ragged": flashinfer_ragged, "flashinfer-paged": flashinfer_paged,
    "fa3-varlen": fa3_varlen, "fa3-paged": fa3_paged}


def compare(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    dev, cu = torch.device("cuda"), [0, *itertools.accumulate(LENGTHS)]
    q = torch.randn(cu[-1], Q_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(cu[-1], KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    ref = reference(q, k, v, cu)
    outs: dict[str, torch.Tensor] = {}
    report: dict[str, Any] = {"lengths": LENGTHS, "heads": [Q_HEADS, KV_HEADS, HEAD_DIM], "kernels": {}}
    for name, fn in KERNELS.items():
        try:
            out = fn(q, k, v, cu_t).reshape(ref.shape)
            torch.cuda.synchronize()
        except Exception as exc:  # a missing kernel or API: recorded, the others still run
            report["kernels"][name] = {"error": repr(exc)[:500]}
            continue
        outs[name] = out
        report["kernels"][name] = {"max_abs_diff_vs_fp32": float((out.float() - ref).abs().max())}
    pairs = list(itertools.combinations(sorted(outs), 2))
    report["bitwise_equal"] = {f"{a} = {b}": bool(torch.equal(outs[a], outs[b])) for a, b in pairs}
    report["max_abs_diff"] = {f"{a} - {b}": float((outs[a].float() - outs[b].float()).abs().max())
                              for a, b in pairs}
    try:
        from flashinfer.utils import determine_attention_backend

        report["flashinfer_auto_picks"] = determine_attention_backend(
            dev, 0, False, False, torch.bfloat16, torch.bfloat16, head_dim_qk=HEAD_DIM, head_dim_vo=HEAD_DIM)
    except Exception as exc:
        report["flashinfer_auto_picks"] = repr(exc)[:300]
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the report here as JSON too")
    a = ap.parse_args(argv)
    text = json.dumps(compare(), indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
