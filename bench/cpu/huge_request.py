"""Benchmark: one client sends a huge request while another sends single short ones.

The huge request is 1,000 inputs of 400 words (within the documented limits: 2,048 inputs,
300,000 tokens), sent again as soon as it is answered; the other client sends one short
input at a time, closed loop. Target on the CPU stack: the short requests keep P95 at or
under 1 s with no 5xx, and the huge request gets 200 or an immediate 4xx/429.

    python -m bench.cpu.huge_request --url http://127.0.0.1:8000 --seconds 60 --out results/huge-request-cpu

Against a stack started with ``embedserve up``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

# bench's scripts import each other by file name, as mypy names them (bench has no packages)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procs import machine, publish

WORDS = ["memory", "model", "token", "embedding", "query"]
WORDS += ["passage", "search", "retrieve", "document", "vector"]


def huge_body(model: str, inputs: int, words: int) -> dict[str, Any]:
    texts = [" ".join(f"{WORDS[(i + j) % len(WORDS)]}{i}" for j in range(words)) for i in range(inputs)]
    return {"model": model, "input": texts}


def run(url: str, seconds: float, inputs: int, words: int) -> dict[str, Any]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    stop = time.monotonic() + seconds
    big: list[tuple[int, float, str]] = []
    small: list[tuple[int, float]] = []

    def big_client() -> None:
        body = huge_body(model, inputs, words)
        with httpx.Client(timeout=300) as c:
            while time.monotonic() < stop:
                t0 = time.monotonic()
                r = c.post(url + "/v1/embeddings", json=body)
                code = r.json().get("error", {}).get("code") if r.status_code != 200 else ""
                big.append((r.status_code, time.monotonic() - t0, code or ""))
                if r.status_code != 200:
                    time.sleep(float(r.headers.get("retry-after", 1)))

    def small_client() -> None:
        with httpx.Client(timeout=120) as c:
            i = 0
            while time.monotonic() < stop:
                t0 = time.monotonic()
                r = c.post(url + "/v1/embeddings", json={"model": model, "input": f"short question {i}"})
                small.append((r.status_code, time.monotonic() - t0))
                i += 1
                time.sleep(0.2)

    threads = [threading.Thread(target=big_client), threading.Thread(target=small_client)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = np.array([s for code, s in small if code == 200]) * 1000
    return {
        "huge_request": {"inputs": inputs, "words_per_input": words,
                         "answers": [{"status": c, "seconds": round(s, 3), "code": k} for c, s, k in big]},
        "short_requests": {
            "sent": len(small),
            "status_counts": dict(sorted(Counter(str(code) for code, _ in small).items())),
            "p50_ms": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
            "p95_ms": round(float(np.percentile(lat, 95)), 1) if len(lat) else None,
            "max_ms": round(float(lat.max()), 1) if len(lat) else None,
        },
    }


def markdown(result: dict[str, Any]) -> str:
    s, h = result["short_requests"], result["huge_request"]
    first = h["answers"][0] if h["answers"] else {}
    return "\n".join([
        "# One huge request beside short ones", "", f"Machine: {result['machine']}; {result['when']}. "
        f"Command: `{result['command']}`.", "", "| client | what | result |", "|---|---|---|",
        f"| huge | {h['inputs']} inputs x {h['words_per_input']} words | first answer {first.get('status')} "
        f"{first.get('code', '')} in {first.get('seconds')} s; {len(h['answers'])} answers |",
        f"| short | one input, closed loop | {s['sent']} sent, statuses {s['status_counts']}, "
        f"P50 {s['p50_ms']} ms, P95 {s['p95_ms']} ms, max {s['max_ms']} ms |", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.huge_request", description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--inputs", type=int, default=1000)
    ap.add_argument("--words", type=int, default=400)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    result = {**run(a.url, a.seconds, a.inputs, a.words), **machine(), "command":
              f"python -m bench.cpu.huge_request --seconds {a.seconds:g} --inputs {a.inputs} "
              f"--words {a.words}"}
    publish(result, markdown(result), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
