"""Request priority on the CPU stack: the suite's ``priority`` scenario (bench/probes.py).

Three phases on one stack, each ``seconds`` long: interactive requests alone (one short unique
input, priority 0, sent every 0.25 s whether or not the last one was answered), then beside a
bulk client that saturates the engine (``workers`` closed-loop requests of ``inputs`` unique
texts of ``words`` words each) at the interactive requests' priority, then the same bulk client
at priority 10. Per phase: the interactive requests' statuses and P50 / P95 / max, the bulk
requests answered and their tokens per second, and the aged requests from /metrics. Targets:
at priority 10 the interactive P95 within one full engine call of the phase alone (the call
running when a request arrives, which nothing preempts), no 5xx, and bulk requests answered.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import httpx
import numpy as np

SERIAL = itertools.count()
INTERVAL_S = 0.25


def ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def tally(statuses: Iterable[int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(Counter(statuses).items()))


def aged(url: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return next((float(x.split()[1]) for x in lines if x.startswith("embedserve_priority_aged_total ")), 0.0)


def phase(url: str, model: str, name: str, seconds: float, bulk_priority: int | None, workers: int,
          inputs: int, words: int) -> dict[str, Any]:
    """One phase; ``bulk_priority`` None: the interactive requests alone."""
    stop = time.monotonic() + seconds
    interactive: list[tuple[int, float]] = []
    bulk: list[tuple[int, int, float]] = []
    lock = threading.Lock()

    def ask(client: httpx.Client) -> None:
        t0 = time.monotonic()
        body = {"model": model, "input": f"how do I sort a list, question {next(SERIAL)}", "priority": 0}
        status = client.post(url + "/v1/embeddings", json=body).status_code
        with lock:
            interactive.append((status, time.monotonic() - t0))

    def interactive_client() -> None:
        with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            senders: list[threading.Thread] = []
            next_at = time.monotonic()
            while next_at < stop:
                time.sleep(max(0.0, next_at - time.monotonic()))
                senders.append(threading.Thread(target=ask, args=(client,)))
                senders[-1].start()
                next_at += INTERVAL_S
            for t in senders:
                t.join()

    def bulk_client() -> None:
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < stop:
                n = next(SERIAL)
                texts = [" ".join(f"passage{n}x{i} word{j}" for j in range(words // 2))
                         for i in range(inputs)]
                t0 = time.monotonic()
                r = client.post(url + "/v1/embeddings",
                                json={"model": model, "input": texts, "priority": bulk_priority})
                tokens = r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else 0
                with lock:
                    bulk.append((r.status_code, tokens, time.monotonic() - t0))
                if r.status_code != 200:
                    time.sleep(float(r.headers.get("retry-after", 1)))

    aged_before = aged(url)
    t_start = time.monotonic()
    threads = [threading.Thread(target=interactive_client)]
    if bulk_priority is not None:
        threads += [threading.Thread(target=bulk_client) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t_start
    ok = [s for status, s in interactive if status == 200]
    bulk_ok = [b for b in bulk if b[0] == 200]
    return {
        "phase": name,
        "bulk": "none" if bulk_priority is None else f"{workers} x {inputs} inputs, priority {bulk_priority}",
        "interactive_sent": len(interactive),
        "interactive_statuses": tally(s for s, _ in interactive),
        "interactive_p50_ms": ms(ok, 50), "interactive_p95_ms": ms(ok, 95),
        "interactive_max_ms": round(max(ok) * 1000, 1) if ok else None,
        "bulk_answered": len(bulk_ok),
        "bulk_statuses": tally(b[0] for b in bulk) or "-",
        "bulk_p95_s": round(float(np.percentile([b[2] for b in bulk_ok], 95)), 2) if bulk_ok else None,
        "bulk_tokens_per_s": round(sum(b[1] for b in bulk_ok) / took),
        "aged_requests": int(aged(url) - aged_before),
    }


def run(url: str, model: str, seconds: float, workers: int = 16, inputs: int = 4,
        words: int = 24) -> dict[str, Any]:
    """The three phases, one after the other, after a short warm-up. The default bulk client
    keeps ~5,000 tokens waiting (16 x 4 inputs of ~80 tokens): the engine always has work, and
    on a loaded 2-core VM a bulk request's own wait stays under the stack's aging bound."""
    load_before = os.getloadavg()
    phase(url, model, "warm-up", min(5.0, seconds), None, workers, inputs, words)
    rows = [phase(url, model, "interactive alone", seconds, None, workers, inputs, words),
            phase(url, model, "bulk at the same priority", seconds, 0, workers, inputs, words),
            phase(url, model, "bulk at priority 10", seconds, 10, workers, inputs, words)]
    return {"rows": rows, "interval_s": INTERVAL_S, "workers": workers, "inputs": inputs, "words": words,
            "load_average": [load_before, os.getloadavg()]}
