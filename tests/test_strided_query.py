"""``engine.strided_query``: FA3 reads each layer's queries in place. SGLang and FA3 do not run
without a GPU, so ``FlashAttentionBackend`` and ``RadixAttention`` are played by namespaces with the
attributes SGLang 0.5.17's ``__init__`` sets (checked against its wheel below), and FA3's varlen call
by a causal attention over each packed sequence in torch."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from embedserve.config import Settings
from embedserve.engines import sglang_plugin, strided_query
from embedserve.engines.sglang import LaunchConfigError, build_launch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HEADS, KV_HEADS, DIM = 4, 2, 8
LENS = [5, 3, 7]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     softmax_scale: float, causal: bool, out: torch.Tensor | None = None,
                     **_: Any) -> torch.Tensor:
    """FA3's ``flash_attn_varlen_func``: causal attention within each packed sequence (GQA),
    reading its arguments through their strides as the kernel does."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and causal
    result = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    starts = cu_seqlens_q.tolist()
    for a, b in itertools.pairwise(starts):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = (t.repeat_interleave(HEADS // KV_HEADS, dim=0) for t in (ks, vs))
        attended = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale)
        result[a:b] = attended.transpose(0, 1)
    return result


class Mode:
    def __init__(self, verify: bool = False) -> None:
        self.verify = verify

    def is_target_verify(self) -> bool:
        return self.verify


CALLS: list[dict[str, Any]] = []


def flash_attn_varlen_func(**kw: Any) -> torch.Tensor:
    """What SGLang's backend module imports as ``flash_attn_varlen_func``: every call's keywords kept."""
    CALLS.append(kw)
    return varlen_attention(**kw)


class Backend(SimpleNamespace):
    """``FlashAttentionBackend``: its module (this one) holds the ``flash_attn_varlen_func`` it calls."""


def parts(pad: int = 0, **backend: Any) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]:
    """A backend, q/k/v as views of one QKV projection's output (``pad`` rows past the batch's
    sequences: a prefill graph's captured token count), a layer and a batch."""
    CALLS.clear()
    total = sum(LENS)
    qkv = torch.randn(total + pad, (HEADS + 2 * KV_HEADS) * DIM)
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    k, v = k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM)  # as RadixAttention.forward passes them
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(LENS), 0).tolist()], dtype=torch.int32)
    metadata = SimpleNamespace(cu_seqlens_q=cu, max_seq_len_q=max(LENS), fa_skip_cu_seqlens_q=None,
                               fa_skip_max_seqlen_q=None)
    be = Backend(fa_skip_kv_cache=True, fa_impl_ver=3, use_mla=False, kv_cache_dtype_str="auto",
                 kv_cache_is_mxfp8=False, has_local_attention=False, attn_cp_size=1, num_splits=0,
                 forward_metadata=metadata)
    for key, value in backend.items():
        setattr(be, key, value)
    layer = SimpleNamespace(attn_type=SimpleNamespace(value="decoder"), is_cross_attention=False,
                            sliding_window_size=-1, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS,
                            tp_v_head_num=KV_HEADS, head_dim=DIM, v_head_dim=DIM, scaling=DIM ** -0.5,
                            logit_cap=30.0)  # Qwen3's is 0: any other value shows it is passed on
    batch = SimpleNamespace(forward_mode=Mode(), extend_num_tokens=total)
    return be, q, k, v, layer, batch


def sglang_branch(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, batch: Any,
                  save_kv_cache: bool = True, **_: Any) -> torch.Tensor:
    """SGLang 0.5.17's ``fa_skip_kv_cache`` branch (flashattention_backend.py:1397-1456) as it is,
    for a decoder layer with no window, sinks or scales: a padded tail made a dummy sequence once per
    forward, the queries copied first."""
    m = backend.forward_metadata
    if m.fa_skip_cu_seqlens_q is None:
        num_real_tokens, num_padded_tokens = batch.extend_num_tokens, q.shape[0]
        if num_real_tokens is not None and num_real_tokens < num_padded_tokens:
            tail = m.cu_seqlens_q.new_tensor([num_padded_tokens])
            m.fa_skip_cu_seqlens_q = torch.cat([m.cu_seqlens_q, tail])
            m.fa_skip_max_seqlen_q = max(int(m.max_seq_len_q), num_padded_tokens - num_real_tokens)
        else:
            m.fa_skip_cu_seqlens_q, m.fa_skip_max_seqlen_q = m.cu_seqlens_q, m.max_seq_len_q
    fa_out = getattr(batch, "_attn_output", None)
    out = flash_attn_varlen_func(
        q=q.contiguous().view(-1, HEADS, DIM), k=k.view(-1, KV_HEADS, DIM), v=v.view(-1, KV_HEADS, DIM),
        cu_seqlens_q=m.fa_skip_cu_seqlens_q, cu_seqlens_k=m.fa_skip_cu_seqlens_q,
        max_seqlen_q=m.fa_skip_max_seqlen_q, max_seqlen_k=m.fa_skip_max_seqlen_q, softmax_scale=layer.scaling,
        causal=True, window_size=(-1, -1), softcap=layer.logit_cap, num_splits=backend.num_splits,
        out=None if fa_out is None else fa_out.view(-1, HEADS, DIM))
    return out.view(-1, HEADS * DIM)


def fresh(backend: Any) -> Any:
    """The backend with the forward's metadata as SGLang builds it for each batch (nothing cached)."""
    backend.forward_metadata.fa_skip_cu_seqlens_q = backend.forward_metadata.fa_skip_max_seqlen_q = None
    return backend


def same_call_but_the_query(q: torch.Tensor) -> None:
    """The hook's call (the first) has every keyword as SGLang's branch (the second) passes it; the
    query in place where SGLang's is a copy."""
    hook, sglang = CALLS[:2]
    assert hook.keys() == sglang.keys()
    for name in hook.keys() - {"q", "out"}:
        same = torch.equal if isinstance(hook[name], torch.Tensor) else lambda a, b: a == b
        assert same(hook[name], sglang[name]), name
    assert (hook["out"] is None) == (sglang["out"] is None)
    assert hook["q"].data_ptr() == q.data_ptr() and not hook["q"].is_contiguous()  # no copy
    assert sglang["q"].data_ptr() != q.data_ptr()  # SGLang's branch copies
    assert torch.equal(hook["q"], sglang["q"])


def test_fa3_gets_the_queries_in_place_and_the_rest_as_sglang_passes_it() -> None:
    backend, q, k, v, layer, batch = parts()
    assert not q.is_contiguous()
    got = strided_query.around_forward_extend(sglang_branch, backend, q, k, v, layer, batch)
    want = sglang_branch(fresh(backend), q, k, v, layer, batch)
    same_call_but_the_query(q)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # and it is attention: the first sequence's first token attends to itself alone
    torch.testing.assert_close(got[0], v[0].repeat_interleave(HEADS // KV_HEADS, dim=0).reshape(-1))


def test_fa3_writes_into_the_batchs_output_buffer_where_sglang_gives_one() -> None:
    backend, q, k, v, layer, batch = parts()
    batch._attn_output = torch.zeros(sum(LENS), HEADS * DIM)
    got = strided_query.around_forward_extend(sglang_branch, backend, q, k, v, layer, batch)
    assert got.data_ptr() == batch._attn_output.data_ptr()
    got = got.clone()
    torch.testing.assert_close(got, sglang_branch(fresh(backend), q, k, v, layer, batch))
    same_call_but_the_query(q)


def test_a_tail_padded_by_a_prefill_graph_attends_as_sglangs_dummy_sequence() -> None:
    backend, q, k, v, layer, batch = parts(pad=9)  # longer than any sequence (7)
    got = strided_query.around_forward_extend(sglang_branch, backend, q, k, v, layer, batch)
    assert backend.forward_metadata.fa_skip_cu_seqlens_q.tolist() == [0, 5, 8, 15, 24]
    assert backend.forward_metadata.fa_skip_max_seqlen_q == 9
    torch.testing.assert_close(got, sglang_branch(fresh(backend), q, k, v, layer, batch), rtol=0, atol=0)
    same_call_but_the_query(q)
    strided_query.around_forward_extend(sglang_branch, backend, q, k, v, layer, batch)  # the next layer
    assert backend.forward_metadata.fa_skip_cu_seqlens_q.tolist() == [0, 5, 8, 15, 24]  # built once


@pytest.mark.parametrize(("backend", "layer", "extra"), [
    ({"fa_skip_kv_cache": False}, {}, {}),  # a KV pool
    ({"fa_impl_ver": 4}, {}, {}),
    ({"use_mla": True}, {}, {}),
    ({"kv_cache_dtype_str": "fp8_e4m3"}, {}, {}),
    ({"kv_cache_is_mxfp8": True}, {}, {}),
    ({"has_local_attention": True}, {}, {}),
    ({"attn_cp_size": 2}, {}, {}),
    ({}, {"sliding_window_size": 128}, {}),
    ({}, {"attn_type": SimpleNamespace(value="encoder_only")}, {}),
    ({}, {"is_cross_attention": True}, {}),
    ({}, {}, {"sinks": torch.zeros(HEADS)}),
    ({}, {}, {"q_descale": torch.ones(1)}),
    ({}, {}, {"verify": True}),  # speculative decoding's target verify (cascade attention)
    ({}, {}, {"no_k": True}),  # K/V shared across layers
    ({}, {}, {"transposed_q": True}),  # a query whose last dimension is not contiguous
])
def test_every_other_call_runs_sglangs_own_method(backend: dict[str, Any], layer: dict[str, Any],
                                                  extra: dict[str, Any]) -> None:
    be, q, k, v, lay, batch = parts(**backend)
    for key, value in layer.items():
        setattr(lay, key, value)
    batch.forward_mode = Mode(verify=extra.pop("verify", False))
    if extra.pop("no_k", False):
        k = v = None  # type: ignore[assignment]
    if extra.pop("transposed_q", False):
        q = torch.randn(HEADS * DIM, q.shape[0]).t()
    seen: list[Any] = []

    def original(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "sglang"

    assert strided_query.around_forward_extend(original, be, q, k, v, lay, batch, True, **extra) == "sglang"
    assert CALLS == [] and seen[0][0][1] is q and seen[0][1] == extra


def test_the_hook_stands_in_for_sglang_0_5_17s_method_and_reads_attributes_it_sets() -> None:
    hooks = json.loads((FIXTURES / "sglang_0.5.17_hooks.json").read_text())["methods"]
    backend = "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend"
    assert hooks[strided_query.TARGET]["args"][:7] == ["self", "q", "k", "v", "layer", "forward_batch",
                                                       "save_kv_cache"]
    # the branch stood in for, as read when this module was written: a changed method fails here
    assert hooks[strided_query.TARGET]["source_sha256"] == (
        "23afc162b867b59a639ec613ca78110808399f83a66cae2a8f6ce73f41558db4")
    read = {"fa_skip_kv_cache", "fa_impl_ver", "use_mla", "kv_cache_dtype_str", "kv_cache_is_mxfp8",
            "has_local_attention", "attn_cp_size", "num_splits", "flash_attn_varlen_func"}
    assert read <= set(hooks[f"{backend}.__init__"]["self_attrs"])
    layer = {"attn_type", "is_cross_attention", "sliding_window_size", "tp_q_head_num", "tp_k_head_num",
             "tp_v_head_num", "head_dim", "v_head_dim", "scaling", "logit_cap"}
    assert layer <= set(hooks["sglang.srt.layers.radix_attention.RadixAttention.__init__"]["self_attrs"])


def test_the_plugin_adds_the_hook_only_where_the_launch_resolved_it_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tests.test_sglang_plugin import _fake_sglang

    monkeypatch.chdir(tmp_path)
    registered = _fake_sglang(monkeypatch)
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "sglang")
    for unresolved in ("auto", "false"):  # a launcher always resolves auto; unresolved, no hook
        monkeypatch.setenv("EMBEDSERVE_ENGINE__STRIDED_QUERY", unresolved)
        sglang_plugin.register()
        assert strided_query.TARGET not in [t for t, _, _ in registered]
    monkeypatch.setenv("EMBEDSERVE_ENGINE__STRIDED_QUERY", "true")
    sglang_plugin.register()
    assert (strided_query.TARGET, strided_query.around_forward_extend, "around") in registered


def test_the_launcher_refuses_it_without_the_embedding_only_forward_on_fa3(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "max_position_embeddings": 32768, "hidden_size": 64}))

    def launch(**engine: Any) -> Any:
        return build_launch(Settings(_env_file=None, model={"path": str(model)},
                                     engine={"strided_query": True, **engine}), gpu_capability=(9, 0))

    launch(attention_backend="fa3")  # auto: kv_cache none on Hopper
    paged = {"attention_backend": "fa3", "kv_cache": "paged"}
    for engine, on in (({"attention_backend": "fa3"}, True), (paged, False),
                       ({"attention_backend": "flashinfer"}, False)):  # auto: on only where it can run
        spec = launch(**engine, strided_query="auto")
        resolved = Settings.model_validate_json(spec.env["EMBEDSERVE_SETTINGS_JSON"]).engine.strided_query
        note = f"strided_query auto: {'on' if on else 'off'}"
        assert resolved is on and [n for n in spec.notes if n.startswith(note)]
    with pytest.raises(LaunchConfigError, match=r"engine\.strided_query needs .*kv_cache is paged"):
        launch(attention_backend="fa3", kv_cache="paged")
    with pytest.raises(LaunchConfigError, match=r"engine\.strided_query needs .*backend flashinfer"):
        launch(attention_backend="flashinfer")
