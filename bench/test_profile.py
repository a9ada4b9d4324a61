"""bench/profile_engine.py's arithmetic on hand-made traces and py-spy output."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from profile_engine import kernel_kind, listener_pid, load_trace, summarise_pyspy, summarise_trace


def kernel(ts: float, dur: float, name: str, cat: str = "kernel") -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_kernels_are_sorted_into_gemm_attention_and_the_rest() -> None:
    assert kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_kind("BatchPrefillWithRaggedKVCacheKernel") == "attention"
    assert kernel_kind("flash_fwd_kernel") == "attention"
    name = "void flashinfer::PrefillWithKVCacheKernel<flashinfer::CollectiveMainloop<cutlass::bfloat16_t>>"
    assert kernel_kind(name) == "attention"
    assert kernel_kind("RMSNormKernel") == "other"


def test_busy_time_and_gaps_from_a_trace() -> None:
    events = [
        kernel(0, 100, "gemm_a"),  # 0-100
        kernel(50, 100, "flash_fwd"),  # overlaps: busy to 150
        kernel(155, 45, "rmsnorm"),  # 5 us gap
        kernel(250, 50, "gemm_b"),  # 50 us gap
        kernel(2300, 100, "copy", cat="gpu_memcpy"),  # 2,000 us gap
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # not GPU time
    ]
    s = summarise_trace(events, steps=2)
    assert s["kernels"] == 5
    assert s["span_ms"] == pytest.approx(2.4)
    assert s["gpu_busy_ms"] == pytest.approx(0.345)
    assert s["kernel_ms_by_kind"] == {"gemm": 0.15, "attention": 0.1, "memcpy/memset": 0.1, "other": 0.045}
    assert s["gaps_by_size"] == {"under 10 us": 1, "10-100 us": 1, "0.1-1 ms": 0, "over 1 ms": 1}
    assert s["idle_ms_by_gap"]["over 1 ms"] == pytest.approx(2.0)
    assert s["per_step_ms"]["span"] == pytest.approx(1.2)


def test_an_empty_trace_says_so() -> None:
    assert summarise_trace([{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]) == {"kernels": 0}


def test_gzipped_trace_files_load(tmp_path: Path) -> None:
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [kernel(0, 10, "gemm")]}, f)
    assert load_trace(path)[0]["name"] == "gemm"


def test_pyspy_shares_per_thread_and_the_busiest_threads_functions() -> None:
    raw = "\n".join([
        "thread (0x1);run (a/loop.py:10);forward (m/model.py:5) 60",
        "thread (0x1);run (a/loop.py:10);recv (z/zmq.py:3) 40",
        "thread (0x2);tokenize (t/tok.py:1) 20",
        "not a stack line",
    ])
    s = summarise_pyspy(raw, rate_hz=100, seconds=1)
    assert s["threads_cpu_pct"] == {"thread (0x1)": 100.0, "thread (0x2)": 20.0}
    assert s["busiest_thread"] == "thread (0x1)"
    assert s["inclusive_pct"]["run (loop.py)"] == 100.0
    assert s["own_pct"] == {"forward (model.py)": 60.0, "recv (zmq.py)": 40.0}


def test_listener_pid_finds_this_process(tmp_path: Path) -> None:
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert listener_pid(s.getsockname()[1]) == os.getpid()
