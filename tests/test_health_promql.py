"""The example alert (Prometheus predict_linear) agrees with the endpoint on a linear leak."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from embedserve.health.forecast import ForecastParams
from tests.conftest import tool_missing
from tests.memory_series import HOUR, GiB, Series, replay, verdict

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yaml"
LIMIT = 80 * GiB
PARAMS = ForecastParams()
SCRAPE_S = 15.0


def linear_regression(t: np.ndarray, y: np.ndarray, at: float) -> tuple[float, float]:
    """Prometheus' linearRegression (promql/functions.go): slope, intercept at ``at``."""
    x = t - at
    n = len(x)
    cov_xy = np.sum(x * y) - np.sum(x) * np.sum(y) / n
    var_x = np.sum(x * x) - np.sum(x) ** 2 / n
    slope = cov_xy / var_x
    return float(slope), float(np.sum(y) / n - slope * np.sum(x) / n)


def predict_linear(t: np.ndarray, y: np.ndarray, at: float, rng_s: float, ahead_s: float) -> float:
    sel = (t > at - rng_s) & (t <= at)
    slope, intercept = linear_regression(t[sel], y[sel], at)
    return intercept + slope * ahead_s


def promql_hours(t: np.ndarray, y: np.ndarray, at: float, rng_s: float = 6 * HOUR) -> float:
    """The recording rule embedserve:hours_until_oom:predict_linear6h."""
    sel = (t > at - rng_s) & (t <= at)
    slope, intercept = linear_regression(t[sel], y[sel], at)
    return (LIMIT - intercept) / slope / 3600


def leak(per_hour: float, hours: float = 8.0, start: float = 20 * GiB, noise: float = 0.0):
    t = np.arange(0.0, hours * HOUR + 1, SCRAPE_S)
    rng = np.random.default_rng(7)
    return Series(t, start + per_hour * t / HOUR + rng.normal(0, noise * GiB, len(t)))


@pytest.mark.parametrize(
    ("per_hour", "noise", "rel"),
    [(1 * GiB, 0.0, 0.02), (4 * GiB, 0.0, 0.02), (4 * GiB, 0.2, 0.05), (6 * GiB, 0.5, 0.10)],
)
def test_endpoint_agrees_with_predict_linear(per_hour: float, noise: float, rel: float) -> None:
    s = leak(per_hour, noise=noise)
    at = float(s.t[-1])
    ours = replay(s, LIMIT, at, PARAMS).estimated_hours_until_oom
    theirs = promql_hours(s.t, s.y, at)
    assert ours is not None
    assert ours == pytest.approx(theirs, rel=rel)


@pytest.mark.parametrize(("per_hour", "fires"), [(7 * GiB, True), (4 * GiB, False)])
def test_alert_fires_when_readiness_drains(per_hour: float, fires: bool) -> None:
    # At 8 h: 7 GiB/h leaves 4 GiB (0.6 h); 4 GiB/h leaves 28 GiB (7 h) > the 6 h horizon.
    s = leak(per_hour, start=4 * GiB)
    at = float(s.t[-1])
    predicted = predict_linear(s.t, s.y, at, 6 * HOUR, 6 * HOUR)
    assert (predicted > LIMIT) is fires
    assert verdict(replay(s, LIMIT, at, PARAMS)).recommends_restart is fires


def test_rule_file_uses_exported_names() -> None:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    exprs = " ".join(r["expr"] for r in rules)
    assert "predict_linear(embedserve_memory_used_bytes[6h], 6 * 3600)" in exprs
    assert f"[{int(PARAMS.window_s // 3600)}h]" in exprs  # window matches the endpoint's
    exported = {
        "embedserve_memory_used_bytes",
        "embedserve_memory_limit_bytes",
        "embedserve_hours_until_oom",
        "embedserve_engine_ooms_total",
    }
    used = set(re.findall(r"\bembedserve_[a-z_]+", exprs))
    assert used <= exported, used - exported


def test_on_a_step_predict_linear_false_alarms_and_the_endpoint_does_not() -> None:
    # Reserved memory jumps once by 6 GiB (a new largest shape) to 4 GiB under the limit.
    # OLS over a 6 h window that straddles the jump invents a trend; the envelope and
    # Theil-Sen do not. This is why the pod's own forecast drives the probes.
    from tests.memory_series import one_step

    s = one_step(level=70 * GiB, at=3.0)
    ols_alarms = ours = 0
    for at in np.arange(1.0, 12.01, 0.25) * HOUR:
        ols_alarms += predict_linear(s.t, s.y, at, 6 * HOUR, 6 * HOUR) > LIMIT
        ours += verdict(replay(s, LIMIT, at, PARAMS)).recommends_restart
    assert ols_alarms > 10
    assert ours == 0


# -- the real rules, evaluated by Prometheus' own promtool ----------------------------------
def _promtool() -> str:
    promtool = shutil.which("promtool")
    if not promtool:
        tool_missing("promtool (Debian package: prometheus)")
    return promtool


def _series(start: float, per_hour: float, hours: float = 8.0) -> str:
    """promtool's expanding notation: one sample per scrape, linear."""
    steps = int(hours * HOUR / SCRAPE_S)
    return f"{start!r}+{per_hour * SCRAPE_S / HOUR!r}x{steps}"


def _run_promtool_test(tmp_path: Path, tests: list[dict[str, object]]) -> subprocess.CompletedProcess[str]:
    yaml = pytest.importorskip("yaml")
    spec = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return subprocess.run(
        [_promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )


LABELS = '{instance="pod-a:8000", resource="gpu:0"}'
FIRING = {
    "exp_labels": {"instance": "pod-a:8000", "resource": "gpu:0", "severity": "warning"},
    "exp_annotations": {
        "summary": "pod-a:8000 gpu:0: out of memory within 6 h (predict_linear)",
        "description": "Linear fit over 6 h reaches gpu:0's limit within 6 h. Compare with "
        "embedserve_hours_until_oom and GET /health/memory on the pod; a rolling restart "
        "(kubectl rollout restart) returns the memory.",
    },
}


def _input(start: float, per_hour: float) -> list[dict[str, str]]:
    return [
        {"series": f"embedserve_memory_used_bytes{LABELS}", "values": _series(start, per_hour)},
        {"series": f"embedserve_memory_limit_bytes{LABELS}", "values": _series(LIMIT, 0.0)},
    ]


@pytest.mark.parametrize("per_hour", [1 * GiB, 4 * GiB])
def test_recording_rule_agrees_with_the_endpoint_in_promtool(tmp_path: Path, per_hour: float) -> None:
    s = leak(per_hour)
    at = float(s.t[-1])
    ours = replay(s, LIMIT, at, PARAMS).estimated_hours_until_oom
    assert ours is not None
    check = f"abs(embedserve:hours_until_oom:predict_linear6h - {ours!r}) < bool {0.02 * ours!r}"
    case: dict[str, object] = {
        "interval": f"{SCRAPE_S:.0f}s",
        "input_series": _input(20 * GiB, per_hour),
        "promql_expr_test": [
            {"expr": check, "eval_time": f"{at:.0f}s", "exp_samples": [{"labels": LABELS, "value": 1}]},
        ],
    }
    r = _run_promtool_test(tmp_path, [case])
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_agreement_check_can_fail_in_promtool(tmp_path: Path) -> None:
    check = "abs(embedserve:hours_until_oom:predict_linear6h - 3.0) < bool 0.06"
    case: dict[str, object] = {
        "interval": f"{SCRAPE_S:.0f}s",
        "input_series": _input(20 * GiB, 4 * GiB),  # 7 h to OOM, not 3
        "promql_expr_test": [
            {"expr": check, "eval_time": "8h", "exp_samples": [{"labels": LABELS, "value": 1}]}
        ],
    }
    r = _run_promtool_test(tmp_path, [case])
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr


@pytest.mark.parametrize(("per_hour", "fires"), [(7 * GiB, True), (4 * GiB, False)])
def test_alert_fires_in_promtool_exactly_when_the_endpoint_drains(
    tmp_path: Path, per_hour: float, fires: bool
) -> None:
    s = leak(per_hour, start=4 * GiB)
    assert verdict(replay(s, LIMIT, float(s.t[-1]), PARAMS)).recommends_restart is fires
    alerts = [FIRING] if fires else []
    case: dict[str, object] = {
        "interval": f"{SCRAPE_S:.0f}s",
        "input_series": _input(4 * GiB, per_hour),
        "alert_rule_test": [
            {"alertname": "EmbedserveMemoryExhaustionPredicted", "eval_time": "8h", "exp_alerts": alerts}
        ],
    }
    r = _run_promtool_test(tmp_path, [case])
    assert r.returncode == 0, r.stdout + r.stderr
