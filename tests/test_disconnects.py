"""Clients that hang up before the answer: their queued inputs never reach the engine, the
counter says so, nothing is left behind (queue, tokens in flight), and nothing is logged
above INFO. Real sockets and production's HTTP protocol (uvicorn with the bounded httptools
parser, in a thread) over a gated fake engine, so each step waits for a state, not a time."""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from embedserve.config import Settings
from embedserve.gateway.app import create_app
from embedserve.http_server import bounded_httptools
from tests.conftest import free_port, metric, metric_samples, wait_until
from tests.fake_engine import FakeEngine, HttpxEngineClient

MODEL = "all-MiniLM-L6-v2"


@dataclass
class Served:
    url: str
    host: str
    port: int
    engine: FakeEngine
    gate: threading.Event
    app: Any
    server: uvicorn.Server
    settings: Settings


@pytest.fixture()
def served() -> Iterator[Served]:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)  # engine calls wait until the test opens the gate
    settings = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"request_timeout_s": 60.0, "batch_max_wait_ms": 0, "accept_token_ids": True},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    app = create_app(settings, engine_client=HttpxEngineClient(httpx.ASGITransport(app=engine.app())))
    port = free_port()
    protocol = bounded_httptools(settings.gateway.max_head_bytes)  # as embedserve.runtime.stack runs it
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, http=protocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: server.started and app.state.pool.any_ready, timeout=10, interval=0.02)
    yield Served(url, "127.0.0.1", port, engine, gate, app, server, settings)
    gate.set()
    server.should_exit = True
    thread.join(10)


def _request(body: bytes) -> bytes:
    return (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


def _metric(url: str, name: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, name)


def _open_requests(s: Served) -> int:
    """Requests the server is running the app for (uvicorn's own count)."""
    return len(s.server.server_state.tasks)


def test_abandoned_requests_are_dropped_before_the_engine(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    s, engine, app = served, served.engine, served.app
    sent, slots = 40, s.settings.engine_calls("external")  # engine calls the coalescer keeps
    with caplog.at_level(logging.INFO), concurrent.futures.ThreadPoolExecutor(slots) as pool:
        blockers = []
        for i in range(slots):  # one at a time, so each takes an engine slot of its own
            body = {"model": MODEL, "input": [[5, i]]}
            blockers.append(pool.submit(httpx.post, f"{s.url}/v1/embeddings", json=body, timeout=60))
            wait_until(lambda n=i + 1: len(engine.calls) >= n, timeout=10, interval=0.005)
        # every engine slot is held: these queue in the gateway, then their clients hang up
        clients = [socket.create_connection((s.host, s.port)) for _ in range(sent)]
        try:
            for i, sock in enumerate(clients):
                sock.sendall(_request(orjson.dumps({"model": MODEL, "input": [[1000 + i, 7]]})))
            wait_until(lambda: app.state.coalescer.queued_inputs == sent, timeout=30, interval=0.01)
        finally:
            for sock in clients:
                sock.close()
        wait_until(lambda: _metric(s.url, "embedserve_client_disconnects_total") >= sent, timeout=30)
        assert len(engine.calls) == slots  # nothing new reached the engine meanwhile
        s.gate.set()
        assert [b.result().status_code for b in blockers] == [200] * slots
    wait_until(lambda: app.state.coalescer.queued_inputs == 0 and _open_requests(s) == 0, timeout=30)
    abandoned_seen = sum(1 for call in engine.calls for ids in call if ids[0] >= 1000)
    assert abandoned_seen == 0, f"the engine embedded {abandoned_seen} of {sent} abandoned inputs"
    assert app.state.coalescer.stats.dropped_abandoned == sent
    assert _metric(s.url, "embedserve_tokens_in_flight") == 0
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy][:5]
    # and the gateway still serves
    r = httpx.post(f"{s.url}/v1/embeddings", json={"model": MODEL, "input": [[1, 2, 3]]}, timeout=30)
    assert r.status_code == 200


def test_disconnect_mid_upload_is_counted_not_an_error(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    s = served
    before = _metric(s.url, "embedserve_client_disconnects_total")
    partial = _request(b"x" * 1000)[: -1000] + b'{"model": "' + MODEL.encode() + b'", "input": "ab'
    with caplog.at_level(logging.INFO):
        clients = [socket.create_connection((s.host, s.port)) for _ in range(3)]
        try:
            for sock in clients:
                sock.sendall(partial)  # the head and part of a 1000-byte body
            wait_until(lambda: _open_requests(s) == 3, timeout=30, interval=0.01)  # reading the bodies
        finally:
            for sock in clients:
                sock.close()
        wait_until(lambda: _metric(s.url, "embedserve_client_disconnects_total") >= before + 3, timeout=30)
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy][:5]
    samples = metric_samples(httpx.get(f"{s.url}/metrics").text)
    errors = [k for k in samples if k[0] == "embedserve_requests_total" and ("status", "500") in k[1]]
    assert not errors, errors
    assert not s.engine.calls
