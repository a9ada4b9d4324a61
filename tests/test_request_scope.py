"""Every request ends in an answer that can be traced. Fault injection: a handler that raises
is a 500 in our envelope, counted by its route's metrics, with its x-request-id, and its
traceback's log line carries that id; a route outside the handlers' wrapper too. A handler
cancelled while its inputs wait on the engine (shutdown, an outer timeout) releases its
admission and cancels the engine call before it ends."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from embedserve.config import Settings
from embedserve.core.coalesce import Coalescer
from embedserve.gateway.app import create_app
from embedserve.logs import JsonFormatter
from embedserve.model_info import ModelInfo
from tests.asgi_post import post_and_stay
from tests.conftest import metric
from tests.fake_engine import FakeEngine, HttpxEngineClient
from tests.test_gateway_unit import MODEL, wait_ready

RID = "trace-me-42"


def gateway_settings() -> Settings:
    return Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"request_timeout_s": 30.0, "batch_max_wait_ms": 0, "accept_token_ids": True},
        health={"sample_interval_s": 60},
        _env_file=None,
    )


def gateway(engine: FakeEngine) -> Any:
    client = HttpxEngineClient(httpx.ASGITransport(app=engine.app()))
    return create_app(gateway_settings(), engine_client=client)


class Lines(logging.Handler):
    """Log lines as production writes them (JSON, formatted when logged: the request id is
    the one current then)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture()
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("embedserve")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.fixture()
def client() -> Iterator[TestClient]:
    with TestClient(gateway(FakeEngine()), raise_server_exceptions=False) as c:
        wait_ready(c)
        yield c


async def broken_embed(self: Coalescer, inputs: list[list[int]], priority: int = 0) -> Any:
    raise ZeroDivisionError("injected")


ROUTES = [  # path, body, the status counter and its labels
    ("/v1/embeddings", {"model": MODEL, "input": "hello"}, "embedserve_requests_total", {}),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]}, "embedserve_score_requests_total",
     {"route": "rerank"}),
    ("/v1/score", {"model": MODEL, "text_1": "q", "text_2": ["d"]}, "embedserve_score_requests_total",
     {"route": "score"}),
]


@pytest.mark.parametrize(("path", "body", "counter", "labels"), ROUTES, ids=[r[0] for r in ROUTES])
def test_a_handler_that_raises_is_a_counted_traceable_500(
    path: str, body: dict[str, Any], counter: str, labels: dict[str, str],
    client: TestClient, lines: Lines, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Coalescer, "embed", broken_embed)
    r = client.post(path, json=body, headers={"x-request-id": RID})
    assert r.status_code == 500 and r.headers["x-request-id"] == RID
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error" and RID in err["message"]
    assert metric(client.get("/metrics").text, counter, **labels, status="500") == 1
    (line,) = [x for x in lines.lines if x["msg"] == "request failed"]
    assert line["request_id"] == RID and line["path"] == path and "ZeroDivisionError: injected" in line["exc"]
    monkeypatch.undo()  # and the route still serves
    assert client.post(path, json=body).status_code == 200


def test_a_route_outside_the_wrapper_that_raises_is_a_traceable_500(
    client: TestClient, lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: ModelInfo, name: str) -> bool:
        raise KeyError("injected")

    monkeypatch.setattr(ModelInfo, "serves", broken)
    r = client.get(f"/v1/models/{MODEL}", headers={"x-request-id": RID})
    assert r.status_code == 500 and r.headers["x-request-id"] == RID
    assert r.json()["error"]["code"] == "internal_error"
    (line,) = [x for x in lines.lines if x["msg"] == "request failed"]
    assert line["request_id"] == RID and "KeyError" in line["exc"]


def test_a_cancelled_handler_releases_its_admission_and_its_engine_call() -> None:
    """The handler's task cancelled while its inputs are at the engine, as a shutdown or an
    outer timeout cancels it: the cancellation propagates, and by then nothing is held."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)  # the engine holds every call until the test opens it
    app = gateway(engine)
    runtime = app.state.runtimes[0]
    body = orjson.dumps({"model": MODEL, "input": [[5, 6, 7]]})

    async def go() -> tuple[bool, int, int]:
        async with app.router.lifespan_context(app):
            while not runtime.pool.any_ready:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            handler = asyncio.create_task(post_and_stay(app, "/v1/embeddings", body))
            while not engine.calls:  # noqa: ASYNC110  (the fake engine runs on this loop)
                await asyncio.sleep(0.01)
            held = runtime.admission.in_flight
            handler.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handler
            left = runtime.admission.in_flight
            for _ in range(100):  # the call's own task notes its cancellation in a turn or two
                if runtime.coalescer.stats.cancelled_calls:
                    break
                await asyncio.sleep(0)
            calls = runtime.coalescer.stats.cancelled_calls
            gate.set()
        return held > 0, left, calls

    held, left, cancelled_calls = asyncio.run(go())
    assert held and left == 0
    assert cancelled_calls == 1  # nobody waits for the rows: the engine call is cancelled too
