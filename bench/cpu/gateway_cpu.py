"""Gateway efficiency on CPU: requests per CPU-second of the gateway process, and where its
time goes, against a fake engine that answers instantly. A benchmark that prints numbers,
not a test.

    python -m bench.cpu.gateway_cpu --seconds 10 --out results/bench-gateway-cpu

Part 1 times each stage in-process (median µs per request over many repeats).
Part 2 runs the real gateway process over HTTP at a fixed concurrency and divides the
requests it served by the CPU seconds it used (psutil), so the figure holds on a noisy
machine where wall-clock throughput does not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import psutil

from embedserve.config import BUNDLED_MODEL, resolve_model_path
from embedserve.contracts.wire import decode_response, encode_base64
from embedserve.gateway.schemas import EmbeddingRequest
from embedserve.gateway.tokenize import ModelTokenizer
from embedserve.gateway.vectors import shape_vectors
from embedserve.loadtest.instant_engine import reply

SHORT = "How do I keep GPU memory flat when inputs vary in length?"
LONG = " ".join(["the embedding service truncates long inputs and keeps the EOS token"] * 30)

SCENARIOS: dict[str, dict[str, Any]] = {
    "1 short text, float": {"input": SHORT, "encoding_format": "float"},
    "1 short text, base64": {"input": SHORT, "encoding_format": "base64"},
    "32 short texts, base64": {"input": [SHORT] * 32, "encoding_format": "base64"},
    "1 long text (~300 tok), base64": {"input": LONG, "encoding_format": "base64"},
    "8 token-id inputs, float": {"input": [[101, *range(2000, 2100), 102]] * 8, "encoding_format": "float"},
}


def median_us(fn: Callable[[], object], repeats: int = 7, number: int = 200) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times) * 1e6


def scenario_stages(tok: ModelTokenizer, fields: dict[str, Any]) -> dict[str, float]:
    """Median µs per request for each CPU stage of the pipeline, for one request shape."""
    body = orjson.dumps({"model": "m", **fields})
    req = EmbeddingRequest.model_validate(orjson.loads(body))
    raw = req.input
    texts = [raw] if isinstance(raw, str) else raw if isinstance(raw[0], str) else None
    n = 1 if isinstance(raw, str) or isinstance(raw[0], int) else len(raw)
    engine_reply = reply(n)
    vectors = decode_response(engine_reply, n)

    def respond() -> bytes:
        shaped = shape_vectors(vectors, None, True)
        payload = encode_base64(shaped) if req.encoding_format == "base64" else list(shaped)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(payload)]
        return orjson.dumps({"object": "list", "data": data}, option=orjson.OPT_SERIALIZE_NUMPY)

    stages = {
        "parse+validate": median_us(lambda: EmbeddingRequest.model_validate(orjson.loads(body))),
        "tokenize": median_us(lambda: tok.encode_texts(texts)) if texts else 0.0,
        "engine reply parse": median_us(lambda: decode_response(engine_reply, n)),
        "normalise+encode response": median_us(respond),
    }
    stages["total"] = sum(stages.values())
    return {k: round(v, 1) for k, v in stages.items()}


def stage_profile(tok: ModelTokenizer) -> dict[str, dict[str, float]]:
    return {name: scenario_stages(tok, fields) for name, fields in SCENARIOS.items()}


async def _closed_loop(url: str, body: bytes, concurrency: int, seconds: float) -> tuple[int, int]:
    ok = errors = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def worker() -> None:
            nonlocal ok, errors
            while time.monotonic() < stop:
                async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
                    await r.read()
                    ok, errors = (ok + 1, errors) if r.status == 200 else (ok, errors + 1)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok, errors


def wait_http(url: str, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


@contextlib.contextmanager
def instant_gateway(engine_port: int, gw_port: int, env: dict[str, str], *gateway_args: str,
                    dim: int | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A gateway process (``env``'s settings, ``gateway_args`` on its command line) in front
    of ``embedserve.loadtest.instant_engine`` (``dim``-sized vectors), both ready; stopped after."""
    engine = subprocess.Popen([sys.executable, "-m", "embedserve.loadtest.instant_engine", str(engine_port),
                               *([str(dim)] if dim else [])])
    gateway = subprocess.Popen(
        [sys.executable, "-m", "embedserve.runtime.cli", "gateway", *gateway_args,
         "--engine-url", f"http://127.0.0.1:{engine_port}"],
        env={**os.environ, "EMBEDSERVE_GATEWAY__PORT": str(gw_port), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{engine_port}/health")
        wait_http(f"http://127.0.0.1:{gw_port}/health/ready")
        yield gateway
    finally:
        for p in (gateway, engine):
            p.terminate()
            p.wait(10)


def http_runs(seconds: float, concurrency: int) -> dict[str, dict[str, float]]:
    engine_port, gw_port = 30991, 8991
    env = {
        "EMBEDSERVE_LOG_LEVEL": "WARNING",
        "EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": str(10**9),
        "EMBEDSERVE_GATEWAY__ACCEPT_TOKEN_IDS": "true",  # one scenario sends the model's own ids
    }
    results: dict[str, dict[str, float]] = {}
    with instant_gateway(engine_port, gw_port, env) as gateway:
        proc = psutil.Process(gateway.pid)
        for name, fields in SCENARIOS.items():
            body = orjson.dumps({"model": "all-MiniLM-L6-v2", **fields})
            url = f"http://127.0.0.1:{gw_port}/v1/embeddings"
            asyncio.run(_closed_loop(url, body, concurrency, 1.0))  # warm-up
            cpu0 = sum(proc.cpu_times()[:2])
            t0 = time.monotonic()
            ok, errors = asyncio.run(_closed_loop(url, body, concurrency, seconds))
            wall = time.monotonic() - t0
            cpu = sum(proc.cpu_times()[:2]) - cpu0
            results[name] = {
                "requests": ok,
                "errors": errors,
                "req_per_s": round(ok / wall, 1),
                "gateway_cpu_s": round(cpu, 2),
                "req_per_gateway_cpu_s": round(ok / cpu, 1) if cpu else float("nan"),
                "gateway_cpu_ms_per_req": round(1000 * cpu / max(ok, 1), 3),
            }
    return results


def to_markdown(
    stages: dict[str, dict[str, float]], http: dict[str, dict[str, float]], meta: dict[str, Any]
) -> str:
    lines = [
        "# Gateway efficiency on CPU (fake engine that answers instantly)",
        "",
        f"Machine: {meta['cpus']} cores; {meta['seconds']} s per scenario, "
        f"concurrency {meta['concurrency']}; "
        "load generator, gateway and fake engine share the machine.",
        "",
        "## Requests per CPU-second of the gateway process",
        "",
        "| scenario | req/s (wall) | req per gateway CPU-s | gateway CPU ms/req | errors |",
        "|---|---|---|---|---|",
    ]
    for name, r in http.items():
        lines.append(
            f"| {name} | {r['req_per_s']} | {r['req_per_gateway_cpu_s']} | "
            f"{r['gateway_cpu_ms_per_req']} | {r['errors']} |"
        )
    lines += [
        "",
        "## Where the time goes (in-process, median µs per request)",
        "",
        "| scenario | parse+validate | tokenize | engine reply parse | normalise+encode | sum of stages |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in stages.items():
        lines.append(
            f"| {name} | {s['parse+validate']} | {s['tokenize']} | {s['engine reply parse']} | "
            f"{s['normalise+encode response']} | {s['total']} |"
        )
    lines += [
        "",
        "The rest of the gateway CPU per request (HTTP parsing, FastAPI routing, middleware, asyncio "
        "scheduling, the engine call's HTTP client) is the difference between the two tables.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    tok = ModelTokenizer(resolve_model_path(BUNDLED_MODEL), 256)
    stages = stage_profile(tok)
    http = http_runs(a.seconds, a.concurrency)
    meta = {
        "cpus": os.cpu_count(),
        "seconds": a.seconds,
        "concurrency": a.concurrency,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    md = to_markdown(stages, http, meta)
    print(md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(
            json.dumps({"meta": meta, "stages_us": stages, "http": http}, indent=1)
        )
        (a.out / "results.md").write_text(md)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
