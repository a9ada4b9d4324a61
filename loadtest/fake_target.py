"""A small fake OpenAI-compatible embeddings server that counts what it sees.

For tests and for trying the load generator without a model::

    python -m embedserve.loadtest.fake_target --port 8099 --tokenizer MODEL_DIR

It answers ``POST /v1/embeddings`` (texts or token ids), ``GET /v1/models`` and, unless
disabled, ``GET /health/memory`` (a fake, slowly growing figure) and ``GET /metrics``
(SGLang's prompt and cached token counters, from a simulated prefix cache); it can inject
503s, 429s with Retry-After, and latency.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from embedserve.contracts.memory import MemoryReport, ProcessMemory, ResourceForecast


def fake_report(host_bytes: int) -> MemoryReport:
    """A /health/memory report with a fixed forecast and the given host memory."""
    limit = 8 << 30
    host = ResourceForecast(
        resource="host", status="growing", used_bytes=host_bytes, limit_bytes=limit,
        limit_source="fake", headroom_bytes=limit - host_bytes, peak_bytes=host_bytes,
        slope_bytes_per_hour=None, slope_low_bytes_per_hour=None, slope_high_bytes_per_hour=None,
        window_start=None, window_s=0.0, samples=0, estimated_hours_until_oom=100.0,
        hours_lower=80.0, hours_upper=130.0, capped=False, reason="fake",
    )
    return MemoryReport(
        status="ok", recommends_restart=False, binding_resource="host",
        estimated_hours_until_oom=100.0, hours_lower=80.0, hours_upper=130.0, reason="fake",
        resources={"host": host},
        processes={"engine": ProcessMemory(name="engine", pid=0, rss_bytes=host_bytes // 2)},
    )


@dataclass
class FakeConfig:
    """Behaviour knobs."""

    dim: int = 8
    fail_every: int = 0  # every N-th request gets a 503
    throttle_every: int = 0  # every N-th request gets a 429
    retry_after_s: float = 0.2
    delay_s: float = 0.0
    delay_per_token_s: float = 0.0
    health_memory: bool = True
    host_growth_bytes_per_s: float = 0.0
    redirect_to: str | None = None  # answer every POST with a 307 to this URL
    metrics: bool = True  # GET /metrics: SGLang's prompt/cached token counters
    prefix_cache_tokens: int = 65_536  # the simulated prefix cache's size (0: no cache)
    max_seq_len: int | None = None  # advertised in /v1/models; longer inputs are truncated


class PrefixCache:
    """A server's prefix cache, simulated: every prefix of every input is a key (a chained
    hash), least recently used first out, one token per key. A path is touched longest
    first, so a shared prefix stays more recent than the tails hanging off it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def serve(self, tokens: Sequence[Any]) -> int:
        """Leading tokens already cached; then cache them all."""
        keys, h = [], 0
        for t in tokens:
            h = hash((h, t))
            keys.append(h)
        hit = 0
        while hit < len(keys) and keys[hit] in self._keys:
            hit += 1
        if self.capacity <= 0:
            return 0
        for k in reversed(keys):
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return hit


@dataclass
class Counters:
    """What the server saw (all POSTs, whatever the answer)."""

    requests: int = 0
    ok: int = 0
    failed_503: int = 0
    throttled_429: int = 0
    inputs: int = 0
    tokens: int = 0
    tokens_ok: int = 0
    health_calls: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0  # embeddings requests answered at once (counted when a delay applies)
    prompt_tokens: int = 0  # as SGLang counts them: answered requests only
    cached_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def create_app(cfg: FakeConfig, counters: Counters, tokenizer: Any = None) -> Starlette:
    """The app; ``tokenizer`` (a ``tokenizers.Tokenizer``) counts text inputs, else words."""
    started = time.time()
    cache = PrefixCache(cfg.prefix_cache_tokens)

    def tokens_of(item: Any) -> list[Any]:
        if isinstance(item, list):
            return item
        if tokenizer is not None:
            return list(tokenizer.encode(str(item)).ids)
        return str(item).split()

    def count(item: Any) -> int:
        return len(tokens_of(item))

    async def embeddings(request: Request) -> Response:
        body = await request.json()
        raw = body.get("input")
        items = raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]
        tokens = sum(count(x) for x in items)
        with counters.lock:
            counters.requests += 1
            n = counters.requests
            counters.inputs += len(items)
            counters.tokens += tokens
        if cfg.redirect_to:
            return Response(status_code=307, headers={"Location": cfg.redirect_to})
        if cfg.fail_every and n % cfg.fail_every == 0:
            with counters.lock:
                counters.failed_503 += 1
            return JSONResponse({"error": {"message": "injected", "type": "server_error",
                                           "param": None, "code": 503}}, status_code=503)
        if cfg.throttle_every and n % cfg.throttle_every == 0:
            with counters.lock:
                counters.throttled_429 += 1
            return JSONResponse({"error": {"message": "busy", "type": "rate_limit_error",
                                           "param": None, "code": 429}}, status_code=429,
                                headers={"Retry-After": f"{cfg.retry_after_s:g}"})
        delay = cfg.delay_s + cfg.delay_per_token_s * tokens
        if delay:
            with counters.lock:
                counters.in_flight += 1
                counters.peak_in_flight = max(counters.peak_in_flight, counters.in_flight)
            try:
                await asyncio.sleep(delay)
            finally:
                with counters.lock:
                    counters.in_flight -= 1
        rng = random.Random(n)
        data = [{"object": "embedding", "index": i,
                 "embedding": [rng.random() for _ in range(cfg.dim)]} for i in range(len(items))]
        embedded = sum(min(count(x), cfg.max_seq_len or count(x)) for x in items)
        with counters.lock:
            counters.ok += 1
            counters.tokens_ok += tokens
            counters.prompt_tokens += embedded
            counters.cached_tokens += sum(cache.serve(tokens_of(x)) for x in items)
        return JSONResponse({"object": "list", "data": data, "model": body.get("model"),
                             "usage": {"prompt_tokens": embedded, "total_tokens": embedded}})

    async def models(request: Request) -> Response:
        card: dict[str, Any] = {"id": "fake-embed", "object": "model"}
        if cfg.max_seq_len:
            card["max_seq_len"] = cfg.max_seq_len
        return JSONResponse({"object": "list", "data": [card]})

    async def health_memory(request: Request) -> Response:
        if not cfg.health_memory:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        with counters.lock:
            counters.health_calls += 1
        age = time.time() - started
        host = (1 << 30) + int(cfg.host_growth_bytes_per_s * age)
        return Response(fake_report(host).model_dump_json(), media_type="application/json")

    async def metrics(request: Request) -> Response:
        if not cfg.metrics:
            return Response("not found", status_code=404)
        with counters.lock:
            prompt, cached = counters.prompt_tokens, counters.cached_tokens
            seen = counters.requests
        model = 'model_name="fake-embed"'
        text = (
            "# HELP fake_requests_seen Requests answered so far (a gauge for --gauge).\n"
            "# TYPE fake_requests_seen gauge\n"
            f"fake_requests_seen {float(seen)}\n"
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n"
            "# TYPE sglang:prompt_tokens_total counter\n"
            f'sglang:prompt_tokens_total{{{model},is_streaming="false"}} {float(prompt)}\n'
            "# HELP sglang:cached_tokens_total Number of cached prompt tokens by source.\n"
            "# TYPE sglang:cached_tokens_total counter\n"
            f'sglang:cached_tokens_total{{{model},cache_source="device"}} {float(cached)}\n'
        )
        return Response(text, media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health/memory", health_memory),
        Route("/metrics", metrics),
    ])


class FakeServer:
    """Runs the app with uvicorn on 127.0.0.1 in a thread (random free port by default)."""

    def __init__(self, cfg: FakeConfig | None = None, tokenizer: Any = None,
                 port: int = 0) -> None:
        import uvicorn

        self.cfg = cfg or FakeConfig()
        self.counters = Counters()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        app = create_app(self.cfg, self.counters, tokenizer)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embedserve.loadtest.fake_target", description=__doc__)
    ap.add_argument("--port", type=int, default=8099)
    ap.add_argument("--tokenizer")
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--throttle-every", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.0)
    a = ap.parse_args(argv)
    tok = None
    if a.tokenizer:
        from embedserve.loadtest.textbuild import load_tokenizer

        tok = load_tokenizer(a.tokenizer)
    cfg = FakeConfig(fail_every=a.fail_every, throttle_every=a.throttle_every, delay_s=a.delay)
    with FakeServer(cfg, tok, a.port) as srv:
        print(f"fake target on {srv.url}", flush=True)
        try:
            while srv.thread.is_alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
