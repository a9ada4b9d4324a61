"""The leak drill's arithmetic and report, checked without a GPU on a recorded CPU dry run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import drill
import drill_report
import harness
import pytest
from procs import WorkDir

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "drill-cpu-dry-run.json"
MB = 1e6


def test_true_time_and_forecast_error() -> None:
    rate = 10 * MB  # bytes per second
    # used grows at the rate; the forecast is 10% long at t=0..9, then 30% short at t=10
    samples: list[dict[str, Any]] = [{"t": float(t), "used": 100 * MB + rate * t, "limit": 1_100 * MB,
                "res_hours": (1.1 if t < 10 else 0.7) * (100 - t) / 3600} for t in range(11)]
    samples.insert(0, {"t": -1.0, "used": 90 * MB, "limit": 1_100 * MB, "res_hours": None})
    pts = drill_report.forecast_points(samples, rate)
    assert pts[1].true_s == pytest.approx(100.0) and pts[-1].true_s == pytest.approx(90.0)
    err = drill_report.forecast_error(pts, 0.0, 11.0)
    assert err["samples"] == 11 and err["no_forecast"] == 0
    assert err["median_abs"] == pytest.approx(0.1) and err["max_abs"] == pytest.approx(0.3)
    assert err["within_target"] is True and err["share_within_target"] == pytest.approx(10 / 11, abs=1e-3)
    before = drill_report.forecast_error(pts, -5.0, 0.0)  # only the sample without a forecast
    assert before["samples"] == 0 and before["no_forecast"] == 1 and before["median_abs"] is None
    past = [drill_report.Point(0.0, -5.0, 10.0)]  # beyond the limit: no relative error
    assert drill_report.forecast_error(past, 0.0, 1.0)["samples"] == 0


def test_failed_requests_are_all_but_2xx_429_and_503() -> None:
    counted = drill_report.count_requests(
        {"200": 90, "429": 5, "503": 3, "500": 1, "timeout": 1, "connection_refused": 0}, dropped=2)
    assert counted["sent"] == 100 and counted["ok"] == 90
    assert (counted["status_429"], counted["status_503"]) == (5, 3)
    assert counted["failed"] == 2 and counted["failed_by_status"] == {"500": 1, "timeout": 1}
    assert counted["dropped_arrivals"] == 2
    assert drill_report.count_requests({"200": 4, "201": 1})["failed"] == 0


def test_the_recorded_drill() -> None:
    doc = json.loads(FIXTURE.read_text())
    s = drill_report.summarize(doc)
    assert s == doc["summary"]  # what the drill wrote is what the arithmetic gives
    assert s["replaced"] and s["passed"] and s["replacements_metric"] == 1
    assert s["requests"]["failed"] == 0 and s["requests"]["sent"] == sum(doc["load"]["by_status"].values())
    ev = doc["events"]
    assert s["replace_start_s"] == pytest.approx(ev["replace_start"] - ev["leak_start"], abs=0.1)
    assert s["swap_s"] == pytest.approx(ev["replace_done"] - ev["replace_start"], abs=0.1)
    # the true time at the replacement's start, by hand from the last sample before it
    last = [x for x in doc["samples"] if x.get("used") is not None and x["t"] <= ev["replace_start"]][-1]
    by_hand = (last["limit"] - last["used"]) / doc["meta"]["rate_bytes_per_s"]
    assert s["true_s_at_replace_start"] == pytest.approx(by_hand, abs=0.1)
    assert s["true_s_at_replace_start"] <= s["replace_below_s"] + 2  # started when it was due
    assert not s["limit_reached"] and s["peak_used_gb"] < s["limit_gb"]
    fe = s["forecast_error"]
    assert fe["samples"] > 20 and fe["median_abs"] <= drill_report.ERROR_TARGET


def test_report_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    text = drill_report.write_report(json.loads(FIXTURE.read_text()), tmp_path).read_text()
    assert "| verdict | PASS |" in text and "embedserve up --drill-leak 20MiB/s" in text
    for png in ("memory.png", "forecast.png", "requests.png"):
        assert (tmp_path / png).stat().st_size > 10_000 and f"]({png})" in text
    assert all(line.count("|") == 3 for line in text.splitlines() if line.startswith("| forecast"))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_replacement_is_due_about_when_planned(tmp_path: Path, device: str) -> None:
    host = harness.Host(WorkDir(tmp_path), device=device)
    cfg = drill.config_for(host)
    to_limit = (cfg.limit_bytes - cfg.base_bytes) / cfg.rate_bytes_per_s
    due = cfg.health["replace_below_hours"] * 3600
    assert to_limit - due == pytest.approx(cfg.replace_after_s, abs=2)
    if device == "cuda":  # room at the start of the swap for a second engine and ~2 min of leak
        assert due * cfg.rate_bytes_per_s > cfg.base_bytes + 120 * cfg.rate_bytes_per_s
        assert cfg.env()["EMBEDSERVE_HEALTH__GPU_MEMORY_LIMIT_BYTES"] == "56000000000"
    assert cfg.env()["EMBEDSERVE_HEALTH__REPLACE_COOLDOWN_S"] == "600"
