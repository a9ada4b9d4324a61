"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from embedserve.loadtest.stats import embedded_per_s

GIB = 1024.0**3


def _minutes(ts: list[float]) -> list[float]:
    return [t / 60.0 for t in ts]


def _mid(w: dict[str, Any]) -> float:
    return (w["t_start"] + w["t_end"]) / 2.0


def _warmup_line(ax: Any, res: dict[str, Any]) -> None:
    start = res["measured"]["start_s"]
    if start > 0:
        ax.axvline(start / 60.0, color="grey", ls=":", lw=1, label="end of warm-up")


def latency(res: dict[str, Any], path: Path) -> None:
    wins = res["windows"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = _minutes([_mid(w) for w in wins])
    for p, style in (("p50", "-"), ("p95", "-"), ("p99", "--")):
        ax.plot(xs, [w["latency_ms"][p] for w in wins], style, marker=".", label=p.upper())
    ax.set(xlabel="minutes since start", ylabel="latency ms (successful requests)",
           title=f"Latency per {res['meta']['window_s']:g} s window")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def throughput(res: dict[str, Any], path: Path) -> None:
    wins = res["windows"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = _minutes([_mid(w) for w in wins])
    ax.plot(xs, [w["requests_per_s"] for w in wins], marker=".", color="C0", label="req/s")
    ax.set(xlabel="minutes since start", ylabel="successful requests/s",
           title="Throughput per window")
    ax2 = ax.twinx()
    label, values = token_line(wins)
    ax2.plot(xs, values, marker=".", color="C1", label=label)
    ax2.set_ylabel(label)
    errs = [w["errors"] + w["throttled_429"] for w in wins]
    if any(errs):
        width = res["meta"]["window_s"] / 60.0 * 0.8
        ax.bar(xs, errs, width=width, color="C3", alpha=0.4, label="errors + 429")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def token_line(wins: list[dict[str, Any]]) -> tuple[str, list[float]]:
    """Tokens/s embedded (the server's usage, after its truncation) per window, NaN (a gap)
    where it is unknown; tokens/s sent, labelled so, only when the server reported no usage."""
    if any(w["usage_reported"] for w in wins):
        return "tokens/s embedded (server usage)", [
            math.nan if (v := embedded_per_s(w)) is None else v for w in wins]
    return "tokens/s sent (the server reported no usage)", [w["tokens_per_s"] for w in wins]


def memory(res: dict[str, Any], path: Path) -> None:
    hmem = res["memory"].get("health_memory") or {}
    hm = hmem.get("samples", [])
    watched = res["memory"].get("watched_pids", {})
    client = res["memory"].get("client", [])
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    gpu, host, fc = axes
    _series(gpu, hm, "gpu_bytes", "target GPU memory", "gpu_slope_bytes_per_hour")
    gpu.set(ylabel="GiB", title="GPU memory (target /health/memory)" + _limit(gpu, hm, "gpu"))
    _series(host, hm, "host_bytes", "target host memory", "host_slope_bytes_per_hour")
    _series(host, hm, "engine_rss_bytes", "target engine RSS")
    _series(host, hm, "gateway_rss_bytes", "target gateway tree RSS (incl. engine)")
    for pid, samples in watched.items():
        host.plot(_minutes([s["t"] for s in samples]),
                  [s["tree_rss_bytes"] / GIB for s in samples], label=f"pid {pid} tree RSS")
    if client:
        host.plot(_minutes([s["t"] for s in client]),
                  [s["rss_bytes"] / GIB for s in client], ls=":", label="load generator RSS")
    host.set(ylabel="GiB", title="Host memory" + _limit(host, hm, "host"))
    pts = [s for s in hm if s.get("hours_to_oom") is not None]
    if pts:
        xs = _minutes([s["t"] for s in pts])
        fc.plot(xs, [s["hours_to_oom"] for s in pts], marker=".", label="forecast hours to OOM")
        lo = [s.get("hours_low") for s in pts]
        hi = [s.get("hours_high") for s in pts]
        if all(v is not None for v in lo + hi):
            fc.fill_between(xs, lo, hi, alpha=0.2, label="forecast interval")
    for kind in ("host", "gpu"):
        worst = [(s["t"], s[f"{kind}_hours_low"]) for s in hm if s.get(f"{kind}_hours_low")]
        if worst:
            fc.plot(_minutes([w[0] for w in worst]), [w[1] for w in worst], ls="--",
                    label=f"{kind}: worst case (steepest slope in the interval)")
    if fc.lines:
        fc.set_yscale("log")
    fc.set(xlabel="minutes since start", ylabel="hours",
           title="Forecast hours to OOM (target /health/memory)")
    last = hmem.get("last_answer") if isinstance(hmem.get("last_answer"), dict) else {}
    empty_note = {gpu: "no GPU figures", host: "no host figures",
                  fc: "no forecast: " + str((last or {}).get("reason") or hmem.get("status")
                                            or "no /health/memory")}
    for ax in axes:
        if not ax.lines and not ax.collections:
            ax.text(0.5, 0.5, "\n".join(textwrap.wrap(empty_note[ax], 90)), ha="center",
                    va="center", transform=ax.transAxes, fontsize=9)
        _warmup_line(ax, res)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _series(ax: Any, samples: list[dict[str, Any]], key: str, label: str,
            slope_key: str | None = None) -> None:
    """A memory line; with ``slope_key``, the target's own fitted trend drawn ahead."""
    pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if not pts:
        return
    (line,) = ax.plot(_minutes([p[0] for p in pts]), [p[1] / GIB for p in pts], label=label)
    slope = samples[-1].get(slope_key) if slope_key else None
    if slope is not None and len(pts) > 1:
        t1, y1 = pts[-1]
        ahead = max((t1 - pts[0][0]) * 0.25, 60.0)
        ax.plot([t1 / 60.0, (t1 + ahead) / 60.0], [y1 / GIB, (y1 + slope * ahead / 3600) / GIB],
                ls="--", color=line.get_color(), label=f"{label}: forecast trend")


def _limit(ax: Any, samples: list[dict[str, Any]], kind: str) -> str:
    """Draw the limit when it is on the same scale as the data; else name it in the title."""
    vals = [s[f"{kind}_limit_bytes"] for s in samples if s.get(f"{kind}_limit_bytes")]
    if not vals:
        return ""
    top = max((max(ln.get_ydata(), default=0.0) for ln in ax.lines), default=0.0)
    if top and vals[-1] / GIB <= 2.5 * top:
        ax.axhline(vals[-1] / GIB, color="C3", ls="--", lw=1, label="limit")
    return f" (limit {vals[-1] / GIB:.1f} GiB)"


def write_all(res: dict[str, Any], out: Path) -> list[str]:
    """Write the three PNGs; returns their file names (relative to ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for name, fn in (("latency.png", latency), ("throughput.png", throughput),
                     ("memory.png", memory)):
        fn(res, out / name)
        names.append(name)
    return names
