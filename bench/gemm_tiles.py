"""Per-token time of the Qwen3 embedding models' four GEMMs at each batch token count, cuBLAS as torch
calls it (``F.linear``, bf16): the token count a batch has against the one a prefill CUDA graph pads
it to (SGLang captures 256-token steps from 1,280 to 4,096 and 512-token steps above), and which
cuBLAS kernel each picks. Prints one JSON document; GPU only.

    python3 bench/gemm_tiles.py --out gemm.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

#: (hidden, q heads, kv heads, intermediate) with head_dim 128: the 0.6B's and the 4B's
SHAPES = {"0.6b": (1024, 16, 8, 3072), "4b": (2560, 32, 8, 9728)}


def gemms(hidden: int, q_heads: int, kv_heads: int, inter: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of a decoder layer's four linear layers."""
    return {"qkv": (hidden, (q_heads + 2 * kv_heads) * 128), "o": (q_heads * 128, hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}


def bucket(tokens: int) -> int:
    """The token count SGLang 0.5.17's prefill CUDA graph pads a batch of ``tokens`` to."""
    steps = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, 16385, 512)]
    return next(s for s in steps if s >= tokens)


def time_ms(fn: Any, *args: Any, iters: int) -> float:
    """Mean GPU ms of ``fn(*args)`` over ``iters`` calls after one warm call (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(*args)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernels(fn: Any, *args: Any) -> list[str]:
    """The names of the GPU kernels one call of ``fn(*args)`` launches (torch profiler)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "CUDA" in str(e.device_type)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--step", type=int, default=64)
    a = ap.parse_args()
    rows = []
    for shape, dims in SHAPES.items():
        for name, (k, n) in gemms(*dims).items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(16384, k, device="cuda", dtype=torch.bfloat16)
            for m in sorted({t + d for t in range(1024, 16385, a.step) for d in (0, 8) if t + d <= 16384}):
                ms = time_ms(F.linear, x[:m], w, iters=a.iters)
                rows.append({"shape": shape, "gemm": name, "tokens": m, "ms": round(ms, 5),
                             "us_per_token": round(1000 * ms / m, 5), "bucket": bucket(m),
                             "kernel": max(kernels(F.linear, x[:m], w), key=len, default="?")
                             if m % 2048 in (0, 8) else None})
            print(shape, name, "done", flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cublas": str(torch.backends.cuda.preferred_blas_library()), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main()
