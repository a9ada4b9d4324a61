"""Forecast on synthetic series: a leak is timed within 10%, non-leaks never restart."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from embedserve.health.forecast import ForecastParams
from tests.memory_series import (
    HOUR,
    GiB,
    Series,
    flat,
    linear,
    one_step,
    plateau,
    replay,
    sawtooth,
    steps,
    verdict,
)

PARAMS = ForecastParams()  # the shipped defaults (settings.health)
LIMIT = 80 * GiB
EVAL_TIMES = [h * HOUR for h in np.arange(0.25, 12.01, 0.25)]


def truth_hours(start: float, per_hour: float, at: float, limit: float = LIMIT) -> float:
    return (limit - (start + per_hour * at / HOUR)) / per_hour


@pytest.mark.parametrize("per_hour_gib", [0.25, 1.0, 3.0, 8.0])
def test_linear_leak_within_ten_percent(per_hour_gib: float) -> None:
    s = linear(hours=6, start=20 * GiB, per_hour=per_hour_gib * GiB)
    at = float(s.t[-1])
    f = replay(s, LIMIT, at, PARAMS)
    truth = truth_hours(20 * GiB, per_hour_gib * GiB, at)
    assert f.status == "growing", f.reason
    expected = min(truth, PARAMS.horizon_cap_hours)
    assert f.estimated_hours_until_oom == pytest.approx(expected, rel=0.10), f.reason
    assert f.hours_lower is not None and f.estimated_hours_until_oom is not None
    assert f.hours_lower <= f.estimated_hours_until_oom
    assert f.slope_bytes_per_hour == pytest.approx(per_hour_gib * GiB, rel=0.10)


def test_fast_leak_recommends_restart_and_names_binding() -> None:
    s = linear(hours=4, start=40 * GiB, per_hour=8 * GiB)  # 72 GiB at 4 h: 1 h left
    f = replay(s, LIMIT, float(s.t[-1]), PARAMS)
    v = verdict(f)
    assert v.recommends_restart is True
    assert v.binding_resource == "gpu:0"
    assert v.status == "critical"
    assert "out of memory in about" in v.reason


def test_leak_needs_min_span_and_samples() -> None:
    s = linear(hours=1, per_hour=20 * GiB)
    early = replay(s, LIMIT, 0.4 * HOUR, PARAMS)  # 5 min warm-up + 19 min < 30 min
    assert early.status == "insufficient_data"
    assert verdict(early).recommends_restart is False


@pytest.mark.parametrize(
    "series",
    [
        flat(),
        steps(),
        one_step(),
        one_step(at=6.0),
        plateau(),
        sawtooth(),
        flat(level=79 * GiB),
        plateau(level=74 * GiB),
    ],
    ids=[
        "flat",
        "steps",
        "step-near-limit",
        "late-step-near-limit",
        "plateau",
        "sawtooth",
        "flat-near-limit",
        "plateau-near-limit",
    ],
)
def test_no_leak_never_recommends_restart(series: Series) -> None:
    for at in EVAL_TIMES:
        f = replay(series, LIMIT, at, PARAMS)
        v = verdict(f)
        assert v.recommends_restart is False, f"at {at / HOUR:.2f} h: {v.reason}"


@pytest.mark.parametrize("make", [flat, plateau, sawtooth], ids=["flat", "plateau", "sawtooth"])
def test_stationary_series_report_not_growing(make: Callable[[], Series]) -> None:
    s = make()
    f = replay(s, LIMIT, float(s.t[-1]), PARAMS)
    assert f.status == "not_growing", f.reason
    assert f.estimated_hours_until_oom is None


def test_steps_settle_to_not_growing() -> None:
    s = steps()
    f = replay(s, LIMIT, float(s.t[-1]), PARAMS)  # last step 7 h ago, window 6 h
    assert f.status == "not_growing", f.reason


def test_sawtooth_over_a_leaking_floor_is_timed() -> None:
    s = sawtooth(hours=8, floor_per_hour=2 * GiB)
    at = float(s.t[-1])
    f = replay(s, LIMIT, at, PARAMS)
    peak_now = 30 * GiB + 2 * GiB * at / HOUR + 6 * GiB
    truth = (LIMIT - peak_now) / (2 * GiB)
    assert f.status == "growing", f.reason
    assert f.estimated_hours_until_oom == pytest.approx(truth, rel=0.10)


def test_isolated_cache_clear_resets_the_fit() -> None:
    # 3 h of cache growth, then one manual clear back down, then flat: the old ramp is
    # no evidence about the present.
    t = np.arange(0.0, 6 * HOUR + 1, 60.0)
    y = np.where(t < 3 * HOUR, 20 * GiB + 10 * GiB * t / (3 * HOUR), 20 * GiB)
    s = Series(t, y, clears=[3 * HOUR])
    f = replay(s, LIMIT, float(t[-1]), PARAMS)
    assert f.window_start is not None and f.window_start >= 3 * HOUR
    assert f.status == "not_growing", f.reason


def test_horizon_is_capped() -> None:
    s = linear(hours=8, start=20 * GiB, per_hour=0.05 * GiB, noise=0.001)
    f = replay(s, LIMIT, float(s.t[-1]), PARAMS)
    assert f.status == "growing"
    assert f.capped is True
    assert f.estimated_hours_until_oom == PARAMS.horizon_cap_hours
    assert f.hours_upper is None


def test_at_limit() -> None:
    s = flat(level=81 * GiB)
    f = replay(s, LIMIT, float(s.t[-1]), PARAMS)
    assert f.status == "at_limit"
    assert verdict(f).recommends_restart is True


def test_no_limit_is_reported() -> None:
    s = linear()
    from embedserve.health.forecast import forecast_resource

    f = forecast_resource("gpu:0", s.t, s.y, None, None, 0.0, PARAMS)
    assert f.status == "no_limit"
    assert verdict(f).recommends_restart is False
