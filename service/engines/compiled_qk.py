"""Each dense Qwen3 attention's QK-norm and RoPE as one function torch inductor compiles
(``engine.compiled_qk_norm_rope``; off by default, not yet measured in a server).

SGLang 0.5.17's ``Qwen3Attention.forward_prepare_native`` normalises q and k in place (one kernel)
and rotates them (another): two passes over q and k, 0.43 GPU ms per 1,000 of the 4B's tokens on one
H200, where vLLM, whose compiler fuses that work into its own kernels, runs no separate pass for
either (docs/PERFORMANCE.md). The AROUND hook here projects QKV as SGLang does, then runs
:func:`qk_norm_rope`, compiled once per process with only the token count symbolic, in place of the
two kernels; ``bench/qk_rope.py`` times the two forms alone on a GPU. SGLang's own method runs where
the function does not fit (:func:`unfit`), for a one-token batch, from the first time the compiled
function fails outside a capture (logged once), and while a CUDA graph is being captured before the
function has run: compiling inside a capture would break it, and SGLang runs each graph's batch
size eagerly before capturing it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger("embedserve.compiled_qk")

TARGET = "sglang.srt.models.qwen3.Qwen3Attention.forward_prepare_native"
#: head sizes SGLang 0.5.17's fused QK-norm kernel takes (kernels/ops/layernorm/norm.py); else its RMSNorm
FUSED_HEAD_DIMS = (64, 128, 256, 512, 1024)
_state: dict[str, Any] = {"compiled": None, "ran": False, "failed": None, "logged": set()}


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both steps on ``[tokens, heads * head_dim]`` views, in new tensors: each head's RMSNorm in
    fp32 times its weight, rounded to the input's dtype where SGLang's norm kernel writes it, then
    the rotation (neox halves; ``cache`` holds each position's cosines, then its sines) in fp32,
    rounded once more: SGLang's two kernels' arithmetic."""
    head_dim = q_weight.numel()
    cos, sin = cache[positions].float().unsqueeze(1).chunk(2, dim=-1)

    def one(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.unflatten(-1, (-1, head_dim)).float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(dtype).float()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype).flatten(-2)

    return one(q, q_weight), one(k, k_weight)


def unfit(attention: Any) -> str | None:
    """Why :func:`qk_norm_rope` cannot stand in for this attention's two kernels, or None."""
    rope, d = attention.rotary_emb, attention.head_dim
    if type(rope).__name__ != "RotaryEmbedding" or rope.rotary_dim != d or rope.head_size != d:
        return f"{type(rope).__name__} over {rope.rotary_dim} of {d} dims, not plain RoPE over the whole head"
    if not rope.is_neox_style:
        return "interleaved (GPT-J) RoPE"
    if attention.q_norm.variance_epsilon != attention.k_norm.variance_epsilon:
        return "q and k norms with different eps"
    if attention.q_norm.weight.dtype != torch.bfloat16:
        return f"norm weights in {attention.q_norm.weight.dtype}, not bfloat16"
    if d not in FUSED_HEAD_DIMS or getattr(rope, "use_fallback_kernel", False):
        return f"SGLang runs its unfused norm or RoPE for head_dim {d} here, whose rounding differs"
    if os.environ.get("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", "").lower() in ("1", "true"):
        return "SGLANG_ENABLE_DETERMINISTIC_INFERENCE asks for SGLang's unfused norm"
    return None


def _once(message: str) -> None:
    if message not in _state["logged"]:
        _state["logged"].add(message)
        log.info(message)


def around_prepare(original: Any, attention: Any, positions: torch.Tensor,
                   hidden_states: torch.Tensor) -> Any:
    """AROUND hook on ``Qwen3Attention.forward_prepare_native``: q, k and v as SGLang's method returns
    them, q and k normalised and rotated by the compiled function; SGLang's method where it does not fit."""
    if not hasattr(attention, "_embedserve_qk_unfit"):
        attention._embedserve_qk_unfit = unfit(attention)
    why = attention._embedserve_qk_unfit or _state["failed"]
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if why is None and positions.numel() < 2:
        why = "a batch of one token"  # not worth a compile of its own (sizes 0 and 1 are specialised)
    if why is not None or (capturing and not _state["ran"]):
        _once(f"compiled QK-norm + RoPE: SGLang's kernels here: {why or 'a graph captured before compiling'}")
        return original(attention, positions=positions, hidden_states=hidden_states)
    qkv, _ = attention.qkv_proj(hidden_states)
    q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
    norm_q, norm_k = attention.q_norm, attention.k_norm
    try:
        q, k = compiled()(*tokens_dynamic(q, k), norm_q.weight, norm_k.weight, norm_q.variance_epsilon,
                          attention.rotary_emb.cos_sin_cache, *tokens_dynamic(positions))
    except Exception as exc:  # inside a capture the graph is broken already; elsewhere SGLang's kernels
        if capturing:
            raise
        _state["failed"] = f"the compiled function failed ({type(exc).__name__}: {exc})"[:300]
        log.exception("compiled QK-norm + RoPE failed; SGLang's kernels run from now on")
        return original(attention, positions=positions, hidden_states=hidden_states)
    _state["ran"] = True
    _once("compiled QK-norm + RoPE: Qwen3 attention normalises and rotates q and k in one compiled function")
    return q, k, v


def compiled() -> Any:
    """The function compiled for a symbolic token count only (the first dimension, marked by
    :func:`tokens_dynamic`): every other size is the model's, so one compile serves every batch.
    Inductor keeps the rounding to bf16 between the norm and the rotation, which it would otherwise
    fuse away (``emulate_precision_casts``), and compiles in the engine's process (one small function)."""
    if _state["compiled"] is None:
        _state["compiled"] = torch.compile(qk_norm_rope, dynamic=False,
                                           options={"emulate_precision_casts": True, "compile_threads": 1})
    return _state["compiled"]


def tokens_dynamic(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)
    return tensors


def register(registry: Any, hook_type: Any) -> None:
    registry.register(TARGET, around_prepare, hook_type.AROUND)
