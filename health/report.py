"""The /health/memory document: all forecasts joined, the binding resource, the advice.

Built once per sample by the sampler (never per request), as plain JSON-ready data.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from health.forecast import ResourceForecast
from health.reading import Reading
from health.sources.allocator import fragmentation


def binding(forecasts: dict[str, ResourceForecast]) -> tuple[ResourceForecast | None, bool]:
    """The resource that runs out first, and whether that is a forecast (else: the fullest)."""
    timed = [f for f in forecasts.values() if f.estimated_hours_until_oom is not None]
    if timed:
        return min(timed, key=lambda f: f.estimated_hours_until_oom or 0.0), True
    limited = [f for f in forecasts.values() if f.limit_bytes and f.used_bytes is not None]
    if not limited:
        return None, False
    return max(limited, key=lambda f: (f.used_bytes or 0.0) / (f.limit_bytes or 1.0)), False


def advice(
    forecasts: dict[str, ResourceForecast], warning_hours: float, critical_hours: float
) -> dict[str, Any]:
    first, forecast = binding(forecasts)
    hours = first.estimated_hours_until_oom if first and forecast else None
    restart = hours is not None and hours <= warning_hours
    if hours is not None and hours <= critical_hours:
        level = "critical"
    elif restart:
        level = "warning"
    elif any(f.status == "insufficient_data" for f in forecasts.values()) and not forecast:
        level = "unknown"
    else:
        level = "ok"
    if first is None:
        reason = "no limited resource is measured"
    elif forecast:
        action = (
            f"restart advised (under the {warning_hours:g} h warning horizon)"
            if restart
            else f"no restart needed (warning at {warning_hours:g} h)"
        )
        reason = f"{first.reason}. {action}"
    else:
        pct = 100.0 * (first.used_bytes or 0.0) / (first.limit_bytes or 1.0)
        lead = "no forecast yet" if level == "unknown" else "no out-of-memory foreseen"
        reason = f"{lead}; closest to its limit: {first.resource} at {pct:.0f}%. " + "; ".join(
            f.reason for f in forecasts.values()
        )
    return {
        "status": level,
        "recommends_restart": restart,
        "binding_resource": first.resource if first else None,
        "estimated_hours_until_oom": hours,
        "hours_lower": first.hours_lower if first and forecast else None,
        "hours_upper": first.hours_upper if first and forecast else None,
        "reason": reason,
    }


def reading_figures(r: Reading) -> dict[str, Any]:
    """The raw current figures, each source null with a reason when absent."""
    gpu = None
    if r.gpu.available:
        gpu = {"devices": [asdict(d) for d in r.gpu.devices]}
    engines = []
    for e in r.allocator.engines:
        d = asdict(e)
        d["fragmentation"] = fragmentation(e)
        engines.append(d)
    return {
        "gpu": gpu,
        "gpu_reason": r.gpu.reason,
        "allocator": engines or None,
        "allocator_reason": r.allocator.reason,
        "fragmentation": max(
            (x["fragmentation"] for x in engines if x["fragmentation"] is not None),
            default=None,
        ),
        "num_alloc_retries": sum(e.num_alloc_retries for e in r.allocator.engines),
        "num_ooms": sum(e.num_ooms for e in r.allocator.engines),
        "cache_clears": r.allocator.cache_clears,
        "processes": {k: asdict(v) for k, v in r.processes.items()},
        "processes_missing": r.processes_missing,
        "cgroup": asdict(r.cgroup) if r.cgroup.available else None,
        "cgroup_reason": r.cgroup.reason,
        "machine": {"total_bytes": r.machine_total_bytes, "used_bytes": r.machine_used_bytes},
    }
