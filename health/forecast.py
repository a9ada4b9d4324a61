"""Hours until one resource runs out, from its history: the decision rules in one place.

Rules (docs/HEALTH.md explains each): fit only samples after the last engine restart plus
the warm-up, or after an isolated cache clear, within ``window_s``; require ``min_span_s``
and ``min_samples``; fit the peak envelope with Theil-Sen; call it growth only when the
whole 95% interval of the slope is above zero; cap every horizon at ``horizon_cap_hours``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from embedserve.config import HealthSettings
from embedserve.contracts.memory import ResourceForecast
from embedserve.health.trend import FloatArray, peak_envelope, theil_sen


@dataclass(frozen=True)
class ForecastParams:
    warmup_s: float = 300.0
    min_span_s: float = 1800.0
    min_samples: int = 30
    window_s: float = 6 * 3600.0
    horizon_cap_hours: float = 168.0
    envelope_s: float = 180.0
    confidence: float = 0.95
    max_fit_points: int = 400

    @classmethod
    def from_settings(cls, health: HealthSettings) -> ForecastParams:
        """From ``settings.health``; the envelope spans a tenth of the minimum span."""
        return cls(
            warmup_s=health.warmup_s,
            min_span_s=health.min_span_s,
            min_samples=health.min_samples,
            window_s=health.window_s,
            horizon_cap_hours=health.horizon_cap_hours,
            envelope_s=max(2 * health.sample_interval_s, health.min_span_s / 10),
        )


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def _hours(x: float) -> str:
    if x < 1 / 60:
        return f"{x * 3600:.0f} s"
    if x < 1:
        return f"{x * 60:.0f} min"
    return f"{x:.1f} h" if x < 48 else f"{x / 24:.1f} days"


def forecast_resource(
    resource: str,
    t: FloatArray,
    y: FloatArray,
    limit: float | None,
    limit_source: str | None,
    fit_start: float,
    params: ForecastParams,
    start_why: str = "",
) -> ResourceForecast:
    """Forecast for one resource; ``t``, ``y`` its whole history, ``fit_start`` from resets."""
    t = np.asarray(t, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    used = float(y[-1]) if len(y) else None
    now = float(t[-1]) if len(t) else fit_start
    cap = params.horizon_cap_hours
    start = max(fit_start, now - params.window_s)
    sel = t >= start
    ts, ys = t[sel], y[sel]
    n = len(ts)
    span = float(ts[-1] - ts[0]) if n else 0.0
    base: dict[str, Any] = dict(
        resource=resource,
        used_bytes=used,
        limit_bytes=limit,
        limit_source=limit_source,
        headroom_bytes=None if limit is None or used is None else limit - used,
        peak_bytes=None,
        slope_bytes_per_hour=None,
        slope_low_bytes_per_hour=None,
        slope_high_bytes_per_hour=None,
        window_start=float(ts[0]) if n else None,
        window_s=span,
        samples=n,
        estimated_hours_until_oom=None,
        hours_lower=None,
        hours_upper=None,
        capped=False,
    )
    if limit is None:
        return ResourceForecast(status="no_limit", reason=f"{resource}: no limit known", **base)
    if n < params.min_samples or span < params.min_span_s:
        need = []
        if span < params.min_span_s:
            need.append(f"{span / 60:.0f} of {params.min_span_s / 60:.0f} min")
        if n < params.min_samples:
            need.append(f"{n} of {params.min_samples} samples")
        why = f" since {start_why}" if start_why else ""
        return ResourceForecast(
            status="insufficient_data",
            reason=f"{resource}: collecting data{why} ({', '.join(need)})",
            **base,
        )
    te, ye = peak_envelope(ts, ys, params.envelope_s, params.max_fit_points)
    n_eff = max(span / params.envelope_s, 3.0) if params.envelope_s > 0 else None
    fit = theil_sen(te, ye, params.confidence, n_eff=n_eff)
    peak = float(ye[-1])
    headroom = limit - peak
    per_h = 3600.0
    base.update(
        peak_bytes=peak,
        headroom_bytes=headroom,
        slope_bytes_per_hour=fit.slope * per_h,
        slope_low_bytes_per_hour=fit.low * per_h,
        slope_high_bytes_per_hour=fit.high * per_h,
    )
    over = f"over {_hours(span / 3600)} ({n} samples)"
    if headroom <= 0:
        base.update(estimated_hours_until_oom=0.0, hours_lower=0.0, hours_upper=0.0)
        return ResourceForecast(
            status="at_limit",
            reason=f"{resource}: peak {_gib(peak)} has reached the limit {_gib(limit)}",
            **base,
        )

    def hours_at(slope: float) -> float:
        return headroom / (slope * per_h)

    if fit.low <= 0 or fit.slope <= 0:
        lower = hours_at(fit.high) if fit.high > 0 else None
        base.update(
            estimated_hours_until_oom=None,
            hours_lower=None if lower is None else min(lower, cap),
            hours_upper=None,
        )
        return ResourceForecast(
            status="not_growing",
            reason=(
                f"{resource}: not growing {over}; slope {_gib(fit.slope * per_h)}/h, "
                f"95% interval includes zero; {_gib(headroom)} headroom"
            ),
            **base,
        )

    est, lower, upper = hours_at(fit.slope), hours_at(fit.high), hours_at(fit.low)
    capped = est > cap
    base.update(
        estimated_hours_until_oom=min(est, cap),
        hours_lower=min(lower, cap),
        hours_upper=None if upper > cap else upper,
        capped=capped,
    )
    when = f"beyond the {_hours(cap)} horizon" if capped else f"in about {_hours(est)}"
    return ResourceForecast(
        status="growing",
        reason=(
            f"{resource}: grows {_gib(fit.slope * per_h)}/h "
            f"(95% {_gib(fit.low * per_h)}-{_gib(fit.high * per_h)}/h) {over}; "
            f"{_gib(headroom)} headroom to {_gib(limit)} ({limit_source}): out of memory {when}"
        ),
        **base,
    )
