"""The engines' forward passes from their /metrics pages (bench/measure.py)."""

from __future__ import annotations

import measure
import pytest

SGLANG_PAGE = """# TYPE sglang:cuda_graph_passes_total counter
sglang:cuda_graph_passes_total{mode="prefill_cuda_graph"} 30.0
sglang:cuda_graph_passes_total{mode="prefill_none"} 10.0
sglang:cuda_graph_passes_total{mode="decode_cuda_graph"} 500.0
# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{mode="prefill_compute"} 160000.0
sglang:realtime_tokens_total{mode="prefill_cache"} 9000.0
sglang:realtime_tokens_total{mode="decode"} 7000.0
# TYPE sglang:forward_execution_seconds_total counter
sglang:forward_execution_seconds_total{category="extend"} 2.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total 169000.0
"""
VLLM_PAGE = """# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 8.0
vllm:iteration_tokens_total_count{engine="0"} 8.0
vllm:iteration_tokens_total_sum{engine="0"} 96000.0
"""
SGLANG = {"passes": 40.0, "graph_passes": 30.0, "tokens": 160000.0, "forward_s": 2.0}


def test_pass_counts_read_sglang_prefill_passes_and_vllm_engine_steps() -> None:
    assert measure.pass_counts(SGLANG_PAGE) == SGLANG
    assert measure.pass_counts(VLLM_PAGE) == {"passes": 8.0, "tokens": 96000.0}
    assert measure.pass_counts("# nothing here\n") == measure.pass_counts("{not prometheus") == {}


def test_pass_figures_give_tokens_per_pass_graph_share_and_gpu_time_of_the_run() -> None:
    after = {"passes": 60.0, "graph_passes": 35.0, "tokens": 240000.0, "forward_s": 3.0}
    assert measure.pass_figures(SGLANG, after) == {"engine_passes": 20, "engine_tokens_per_pass": 4000.0,
                                                   "engine_graph_passes_pct": 25.0,
                                                   "engine_forward_ms_per_1k_tokens": 12.5}
    assert measure.pass_figures({"passes": 8.0, "tokens": 96000.0}, {"passes": 10.0, "tokens": 126000.0}) == {
        "engine_passes": 2, "engine_tokens_per_pass": 15000.0}
    assert measure.pass_figures({}, {}) == {}  # not exposed: no figure, not a zero
    assert measure.pass_figures(after, SGLANG) == {}  # counters went back: the engine restarted


def test_engine_passes_sum_every_metrics_page_of_a_side(monkeypatch: pytest.MonkeyPatch) -> None:
    pages = {"http://e0/metrics": (200, SGLANG_PAGE), "http://e1/metrics": (200, SGLANG_PAGE),
             "http://gone/metrics": (0, "")}
    monkeypatch.setattr(measure, "http_get", lambda url: pages[url])
    t = type("T", (), {"metrics": list(pages)})()
    assert measure.engine_passes(t) == {k: 2 * v for k, v in SGLANG.items()}
