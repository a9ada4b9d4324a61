"""How much of the gateway's event loop one request takes, against an engine that answers
at once: the loop is one thread, so 1 / (loop CPU per request) is the most requests a second
one gateway process can carry, whatever the GPU behind it does. A benchmark that prints
numbers, not a test.

    python bench/cpu/gateway_loop.py --model qwen3=DIR --model stand-in=DIR2 \
        --seconds 10 --out results/gateway-loop-cpu

For each model folder (its tokenizer is what differs), each ``gateway.inline_tokenize_chars``
setting and each length mix, one gateway process in front of
``embedserve.loadtest.instant_engine`` takes ``embedserve loadtest`` (unique texts of exact
token counts, closed loop); the event loop's CPU time (the gateway's main thread, from
/proc) and the whole process's are divided by the requests it answered. CPU time per request
holds on a machine whose cores the load generator shares, where wall-clock rates do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

# bench's scripts import each other by file name, as mypy names them (bench has no packages)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_cpu import instant_gateway

MIXES = {"short 16-512": "uniform:16-512", "seed mix": "seed"}


def loop_and_process_cpu(pid: int) -> tuple[float, float]:
    """(main thread, whole process) user + system CPU seconds."""
    proc = psutil.Process(pid)
    main = next(t for t in proc.threads() if t.id == pid)
    total = proc.cpu_times()
    return main.user_time + main.system_time, total.user + total.system


def one_run(model: str, inline_chars: int, mix: str, seconds: float, concurrency: int,
            dim: int, event_loop: str) -> dict[str, Any]:
    env = {"EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": str(10**9),
           "EMBEDSERVE_GATEWAY__INLINE_TOKENIZE_CHARS": str(inline_chars),
           "EMBEDSERVE_GATEWAY__EVENT_LOOP": event_loop}
    with instant_gateway(30993, 8993, env, "--model", model, dim=dim) as gateway, \
            tempfile.TemporaryDirectory() as out:
        loop0, proc0 = loop_and_process_cpu(gateway.pid)
        subprocess.run([sys.executable, "-m", "embedserve.runtime.cli", "loadtest",
                        "http://127.0.0.1:8993", "--tokenizer", model, "--mix", mix,
                        "--concurrency", str(concurrency), "--duration", f"{seconds:g}",
                        "--warmup", "0", "--seed", "7", "--out", out, "--no-progress", "--no-plots",
                        "--health-url", "none", "--metrics-url", "none", "--build-workers", "0"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        loop1, proc1 = loop_and_process_cpu(gateway.pid)
        measured = json.loads((Path(out) / "results.json").read_text())["measured"]
    ok = measured.get("ok", 0)
    lat = measured.get("latency_ms") or {}
    return {"concurrency": concurrency, "requests": ok, "p50_ms": lat.get("p50"),
            "p95_ms": lat.get("p95"), "errors": measured.get("errors", 0),
            "req_per_s_wall": round(float(measured.get("requests_per_s") or 0), 1),
            "tokens_per_request": round(float(measured.get("tokens_per_s") or 0)
                                        / max(float(measured.get("requests_per_s") or 1), 1e-9)),
            "loop_cpu_ms_per_request": round(1000 * (loop1 - loop0) / max(ok, 1), 3),
            "process_cpu_ms_per_request": round(1000 * (proc1 - proc0) / max(ok, 1), 3),
            "loop_limit_req_per_s": round(ok / (loop1 - loop0)) if loop1 > loop0 else None}


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# The gateway's event loop per request (CPU, instant engine)", "",
             f"{meta['cpus']} cores shared by load generator, gateway and engine; {meta['seconds']:g} s "
             f"per run, unique texts, closed loop; {meta['time']}.", "",
             "| event loop | tokenizer | inline tokenise up to | mix | in flight | tokens/request | "
             "loop CPU ms/request | "
             "gateway CPU ms/request | loop limit, requests/s | P50 / P95 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['event_loop']} | {r['tokenizer']} | {r['inline_chars']} chars | {r['mix']} | "
              f"{r['concurrency']} | "
              f"{r['tokens_per_request']} | {r['loop_cpu_ms_per_request']} | "
              f"{r['process_cpu_ms_per_request']} | "
              f"{r['loop_limit_req_per_s']} | {r['p50_ms']} / {r['p95_ms']} | {r['errors']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                    help="a model folder whose tokenizer the gateway and the load use")
    ap.add_argument("--inline-chars", default="2048,0",
                    help="gateway.inline_tokenize_chars values, comma-separated")
    ap.add_argument("--event-loops", default="uvloop,asyncio",
                    help="gateway.event_loop values, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", default="64,1", help="requests in flight, comma-separated")
    ap.add_argument("--dim", type=int, default=1024, help="the instant engine's vector size")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    rows = []
    for name, model in (m.split("=", 1) for m in a.model):
        for chars in (int(c) for c in a.inline_chars.split(",")):
            for conc in (int(c) for c in a.concurrency.split(",")):
                for mix_name, mix in MIXES.items():
                    for loop in a.event_loops.split(","):  # side by side, so they meet one machine state
                        row = {"event_loop": loop, "tokenizer": name, "inline_chars": chars, "mix": mix_name,
                               **one_run(model, chars, mix, a.seconds, conc, a.dim, loop)}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    meta = {"cpus": os.cpu_count(), "seconds": a.seconds, "concurrency": a.concurrency,
            "models": dict(m.split("=", 1) for m in a.model),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    md = markdown(rows, meta)
    print(md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (a.out / "results.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
