"""Benchmark: a burst after an idle spell, against a running stack.

An evening of traffic (rounds of concurrent requests), then ``--idle-s`` with no request at
all, then the morning's burst: eight concurrent requests of one engine call's size (one
input of at most one model length) and eight of several calls each (twelve such inputs),
every text unique. Target: every
request of the burst answered 200, none refused with 413, and the measured capacity
(``embedserve_capacity_tokens_per_second``) the same before and after the idle spell.

    python -m bench.cpu.idle_burst --url http://127.0.0.1:8000 --idle-s 3600 --out results/idle-burst-cpu
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

_unique = itertools.count()


def texts(count: int, words: int) -> list[str]:
    """Texts no cache has seen: every word carries a serial number."""
    return [" ".join(f"note{next(_unique)}" for _ in range(words)) for _ in range(count)]


def tokens(replies: list[dict[str, Any]]) -> str:
    """The tokens the server embedded per request (its usage), as a range."""
    counts = sorted(r["tokens"] for r in replies if r["tokens"] is not None)
    if not counts:
        return "no usage"
    return f"{counts[0]:,}" if counts[0] == counts[-1] else f"{counts[0]:,}-{counts[-1]:,}"


def capacity(url: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("embedserve_capacity_tokens_per_second "):
            return float(line.split()[1])
    return None


def burst(url: str, model: str, inputs: int, words: int, clients: int = 8) -> list[dict[str, Any]]:
    def one(body: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/embeddings", json=body, timeout=120)
        code = "" if r.status_code == 200 else r.json()["error"]["code"]
        tokens = r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else None
        return {"status": r.status_code, "code": code, "tokens": tokens, "s": round(time.monotonic() - t0, 3)}

    bodies = [{"model": model, "input": texts(inputs, words)} for _ in range(clients)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, bodies))


def phase(url: str, model: str) -> dict[str, Any]:
    short, long = burst(url, model, 1, 70), burst(url, model, 12, 70)
    return {"one_call": short, "several_calls": long,
            "statuses": dict(Counter(str(r["status"]) for r in short + long))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--idle-s", type=float, default=3600.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    model = httpx.get(a.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    evening = [phase(a.url, model) for _ in range(3)]
    before = capacity(a.url)
    time.sleep(a.idle_s)
    after_idle = capacity(a.url)
    morning = phase(a.url, model)
    result = {"model": model, "idle_s": a.idle_s, "host": f"{os.cpu_count()} cores, {platform.machine()}",
              "capacity_before_idle": before, "capacity_after_idle": after_idle,
              "capacity_after_burst": capacity(a.url), "evening": evening, "morning": morning}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(result, indent=1))
    rows = [("evening, last round", evening[-1]), ("after the idle spell", morning)]
    md = [f"# A burst after {a.idle_s / 3600:g} h idle ({model}, CPU stack)", "",
          f"| phase | 8 x one call ({tokens(morning['one_call'])} tokens) | 8 x several calls "
          f"({tokens(morning['several_calls'])} tokens) |", "|---|---|---|"]
    for name, p in rows:
        cells = [", ".join(f"{k}: {v}" for k, v in Counter(str(r["status"]) for r in p[key]).items())
                 for key in ("one_call", "several_calls")]
        md.append(f"| {name} | {cells[0]} | {cells[1]} |")
    md += ["", f"Capacity (tokens/s): {before:,.0f} before the idle spell, {after_idle:,.0f} after it, "
           f"{result['capacity_after_burst']:,.0f} after the burst.", "",
           f"`python -m bench.cpu.idle_burst --url URL --idle-s {a.idle_s:g} --out OUT`, against "
           "`embedserve up` on the CPU stack."]
    (a.out / "README.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
