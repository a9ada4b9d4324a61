"""The fused QK norm + RoPE (``engine.fused_qk_norm_rope``) against SGLang 0.5.17's unfused path. SGLang
does not run without a GPU and the kernel is CUDA: its unfused path is copied here from the wheel
(``Qwen3Attention.forward_prepare_native``, ``apply_qk_norm``, ``RMSNorm.forward_native``, the rotary
embedding; digests checked against tests/fixtures/sglang_0.5.17_hooks.json), and the kernel is played
by :func:`reference_kernel`, its arithmetic (``kernels/jit/csrc/elementwise/fused_qknorm_rope.cuh``) and
argument checks in torch, with the signature of SGLang's ``fused_qk_norm_rope``."""

from __future__ import annotations

import inspect
import json
import logging
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from embedserve.engines import fused_qk

FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: the code of SGLang 0.5.17 the copies below were made from, and the kernel's Python API
SOURCES = {
    "sglang.srt.models.qwen3.Qwen3Attention.forward_prepare_native":
        "a494bdaa3a2bea2a4371c8ea2dab85f3376177216bb7c98fb16169bf49bd97e3",
    "sglang.srt.models.utils.apply_qk_norm":
        "e81d53440c54ab08ca98702a93a29577091ea76c2070a10af99593628fb931d6",
    "sglang.srt.models.utils._reshape_for_qk_norm":
        "200e0d1d37b13f3e568588c5e41582cbf899e854a2c937177655d3c6d1013afc",
    "sglang.srt.layers.layernorm.RMSNorm.forward_native":
        "3335b16d634b2fb540b95414125a0161a831d7c9d20c899d7c926d8566bd3971",
    "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding._compute_inv_freq":
        "dae4bcdced5125756cd1d1e23d6538643cc74a36112866534f576c069931c921",
    "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding._compute_cos_sin_cache":
        "d7db0acd2b005e3cdc3d5f4e10c38b76f1e0e5c9af981f07442239ceac2bab71",
    "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native":
        "d3fe1cdb973c311fdc68091c442c3986e72388c670c6e26a8f70436cd6df5861",
    "sglang.srt.layers.rotary_embedding.utils.apply_rotary_emb":
        "bcc9ea846a4e736d609bf30a8cefe18a237cfe17662a5d1cc78eca39ed60f699",
    "sglang.kernels.ops.attention.fused_qknorm_rope.fused_qk_norm_rope":
        "7318a5eb761c866d268f2e254d6a269042e5151211e9fe110b5ae4dd408f0f16",
    "sglang.kernels.ops.attention.fused_qknorm_rope.can_use_fused_qk_norm_rope":
        "3e23cd53b26018c844afe7521095bd806d4221b0c2c62a62b7c5e2750af72679",
}


# -- SGLang 0.5.17's unfused path, as its wheel has it (the branches a CPU takes) --------------------

class RMSNorm(torch.nn.Module):
    """``layers/layernorm.py``: ``forward_native`` without a residual."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon, self.hidden_size = eps, hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return (x * self.weight).to(orig_dtype)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     is_neox_style: bool) -> torch.Tensor:
    """``layers/rotary_embedding/utils.py``."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


class RotaryEmbedding(torch.nn.Module):
    """``layers/rotary_embedding/base.py``: the cos/sin cache and ``forward_native``."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool) -> None:
        super().__init__()
        self.head_size, self.rotary_dim, self.base = head_size, rotary_dim, base
        self.max_position_embeddings, self.is_neox_style = max_position_embeddings, is_neox_style
        self.cos_sin_cache = self._compute_cos_sin_cache()

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> Any:
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_pass = query[..., self.rotary_dim :]
        query_rot = apply_rotary_emb(query_rot, cos, sin, self.is_neox_style)
        query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)
        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_pass = key[..., self.rotary_dim :]
        key_rot = apply_rotary_emb(key_rot, cos, sin, self.is_neox_style)
        key = torch.cat((key_rot, key_pass), dim=-1).reshape(key_shape)
        return query, key


def apply_qk_norm(q: torch.Tensor, k: torch.Tensor, q_norm: Any, k_norm: Any, head_dim: int,
                  alt_stream: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``models/utils.py`` off CUDA (``_reshape_for_qk_norm``'s flat reshape)."""
    q_by_head = q_norm(q.reshape(-1, head_dim))
    k_by_head = k_norm(k.reshape(-1, head_dim))
    return q_by_head.view(q.shape), k_by_head.view(k.shape)


class QKVParallelLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> Any:
        return super().forward(x), None


class Qwen3Attention(torch.nn.Module):
    """The attributes ``forward_prepare_native`` and the hook read, as ``Qwen3Attention.__init__`` sets
    them on one GPU; the q and k norms with weights of their own."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, hidden: int = 96, eps: float = 1e-6,
                 base: float = 1_000_000.0, max_position: int = 32768) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = QKVParallelLinear(hidden, self.q_size + 2 * self.kv_size)
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(-1.0, 2.0)
        self.rope_theta, self.alt_stream = base, None
        self.rotary_emb = RotaryEmbedding(head_dim, head_dim, max_position, base, True)

    def forward_prepare_native(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> Any:
        """SGLang 0.5.17's, verbatim."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = apply_qk_norm(
            q=q,
            k=k,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            head_dim=self.head_dim,
            alt_stream=self.alt_stream,
        )
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


# -- the kernel's arithmetic -----------------------------------------------------------------------

def reference_kernel(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int, head_dim: int,
                     eps: float, q_weight: torch.Tensor, k_weight: torch.Tensor, base: float, is_neox: bool,
                     position_ids: torch.Tensor, factor: float, low: float, high: float,
                     attention_factor: float, rotary_dim: int | None = None) -> None:
    """SGLang's ``fused_qk_norm_rope`` in torch: each q head and each k head RMS-normalised in fp32 and
    scaled by its norm's weight, then rotated (NeoX: the two halves paired, frequency
    ``base ** (-2i / head_dim)`` at the token's position), written back in place; v untouched.
    The frequencies are computed as SGLang's rotary embedding computes them (the kernel's ``powf`` and
    ``__sincosf`` differ in the last bits, which the GPU's quality gate judges). The CUDA op's checks
    first: a wrong width, weight, position dtype or scaling fails here as it fails there."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.is_contiguous(), "qkv must be contiguous 2D"
    assert qkv.shape[1] == (num_heads_q + num_heads_k + num_heads_v) * head_dim, "qkv.size(1) != heads x dim"
    assert q_weight.shape == k_weight.shape == (head_dim,), "weights must be [head_dim]"
    assert position_ids.dtype == torch.int32 and position_ids.shape == (tokens,), "int32 [tokens] positions"
    assert position_ids.is_contiguous()
    assert is_neox and rotary_dim == head_dim and (factor, low, high, attention_factor) == (1.0, 0, 0, 1.0)
    heads = qkv.view(tokens, -1, head_dim)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    theta = position_ids.float()[:, None] * inv_freq
    cos, sin = theta.cos()[:, None], theta.sin()[:, None]
    for part, weight in ((heads[:, :num_heads_q], q_weight),
                         (heads[:, num_heads_q:num_heads_q + num_heads_k], k_weight)):
        x = part.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
        x1, x2 = x.chunk(2, dim=-1)
        part.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1) * attention_factor)


def usable(head_dim: int, is_neox: bool, dtype: torch.dtype, yarn: bool = False) -> bool:
    """``can_use_fused_qk_norm_rope`` on CPU in fp32: any head_dim the kernel takes, any dtype."""
    return head_dim in (64, 128, 256) and not yarn


def batch(lens: list[int], seed: int, hidden: int = 96, far: bool = False) -> tuple[torch.Tensor, ...]:
    """Packed positions (0 .. n-1 per sequence, or, ``far``, random ones up to 32767) and hidden states."""
    g = torch.Generator().manual_seed(seed)
    positions = (torch.randint(0, 32768, (sum(lens),), generator=g) if far
                 else torch.cat([torch.arange(n) for n in lens]))
    return positions, torch.randn(sum(lens), hidden, generator=g)


# -- the tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 128), (32, 8, 128), (16, 8, 64),
                                                             (4, 4, 256), (14, 2, 64)])
@pytest.mark.parametrize("far", [False, True])
@torch.no_grad()
def test_the_fused_prepare_gives_sglangs_unfused_q_k_and_v(heads: int, kv_heads: int, head_dim: int,
                                                           far: bool) -> None:
    torch.manual_seed(heads * head_dim + far)
    attention = Qwen3Attention(heads, kv_heads, head_dim)
    positions, hidden = batch([7, 1, 30, 12], seed=heads + head_dim, far=far)
    want = attention.forward_prepare_native(positions, hidden)
    assert fused_qk.install(attention, reference_kernel, usable, RotaryEmbedding)
    got = attention.forward_prepare_native(positions=positions, hidden_states=hidden)  # as SGLang calls it
    assert [t.shape for t in got] == [t.shape for t in want]
    for name, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    assert got[0].data_ptr() + attention.q_size * 4 == got[1].data_ptr()  # views of the one packed QKV


def test_an_attention_the_kernel_cannot_take_is_left_unfused_and_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "embedserve.fused_qk")
    fused_qk._logged.clear()

    class Scaled(RotaryEmbedding):
        pass

    cases = {"head_dim": lambda a: None,
             "scaled": lambda a: setattr(a, "rotary_emb", Scaled(64, 64, 8, 1e4, True)),
             "partial": lambda a: setattr(a, "rotary_emb", RotaryEmbedding(64, 32, 8, 1e4, True)),
             "split": lambda a: setattr(a, "kv_size", a.kv_size // 2),
             "eps": lambda a: setattr(a.k_norm, "variance_epsilon", 1e-5)}
    for name, spoil in cases.items():
        attention = Qwen3Attention(4, 2, 80 if name == "head_dim" else 64)
        spoil(attention)
        assert not fused_qk.install(attention, reference_kernel, usable, RotaryEmbedding), name
        assert "forward_prepare_native" not in vars(attention), name
    for _ in range(3):  # every layer of a model: one line
        fused_qk.install(Qwen3Attention(4, 2, 80), reference_kernel, usable, RotaryEmbedding)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == len(cases) and len(set(said)) == len(said)
    assert "head_dim 80" in said[0] and "Scaled over 64 of 64 dims" in said[1] and "32 of 64" in said[2]
    fused_qk.after_init(None, Qwen3Attention(4, 2, 64))  # no SGLang here: logged, not raised


def test_the_hook_and_what_it_stands_in_for_match_sglang_0_5_17() -> None:
    """The hooked ``__init__``, the attributes the hook reads, the replaced method's arguments, the
    kernel's API as :func:`reference_kernel` and the hook call it, and the copied code's digests."""
    registered: list[tuple[str, Any, str]] = []
    fused_qk.register(types.SimpleNamespace(register=lambda *hook: registered.append(hook)),
                      types.SimpleNamespace(AFTER="after"))
    sglang = json.loads((FIXTURES / "sglang_0.5.17_hooks.json").read_text())
    methods, functions = sglang["methods"], sglang["functions"]
    assert registered == [(f"{fused_qk.ATTENTION_CLASS}.__init__", fused_qk.after_init, "after")]
    assert {"qkv_proj", "q_norm", "k_norm", "rotary_emb", "num_heads", "num_kv_heads", "head_dim", "q_size",
            "kv_size"} <= set(methods[f"{fused_qk.ATTENTION_CLASS}.__init__"]["self_attrs"])
    rope = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init__"
    assert {"base", "is_neox_style", "rotary_dim", "head_size"} <= set(methods[rope]["self_attrs"])
    norm = "sglang.srt.layers.layernorm.RMSNorm.__init__"
    assert {"weight", "variance_epsilon"} <= set(methods[norm]["self_attrs"])
    assert list(inspect.signature(fused_qk.fused_prepare).parameters)[2:] == \
        methods[f"{fused_qk.ATTENTION_CLASS}.forward_prepare_native"]["args"][1:]
    kernel = "sglang.kernels.ops.attention.fused_qknorm_rope"
    for stand_in, name in ((reference_kernel, "fused_qk_norm_rope"), (usable, "can_use_fused_qk_norm_rope")):
        assert list(inspect.signature(stand_in).parameters) == functions[f"{kernel}.{name}"]["args"]
    digests = {**{t: m["source_sha256"] for t, m in methods.items() if "source_sha256" in m},
               **{t: f["source_sha256"] for t, f in functions.items()}}
    assert {t: digests[t] for t in SOURCES} == SOURCES
