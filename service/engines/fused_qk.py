"""QK RMSNorm and RoPE in one kernel for the dense Qwen3's attention (``engine.fused_qk_norm_rope``).

SGLang 0.5.17's ``Qwen3Attention.forward_prepare_native`` (``srt/models/qwen3.py``) splits the fused QKV
projection, normalises each q and k head (``apply_qk_norm``, one kernel) and rotates them (the rotary
embedding, another): two passes over q and k. SGLang has a kernel that does both in one pass, in place
on the packed QKV (``sglang.kernels.ops.attention.fused_qknorm_rope``, compiled with nvcc at first
use), but calls it only from Qwen3-MoE's attention. :func:`fused_prepare` is ``forward_prepare_native``
with that kernel, called as Qwen3-MoE calls it for RoPE without scaling (YaRN factor 1.0). The kernel
keeps each normalised head in fp32 through the rotation and rounds to bf16 once.

The plugin's AFTER hook on ``Qwen3Attention.__init__`` swaps the method on each attention SGLang
builds (every layer of Qwen3 embedding models and Qwen3-Reranker; the pooled last layer calls it too)
where the kernel serves it: bf16 norm weights and head_dim 64, 128 or 256 (SGLang's
``can_use_fused_qk_norm_rope``, which also compiles the kernel, so none is compiled mid-forward), plain
RoPE over the whole head, one eps for q and k, and each GPU's share of the heads adding up to its
q and kv widths. Elsewhere the layer is left as it is, which is logged once.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger("embedserve.fused_qk")

ATTENTION_CLASS = "sglang.srt.models.qwen3.Qwen3Attention"
#: YaRN factor, low, high, attention factor: Qwen3-MoE's ``compute_yarn_parameters`` without rope scaling
PLAIN_ROPE = (1.0, 0.0, 0.0, 1.0)
_logged: set[str] = set()


def _once(level: int, message: str, *args: Any, exc_info: bool = False) -> None:
    """Each message once per process, not once per layer."""
    if (text := message % args) not in _logged:
        _logged.add(text)
        log.log(level, text, exc_info=exc_info)


def fused_prepare(attention: Any, kernel: Any, positions: torch.Tensor,
                  hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``Qwen3Attention.forward_prepare_native`` with q and k normalised and rotated by ``kernel`` (SGLang's
    ``fused_qk_norm_rope``) in place on the QKV projection's output; v is left as projected."""
    qkv, _ = attention.qkv_proj(hidden_states)
    rope, kv_heads, q_norm = attention.rotary_emb, attention.num_kv_heads, attention.q_norm
    kernel(qkv, attention.num_heads, kv_heads, kv_heads, attention.head_dim, q_norm.variance_epsilon,
           q_norm.weight, attention.k_norm.weight, float(rope.base), rope.is_neox_style,
           positions.view(-1).to(device=qkv.device, dtype=torch.int32).contiguous(), *PLAIN_ROPE)
    return qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)


def unfit(attention: Any, usable: Any, plain_rope: Any) -> str | None:
    """Why the kernel cannot serve this attention, or None. ``usable`` is SGLang's
    ``can_use_fused_qk_norm_rope``, ``plain_rope`` its ``RotaryEmbedding`` (subclasses scale)."""
    rope, d = attention.rotary_emb, attention.head_dim
    if type(rope) is not plain_rope or rope.rotary_dim != d or rope.head_size != d:
        return f"{type(rope).__name__} over {rope.rotary_dim} of {d} dims, not plain RoPE over the whole head"
    if attention.q_size != attention.num_heads * d or attention.kv_size != attention.num_kv_heads * d:
        return "its heads are split across GPUs in a way the kernel does not take"
    q_norm, k_norm = attention.q_norm, attention.k_norm
    if q_norm.variance_epsilon != k_norm.variance_epsilon or q_norm.weight.dtype != k_norm.weight.dtype:
        return "q and k norms with different eps or weight dtypes"
    if not usable(d, rope.is_neox_style, q_norm.weight.dtype, False):
        return f"SGLang's kernel does not take head_dim {d} in {q_norm.weight.dtype} here (its log says why)"
    return None


def install(attention: Any, kernel: Any, usable: Any, plain_rope: Any) -> bool:
    """Swap ``attention``'s ``forward_prepare_native`` for :func:`fused_prepare`; False (logged once)
    where the kernel cannot serve it."""
    if (why := unfit(attention, usable, plain_rope)) is not None:
        _once(logging.WARNING, "fused QK norm + RoPE: attention left unfused: %s", why)
        return False
    attention.forward_prepare_native = functools.partial(fused_prepare, attention, kernel)
    _once(logging.INFO, "fused QK norm + RoPE: Qwen3 attention normalises and rotates q and k in one kernel")
    return True


def after_init(_result: Any, attention: Any, *_args: Any, **_kwargs: Any) -> None:
    """AFTER hook on ``Qwen3Attention.__init__``; an attention it cannot change runs unfused."""
    try:
        from sglang.kernels.ops.attention.fused_qknorm_rope import (
            can_use_fused_qk_norm_rope,
            fused_qk_norm_rope,
        )
        from sglang.srt.layers.rotary_embedding import RotaryEmbedding

        install(attention, fused_qk_norm_rope, can_use_fused_qk_norm_rope, RotaryEmbedding)
    except Exception:
        _once(logging.ERROR, "fused QK norm + RoPE: not installed; attention runs unfused", exc_info=True)


def register(registry: Any, hook_type: Any) -> None:
    registry.register(f"{ATTENTION_CLASS}.__init__", after_init, hook_type.AFTER)
