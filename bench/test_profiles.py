"""The profiles' arithmetic: kernels by class, busy time and gaps of a torch trace, py-spy's shares,
and the same requests profiled on every side (bench/kernel_profile.py). Run: ``pytest bench``."""

from __future__ import annotations

import gzip
import json
import os
import socket
from pathlib import Path
from typing import Any

import harness
import kernel_profile
import measure
import peers
import pytest
from harness import Host, Side
from procs import WorkDir
from profile_engine import kernel_kind, listener_pid, load_trace, summarise_pyspy, summarise_trace
from test_harness import checkpoint


def kernel(ts: float, dur: float, name: str, cat: str = "kernel") -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_kernels_are_sorted_into_classes_by_what_they_compute() -> None:
    classes = {  # names as SGLang's (FA3, FlashInfer, sgl-kernel) and vLLM's (inductor) traces give them
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm", "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm",
        "void flashinfer::PrefillWithKVCacheKernel<flashinfer::CollectiveMainloop<cutlass::bfloat16_t>>":
            "attention",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<": "attention",
        "BatchPrefillWithRaggedKVCacheKernel": "attention", "flash_fwd_kernel": "attention",
        "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>": "norm",
        "void (anonymous namespace)::fused_qknorm_warp<128l, true, __nv_bfloat16>": "norm",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
        "void (anonymous namespace)::fused_rope_kernel<true, 128l": "rope",
        "void (anonymous namespace)::act_and_mul_kernel<__nv_bfloat16": "activation",
        "triton_poi_fused_mul_silu_slice_1": "activation",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda": "copy",
        "void (anonymous namespace)::store_kvcache<2048l": "copy",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>": "other"}
    assert {name: kernel_kind(name) for name in classes} == classes


def test_busy_time_and_gaps_from_a_trace() -> None:
    events = [kernel(0, 100, "gemm_a"),  # 0-100
              kernel(50, 100, "flash_fwd"),  # overlaps: busy to 150
              kernel(155, 45, "rmsnorm"),  # 5 us gap
              kernel(250, 50, "gemm_b"),  # 50 us gap
              kernel(2300, 100, "copy", cat="gpu_memcpy"),  # 2,000 us gap
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]  # not GPU time
    s = summarise_trace(events)
    assert (s["kernels"], s["span_ms"], s["gpu_busy_ms"]) == (5, pytest.approx(2.4), pytest.approx(0.345))
    assert s["kernel_ms_by_kind"] == {"gemm": 0.15, "attention": 0.1, "copy": 0.1, "norm": 0.045}
    assert s["top_kernels_by_kind_ms"]["gemm"] == {"gemm_a": 0.1, "gemm_b": 0.05}
    assert s["gaps_by_size"] == {"under 10 us": 1, "10-100 us": 1, "0.1-1 ms": 0, "over 1 ms": 1}
    assert s["idle_ms_by_gap"]["over 1 ms"] == pytest.approx(2.0)


def test_an_empty_trace_says_so() -> None:
    assert summarise_trace([{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]) == {"kernels": 0}


def test_gzipped_trace_files_load(tmp_path: Path) -> None:
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [kernel(0, 10, "gemm")]}, f)
    assert load_trace(path)[0]["name"] == "gemm"


def test_pyspy_shares_per_thread_and_the_busiest_threads_functions() -> None:
    raw = "\n".join(["thread (0x1);run (a/loop.py:10);forward (m/model.py:5) 60",
                     "thread (0x1);run (a/loop.py:10);recv (z/zmq.py:3) 40",
                     "thread (0x2);tokenize (t/tok.py:1) 20", "not a stack line"])
    s = summarise_pyspy(raw, rate_hz=100, seconds=1)
    assert s["threads_cpu_pct"] == {"thread (0x1)": 100.0, "thread (0x2)": 20.0}
    assert s["busiest_thread"] == "thread (0x1)" and s["inclusive_pct"]["run (loop.py)"] == 100.0
    assert s["own_pct"] == {"forward (model.py)": 60.0, "recv (zmq.py)": 40.0}


def test_listener_pid_finds_this_process(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert listener_pid(s.getsockname()[1]) == os.getpid()


def test_the_same_requests_are_profiled_on_each_side_per_thousand_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine of a stack and vLLM's front end profiled; traces summed per 1,000 answered tokens."""
    host = Host(WorkDir(tmp_path / "w"), models={"4b": str(checkpoint(tmp_path / "m"))})
    ours, vllm = Side("embedserve", harness.UP, 8650, "4b"), Side("vllm tuned", peers.VLLM, 8721, "4b")
    monkeypatch.setattr(harness.Side, "engine_ports", lambda side: [30650, 30651] if side is ours else [])
    monkeypatch.setattr(harness, "running", lambda host, side: True)
    sent, folders = list[tuple[str, int | None, int]](), dict[str, Path]()

    def crosscheck(t: measure.Target, load: measure.Load, seed: int, requests: int | None = None) -> Any:
        sent.append((t.url, requests, t.cap))  # room left under the cap for special tokens
        return {"tokens": 4000 if requests == 800 else 1, "requests": requests, "errors": 0}

    def post(url: str, body: dict[str, Any]) -> None:
        port = url.rsplit(":", 1)[1].split("/")[0]
        folder = folders.setdefault(port, Path(body.get("output_dir") or harness.trace_dir(host, vllm)))
        if url.endswith("/stop_profile"):  # the engine writes its trace: 1 ms of GEMM, 1 ms idle, 0.5 ms norm
            folder.mkdir(parents=True, exist_ok=True)
            gemm = "nvjet_a" if port != "8721" else "sm90_xmma_gemm"
            events = [kernel(0, 1000, gemm), kernel(2000, 500, "FusedAddRMSNormKernel")]
            (folder / f"{port}.trace.json").write_text(json.dumps({"traceEvents": events}))

    for name, value in (("run_crosscheck", crosscheck), ("post", post), ("POLL_S", 0.01)):
        monkeypatch.setattr(kernel_profile, name, value)
    out = kernel_profile.step_kernels(host, 0.0, [ours, vllm], measure.Load("seed", 64), 800, 7)
    # inputs at most half the cap: well under every side's limit
    assert [r for r in sent if r[1] == 800] == [("http://127.0.0.1:8650/v1/embeddings", 800, 4096),
                                                 ("http://127.0.0.1:8721/v1/embeddings", 800, 4096)]
    assert sorted(folders) == ["30650", "30651", "8721"]  # each engine, and vLLM's own folder
    ours_1k = out["kernel_profiles"]["embedserve"]["per_1k_tokens"]  # two engines' traces summed
    assert (ours_1k["gemm"], ours_1k["norm"], ours_1k["idle"], ours_1k["kernels"]) == (0.5, 0.25, 0.5, 0.75)
    rows, top = out["tables"].values()
    gemm = next(r for r in rows if r["kernel class"] == "gemm")
    assert gemm == {"kernel class": "gemm", "embedserve": 0.5, "vllm tuned": 0.25,
                    "embedserve minus vllm tuned": 0.25}
    assert {"side": "vllm tuned", "class": "gemm", "kernel": "sm90_xmma_gemm",
            "ms per 1,000 tokens": 0.25} in top
    work = [r for r in rows if r["kernel class"] in ("tokens answered", "requests not answered")]
    assert [(r["embedserve"], r["vllm tuned"]) for r in work] == [(4000, 4000), (0, 0)]
    out["kernel_profiles"]["vllm tuned"] |= {"tokens": 3000, "errors": 14}  # its limit under an input
    title, rows = next(iter(kernel_profile.tables(out["kernel_profiles"]).items()))
    assert title.endswith("(embedserve 4,000, vllm tuned 3,000 tokens; NOT equal work: embedserve did not "
                          "answer 0, vllm tuned did not answer 14)") and rows[-1]["vllm tuned"] == 14
