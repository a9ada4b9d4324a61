"""The GPU lab's verdict arithmetic and run plans (loadtest/gpu_lab), checked on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loadtest" / "gpu_lab"))

import labreport as lr
import labsteps


def row(case: str, side: str, tok: int, p50: float, errors: int = 0, **kw: Any) -> dict[str, Any]:
    return {"case": case, "side": side, "tok_s": tok, "p50_ms": p50, "p95_ms": p50 * 2,
            "errors": errors, **kw}


def test_compare_uses_medians_and_targets() -> None:
    rows = [row("short", "raw", 50_000, 200), row("short", "gateway", 66_000, 150),
            row("short", "raw", 60_000, 220), row("short", "gateway", 70_000, 160),
            row("medium", "raw", 80_000, 900), row("medium", "gateway", 77_000, 930),
            row("low", "raw", 5_000, 20.0), row("low", "gateway", 5_000, 22.5)]
    out = {c["case"]: c for c in lr.compare(rows)}
    assert out["short"]["raw_tok_s"] == 55_000 and out["short"]["gateway_tok_s"] == 68_000
    assert out["short"]["ratio"] == pytest.approx(1.236, abs=1e-3) and out["short"]["pass"] is True
    assert out["medium"]["ratio"] == pytest.approx(0.963, abs=1e-3) and out["medium"]["pass"] is False
    assert out["low"]["added_p50_ms"] == 2.5 and out["low"]["pass"] is True


def test_errors_fail_a_case_and_best_knobs_skip_errors() -> None:
    rows = [row("long", "raw", 50_000, 1000), row("long", "gateway", 60_000, 1000, errors=3)]
    assert lr.compare(rows)[0]["pass"] is False
    sweep = [row("short", "raw", 90_000, 1), row("short", "gateway", 80_000, 1, errors=1, calls=8),
             row("short", "gateway", 70_000, 1, calls=4, wait_ms=2.0)]
    best = lr.pick_best(sweep)
    assert best is not None and best["calls"] == 4


def test_scale_ratio_takes_the_best_concurrency_per_replica_count() -> None:
    rows = [{"case": "medium", "replicas": n, "conc": c, "tok_s": t, "errors": 0}
            for n, c, t in [(1, 64, 70_000), (1, 128, 71_000), (2, 64, 100_000), (2, 128, 136_000)]]
    s = lr.scale_summary(rows)[0]
    assert s["one_conc"] == 128 and s["two_conc"] == 128
    assert s["ratio"] == pytest.approx(1.915, abs=1e-3) and s["pass"] is True
    assert s["per_engine_ratio"] == pytest.approx(136_000 / 70_000, abs=1e-3)  # 2 at 128 vs 1 at 64


def test_soak_rate_and_sweep_spec() -> None:
    assert lr.soak_rate(20.0) == pytest.approx(17.0)
    with pytest.raises(ValueError):
        lr.soak_rate(0.0)
    assert labsteps.parse_sweep("2:0, 8:2.5") == [(2, 0.0), (8, 2.5)]


def test_raw_runs_send_ids_clamped_to_the_cap_and_gateway_runs_texts() -> None:
    raw = labsteps.loadtest_argv("http://h:30000/v1/embeddings", Path("/o"), model_dir="/m/m4",
                                 mix="uniform:16-512", duration=20, conc=64, ids=True)
    gw = labsteps.loadtest_argv("http://h:8000", Path("/o"), model_dir="/m/m4", mix="seed",
                                duration=900, rate=12.5, extra=["--health-url", "/health/memory"])
    assert raw[raw.index("--input") + 1] == "ids" and "--max-tokens" in raw
    assert raw[raw.index("--concurrency") + 1] == "64" and raw[raw.index("--model") + 1] == "m4"
    assert "--input" not in gw and gw[gw.index("--rate") + 1] == "12.5" and "--concurrency" not in gw
    assert gw[-2:] == ["--health-url", "/health/memory"]


def test_render_handles_a_partial_visit() -> None:
    res = {"visit": "perf", "steps": {
        "ready-4b": {"ok": True, "ready_after_s": 260.0},
        "perf-4b": {"ok": True, "knobs": {"calls": 8, "wait_ms": 2.0},
                    "rows": [row("short", "raw", 50_000, 200, name="a"),
                             row("short", "gateway", 61_000, 150, name="b")],
                    "comparison": lr.compare([row("short", "raw", 50_000, 200),
                                              row("short", "gateway", 61_000, 150)])},
        "perf-0.6b": {"ok": False, "error": "boom"}}}
    md = lr.render(res)
    assert "| short | 1+1 | 50,000 | 61,000 | 1.22 |" in md
    assert "perf-0.6b: `boom`" in md


def test_engine_visit_report_renders_the_committed_lab_results() -> None:
    results = Path(__file__).resolve().parents[1] / "results" / "gpu-lab" / "results.json"
    md = lr.render_engine(json.loads(results.read_text()), 8192)
    correctness = [ln for ln in md.splitlines() if "| SGLang token ids |" in ln or "| gateway text |" in ln]
    assert len(correctness) == 15 and all("| yes |" in ln for ln in correctness)
    assert "| p50 ms | p95 ms | p99 ms |" in md  # cache-clearing columns in order
    assert "5 runs, mean 58,325 tok/s, median 56,643" in md
    assert "## Failed steps" not in md


def test_side_by_side_names_columns_after_the_sides() -> None:
    rows = [row("low", "graphs", 50_000, 6.0), row("low", "eager", 45_000, 7.5),
            row("low", "graphs", 52_000, 6.2), row("low", "eager", 47_000, 7.3)]
    (c,) = lr.side_by_side(rows, "graphs", "eager")
    assert c["graphs_tok_s"] == 51_000 and c["eager_tok_s"] == 46_000 and c["runs"] == "2+2"
    assert c["ratio"] == pytest.approx(0.902, abs=1e-3) and c["added_p50_ms"] == pytest.approx(1.3)


@pytest.mark.parametrize("visit", ["perf", "perf-recheck"])
def test_perf_reports_render_the_committed_lab_results(visit: str) -> None:
    """The committed results.md of each perf visit is what results.json renders to."""
    folder = Path(__file__).resolve().parents[1] / "results" / "gpu-lab" / visit
    md = lr.render(json.loads((folder / "results.json").read_text()))
    assert md.strip() == (folder / "results.md").read_text().strip()


def test_vector_lines_tell_the_gateway_hop_from_sglangs_own_spread() -> None:
    old = lr.vector_lines({"tokens": [8], "min_cos": 0.9992, "ok": False})
    assert old == ["Vectors, same token ids ([8]) through the gateway and straight to SGLang: "
                   "min cosine 0.9992 (MISMATCH)."]
    new = lr.vector_lines({"tokens": [8, 300], "hop_cos": [1.0, 1.0], "batch_cos": [0.9995, 0.9992],
                           "raw_spread_cos": [0.9995, 0.9992], "min_cos": 0.9992, "ok": True})
    assert "gateway vs SGLang: [1.0, 1.0] (ok, >= 0.9999)" in new[1]
    assert new[2].endswith("[0.9995, 0.9992]") and "SGLang against itself" in new[3]


def test_visit_names_on_the_command_line_are_the_visits_defined() -> None:
    assert ("engine", *labsteps.VISITS) == labsteps.lab.VISIT_NAMES
