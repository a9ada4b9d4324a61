"""The autoscaling signal (``embedserve_load``) along a closed-loop ramp: the suite's
``autoscale-ramp`` scenario (bench/probes.py) and tests/test_load_signal.py's short ramp. ``prime``
the stack, then one closed-loop ``embedserve loadtest`` per ``step``, more requests in flight each
step, reading the gauge and its parts from the gateway's /metrics (``--gauge``); ``crossing`` finds
where the gauge reaches 1.0 and where 429s begin (target: within 20%). Why prime: the gauge's demand
part divides by the engines' measured capacity, at start that of ``up``'s warm-up call (the model's
longest inputs on a cold engine), where a pod in service has measured its own traffic (calls under a
quarter of the call budget do not count); the idle time lets the priming leave the 15 s averages.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from embedserve.config import BUNDLED_MODEL, resolve_model_path
from embedserve.gateway.load import REFUSING_SHARE
from embedserve.loadtest.cli import main as loadtest

GAUGES = ("embedserve_load", "embedserve_offered_tokens_per_second", "embedserve_refused_tokens_per_second",
          "embedserve_capacity_tokens_per_second", "embedserve_admission_fill")
ONSET_429 = 0.01  # 429s "begin" at the first step where at least 1% of attempts get one


def step(url: str, concurrency: int, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One closed-loop run; its row of the ramp."""
    args = [url, "--tokenizer", str(resolve_model_path(BUNDLED_MODEL)), "--mix", f"fixed:{a.tokens}",
            "--inputs", str(a.inputs), "--encoding-format", "base64", "--concurrency", str(concurrency),
            "--duration", str(a.seconds), "--warmup", str(a.warmup), "--sample-interval", "1",
            "--timeout", "120", "--no-progress", "--no-plots", "--health-url", "none",
            "--metrics-url", "none", "--out", str(out)]
    loadtest([*args, *(x for g in GAUGES for x in ("--gauge", g))])
    res = json.loads((out / "results.json").read_text())
    m, g = res["measured"], res["gauges"]["measured"]
    load = g["embedserve_load"]
    attempts, seconds = max(m["attempts"], 1), max(m["duration_s"], 1e-9)
    return {"concurrency": concurrency, "attempts": m["attempts"], "ok": m["ok"],
            "throttled_429": m["throttled_429"], "share_429": round(m["throttled_429"] / attempts, 4),
            "offered_tokens_per_s": round(m["attempts"] * a.tokens * a.inputs / seconds, 1),
            "answered_tokens_per_s": round(m["tokens_per_s"], 1), "p50_ms": m["latency_ms"]["p50"],
            "p95_ms": m["latency_ms"]["p95"], **{f"load_{k}": load[k] for k in ("median", "min", "max")},
            "capacity_tokens_per_s": g["embedserve_capacity_tokens_per_second"]["median"],
            "gateway_offered_tokens_per_s": g["embedserve_offered_tokens_per_second"]["median"],
            "gateway_refused_tokens_per_s": g["embedserve_refused_tokens_per_second"]["median"],
            "admission_fill_median": g["embedserve_admission_fill"]["median"]}


def prime(url: str, a: argparse.Namespace, concurrency: int, out: Path) -> None:
    """A full admission window for ``a.prime`` seconds, then ``a.idle`` seconds idle."""
    if a.prime <= 0:
        return
    step(url, concurrency, argparse.Namespace(**{**vars(a), "seconds": a.prime, "warmup": 0.0}), out)
    time.sleep(a.idle)


def crossing(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the gauge first reaches 1.0 and where 429s begin, in offered tokens/s and in
    requests in flight, and the gauge at the 429 onset."""
    onset = next((r for r in rows if r["share_429"] >= ONSET_429), None)
    cross: dict[str, Any] | None = None
    for prev, r in zip([None, *rows], rows, strict=False):
        if r["load_median"] is not None and r["load_median"] >= 1.0:
            keys = ("offered_tokens_per_s", "concurrency")
            if prev is None or prev["load_median"] is None:
                cross = {k: r[k] for k in keys}
            else:  # linear between the two steps, in offered load
                lo, hi = prev["load_median"], r["load_median"]
                f = (1.0 - lo) / (hi - lo) if hi > lo else 1.0
                cross = {k: round(prev[k] + f * (r[k] - prev[k]), 1) for k in keys}
            break
    out: dict[str, Any] = {"gauge_reaches_1": cross, "onset_429": None if onset is None else {
        "offered_tokens_per_s": onset["offered_tokens_per_s"], "concurrency": onset["concurrency"],
        "gauge": onset["load_median"]}, "within_20_percent": None}
    if cross is not None and onset is not None:
        # The ramp's load is the closed loop's requests in flight. Offered tokens/s is given
        # too, but it jumps at the onset: every refused request is sent again after its
        # Retry-After, so the attempts grow while the answers do not.
        gap = cross["concurrency"] / onset["concurrency"] - 1
        out["gap_in_flight"] = round(gap, 4)
        out["gap_offered_load"] = round(cross["offered_tokens_per_s"] / onset["offered_tokens_per_s"] - 1, 4)
        out["within_20_percent"] = abs(gap) <= 0.2
    return out


def f2(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each step's row: what was offered and answered, and the gauge with its parts (medians)."""
    out = []
    for r in doc["steps"]:
        offered, refused = r["gateway_offered_tokens_per_s"], r.get("gateway_refused_tokens_per_s")
        out.append({
            "in flight": r["concurrency"], "offered tok/s": f"{r['offered_tokens_per_s']:,.0f}",
            "answered tok/s": f"{r['answered_tokens_per_s']:,.0f}", "429 share": f"{r['share_429']:.1%}",
            "P50 ms": r["p50_ms"], "capacity tok/s": f"{r['capacity_tokens_per_s'] or 0:,.0f}",
            "demand": f2(_demand(r)), "admission fill": f2(r.get("admission_fill_median")),
            "refused share": f2(refused / offered if offered and refused is not None else None),
            "embedserve_load (min-max)": f"{f2(r['load_median'])} ({f2(r['load_min'])}-{f2(r['load_max'])})"})
    return out


def verdict(doc: dict[str, Any]) -> list[str]:
    c = doc["crossing"]
    g1, on = c["gauge_reaches_1"], c["onset_429"]
    if not (g1 and on):
        return []
    return [f"The gauge reaches 1.0 at {g1['concurrency']} requests in flight; 429s begin (>= "
            f"{ONSET_429:.0%} of attempts) at {on['concurrency']} in flight, where the gauge reads "
            f"{on['gauge']:.2f}: {c['gap_in_flight']:+.1%} apart, "
            f"{'within' if c['within_20_percent'] else 'NOT within'} 20%. The ramp's load is the "
            "requests in flight: offered tokens/s is no measure of it past the onset, since the load "
            "generator pauses after a 429 for its Retry-After."]


def plot(doc: dict[str, Any], path: Path) -> None:
    """Left: the gauge and the 429 share along the ramp. Right: the gauge's parts (medians),
    which show which one carries it at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["steps"]
    xs = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(xs, [r["load_median"] for r in rows], "o-", color="C0", label="embedserve_load (median)")
    left.fill_between(xs, [r["load_min"] for r in rows], [r["load_max"] for r in rows], color="C0",
                      alpha=0.15)
    twin = left.twinx()
    twin.plot(xs, [r["share_429"] for r in rows], "s-", color="C3", label="429 share of attempts")
    twin.set(ylabel="429 share", ylim=(0, 1))
    twin.legend(loc="lower right", fontsize=8)
    for part, style, color, label in ((lambda r: r["load_median"], "o-", "C0", "embedserve_load"),
                                      (_demand, "^--", "C1", "demand (offered / capacity)"),
                                      (lambda r: r["admission_fill_median"], "v--", "C2", "admission fill"),
                                      (_refusal, "D--", "C3", "refusal (offered / admitted)")):
        right.plot(xs, [part(r) for r in rows], style, color=color, label=label)
    for ax in (left, right):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if on := doc["crossing"]["onset_429"]:
            ax.axvline(on["concurrency"], color="C3", lw=0.8, ls=":")
        ax.set(xlabel="requests in flight (closed loop)", ylabel="embedserve_load")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(doc["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _demand(r: dict[str, Any]) -> float | None:
    cap, offered = r["capacity_tokens_per_s"], r["gateway_offered_tokens_per_s"]
    return offered / cap if cap and offered is not None else None


def _refusal(r: dict[str, Any]) -> float | None:
    """The refusal part from the medians (the gateway also needs the last refusal recent)."""
    offered, refused = r["gateway_offered_tokens_per_s"], r.get("gateway_refused_tokens_per_s")
    if not offered or refused is None or refused < REFUSING_SHARE * offered:
        return None
    return offered / max(offered - refused, REFUSING_SHARE * offered)
