"""Percentiles, per-window aggregates and totals from the attempt records."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from embedserve.loadtest.records import Recorder, code_name

PERCENTILES = (50, 90, 95, 99)


def percentiles(values: np.ndarray | list[float]) -> dict[str, float | None]:
    """p50/p90/p95/p99, mean and max in milliseconds (None when there are no values)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        out: dict[str, float | None] = {f"p{p}": None for p in PERCENTILES}
        out.update(mean=None, max=None)
        return out
    ps = np.percentile(v, PERCENTILES) * 1000.0
    out = {f"p{p}": round(float(x), 3) for p, x in zip(PERCENTILES, ps, strict=True)}
    out.update(mean=round(float(v.mean() * 1000.0), 3), max=round(float(v.max() * 1000.0), 3))
    return out


def columns(rec: Recorder) -> dict[str, np.ndarray]:
    """The records as numpy columns."""
    return {
        "t": np.frombuffer(rec.t, dtype=np.float64) if len(rec) else np.zeros(0),
        "latency": np.asarray(rec.latency, dtype=float),
        "code": np.asarray(rec.code, dtype=np.int64),
        "tokens": np.asarray(rec.tokens, dtype=np.int64),
        "usage": np.asarray(rec.usage_tokens, dtype=np.int64),
        "inputs": np.asarray(rec.inputs, dtype=np.int64),
        "warm": np.asarray(rec.warm, dtype=bool),
    }


def aggregate(c: dict[str, np.ndarray], mask: np.ndarray, span_s: float) -> dict[str, Any]:
    """Counts, rates and latency percentiles for the rows in ``mask`` over ``span_s``."""
    code = c["code"][mask]
    ok = (code >= 200) & (code < 300)
    throttled = code == 429
    errors = ~ok & ~throttled
    usage = c["usage"][mask][ok]
    span = max(span_s, 1e-9)
    ok_tokens = int(c["tokens"][mask][ok].sum())
    embedded = int(usage[usage >= 0].sum())
    return {
        "attempts": int(mask.sum()),
        "ok": int(ok.sum()),
        "errors": int(errors.sum()),
        "throttled_429": int(throttled.sum()),
        "error_rate": round(float(errors.sum()) / max(int(mask.sum()), 1), 6),
        "inputs_ok": int(c["inputs"][mask][ok].sum()),
        "tokens_sent": int(c["tokens"][mask].sum()),
        "tokens_ok": ok_tokens,
        "usage_prompt_tokens": embedded,
        "usage_reported": int((usage >= 0).sum()),
        "requests_per_s": round(float(ok.sum()) / span, 4),
        "tokens_per_s": round(ok_tokens / span, 2),
        "embedded_tokens_per_s": round(embedded / span, 2),
        "latency_ms": percentiles(c["latency"][mask][ok]),
        "by_status": dict(sorted(Counter(code_name(int(x)) for x in code).items())),
    }


def embedded_per_s(agg: dict[str, Any]) -> float | None:
    """Tokens/s the server embedded (its ``usage``), or None where successful requests came
    back without usage (then only tokens sent are known)."""
    return None if agg["ok"] and not agg["usage_reported"] else agg["embedded_tokens_per_s"]


def window_edges(start: float, end: float, window_s: float) -> list[tuple[float, float]]:
    """Consecutive windows covering [start, end); a short tail (< half a window) is
    folded into the window before it so the last window is never a handful of requests."""
    if end <= start or window_s <= 0:
        return []
    edges: list[tuple[float, float]] = []
    a = start
    while a < end - 1e-9:
        b = min(a + window_s, end)
        if edges and b - a < window_s / 2:
            edges[-1] = (edges[-1][0], b)
        else:
            edges.append((a, b))
        a = b
    return edges


def windows(c: dict[str, np.ndarray], start: float, end: float,
            window_s: float) -> list[dict[str, Any]]:
    """Aggregates per time window (by send time) over the measured (non-warm-up) rows."""
    out = []
    for a, b in window_edges(start, end, window_s):
        mask = (c["t"] >= a) & (c["t"] < b) & ~c["warm"]
        agg = aggregate(c, mask, b - a)
        out.append({"t_start": round(a, 3), "t_end": round(b, 3), **agg})
    return out


def auto_window(measured_s: float) -> float:
    """About 20 windows per run, at least 5 s, rounded to a friendly size."""
    raw = max(measured_s / 20.0, 5.0)
    for nice in (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if raw <= nice:
            return float(nice)
    return raw
