"""Pass/fail against targets given on the command line."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MIB = 1024.0 * 1024.0
#: A per-hour memory slope needs this much time of samples after the warm-up, and the growth
#: should start at least ``MIN_WARMUP_S`` into the load: the defaults of the target's own
#: forecast (``health.min_span_s``, ``health.warmup_s``; docs/HEALTH.md). The first minutes
#: of load fill caches and allocator pools, and a short span scaled to an hour is its noise.
MIN_SLOPE_SPAN_S = 1800.0
MIN_WARMUP_S = 300.0


@dataclass(frozen=True)
class Targets:
    """Each target is optional; a check runs only when its target is set."""

    max_error_rate: float | None = None
    max_p95_drift: float | None = None  # fraction: 0.2 = last window's P95 at most 20% above
    max_memory_growth_mib: float | None = None  # per series, after warm-up
    max_p95_ms: float | None = None
    max_throttle_rate: float | None = None
    min_requests_per_s: float | None = None
    memory_series: str | None = None  # regex: only matching series count for growth

    def counts(self, series: str) -> bool:
        """Whether a memory series' growth is judged (all, unless ``memory_series`` is set)."""
        return self.memory_series is None or re.search(self.memory_series, series) is not None

    def any(self) -> bool:
        return any(v is not None for k, v in asdict(self).items() if k != "memory_series")


def growth(ts: list[float], values: list[float], start: float) -> dict[str, Any] | None:
    """Memory growth after ``start`` (the end of the warm-up, in seconds since the run
    began): median of the last tenth of the samples minus the median of the first tenth (at
    least one sample each; steps count, jitter does not). The per-hour figure is None under
    ``MIN_SLOPE_SPAN_S``; ``caveat`` says why, and when the growth rests on the warm-up."""
    pts = [(t, v) for t, v in zip(ts, values, strict=True) if t >= start and v is not None]
    if len(pts) < 2:
        return None
    k = max(1, len(pts) // 10)
    first = float(np.median([v for _, v in pts[:k]]))
    last = float(np.median([v for _, v in pts[-k:]]))
    span_s = pts[-1][0] - pts[0][0]
    caveats = []
    if span_s < MIN_SLOPE_SPAN_S:
        caveats.append(f"no per-hour figure: {span_s:.0f} s of samples after the warm-up, under "
                       f"the {MIN_SLOPE_SPAN_S / 60:.0f} min a slope needs")
    if start < MIN_WARMUP_S:
        caveats.append(f"the growth starts {start:.0f} s into the load, inside the first "
                       f"{MIN_WARMUP_S / 60:.0f} min in which memory still settles (caches, "
                       f"allocator pools): give --warmup {MIN_WARMUP_S / 60:.0f}m")
    per_hour = (last - first) / MIB / (span_s / 3600.0) if span_s >= MIN_SLOPE_SPAN_S else None
    return {"first_mib": round(first / MIB, 2), "last_mib": round(last / MIB, 2),
            "growth_mib": round((last - first) / MIB, 2),
            "growth_mib_per_hour": None if per_hour is None else round(per_hour, 2),
            "samples": len(pts), "span_s": round(span_s, 1), "caveat": "; ".join(caveats) or None}


def growth_caveats(growths: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """The distinct caveats of the memory series' growth figures, for the report and console."""
    return list(dict.fromkeys(g["caveat"] for g in growths.values() if g and g.get("caveat")))


def p95_drift(windows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Relative change of P95 from the first to the last window that had successes."""
    p95s = [(w["t_start"], w["latency_ms"]["p95"]) for w in windows
            if w["latency_ms"]["p95"] is not None]
    if len(p95s) < 2 or p95s[0][1] <= 0:
        return None
    first, last = p95s[0][1], p95s[-1][1]
    return {"first_p95_ms": first, "last_p95_ms": last,
            "drift": round((last - first) / first, 4)}


def _check(name: str, value: float | None, target: float | None, ok: bool | None,
           detail: str) -> dict[str, Any]:
    status = "no data" if value is None else ("pass" if ok else "fail")
    return {"check": name, "value": value, "target": target, "status": status,
            "detail": detail}


def evaluate(t: Targets, measured: dict[str, Any], windows: list[dict[str, Any]],
             memory_series: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """The verdict: each requested check, and ``passed`` when none failed."""
    checks: list[dict[str, Any]] = []
    attempts = measured["attempts"]
    # Errors fail every run unless --max-error-rate allows a share; a 429 is throttling.
    allowed = 0.0 if t.max_error_rate is None else t.max_error_rate
    v = measured["error_rate"] if attempts else None
    checks.append(_check("error rate", v, allowed, v is not None and v <= allowed,
                         f"{measured['errors']} errors in {attempts} attempts (429s counted "
                         "apart)" + ("; any error fails without --max-error-rate"
                                     if t.max_error_rate is None else "")))
    if t.max_throttle_rate is not None:
        v = round(measured["throttled_429"] / attempts, 6) if attempts else None
        checks.append(_check("429 rate", v, t.max_throttle_rate,
                             v is not None and v <= t.max_throttle_rate,
                             f"{measured['throttled_429']} answers were 429"))
    if t.max_p95_ms is not None:
        v = measured["latency_ms"]["p95"]
        checks.append(_check("P95 latency ms", v, t.max_p95_ms,
                             v is not None and v <= t.max_p95_ms, "over the measured period"))
    if t.min_requests_per_s is not None:
        v = measured["requests_per_s"] if attempts else None
        checks.append(_check("throughput req/s", v, t.min_requests_per_s,
                             v is not None and v >= t.min_requests_per_s, "successful requests"))
    if t.max_p95_drift is not None:
        d = p95_drift(windows)
        v = d["drift"] if d else None
        detail = (f"P95 {d['first_p95_ms']} ms in the first window, {d['last_p95_ms']} ms "
                  "in the last" if d else "needs two windows with successes")
        checks.append(_check("P95 drift", v, t.max_p95_drift,
                             v is not None and v <= t.max_p95_drift, detail))
    if t.max_memory_growth_mib is not None:
        memory_series = {k: g for k, g in memory_series.items() if t.counts(k)}
        if not any(memory_series.values()):
            checks.append(_check("memory growth MiB", None, t.max_memory_growth_mib, None,
                                 "no memory series (no /health/memory and no --watch-pid)"))
        for name, g in memory_series.items():
            if g is None:
                continue
            v = g["growth_mib"]
            checks.append(_check(f"memory growth MiB: {name}", v, t.max_memory_growth_mib,
                                 v <= t.max_memory_growth_mib,
                                 f"{g['first_mib']} -> {g['last_mib']} MiB over {g['span_s']} s"
                                 + (f" ({g['growth_mib_per_hour']} MiB/h)"
                                    if g.get("growth_mib_per_hour") is not None else "")))
    if not attempts:
        checks.append(_check("requests sent", 0.0, None, False, "no request was sent"))
    failed = [c["check"] for c in checks if c["status"] == "fail"]
    no_data = [c["check"] for c in checks if c["status"] == "no data"]
    return {"passed": not failed, "failed": failed, "no_data": no_data, "checks": checks,
            "targets": asdict(t), "targets_given": t.any()}


def verdict_label(verdict: Mapping[str, Any]) -> str:
    """``PASS`` or ``FAIL``; a run without targets that did not fail says ``no targets``,
    since it met nothing it was asked to meet."""
    if not verdict["passed"]:
        return "FAIL"
    return "PASS" if verdict.get("targets_given", True) else "no targets"
