"""What an output type costs and saves: the same requests to ``/v1/embeddings`` answered as float
(JSON numbers, and base64) and as binary (packed sign bits: JSON numbers, and base64), against
one running stack, in one run: bytes of each answer's body and requests/s.

    python -m bench.cpu.output_types --url http://127.0.0.1:8000 --out results/output-types-cpu

Each round runs every variant in turn for ``--seconds`` (closed loop, ``--concurrency`` requests
in flight, ``--inputs`` texts of ``--words`` words a request, new texts every request), so
the variants share the machine's noise; the table gives each variant's median over the rounds.
Before timing, one request's binary answer is checked against sentence-transformers'
``quantize_embeddings`` of its float answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

#: variant -> the request's extra fields
VARIANTS: dict[str, dict[str, str]] = {
    "float": {},
    "float base64": {"encoding_format": "base64"},
    "binary": {"embedding_type": "binary"},
    "binary base64": {"embedding_type": "binary", "encoding_format": "base64"},
}
SENTENCE = ("memory grows slowly while the pod restarts before the kernel kills it and every request "
            "gets an answer from the engine that embeds text into vectors for search")
WORDS = tuple(SENTENCE.split(" "))


def texts(rng: random.Random, inputs: int, words: int) -> list[str]:
    return [" ".join(rng.choices(WORDS, k=words)) for _ in range(inputs)]


async def check(client: httpx.AsyncClient, url: str, model: str) -> bool:
    """Binary is quantize_embeddings(float, 'binary') on the same inputs."""
    from sentence_transformers.util.quantization import quantize_embeddings

    body = {"model": model, "input": texts(random.Random(0), 4, 12)}
    floats = (await client.post(url, json=body)).json()["data"]
    binary = (await client.post(url, json={**body, "embedding_type": "binary"})).json()["data"]
    want = quantize_embeddings(np.asarray([d["embedding"] for d in floats], dtype=np.float32), "binary")
    return bool(np.array_equal(np.asarray([d["embedding"] for d in binary]), want))


async def run_variant(client: httpx.AsyncClient, url: str, model: str, fields: dict[str, str],
                      a: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One closed-loop run: requests/s, body bytes and latency of the 200s; other statuses counted."""
    rng = random.Random(seed)
    sizes: list[int] = []
    latencies: list[float] = []
    failed = 0
    deadline = time.perf_counter() + a.seconds

    async def worker() -> None:
        nonlocal failed
        while time.perf_counter() < deadline:
            body = {"model": model, "input": texts(rng, a.inputs, a.words), **fields}
            t0 = time.perf_counter()
            r = await client.post(url, json=body)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - t0)
                sizes.append(len(r.content))
            else:
                failed += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    elapsed = time.perf_counter() - t0
    return {"requests": len(sizes), "failed": failed, "seconds": round(elapsed, 2),
            "requests_per_s": round(len(sizes) / elapsed, 2),
            "body_bytes": round(statistics.mean(sizes)) if sizes else None,
            "p50_ms": round(1000 * statistics.median(latencies), 1) if latencies else None}


async def measure(a: argparse.Namespace) -> dict[str, Any]:
    url = a.url.rstrip("/") + "/v1/embeddings"
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(a.url.rstrip("/") + "/v1/models")).json()["data"][0]["id"]
        checked = await check(client, url, model)
        rounds: list[dict[str, Any]] = []
        for i in range(a.rounds):
            rounds.append({name: await run_variant(client, url, model, fields, a, seed=1000 * i + j)
                           for j, (name, fields) in enumerate(VARIANTS.items())})
    summary = {name: {k: statistics.median(r[name][k] for r in rounds)
                      for k in ("requests_per_s", "body_bytes", "p50_ms")} for name in VARIANTS}
    return {"url": a.url, "model": model, "binary_matches_quantize_embeddings": checked,
            "load": {"inputs": a.inputs, "words": a.words, "concurrency": a.concurrency,
                     "seconds": a.seconds, "rounds": a.rounds},
            "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "rounds": rounds, "median": summary}


def table(res: dict[str, Any]) -> str:
    base = res["median"]["float"]
    lines = ["| answer | body bytes a request | vs float | requests/s | vs float | P50 ms |",
             "|---|---|---|---|---|---|"]
    for name, m in res["median"].items():
        lines.append(f"| {name} | {m['body_bytes']:,.0f} | {m['body_bytes'] / base['body_bytes']:.3f}x | "
                     f"{m['requests_per_s']:.2f} | {m['requests_per_s'] / base['requests_per_s']:.2f}x | "
                     f"{m['p50_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the gateway's base URL")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--inputs", type=int, default=32, help="texts a request")
    ap.add_argument("--words", type=int, default=12, help="words a text")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0, help="per variant and round")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    res = asyncio.run(measure(a))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (a.out / "results.md").write_text(table(res))
    print(table(res), end="")
    return 0 if res["binary_matches_quantize_embeddings"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
