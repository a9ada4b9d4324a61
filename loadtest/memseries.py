"""The memory series a load test records from each ``/health/memory`` answer, read with
the report's own model (the one the gateway serves)."""

from __future__ import annotations

from typing import Any

from embedserve.contracts.memory import MemoryReport

#: series name -> where it comes from in the report (also written into the results document)
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


def _lookup(report: MemoryReport, path: str) -> float | None:
    """The figure at a dotted path of the report (dict keys or attributes); None if absent."""
    node: Any = report
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return float(node) if isinstance(node, int | float) else None


def series(report: MemoryReport) -> dict[str, float | None]:
    """One value per series; ``None`` where the report has no such figure."""
    return {name: _lookup(report, path) for name, path in SOURCES.items()}
