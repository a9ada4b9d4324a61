"""Benchmark: slow clients against a running stack, and what normal requests see meanwhile.

Each round: a *quiet* window (a normal client, one short unique input at a time, closed loop),
then a *trickle* window of the same length (the same client while N connections trickle: half
the request head a header line a second, half the body a byte a second), each trickler timed
until the server closes it, with its answer (408 or none).

    python -m bench.cpu.slow_clients --url http://127.0.0.1:8000 --tricklers 400 --rounds 3 \\
        --out results/slow-clients-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

# bench's scripts import each other by file name, as mypy names them (bench has no packages)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import machine, publish

SERIAL = itertools.count()
MAX_TRICKLE_S = 120.0  # a trickler gives up after this long: the bound of the whole run


async def trickle(host: str, port: int, kind: str, model: str) -> dict[str, Any]:
    """One slow client; returns how long the server let it trickle and what it answered."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps({"model": model, "input": f"slow client {next(SERIAL)}"}).encode()
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    pieces = ([head[: head.index(b"\r\n") + 2]] + [b"X-Slow-%d: y\r\n" % i for i in range(200)]
              if kind == "head" else [head] + [body[i : i + 1] for i in range(len(body))])
    answer = b""

    async def read() -> None:
        nonlocal answer
        answer = await reader.read(65536)

    reading = asyncio.ensure_future(read())
    try:
        for piece in pieces:
            if reading.done() or time.monotonic() - t0 > MAX_TRICKLE_S:
                break
            writer.write(piece)
            await writer.drain()
            await asyncio.wait([reading], timeout=1.0)
        await asyncio.wait([reading], timeout=max(0.0, MAX_TRICKLE_S - (time.monotonic() - t0)))
    except (ConnectionError, OSError):
        pass
    took = time.monotonic() - t0
    reading.cancel()
    writer.close()
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
    return {"kind": kind, "held_s": round(took, 2), "answer": status,
            "cut": took < MAX_TRICKLE_S - 1}


async def normal(client: httpx.AsyncClient, url: str, model: str, seconds: float) -> list[float]:
    """Closed loop, one short unique input a request; latencies in seconds (200s only)."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        r = await client.post(url + "/v1/embeddings",
                              json={"model": model, "input": f"a normal query {next(SERIAL)}"})
        if r.status_code == 200:
            out.append(time.monotonic() - t0)
    return out


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


async def run(url: str, tricklers: int, rounds: int, window_s: float) -> dict[str, Any]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        await normal(client, url, model, 2.0)  # warm-up
        out: list[dict[str, Any]] = []
        for i in range(rounds):
            quiet = await normal(client, url, model, window_s)
            slow = [asyncio.ensure_future(trickle(host, port, "head" if j % 2 else "body", model))
                    for j in range(tricklers)]
            await asyncio.sleep(0.5)  # all connected and trickling
            busy = await normal(client, url, model, window_s)
            held = await asyncio.gather(*slow)
            kinds = {kind: [h for h in held if h["kind"] == kind] for kind in ("head", "body")}
            normal_rows = {name: {"requests": len(lat), "p50_ms": _ms(lat, 50), "p95_ms": _ms(lat, 95)}
                           for name, lat in (("quiet", quiet), ("trickle", busy))}
            out.append({"round": i + 1, **normal_rows,
                        "tricklers": {kind: {"count": len(rows), "cut": sum(h["cut"] for h in rows),
                                             "answered_408": sum(h["answer"] == "408" for h in rows),
                                             "held_p50_s": float(np.median([h["held_s"] for h in rows])),
                                             "held_max_s": max(h["held_s"] for h in rows)}
                                      for kind, rows in kinds.items()}})
            print(json.dumps(out[-1]), flush=True)
    return {"url": url, "model": model, "tricklers": tricklers, "window_s": window_s,
            **machine(), "rounds": out}


def markdown(res: dict[str, Any]) -> str:
    lines = ["# Slow clients against the CPU stack", "",
             f"{res['machine']}, shared with other jobs; {res['when']}. `python -m bench.cpu.slow_clients "
             f"--tricklers {res['tricklers']}` against `embedserve up` (defaults: `gateway.header_timeout_s` "
             "20 s, `gateway.body_idle_timeout_s` 20 s). Each round: a "
             f"{res['window_s']:g} s quiet window, then {res['tricklers']} trickling connections (half the "
             "head a header a second, half the body a byte a second) with the same normal client measured "
             "for the same time. Every input unique; ratios within a round.", "",
             "| round | normal P50 quiet / trickle (ms) | P95 quiet / trickle (ms) | P50 ratio | head "
             "tricklers cut (408) | held P50 / max (s) | body tricklers cut (408) | held P50 / max (s) |",
             "|---" * 8 + "|"]
    for r in res["rounds"]:
        q, t, h, b = r["quiet"], r["trickle"], r["tricklers"]["head"], r["tricklers"]["body"]
        ratio = t["p50_ms"] / q["p50_ms"] if q["p50_ms"] and t["p50_ms"] else float("nan")
        slow = [f"{x['cut']}/{x['count']} ({x['answered_408']}) | {x['held_p50_s']:.1f} / "
                f"{x['held_max_s']:.1f}" for x in (h, b)]
        lines.append(f"| {r['round']} | {q['p50_ms']} / {t['p50_ms']} | {q['p95_ms']} / {t['p95_ms']} "
                     f"| {ratio:.2f} | {slow[0]} | {slow[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="slow clients against a running stack")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--tricklers", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=20.0, help="seconds per window")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    res = asyncio.run(run(a.url.rstrip("/"), a.tricklers, a.rounds, a.window))
    publish(res, markdown(res), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
