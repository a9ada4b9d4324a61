"""The fused QK-norm + RoPE function the GPU timing compiles, against a head-by-head reference."""

from __future__ import annotations

import torch
from qk_rope import EPS, HEAD_DIM, cos_sin_cache, qk_norm_rope


def reference(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor
              ) -> torch.Tensor:
    """Each head of each token alone: RMSNorm, bf16, then a rotate-half rotation, bf16."""
    out = torch.empty_like(x)
    for t in range(x.size(0)):
        cos, sin = cache[positions[t]].chunk(2)
        for h in range(x.size(1) // HEAD_DIM):
            v = x[t, h * HEAD_DIM:(h + 1) * HEAD_DIM].float()
            v = (v / torch.sqrt((v * v).mean() + EPS) * weight.float()).bfloat16().float()
            rotated = torch.cat([-v[HEAD_DIM // 2:], v[:HEAD_DIM // 2]])
            out[t, h * HEAD_DIM:(h + 1) * HEAD_DIM] = (v * cos.repeat(2) + rotated * sin.repeat(2)).bfloat16()
    return out


def test_fused_qk_norm_rope_matches_the_head_by_head_reference_on_a_qkv_buffers_views() -> None:
    g = torch.Generator().manual_seed(1)
    qkv = (3 * torch.randn(6, 4 * HEAD_DIM, generator=g)).bfloat16()  # two q heads, one k head, one v head
    q, k = qkv[:, :2 * HEAD_DIM], qkv[:, 2 * HEAD_DIM:3 * HEAD_DIM]
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, HEAD_DIM, generator=g)).bfloat16()
    cache, positions = cos_sin_cache(), torch.tensor([0, 1, 2, 0, 1, 4000])
    fused_q, fused_k = qk_norm_rope(q, k, q_weight, k_weight, cache, positions)
    torch.testing.assert_close(fused_q, reference(q, q_weight, cache, positions), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(fused_k, reference(k, k_weight, cache, positions), atol=2e-2, rtol=1e-2)
    shifted = reference(q, q_weight, cache, positions.roll(1))  # the rotation is position by position
    assert not torch.allclose(fused_q.float(), shifted.float(), atol=0.1)
