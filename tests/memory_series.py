"""Synthetic memory series (flat, leak, steps, plateau, saw-tooth) and a replay helper:
the forecast the sampler would have made at any moment. For tests and demos."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from embedserve.contracts.memory import Advice
from embedserve.health.forecast import ForecastParams, ResourceForecast, forecast_resource
from embedserve.health.history import Event, History, Sample
from embedserve.health.monitor import fit_start
from embedserve.health.report import advice

GiB = float(2**30)
HOUR = 3600.0


@dataclass
class Series:
    t: np.ndarray
    y: np.ndarray
    clears: list[float] = field(default_factory=list)  # times of cache clears


def grid(hours: float, step_s: float = 60.0) -> np.ndarray:
    return np.arange(0.0, hours * HOUR + step_s / 2, step_s)


def flat(hours: float = 12, level: float = 20 * GiB) -> Series:
    t = grid(hours)
    return Series(t, np.full_like(t, level))


def linear(
    hours: float = 12, start: float = 20 * GiB, per_hour: float = 1 * GiB, noise: float = 0.05
) -> Series:
    t = grid(hours)
    rng = np.random.default_rng(1)
    return Series(t, start + per_hour * t / HOUR + rng.normal(0, noise * GiB, len(t)))


def steps(hours: float = 12, level: float = 40 * GiB) -> Series:
    """Reserved memory ratcheting up as new shapes arrive, then staying: no leak."""
    t = grid(hours)
    y = np.full_like(t, level)
    for at, size in ((0.5, 3.0), (1.5, 2.0), (2.5, 1.0), (5.0, 0.5)):
        y[t >= at * HOUR] += size * GiB
    return Series(t, y)


def one_step(hours: float = 12, level: float = 70 * GiB, at: float = 3.0) -> Series:
    """One jump (a new largest shape), then flat: a raw OLS over it invents a trend."""
    t = grid(hours)
    return Series(t, np.where(t >= at * HOUR, level + 6 * GiB, level))


def plateau(hours: float = 12, level: float = 60 * GiB, noise: float = 1.0) -> Series:
    t = grid(hours)
    rng = np.random.default_rng(2)
    y = level + rng.normal(0, noise * GiB, len(t))
    y[rng.random(len(t)) < 0.01] += 4 * GiB  # rare spikes: one big batch
    return Series(t, y)


def sawtooth(
    hours: float = 12,
    base: float = 30 * GiB,
    amplitude: float = 6 * GiB,
    period_s: float = 600.0,
    floor_per_hour: float = 0.0,
) -> Series:
    """The cache fills during ``period_s``, then a clear returns it; the floor may leak."""
    t = grid(hours)
    phase = np.mod(t, period_s) / period_s
    y = base + floor_per_hour * t / HOUR + amplitude * phase
    clears = [float(x) for x in np.arange(period_s, t[-1], period_s)]
    return Series(t, y, clears)


def replay(
    s: Series, limit: float, at: float, params: ForecastParams, resource: str = "gpu:0"
) -> ResourceForecast:
    """The forecast the sampler would have made at time ``at``."""
    history = History(max_samples=100_000)
    history.add_event(Event(0.0, "probe_start"))
    for c in s.clears:
        if c <= at:
            history.add_event(Event(c, "cache_clear"))
    for ti, yi in zip(s.t, s.y, strict=True):
        if ti > at:
            break
        history.append(Sample(float(ti), {resource: float(yi)}))
    start, why = fit_start(history, params, clears_reset=resource.startswith("gpu"))
    t, y = history.series(resource)
    return forecast_resource(resource, t, y, limit, "test", start, params, why)


def verdict(f: ResourceForecast, warning: float = 6.0, critical: float = 1.0) -> Advice:
    return advice({f.resource: f}, warning, critical)
