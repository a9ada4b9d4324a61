"""FA3 reads each layer's queries where the QKV projection wrote them (``engine.strided_query``).

In the embedding-only forward (no KV pool: SGLang 0.5.17's ``FlashAttentionBackend`` with
``fa_skip_kv_cache``), ``forward_extend`` hands FA3 the keys and values as views of the QKV
projection's output, but the queries as ``q.contiguous()``: a copy of every layer's queries (on the
4B's shape 4,096 of the 6,144 values a token's projection writes, 36 times a forward), which the
kernel step counts as ``direct_copy_kernel_cuda``. FA3 needs only the last dimension contiguous (it
reads the keys and values strided already), so the AROUND hook here runs that branch with the
queries' view, and SGLang's own method for every other case: KV pool, other FA versions, MLA,
sliding windows, sinks, FP8 scales, context parallelism. A batch that a prefill CUDA graph padded to
its captured token count gets SGLang's dummy sequence over the padded tail, as in its branch.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

log = logging.getLogger("embedserve.strided_query")

TARGET = "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend.forward_extend"


def runs_raw(backend: Any, q: Any, k: Any, layer: Any, forward_batch: Any, extra: dict[str, Any]) -> bool:
    """Whether this call takes SGLang's ``fa_skip_kv_cache`` branch with nothing beside plain
    causal FA3 (the branch this module stands in for)."""
    return (getattr(backend, "fa_skip_kv_cache", False) and backend.fa_impl_ver == 3 and not backend.use_mla
            and k is not None and q.stride(-1) == 1 and all(v is None for v in extra.values())
            and getattr(layer.attn_type, "value", None) == "decoder" and not layer.is_cross_attention
            and layer.sliding_window_size in (None, -1)
            and backend.kv_cache_dtype_str == "auto" and not backend.kv_cache_is_mxfp8
            and not backend.has_local_attention and getattr(backend, "attn_cp_size", 1) <= 1
            and not forward_batch.forward_mode.is_target_verify())


def packed_sequences(metadata: Any, forward_batch: Any, tokens: int) -> tuple[Any, int]:
    """The batch's sequence starts and longest sequence, with SGLang's dummy self-attending sequence
    over a padded tail (a prefill CUDA graph's captured token count: FA3 needs every row in a
    sequence), computed once per forward on the metadata every layer shares, as SGLang does."""
    if metadata.fa_skip_cu_seqlens_q is None:
        cu, longest, real = metadata.cu_seqlens_q, metadata.max_seq_len_q, forward_batch.extend_num_tokens
        if real is not None and real < tokens:
            cu, longest = torch.cat([cu, cu.new_tensor([tokens])]), max(int(longest), tokens - real)
        metadata.fa_skip_cu_seqlens_q, metadata.fa_skip_max_seqlen_q = cu, longest
    return metadata.fa_skip_cu_seqlens_q, metadata.fa_skip_max_seqlen_q


def around_forward_extend(original: Any, backend: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                          save_kv_cache: bool = True, **extra: Any) -> Any:
    """AROUND hook on ``FlashAttentionBackend.forward_extend``: the ``fa_skip_kv_cache`` branch of
    SGLang 0.5.17 with ``q.view`` in place of ``q.contiguous().view``; any other call, SGLang's."""
    if not runs_raw(backend, q, k, layer, forward_batch, extra):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **extra)
    starts, longest = packed_sequences(backend.forward_metadata, forward_batch, q.shape[0])
    attn_output = getattr(forward_batch, "_attn_output", None)
    # the function SGLang's branch calls: its backend module's import (FA3 or its fallbacks), not the
    # backend's own attribute
    out = sys.modules[type(backend).__module__].flash_attn_varlen_func(
        q=q.view(-1, layer.tp_q_head_num, layer.head_dim),
        k=k.view(-1, layer.tp_k_head_num, layer.head_dim),
        v=v.view(-1, layer.tp_v_head_num, layer.v_head_dim),
        cu_seqlens_q=starts,
        cu_seqlens_k=starts,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        softmax_scale=layer.scaling,
        causal=True,
        window_size=(-1, -1),
        softcap=layer.logit_cap,
        num_splits=backend.num_splits,
        out=None if attn_output is None else attn_output.view(-1, layer.tp_q_head_num, layer.v_head_dim),
    )
    return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def register(registry: Any, hook_type: Any) -> None:
    registry.register(TARGET, around_forward_extend, hook_type.AROUND)
    log.info("strided query: FA3 reads each layer's queries in place (no copy)")
