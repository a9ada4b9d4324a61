"""The /health/memory report: all forecasts joined, the binding resource, the advice.

Built once per sample by the sampler (never per request).
"""

from __future__ import annotations

from collections.abc import Mapping

from embedserve.contracts.memory import (
    Advice,
    CgroupMemory,
    GpuFigures,
    MachineMemory,
    MemoryReport,
    ResourceForecast,
    SamplerInfo,
    Thresholds,
)
from embedserve.health.reading import Reading


def binding(forecasts: Mapping[str, ResourceForecast]) -> tuple[ResourceForecast | None, bool]:
    """The resource that runs out first, and whether that is a forecast (else: the fullest)."""
    timed = [f for f in forecasts.values() if f.estimated_hours_until_oom is not None]
    if timed:
        return min(timed, key=lambda f: f.estimated_hours_until_oom or 0.0), True
    limited = [f for f in forecasts.values() if f.limit_bytes and f.used_bytes is not None]
    if not limited:
        return None, False
    return max(limited, key=lambda f: (f.used_bytes or 0.0) / (f.limit_bytes or 1.0)), False


def advice(
    forecasts: Mapping[str, ResourceForecast], warning_hours: float, critical_hours: float
) -> Advice:
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
    return Advice(
        status=level,
        recommends_restart=restart,
        binding_resource=first.resource if first else None,
        estimated_hours_until_oom=hours,
        hours_lower=first.hours_lower if first and forecast else None,
        hours_upper=first.hours_upper if first and forecast else None,
        reason=reason,
    )


def build_report(
    reading: Reading,
    forecasts: Mapping[str, ResourceForecast],
    verdict: Advice,
    thresholds: Thresholds,
    sampler: SamplerInfo,
) -> MemoryReport:
    """The whole document: the advice, each forecast and the raw figures of this sample,
    each source null with a reason when absent."""
    r = reading
    engines = r.allocator.engines
    cgroup = r.cgroup
    return MemoryReport(
        **verdict.model_dump(),
        time=r.time,
        resources={k: f.model_copy(update={"measure": r.resources[k].measure}) for k, f in forecasts.items()},
        gpu=GpuFigures(devices=r.gpu.devices) if r.gpu.available else None,
        gpu_reason=r.gpu.reason,
        allocator=list(engines) or None,
        allocator_reason=r.allocator.reason,
        fragmentation=max((f for e in engines if (f := e.fragmentation) is not None), default=None),
        num_alloc_retries=sum(e.num_alloc_retries for e in engines),
        num_ooms=sum(e.num_ooms for e in engines),
        cache_clears=r.allocator.cache_clears,
        processes=dict(r.processes),
        processes_missing=dict(r.processes_missing),
        cgroup=CgroupMemory(
            version=cgroup.version or 0,
            current_bytes=cgroup.current_bytes,
            working_set_bytes=cgroup.working_set_bytes,
            limit_bytes=cgroup.limit_bytes,
        )
        if cgroup.available
        else None,
        cgroup_reason=cgroup.reason,
        machine=MachineMemory(total_bytes=r.machine_total_bytes, used_bytes=r.machine_used_bytes),
        thresholds=thresholds,
        sampler=sampler,
    )
