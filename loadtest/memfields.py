"""Pick memory figures and the forecast out of a ``/health/memory`` answer.

The answer is flattened to dotted keys (``gpu.devices.0.used_bytes``); well-known names are
looked for first, then patterns, and ``--memory-field NAME=dotted.path`` overrides both.
"""

from __future__ import annotations

import re
from typing import Any

# series name -> (exact dotted keys tried first, regexes tried in order). The exact keys
# are embedserve's own /health/memory (health/monitor.py); the patterns catch look-alikes.
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gpu_bytes": (
        ("resources.gpu:0.used_bytes", "gpu.used_bytes"),
        (r"^resources\.gpu[^.]*\.used_bytes$", r"gpu.*used.*bytes$"),
    ),
    "gpu_limit_bytes": (
        ("resources.gpu:0.limit_bytes", "gpu.total_bytes"),
        (r"^resources\.gpu[^.]*\.limit_bytes$", r"gpu.*(limit|total).*bytes$"),
    ),
    "host_bytes": (
        ("resources.host.used_bytes", "host.used_bytes"),
        (r"cgroup.*working_set.*bytes$", r"cgroup.*current.*bytes$", r"host.*used.*bytes$"),
    ),
    "host_limit_bytes": (
        ("resources.host.limit_bytes", "host.limit_bytes"),
        (r"cgroup.*(max|limit).*bytes$", r"host.*(limit|total|max).*bytes$"),
    ),
    "engine_rss_bytes": (("processes.engine.rss_bytes",), (r"^processes\.engine[^.]*\.rss",)),
    "gateway_rss_bytes": (("processes.gateway.rss_bytes",), (r"^processes\.gateway\.rss",)),
    "hours_to_oom": (
        ("estimated_hours_until_oom", "forecast.estimated_hours_until_oom"),
        (r"hours_until_oom$", r"hours_to_oom$"),
    ),
    "hours_low": (("hours_lower",), (r"hours.*(lower|low)$",)),
    "hours_high": (("hours_upper",), (r"hours.*(upper|high)$",)),
    "host_hours_to_oom": (("resources.host.estimated_hours_until_oom",), ()),
    "host_hours_low": (("resources.host.hours_lower",), ()),
    "host_hours_high": (("resources.host.hours_upper",), ()),
    "gpu_hours_to_oom": (("resources.gpu:0.estimated_hours_until_oom",), ()),
    "gpu_hours_low": (("resources.gpu:0.hours_lower",), ()),
    "gpu_hours_high": (("resources.gpu:0.hours_upper",), ()),
    "host_slope_bytes_per_hour": (("resources.host.slope_bytes_per_hour",), ()),
    "gpu_slope_bytes_per_hour": (("resources.gpu:0.slope_bytes_per_hour",), ()),
    "recommends_restart": (("recommends_restart",), (r"recommends_restart$",)),
}


def flatten(obj: Any, prefix: str = "", out: dict[str, Any] | None = None,
            limit: int = 2000) -> dict[str, Any]:
    """Numeric, boolean and string leaves as ``{"a.b.0.c": value}`` (bounded in size)."""
    out = {} if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{prefix}{k}.", out, limit)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            flatten(v, f"{prefix}{i}.", out, limit)
    elif isinstance(obj, bool | int | float | str) or obj is None:
        out[prefix[:-1]] = obj
    return out


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    return None


def pick(flat: dict[str, Any], name: str, overrides: dict[str, str] | None = None
         ) -> tuple[str, float] | None:
    """The (key, value) used for series ``name``, or None when the answer has none."""
    if overrides and name in overrides:
        v = _number(flat.get(overrides[name]))
        return (overrides[name], v) if v is not None else None
    exact, patterns = FIELDS[name]
    for key in exact:
        if key in flat:  # present, even as null: authoritative (no guessing past it)
            v = _number(flat[key])
            return (key, v) if v is not None else None
    for pat in patterns:
        rx = re.compile(pat, re.IGNORECASE)
        for key, val in flat.items():
            v = _number(val)
            if v is not None and rx.search(key):
                return key, v
    return None


def extract(answer: Any, overrides: dict[str, str] | None = None
            ) -> tuple[dict[str, float | None], dict[str, str]]:
    """The series values of one answer and the keys they came from."""
    flat = flatten(answer)
    values: dict[str, float | None] = {}
    keys: dict[str, str] = {}
    for name in FIELDS:
        hit = pick(flat, name, overrides)
        values[name] = hit[1] if hit else None
        if hit:
            keys[name] = hit[0]
    return values, keys
