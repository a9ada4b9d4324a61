"""Each dense Qwen3 attention's QK-norm and RoPE as one function torch inductor compiles
(``engine.compiled_qk_norm_rope``; off by default, not yet measured in a server).

SGLang 0.5.17's ``Qwen3Attention.forward_prepare_native`` normalises q and k in place (one kernel) and
rotates them (another): two passes over q and k, 0.43 GPU ms per 1,000 of the 4B's tokens on one H200,
where vLLM, whose compiler fuses that work into its own kernels, runs no separate pass for either
(docs/PERFORMANCE.md). The AROUND hook here projects QKV as SGLang does, then runs :func:`qk_norm_rope`,
compiled once per process for any token count, in place of the two kernels. ``bench/qk_rope.py``
times the two forms alone on a GPU. SGLang's own method runs where the function does not fit (RoPE
other than neox over the whole head, different eps for q and k, not bf16), where its compile failed
(logged once), and while a CUDA graph is being captured before the function has compiled: compiling
inside a capture would break it, and SGLang runs each graph's batch size eagerly before capturing it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("embedserve.compiled_qk")

TARGET = "sglang.srt.models.qwen3.Qwen3Attention.forward_prepare_native"
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
    if why is not None or (capturing and not _state["ran"]):
        _once(f"compiled QK-norm + RoPE: SGLang's kernels here: {why or 'a graph captured before compiling'}")
        return original(attention, positions=positions, hidden_states=hidden_states)
    qkv, _ = attention.qkv_proj(hidden_states)
    q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
    if _state["compiled"] is None:
        _state["compiled"] = torch.compile(qk_norm_rope, dynamic=True)
    norm_q, norm_k = attention.q_norm, attention.k_norm
    try:
        q, k = _state["compiled"](q, k, norm_q.weight, norm_k.weight, norm_q.variance_epsilon,
                                  attention.rotary_emb.cos_sin_cache, positions)
    except Exception as exc:  # a failed compile leaves SGLang's kernels; after a first run, the forward's
        if _state["ran"]:
            raise
        _state["failed"] = f"the compile failed ({type(exc).__name__}: {exc})"[:300]
        log.exception("compiled QK-norm + RoPE: the compile failed; SGLang's kernels run instead")
        return original(attention, positions=positions, hidden_states=hidden_states)
    _state["ran"] = True
    _once("compiled QK-norm + RoPE: Qwen3 attention normalises and rotates q and k in one compiled function")
    return q, k, v


def register(registry: Any, hook_type: Any) -> None:
    registry.register(TARGET, around_prepare, hook_type.AROUND)
