"""Writes deploy/grafana/dashboards/embedserve.json (run after editing; CI checks it is current).

    python deploy/grafana/make_dashboard.py

Metric names are the gateway's (gateway/metrics.py) and health/'s ``embedserve_*``
gauges. Memory panels select gauges by name pattern so that a new ``*_bytes`` gauge from
health/ shows up without editing the dashboard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "dashboards" / "embedserve.json"
DS = {"type": "prometheus", "uid": "embedserve-prometheus"}
WARNING_HOURS = 6  # health.warning_hours default: readiness drains the pod below this
CRITICAL_HOURS = 1  # health.critical_hours default: liveness restarts it below this

_next_id = 0


def _id() -> int:
    global _next_id
    _next_id += 1
    return _next_id


def target(expr: str, legend: str, ref: str = "A") -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}


def timeseries(
    title: str,
    targets: list[dict[str, Any]],
    grid: tuple[int, int, int, int],
    unit: str = "short",
    description: str = "",
    thresholds: list[tuple[str, float | None]] | None = None,
) -> dict[str, Any]:
    x, y, w, h = grid
    steps = [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10}
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "line+area"}
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return {
        "id": _id(),
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": custom,
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    expr: str,
    grid: tuple[int, int, int, int],
    unit: str,
    thresholds: list[tuple[str, float | None]],
    description: str = "",
) -> dict[str, Any]:
    x, y, w, h = grid
    return {
        "id": _id(),
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [target(expr, "")],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {
                    "mode": "absolute",
                    "steps": [{"color": c, "value": v} for c, v in thresholds],
                },
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
        },
    }


def row(title: str, y: int) -> dict[str, Any]:
    return {
        "id": _id(),
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
        "panels": [],
    }


def quantile(q: float, metric: str, by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum by (le{extra}) (rate({metric}_bucket[$__rate_interval])))"


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    add = panels.append

    # -------- overview
    add(
        stat(
            "Hours to OOM (binding)",
            'min(embedserve_hours_until_oom{bound="estimate"})',
            (0, 0, 6, 5),
            "h",
            [("red", None), ("orange", CRITICAL_HOURS), ("yellow", WARNING_HOURS), ("green", 24)],
            "Smallest forecast over resources and pods. Readiness drains a pod under "
            f"{WARNING_HOURS} h, liveness restarts it under {CRITICAL_HOURS} h, and the restart "
            "controller evicts one pod at a time under the warning horizon.",
        )
    )
    add(
        stat(
            "Requests / s",
            "sum(rate(embedserve_requests_total[$__rate_interval]))",
            (6, 0, 6, 5),
            "reqps",
            [("green", None)],
        )
    )
    add(
        stat(
            "Error ratio (5xx)",
            'sum(rate(embedserve_requests_total{status=~"5.."}[$__rate_interval])) / '
            "clamp_min(sum(rate(embedserve_requests_total[$__rate_interval])), 1e-9)",
            (12, 0, 6, 5),
            "percentunit",
            [("green", None), ("orange", 0.001), ("red", 0.01)],
        )
    )
    add(
        stat(
            "Engines ready",
            "sum(embedserve_engine_ready)",
            (18, 0, 6, 5),
            "short",
            [("red", None), ("green", 1)],
        )
    )

    # -------- throughput
    add(row("Throughput", 5))
    add(
        timeseries(
            "Requests / s by status",
            [
                target(
                    "sum by (status) (rate(embedserve_requests_total[$__rate_interval]))",
                    "{{status}}",
                )
            ],
            (0, 6, 12, 8),
            "reqps",
        )
    )
    add(
        timeseries(
            "Tokens / s and inputs / s",
            [
                target("sum(rate(embedserve_tokens_total[$__rate_interval]))", "tokens/s"),
                target("sum(rate(embedserve_inputs_total[$__rate_interval]))", "inputs/s"),
            ],
            (12, 6, 12, 8),
            "short",
        )
    )

    # -------- latency
    add(row("Latency", 14))
    add(
        timeseries(
            "Request latency (end to end)",
            [
                target(quantile(0.5, "embedserve_request_seconds"), "p50"),
                target(quantile(0.95, "embedserve_request_seconds"), "p95"),
                target(quantile(0.99, "embedserve_request_seconds"), "p99"),
            ],
            (0, 15, 12, 8),
            "s",
        )
    )
    add(
        timeseries(
            "p95 latency by stage",
            [
                target(
                    quantile(0.95, "embedserve_stage_seconds", "stage"),
                    "{{stage}}",
                )
            ],
            (12, 15, 12, 8),
            "s",
            "tokenize, queue (coalescing and admission), engine (the model call).",
        )
    )

    # -------- truncation and admission
    add(row("Truncation and admission", 23))
    add(
        timeseries(
            "Truncated inputs",
            [
                target(
                    "sum(rate(embedserve_inputs_truncated_total[$__rate_interval]))",
                    "inputs truncated/s",
                ),
                target(
                    "sum(rate(embedserve_inputs_truncated_total[$__rate_interval])) / "
                    "clamp_min(sum(rate(embedserve_inputs_total[$__rate_interval])), 1e-9)",
                    "fraction of inputs",
                ),
            ],
            (0, 24, 8, 8),
            "short",
            "Inputs cut to the max sequence length (EOS kept last).",
        )
    )
    add(
        timeseries(
            "Tokens dropped by truncation / s",
            [
                target(
                    "sum(rate(embedserve_truncated_tokens_total[$__rate_interval]))",
                    "tokens dropped/s",
                )
            ],
            (8, 24, 8, 8),
            "short",
        )
    )
    add(
        timeseries(
            "Rejected (429/413) and tokens in flight",
            [
                target(
                    "sum by (reason) (rate(embedserve_rejected_total[$__rate_interval]))",
                    "rejected {{reason}}",
                ),
                target("sum(embedserve_tokens_in_flight)", "tokens in flight"),
            ],
            (16, 24, 8, 8),
            "short",
        )
    )

    # -------- memory
    add(row("Memory", 32))
    add(
        timeseries(
            "GPU memory",
            [
                target("embedserve_gpu_memory_used_bytes", "device used gpu{{gpu}} {{pod}}"),
                target("embedserve_gpu_memory_total_bytes", "device total gpu{{gpu}} {{pod}}"),
                target(
                    "embedserve_engine_allocator_reserved_bytes",
                    "torch reserved pid{{engine_pid}} {{pod}}",
                ),
                target(
                    "embedserve_engine_allocator_allocated_bytes",
                    "torch allocated pid{{engine_pid}} {{pod}}",
                ),
                target(
                    "embedserve_engine_allocator_inactive_split_bytes",
                    "inactive split pid{{engine_pid}} {{pod}}",
                ),
            ],
            (0, 33, 12, 9),
            "bytes",
            "NVML device memory and the engine's allocator statistics (allocated, reserved, inactive split).",
        )
    )
    add(
        timeseries(
            "Host memory",
            [
                target("embedserve_host_memory_rss_bytes", "RSS {{process}} {{pod}}"),
                target("embedserve_cgroup_memory_current_bytes", "cgroup current {{pod}}"),
                target("embedserve_cgroup_memory_limit_bytes", "cgroup limit {{pod}}"),
                target("embedserve_machine_memory_used_bytes", "machine used {{instance}}"),
            ],
            (12, 33, 12, 9),
            "bytes",
            "Resident memory of the engine and gateway, and the cgroup's usage and limit "
            "(what the OOM killer acts on).",
        )
    )
    add(
        timeseries(
            "Hours to OOM by resource",
            [
                target(
                    'embedserve_hours_until_oom{bound="estimate"}',
                    "{{resource}} {{pod}}",
                ),
                target(
                    'embedserve_hours_until_oom{bound="lower"}',
                    "{{resource}} lower bound {{pod}}",
                ),
            ],
            (0, 42, 24, 9),
            "h",
            f"Forecast per resource. Lines at {WARNING_HOURS} h (readiness drains, the "
            f"controller evicts) and {CRITICAL_HOURS} h (liveness restarts). The gauge shows the "
            "horizon cap (168 h) when no OOM is foreseen and no value while collecting data.",
            thresholds=[("red", None), ("orange", CRITICAL_HOURS), ("transparent", WARNING_HOURS)],
        )
    )

    return {
        "uid": "embedserve",
        "title": "embedserve",
        "tags": ["embedserve", "embeddings"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    global _next_id
    _next_id = 0
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
