"""The compiled QK-norm + RoPE (``engine.compiled_qk_norm_rope``): its arithmetic against a head-by-head
reference, compiled by inductor on the CPU, the hook's fallbacks, the launcher's refusals and the
plugin's registration. On a GPU ``bench/qk_rope.py`` times it against SGLang's two kernels."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from embedserve.engines import compiled_qk, sglang_plugin
from embedserve.engines.compiled_qk import qk_norm_rope
from tests.test_sglang_plugin import _fake_sglang

D, EPS = 128, 1e-6
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test as a new engine process: nothing compiled, run or failed yet."""
    state: dict[str, Any] = {"compiled": None, "ran": False, "failed": None, "logged": set()}
    monkeypatch.setattr(compiled_qk, "_state", state)


def cos_sin_cache(positions: int = 4096, theta: float = 1_000_000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float) / D)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def reference(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
              eps: float = EPS) -> torch.Tensor:
    """Each head of each token alone, as SGLang 0.5.17's kernels compute it (impl/norm.cuh: x times
    rsqrt(mean of squares + eps) times the weight in fp32, one rounding; rope.cuh: each half of the
    head against the other, x * cos - y * sin and y * cos + x * sin in fp32, one rounding)."""
    out = torch.empty_like(x)
    for t in range(x.size(0)):
        cos, sin = cache[positions[t]].chunk(2)
        for h in range(x.size(1) // D):
            v = x[t, h * D:(h + 1) * D].float()
            v = (v * torch.rsqrt(v.pow(2).mean() + eps) * weight.float()).bfloat16().float()
            first, second = v[:D // 2], v[D // 2:]
            rotated = torch.cat([first * cos - second * sin, second * cos + first * sin])
            out[t, h * D:(h + 1) * D] = rotated.bfloat16()
    return out


def qkv_views(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A QKV projection's output (two q heads, one k, one v) and its q and k column views, weights."""
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(tokens, 4 * D, generator=g)).bfloat16()
    weights = (1 + 0.1 * torch.randn(2, D, generator=g)).bfloat16()
    return qkv, qkv[:, :2 * D], qkv[:, 2 * D:3 * D], weights


def test_the_function_matches_the_head_by_head_reference_on_a_qkv_buffers_views() -> None:
    _, q, k, (q_weight, k_weight) = qkv_views(6)
    cache, positions = cos_sin_cache(), torch.tensor([0, 1, 2, 0, 1, 4000])
    fused_q, fused_k = qk_norm_rope(q, k, q_weight, k_weight, EPS, cache, positions)
    assert torch.equal(fused_q, reference(q, q_weight, cache, positions))
    assert torch.equal(fused_k, reference(k, k_weight, cache, positions))


@pytest.mark.parametrize("mistake", ["weight after rounding", "no rounding between", "bf16 cache",
                                     "positions shifted"])
def test_each_near_miss_of_sglangs_arithmetic_differs_from_it(mistake: str) -> None:
    """The exact comparison above tells apart what a tolerance of a bf16 step would let through."""
    _, q, _, (q_weight, _) = qkv_views(6)
    cache, positions = cos_sin_cache(), torch.tensor([0, 1, 2, 0, 1, 4000])
    want = reference(q, q_weight, cache, positions)
    heads = q.unflatten(-1, (-1, D)).float()
    normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + EPS)
    if mistake == "weight after rounding":  # Hugging Face's Qwen3RMSNorm
        normed = (normed.bfloat16() * q_weight).float()
    elif mistake == "no rounding between":
        normed = normed * q_weight.float()
    else:
        normed = (normed * q_weight.float()).bfloat16().float()
    if mistake == "positions shifted":
        got = reference(q, q_weight, cache, positions.roll(1))
    else:
        rope = cache.bfloat16().float() if mistake == "bf16 cache" else cache
        cos, sin = rope[positions].unsqueeze(1).chunk(2, dim=-1)
        first, second = normed.chunk(2, dim=-1)
        got = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        got = got.bfloat16().flatten(-2)
    assert not torch.equal(got, want)


def test_inductor_compiles_it_once_for_every_token_count_with_the_eager_arithmetic(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine runs, the 4B's widths (32 q heads: 4,096 wide, as wide as the largest graph's
    batch, which SGLang captures first): one compile serving batches of every size; on the CPU
    inductor writes C++ where on a GPU it writes Triton, from the same traced graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(2)
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, D, generator=g)).bfloat16()
    for tokens in (4096, 2, 37, 1024):
        qkv = (3 * torch.randn(tokens, 48 * D, generator=g)).bfloat16()
        q, k, positions = qkv[:, :32 * D], qkv[:, 32 * D:40 * D], torch.arange(tokens) % 264
        dynamic, cache = compiled_qk.tokens_dynamic, cos_sin_cache()
        got = compiled_qk.compiled()(*dynamic(q, k), q_weight, k_weight, EPS, cache, *dynamic(positions))
        want = qk_norm_rope(q, k, q_weight, k_weight, EPS, cache, positions)
        for a, b in zip(got, want, strict=True):  # the same roundings; an fp32 sum's order may differ
            torch.testing.assert_close(a, b, atol=0.0313, rtol=0.0079)
            assert (a != b).float().mean() < 1e-4  # without emulate_precision_casts: about 0.26
    assert counters["stats"]["unique_graphs"] == 1


class RotaryEmbedding:  # the name the hook checks for: SGLang's plain RoPE
    def __init__(self, neox: bool = True, rotary_dim: int = D) -> None:
        self.head_size, self.rotary_dim, self.is_neox_style = D, rotary_dim, neox
        self.cos_sin_cache = cos_sin_cache()


def attention(**changes: Any) -> SimpleNamespace:
    """The attributes of SGLang's ``Qwen3Attention`` the hook reads (its fixture test below)."""
    _, _, _, (q_weight, k_weight) = qkv_views(1)
    proj = torch.nn.Linear(D, 4 * D, bias=False).bfloat16()
    att = SimpleNamespace(head_dim=D, q_size=2 * D, kv_size=D, qkv_proj=lambda h: (proj(h), None),
                          q_norm=SimpleNamespace(weight=q_weight, variance_epsilon=EPS),
                          k_norm=SimpleNamespace(weight=k_weight, variance_epsilon=EPS),
                          rotary_emb=RotaryEmbedding())
    for key, value in changes.items():
        setattr(att, key, value)
    return att


def unfused(att: Any, positions: torch.Tensor, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """SGLang's method as the reference computes it."""
    qkv, _ = att.qkv_proj(hidden_states)
    q, k, v = qkv.split([att.q_size, att.kv_size, att.kv_size], dim=-1)
    rope, at = att.rotary_emb.cos_sin_cache, positions
    return reference(q, att.q_norm.weight, rope, at), reference(k, att.k_norm.weight, rope, at), v


def test_the_hook_returns_sglangs_q_k_and_v(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compiled_qk._state, "compiled", qk_norm_rope)  # the compile is tested above
    att, positions = attention(), torch.tensor([0, 1, 2, 3, 0, 1])
    hidden = torch.randn(6, D).bfloat16()
    got = compiled_qk.around_prepare(lambda *a, **kw: pytest.fail("SGLang's method ran"), att,
                                     positions=positions, hidden_states=hidden)
    for a, b in zip(got, unfused(att, positions, hidden), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("changes", "why"), [
    ({"rotary_emb": RotaryEmbedding(rotary_dim=64)}, "not plain RoPE over the whole head"),
    ({"rotary_emb": RotaryEmbedding(neox=False)}, "interleaved"),
    ({"k_norm": SimpleNamespace(weight=torch.ones(D).bfloat16(), variance_epsilon=1e-5)}, "different eps"),
    ({"q_norm": SimpleNamespace(weight=torch.ones(D), variance_epsilon=EPS)}, "not bfloat16"),
])
def test_sglangs_method_runs_where_the_function_does_not_fit(changes: dict[str, Any], why: str) -> None:
    att = attention(**changes)
    assert why in (compiled_qk.unfit(att) or "")
    sglang = compiled_qk.around_prepare(lambda a, **kw: ("sglang", a), att, positions=torch.tensor([0, 1]),
                                        hidden_states=torch.randn(2, D).bfloat16())
    assert sglang == ("sglang", att)


def call(attention_: Any, tokens: int = 2) -> Any:
    """The hook with a stand-in for SGLang's method that says it ran."""
    return compiled_qk.around_prepare(lambda a, **kw: "sglang", attention_, positions=torch.arange(tokens),
                                      hidden_states=torch.randn(tokens, D).bfloat16())


def test_a_graph_captured_before_the_first_compile_gets_sglangs_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compiled_qk._state, "compiled", qk_norm_rope)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert call(attention()) == "sglang"
    monkeypatch.setitem(compiled_qk._state, "ran", True)  # warmed up eagerly: the capture takes it
    assert call(attention())[0].shape == (2, 2 * D)


def test_a_one_token_batch_gets_sglangs_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compiled_qk._state, "compiled", qk_norm_rope)
    assert call(attention(), tokens=1) == "sglang"
    assert call(attention(), tokens=2)[0].shape == (2, 2 * D)


def test_a_compiled_function_that_fails_leaves_sglangs_kernels_for_good(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: Any) -> Any:
        raise RuntimeError("no Triton")

    monkeypatch.setitem(compiled_qk._state, "compiled", broken)
    monkeypatch.setitem(compiled_qk._state, "ran", True)  # also after it has run, outside a capture
    assert [call(attention()), call(attention())] == ["sglang", "sglang"]
    assert "RuntimeError: no Triton" in compiled_qk._state["failed"]
    monkeypatch.setitem(compiled_qk._state, "failed", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="no Triton"):  # inside a capture the graph is lost already
        call(attention())


def test_the_hook_stands_in_for_sglang_0_5_17s_method_and_reads_attributes_it_sets() -> None:
    hooks = json.loads((FIXTURES / "sglang_0.5.17_hooks.json").read_text())["methods"]
    assert hooks[compiled_qk.TARGET]["args"] == ["self", "positions", "hidden_states"]
    # the method stood in for, as read when this module was written: a changed method fails here
    assert hooks[compiled_qk.TARGET]["source_sha256"] == (
        "a494bdaa3a2bea2a4371c8ea2dab85f3376177216bb7c98fb16169bf49bd97e3")
    read = {"head_dim", "q_size", "kv_size", "qkv_proj", "q_norm", "k_norm", "rotary_emb"}
    assert read <= set(hooks["sglang.srt.models.qwen3.Qwen3Attention.__init__"]["self_attrs"])
    rope = hooks["sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init__"]["self_attrs"]
    assert {"head_size", "rotary_dim", "is_neox_style"} <= set(rope)  # cos_sin_cache: a registered buffer


def test_the_plugin_adds_the_hook_only_where_the_setting_is_on(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    registered = _fake_sglang(monkeypatch)
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "sglang")
    monkeypatch.setenv("EMBEDSERVE_ENGINE__COMPILED_QK_NORM_ROPE", "false")
    sglang_plugin.register()
    assert compiled_qk.TARGET not in [t for t, _, _ in registered]
    monkeypatch.setenv("EMBEDSERVE_ENGINE__COMPILED_QK_NORM_ROPE", "true")
    sglang_plugin.register()
    assert (compiled_qk.TARGET, compiled_qk.around_prepare, "around") in registered


def model_dir(tmp_path: Path, model_type: str) -> Path:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": model_type, "max_position_embeddings": 4096, "hidden_size": 1024,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": "bfloat16"}))
    return model


@pytest.mark.parametrize(("model_type", "extra", "said"), [
    ("bert", [], "needs a dense Qwen3 model"),
    ("qwen3_moe", [], "needs a dense Qwen3 model"),
    ("qwen3", ["--cuda-graph-backend-prefill", "tc_piecewise"], "does not go with SGLang's tc_piecewise"),
])
def test_the_launcher_refuses_it_where_it_cannot_run(tmp_path: Path, model_type: str, extra: list[str],
                                                     said: str) -> None:
    from embedserve.config import Settings
    from embedserve.engines.forward import LaunchConfigError
    from embedserve.engines.sglang import build_launch

    model = model_dir(tmp_path, model_type)
    engine = {"compiled_qk_norm_rope": True, "extra_args": extra}
    settings = Settings(model={"path": str(model)}, engine=engine)
    with pytest.raises(LaunchConfigError, match=said):
        build_launch(settings, gpu_capability=None)


def test_the_launch_notes_say_it_is_on(tmp_path: Path) -> None:
    from embedserve.config import Settings
    from embedserve.engines.sglang import build_launch

    model = model_dir(tmp_path, "qwen3")
    for on in (False, True):
        settings = Settings(model={"path": str(model)}, engine={"compiled_qk_norm_rope": on})
        notes = build_launch(settings, gpu_capability=None).notes
        assert any(n.startswith("compiled_qk_norm_rope: on") for n in notes) is on
