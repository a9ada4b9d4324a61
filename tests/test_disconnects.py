"""Clients that hang up before the answer: their queued inputs never reach the engine, the
counter says so, nothing is left behind (queue, tokens in flight), and nothing is logged
above INFO. Real sockets (uvicorn in a thread) over the fake engine, so it runs in seconds."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from embedserve.config import Settings
from embedserve.gateway.app import create_app
from tests.conftest import free_port, wait_until
from tests.fake_engine import FakeEngine, HttpxEngineClient

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture()
def served() -> Iterator[tuple[str, FakeEngine, Any]]:
    engine = FakeEngine(delay_s=2.5)  # slow: everything sent meanwhile queues behind the blockers
    settings = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"request_timeout_s": 10.0, "batch_max_wait_ms": 0, "accept_token_ids": True},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    app = create_app(settings, engine_client=HttpxEngineClient(httpx.ASGITransport(app=engine.app())))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, http="h11"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: server.started and app.state.pool.any_ready, timeout=10, interval=0.02)
    yield url, engine, app
    server.should_exit = True
    thread.join(10)


async def _abandon_all(url: str, n: int) -> None:
    """``n`` clients, each on its own connection, giving up after 0.5 s (one client
    object: building 40 would take seconds of TLS-context set-up on a slow machine)."""
    async with httpx.AsyncClient(timeout=0.5, limits=httpx.Limits(max_connections=n)) as c:

        async def one(i: int) -> None:
            with contextlib.suppress(httpx.TimeoutException):
                await c.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": [[1000 + i, 7]]})

        await asyncio.gather(*(one(i) for i in range(n)))


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[-1])


def test_abandoned_requests_are_dropped_before_the_engine(
    served: tuple[str, FakeEngine, Any], caplog: pytest.LogCaptureFixture
) -> None:
    url, engine, app = served
    sent, slots = 40, 8  # the coalescer keeps 8 engine calls in flight
    with caplog.at_level(logging.INFO), concurrent.futures.ThreadPoolExecutor(sent + slots) as pool:
        blockers = []
        for i in range(slots):  # one at a time, so each takes an engine slot of its own
            body = {"model": MODEL, "input": [[5, i]]}
            blockers.append(pool.submit(httpx.post, f"{url}/v1/embeddings", json=body, timeout=10))
            wait_until(lambda n=i + 1: len(engine.calls) >= n, timeout=5, interval=0.005)
        asyncio.run(_abandon_all(url, sent))
        wait_until(lambda: _metric(url, "embedserve_client_disconnects_total") >= sent, timeout=10)
        assert all(b.result().status_code == 200 for b in blockers)
    wait_until(lambda: app.state.coalescer.queued_inputs == 0, timeout=5)
    time.sleep(0.2)
    abandoned_seen = sum(1 for call in engine.calls for ids in call if ids[0] >= 1000)
    assert abandoned_seen <= 2, f"the engine embedded {abandoned_seen} of {sent} abandoned inputs"
    assert app.state.coalescer.stats.dropped_abandoned >= sent - abandoned_seen
    assert _metric(url, "embedserve_tokens_in_flight") == 0
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy][:5]
    # and the gateway still serves
    r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": [[1, 2, 3]]}, timeout=10)
    assert r.status_code == 200


def test_disconnect_mid_upload_is_counted_not_an_error(
    served: tuple[str, FakeEngine, Any], caplog: pytest.LogCaptureFixture
) -> None:
    url, engine, _ = served
    host, port = url.removeprefix("http://").split(":")
    before = _metric(url, "embedserve_client_disconnects_total")
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(
                    b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 1000\r\n\r\n{"model": "' + MODEL.encode() + b'", "input": "ab'
                )
                time.sleep(0.1)
        wait_until(lambda: _metric(url, "embedserve_client_disconnects_total") >= before + 3, timeout=5)
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy][:5]
    assert 'embedserve_requests_total{status="500"}' not in httpx.get(f"{url}/metrics").text
    assert not engine.calls
