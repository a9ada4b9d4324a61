"""Benchmark: the autoscaling signal (``embedserve_load``) along a closed-loop ramp.

Starts ``embedserve up`` on the CPU engine with the bundled all-MiniLM-L6-v2, primes it (a
full admission window of the ramp's requests for ``--prime`` seconds, then ``--idle`` seconds
of nothing), then runs ``embedserve loadtest`` once per step, closed loop, with more
requests in flight each step; the load generator reads the gauge from the gateway's
/metrics (``--gauge``) while it runs.

Why prime: the gauge's demand part divides by the engines' measured capacity, at start that of
``up``'s warm-up call (a batch of the model's longest inputs on a cold engine); a pod in service
has measured it on its own traffic, and calls under a quarter of the call budget do not count.
The idle time lets the priming traffic leave the 15 s averages; the capacity keeps its value.
Every input is unique. Target: the gauge crosses 1.0 within 20% of the load where 429s begin.

    python -m bench.cpu.autoscale_ramp --out results/autoscale-cpu     # ramp.json, ramp.md, ramp.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench's scripts import each other by file name, as mypy names them (bench has no packages)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import port_busy, spawn, stop_group, wait_ok

from embedserve.config import BUNDLED_MODEL, Settings, resolve_model_path
from embedserve.gateway.load import REFUSING_SHARE
from embedserve.loadtest.cli import main as loadtest

GAUGES = ("embedserve_load", "embedserve_offered_tokens_per_second", "embedserve_refused_tokens_per_second",
          "embedserve_capacity_tokens_per_second", "embedserve_admission_fill")
ONSET_429 = 0.01  # 429s "begin" at the first step where at least 1% of attempts get one


def start_stack(port: int, env: dict[str, str], work: Path) -> int:
    """``embedserve up`` on ``port`` (the engine on the next one), ready once its gateway answers;
    its process group's id. Both ports must be free: another server answering there would be
    measured."""
    for p in (port, port + 1):
        if port_busy(p):
            raise SystemExit(f"port {p} is in use: choose another with --port")
    pid = spawn([sys.executable, "-m", "embedserve", "up"], work / "stack.log", {**os.environ, **env})
    if wait_ok(f"http://127.0.0.1:{port}/health/ready", time.time() + 300, pid) is None:
        stop_group(pid, 30)
        raise SystemExit(f"the stack was not ready in 300 s: see {work / 'stack.log'}")
    return pid


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
    attempts, seconds = max(m["attempts"], 1), max(m["duration_s"], 1e-9)
    return {
        "concurrency": concurrency, "attempts": m["attempts"], "ok": m["ok"],
        "throttled_429": m["throttled_429"],
        "share_429": round(m["throttled_429"] / attempts, 4),
        "offered_tokens_per_s": round(m["attempts"] * a.tokens * a.inputs / seconds, 1),
        "answered_tokens_per_s": round(m["tokens_per_s"], 1),
        "p50_ms": m["latency_ms"]["p50"], "p95_ms": m["latency_ms"]["p95"],
        "load_median": g["embedserve_load"]["median"], "load_min": g["embedserve_load"]["min"],
        "load_max": g["embedserve_load"]["max"],
        "capacity_tokens_per_s": g["embedserve_capacity_tokens_per_second"]["median"],
        "gateway_offered_tokens_per_s": g["embedserve_offered_tokens_per_second"]["median"],
        "gateway_refused_tokens_per_s": g["embedserve_refused_tokens_per_second"]["median"],
        "admission_fill_median": g["embedserve_admission_fill"]["median"],
    }


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
            if prev is None or prev["load_median"] is None:
                cross = {"offered_tokens_per_s": r["offered_tokens_per_s"], "concurrency": r["concurrency"]}
            else:  # linear between the two steps, in offered load
                lo, hi = prev["load_median"], r["load_median"]
                f = (1.0 - lo) / (hi - lo) if hi > lo else 1.0
                x0, x1 = prev["offered_tokens_per_s"], r["offered_tokens_per_s"]
                c0, c1 = prev["concurrency"], r["concurrency"]
                cross = {"offered_tokens_per_s": round(x0 + f * (x1 - x0), 1),
                         "concurrency": round(c0 + f * (c1 - c0), 1)}
            break
    out: dict[str, Any] = {"gauge_reaches_1": cross, "onset_429": None, "within_20_percent": None}
    if onset is not None:
        out["onset_429"] = {"offered_tokens_per_s": onset["offered_tokens_per_s"],
                            "concurrency": onset["concurrency"], "gauge": onset["load_median"]}
    if cross is not None and onset is not None:
        # The ramp's load is the closed loop's requests in flight. Offered tokens/s is given
        # too, but it jumps at the onset: every refused request is sent again after its
        # Retry-After, so the attempts grow while the answers do not.
        gap = cross["concurrency"] / onset["concurrency"] - 1
        out["gap_in_flight"] = round(gap, 4)
        out["gap_offered_load"] = round(cross["offered_tokens_per_s"] / onset["offered_tokens_per_s"] - 1, 4)
        out["within_20_percent"] = abs(gap) <= 0.2
    return out


def markdown(doc: dict[str, Any]) -> str:
    c = doc["crossing"]
    lines = ["| in flight | offered tok/s | answered tok/s | 429 share | P50 ms | capacity tok/s | demand | "
             "admission fill | refused share | embedserve_load (min-max) |", "|---" * 10 + "|"]

    def f2(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in doc["steps"]:
        offered, refused = r["gateway_offered_tokens_per_s"], r.get("gateway_refused_tokens_per_s")
        share = refused / offered if offered and refused is not None else None
        lines.append(f"| {r['concurrency']} | {r['offered_tokens_per_s']:,.0f} | "
                     f"{r['answered_tokens_per_s']:,.0f} | {r['share_429']:.1%} | {r['p50_ms'] or '-'} | "
                     f"{r['capacity_tokens_per_s'] or 0:,.0f} | "
                     f"{f2(_demand(r))} | {f2(r.get('admission_fill_median'))} | {f2(share)} | "
                     f"{f2(r['load_median'])} ({f2(r['load_min'])}-{f2(r['load_max'])}) |")
    g1, on = c["gauge_reaches_1"], c["onset_429"]
    if g1 and on:
        lines += ["", f"The gauge reaches 1.0 at {g1['concurrency']} requests in flight; 429s begin (>= "
                  f"{ONSET_429:.0%} of attempts) at {on['concurrency']} in flight, where the gauge reads "
                  f"{on['gauge']:.2f}: {c['gap_in_flight']:+.1%} apart, "
                  f"{'within' if c['within_20_percent'] else 'NOT within'} 20%. The ramp's load is the "
                  "requests in flight: offered tokens/s is no measure of it past the onset, since the load "
                  "generator pauses after a 429 for its Retry-After."]
    return "\n".join(lines) + "\n"


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--steps", default="1,2,3,4,6,8,16,32,48,64,72,96", help="requests in flight per step")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per step")
    ap.add_argument("--warmup", type=float, default=6.0, help="seconds before each step's measurement")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per input")
    ap.add_argument("--inputs", type=int, default=4, help="inputs per request")
    ap.add_argument("--max-tokens-in-flight", type=int, help="admission bound (default: the CPU default)")
    ap.add_argument("--prime", type=float, default=20.0, help="seconds of a full admission window first")
    ap.add_argument("--idle", type=float, default=45.0, help="seconds idle after priming")
    ap.add_argument("--replot", action="store_true", help="only write ramp.md and ramp.png from ramp.json")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.replot:
        doc = json.loads((a.out / "ramp.json").read_text())
        (a.out / "ramp.md").write_text(markdown(doc))
        plot(doc, a.out / "ramp.png")
        return 0
    work = Path(tempfile.mkdtemp(prefix="autoscale-ramp-"))
    env = {"HF_HUB_OFFLINE": "1", "EMBEDSERVE_ENGINE__KIND": "cpu", "EMBEDSERVE_GATEWAY__PORT": str(a.port),
           "EMBEDSERVE_ENGINE__PORT": str(a.port + 1), "EMBEDSERVE_ENGINE__STATS_DIR": str(work / "stats"),
           "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "120"}
    if a.max_tokens_in_flight:
        env["EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT"] = str(a.max_tokens_in_flight)
    bound = Settings(_env_file=None, gateway={"max_tokens_in_flight": a.max_tokens_in_flight}
                     ).tokens_in_flight_limit("cpu")
    per_request = a.tokens * a.inputs
    load_before, started = os.getloadavg(), time.time()
    pid = start_stack(a.port, env, work)
    rows = []
    try:
        url = f"http://127.0.0.1:{a.port}"
        prime(url, a, bound // per_request, work / "prime")
        for c in (int(x) for x in a.steps.split(",")):
            rows.append(step(url, c, a, work / f"c{c}"))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_group(pid, 60)
    machine = {"cores": os.cpu_count(), "platform": platform.platform(), "loadavg_before": load_before,
               "loadavg_after": os.getloadavg()}
    doc = {"title": f"embedserve_load along a closed-loop ramp, CPU stack ({os.cpu_count()} cores, shared), "
                    f"{a.inputs} x {a.tokens} tokens per request, admission bound {bound:,} tokens",
           "meta": {"machine": machine, "argv": sys.argv[1:] if argv is None else argv,
                    "model": "all-MiniLM-L6-v2 (bundled), CPU engine", "tokens_per_request": per_request,
                    "max_tokens_in_flight": bound, "in_flight_at_first_429": bound // per_request + 1,
                    "seconds_per_step": a.seconds, "warmup_per_step": a.warmup, "prime_s": a.prime,
                    "idle_after_prime_s": a.idle, "onset_429_share": ONSET_429, "started_at": started},
           "steps": rows}
    doc["crossing"] = crossing(rows)
    (a.out / "ramp.json").write_text(json.dumps(doc, indent=1) + "\n")
    (a.out / "ramp.md").write_text(markdown(doc))
    plot(doc, a.out / "ramp.png")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
