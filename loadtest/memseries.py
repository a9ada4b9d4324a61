"""The memory series a load test records from each ``/health/memory`` answer, read with
the report's own model (the one the gateway serves)."""

from __future__ import annotations

from embedserve.contracts.memory import MemoryReport

#: series name -> where it comes from in the report, for the results document
SOURCES = {
    "gpu_bytes": "resources.gpu:0.used_bytes",
    "gpu_limit_bytes": "resources.gpu:0.limit_bytes",
    "host_bytes": "resources.host.used_bytes",
    "host_limit_bytes": "resources.host.limit_bytes",
    "engine_rss_bytes": "processes.engine.rss_bytes",
    "gateway_rss_bytes": "processes.gateway.rss_bytes",
    "hours_to_oom": "estimated_hours_until_oom",
    "hours_low": "hours_lower",
    "hours_high": "hours_upper",
    "host_hours_to_oom": "resources.host.estimated_hours_until_oom",
    "host_hours_low": "resources.host.hours_lower",
    "host_hours_high": "resources.host.hours_upper",
    "gpu_hours_to_oom": "resources.gpu:0.estimated_hours_until_oom",
    "gpu_hours_low": "resources.gpu:0.hours_lower",
    "gpu_hours_high": "resources.gpu:0.hours_upper",
    "host_slope_bytes_per_hour": "resources.host.slope_bytes_per_hour",
    "gpu_slope_bytes_per_hour": "resources.gpu:0.slope_bytes_per_hour",
    "recommends_restart": "recommends_restart",
}


def series(report: MemoryReport) -> dict[str, float | None]:
    """One value per series; ``None`` where the report has no such figure."""
    gpu, host = report.resource("gpu:0"), report.resource("host")
    engine, gateway = report.processes.get("engine"), report.processes.get("gateway")
    return {
        "gpu_bytes": gpu.used_bytes if gpu else None,
        "gpu_limit_bytes": gpu.limit_bytes if gpu else None,
        "host_bytes": host.used_bytes if host else None,
        "host_limit_bytes": host.limit_bytes if host else None,
        "engine_rss_bytes": engine.rss_bytes if engine else None,
        "gateway_rss_bytes": gateway.rss_bytes if gateway else None,
        "hours_to_oom": report.estimated_hours_until_oom,
        "hours_low": report.hours_lower,
        "hours_high": report.hours_upper,
        "host_hours_to_oom": host.estimated_hours_until_oom if host else None,
        "host_hours_low": host.hours_lower if host else None,
        "host_hours_high": host.hours_upper if host else None,
        "gpu_hours_to_oom": gpu.estimated_hours_until_oom if gpu else None,
        "gpu_hours_low": gpu.hours_lower if gpu else None,
        "gpu_hours_high": gpu.hours_upper if gpu else None,
        "host_slope_bytes_per_hour": host.slope_bytes_per_hour if host else None,
        "gpu_slope_bytes_per_hour": gpu.slope_bytes_per_hour if gpu else None,
        "recommends_restart": float(report.recommends_restart),
    }
