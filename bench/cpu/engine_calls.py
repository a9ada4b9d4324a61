"""How the gateway feeds the CPU engine: `embedserve up` (ONNX fp32) with its defaults against
variants of the gateway's engine-call settings, side by side in one run, on the CPU peers'
loads (``bench.cpu.cpu_peers``). A benchmark that prints numbers, not a test.

    python -m bench.cpu.engine_calls --out results/cpu-engine-calls --rounds 3 --seconds 12 \\
        --variant calls2=EMBEDSERVE_GATEWAY__ENGINE_CALLS_PER_ENGINE=2 \\
        --variant tokens2048=EMBEDSERVE_GATEWAY__MAX_TOKENS_PER_ENGINE_CALL=2048

Rounds alternate the sides (the order rotating per round); tables show medians. Then, one
request in flight on each side, the gateway's per-stage headers (tokenise, queue, engine) and
the engine's own time per call say where a request's milliseconds go.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

# bench's scripts import each other by file name, as mypy names them (bench has no packages)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peers import LOADS, MODEL, Server, drive, embedserve, texts_for


def variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, spec = text.partition("=")
    env = dict(item.split("=", 1) for item in filter(None, spec.split(",")))
    return name, env


def stack(name: str, port: int, env: dict[str, str]) -> Server:
    return embedserve(name, port, port + 22000, env=env)


def stages(url: str, n: int) -> dict[str, float]:
    """Medians over ``n`` sequential single short inputs: the round trip and the gateway's headers."""
    out: dict[str, list[float]] = {"round_trip": [], "tokenize": [], "queue": [], "engine": []}
    with httpx.Client(timeout=30) as client:
        for text in texts_for(20, n, 4242):
            t0 = time.perf_counter()
            r = client.post(url, json={"model": MODEL, "input": text})
            out["round_trip"].append(1000 * (time.perf_counter() - t0))
            r.raise_for_status()
            for stage in ("tokenize", "queue", "engine"):
                out[stage].append(float(r.headers[f"x-embedserve-{stage}-ms"]))
    return {k: round(statistics.median(v), 2) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--variant", type=variant, action="append", default=[], metavar="NAME=K=V,K=V")
    a = ap.parse_args(argv)
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    sides = [stack("default", 8201, {})]
    sides += [stack(name, 8202 + i, env) for i, (name, env) in enumerate(a.variant)]
    doc: dict[str, Any] = {"load_average_before": os.getloadavg(), "started": time.time(), "rows": [],
                           "variants": {s.name: s.env for s in sides}}
    try:
        for s in sides:
            s.start(out / "logs")
            s.wait()
        for rnd in range(a.rounds):
            for li, load in enumerate(LOADS):
                seed = 5000 + 1000 * rnd + li
                shift = rnd % len(sides)
                for s in sides[shift:] + sides[:shift]:
                    r = asyncio.run(drive(s.url, load, a.seconds, a.warmup, seed))
                    row = {"side": s.name, "load": load.name, "round": rnd,
                           "load_average": os.getloadavg()[0], **r}
                    doc["rows"].append(row)
                    print(json.dumps(row), flush=True)
        doc["stages_one_in_flight_ms"] = {s.name: stages(s.url, 300) for s in sides}
        print(json.dumps(doc["stages_one_in_flight_ms"], indent=1), flush=True)
    finally:
        for s in sides:
            s.stop()
    doc["load_average_after"] = os.getloadavg()
    medians: dict[str, dict[str, Any]] = {}
    for s in sides:
        for load in LOADS:
            rows = [r for r in doc["rows"] if r["side"] == s.name and r["load"] == load.name]
            medians.setdefault(s.name, {})[load.name] = {
                "texts_per_s": statistics.median(r["texts_per_s"] for r in rows),
                "p50_ms": statistics.median(r["p50_ms"] for r in rows)}
    doc["medians"] = medians
    lines = ["| load | " + " | ".join(medians) + " |", "|---|" + "---|" * len(medians)]
    for load in LOADS:
        cells = [f"{m[load.name]['texts_per_s']:g}"
                 + (f", {m[load.name]['p50_ms']:.1f} ms" if load.conc == 1 else "") for m in medians.values()]
        lines.append(f"| {load.name} | " + " | ".join(cells) + " |")
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
