"""The gateway's resident memory (the ``embedserve up`` process alone; its engines' apart)
before, during and after large requests, and after it has been idle: what a pod needs under
load, and whether the gateway gives back what a large request took.

Starts ``embedserve up`` (the CPU engine and the bundled model) with the environment it is
run in (so ``MALLOC_ARENA_MAX=...`` or a setting can be compared), waits for it to be ready,
then sends each shape of request ``--rounds`` times from ``--clients`` clients at once and
samples the gateway's RSS every 0.1 s; then idles ``--idle-s`` seconds. Writes one JSON
document (``--out``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

MIB = 1 << 20


def words(n: int, rng: random.Random) -> str:
    vocab = ["model", "vector", "search", "memory", "request", "server", "token", "python", "list",
             "engine", "query", "document", "answer", "latency", "budget", "kernel", "batch"]
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(n))


def shapes(rng: random.Random) -> dict[str, dict[str, Any]]:
    """Bodies near the documented limits (2,048 inputs, 16 MiB, 300,000 tokens)."""
    return {
        # 64 inputs of 25,000 words (~13 MiB): each truncated to the model's 256 tokens, embedded
        "long_inputs": {"input": [words(25_000, rng) for _ in range(64)]},
        # 1,000 inputs of 400 words: 256,000 tokens after truncation; refused 413 (capacity) or embedded
        "many_inputs_256k_tokens": {"input": [words(400, rng) for _ in range(1000)]},
        # 2,048 inputs of 40 words (a full batch as a client library sends it)
        "max_inputs": {"input": [words(40, rng) for _ in range(2048)]},
    }


class Sampler(threading.Thread):
    """The gateway's RSS (the ``up`` process) and its engines' (its children) every
    ``every_s``: the peaks since the last ``take``."""

    def __init__(self, pid: int, every_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.peak = (0, 0)
        self.stop = threading.Event()

    def rss(self) -> tuple[int, int]:
        engines = 0
        for child in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                engines += child.memory_info().rss
        return int(self.proc.memory_info().rss), engines

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            now = self.rss()
            self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))

    def take(self) -> tuple[int, int]:
        now = self.rss()
        peak, self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1])), (0, 0)
        return peak


def mib(n: int) -> float:
    return round(n / MIB, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--label", default="defaults")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    env = {**os.environ, "EMBEDSERVE_ENGINE__PORT": str(a.port + 1), "PYTHONUNBUFFERED": "1"}
    log = open(a.out.with_suffix(".log"), "w")  # noqa: SIM115  (open for the stack's life)
    up = subprocess.Popen([sys.executable, "-m", "embedserve", "up", "--port", str(a.port)],
                          env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{a.port}"
    doc: dict[str, Any] = {"label": a.label, "env": {k: v for k, v in os.environ.items()
                                                     if k.startswith(("MALLOC_", "EMBEDSERVE_"))},
                           "clients": a.clients, "rounds": a.rounds, "steps": []}
    try:
        with httpx.Client(timeout=300) as c:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                try:
                    if c.get(url + "/health/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            model = c.get(url + "/v1/models").json()["data"][0]["id"]
            sampler = Sampler(up.pid)
            sampler.start()

            def step(name: str, statuses: list[int], t0: float) -> None:
                (peak, engines_peak), (rss, engines) = sampler.take(), sampler.rss()
                row = {"step": name, "peak_rss_mib": mib(peak), "rss_mib": mib(rss),
                       "engines_peak_rss_mib": mib(engines_peak), "engines_rss_mib": mib(engines),
                       "statuses": sorted(set(statuses)), "seconds": round(time.monotonic() - t0, 1)}
                doc["steps"].append(row)
                print(json.dumps(row), flush=True)

            t0 = time.monotonic()
            short = [c.post(url + "/v1/embeddings", json={"model": model, "input": "hello world"}).status_code
                     for _ in range(50)]
            step("ready, 50 short requests", short, t0)
            rng = random.Random(0)
            for name, body in shapes(rng).items():
                payload = json.dumps({"model": model, **body}).encode()
                t0 = time.monotonic()

                def send(_: int, payload: bytes = payload) -> int:
                    with httpx.Client(timeout=300) as own:
                        r = own.post(url + "/v1/embeddings", content=payload,
                                     headers={"content-type": "application/json"})
                        return r.status_code

                with ThreadPoolExecutor(a.clients) as pool:
                    statuses = list(pool.map(send, range(a.rounds * a.clients)))
                step(f"{name} ({len(payload) / MIB:.1f} MiB body) x{a.rounds * a.clients}", statuses, t0)
            t0 = time.monotonic()
            waited = 0.0
            while waited < a.idle_s:
                time.sleep(min(10.0, a.idle_s - waited))
                waited = time.monotonic() - t0
                step(f"idle {waited:.0f} s", [], t0)
            sampler.stop.set()
    finally:
        up.terminate()
        up.wait(60)
        log.close()
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
