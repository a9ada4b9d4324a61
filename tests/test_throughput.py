"""The measured capacity behind the 413 for requests that cannot finish in time: tokens per
second of busy time, from large calls only, on an injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import pytest
from fastapi import FastAPI

from embedserve.config import Settings
from embedserve.gateway.app import create_app
from embedserve.upstream.throughput import Throughput
from tests.fake_engine import FakeEngine, HttpxEngineClient

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_busy_time_not_wall_time() -> None:
    clock = Clock()
    tp = Throughput(min_tokens=100, half_life_s=1e9, clock=clock)
    assert tp.tokens_per_s() is None
    tp.started(1000)
    clock.t += 0.5
    tp.finished(1000, ok=True)
    clock.t += 100.0  # idle: no busy time
    tp.started(1000)
    tp.started(1000)  # two in flight at once: the engine pipelines them
    clock.t += 0.5
    tp.finished(1000, ok=True)
    tp.finished(1000, ok=True)
    assert tp.tokens_per_s() == pytest.approx(3000 / 1.0)


def test_small_calls_do_not_make_the_engine_look_slow() -> None:
    clock = Clock()
    tp = Throughput(min_tokens=100, half_life_s=1e9, clock=clock)
    tp.record(16_384, 0.25)  # the warm-up: one full batch
    for _ in range(50):  # light load: single short inputs, mostly fixed per-call time
        tp.started(8)
        clock.t += 0.01
        tp.finished(8, ok=True)
    assert tp.tokens_per_s() == pytest.approx(16_384 / 0.25)


def test_failed_calls_show_nothing_and_old_figures_fade_with_busy_time() -> None:
    clock = Clock()
    tp = Throughput(min_tokens=1, half_life_s=10.0, clock=clock)
    tp.record(1000, 1.0)
    tp.started(1000)
    clock.t += 1.0
    tp.finished(1000, ok=False)  # a failure or a cancelled call measures nothing of the rate
    assert tp.tokens_per_s() == pytest.approx(1000.0)
    tp.started(500)
    clock.t += 1.0
    tp.finished(500, ok=True)  # the older second decays by one busy second of ten
    assert tp.tokens_per_s() == pytest.approx((1000 * 0.5**0.1 + 500) / (1.0 * 0.5**0.1 + 1.0))


def test_an_idle_hour_keeps_what_the_engine_showed() -> None:
    """The morning after a quiet night: the estimate the last busy minutes left stands, and
    a call in flight is not work that embedded nothing."""
    clock = Clock()
    tp = Throughput(min_tokens=100, half_life_s=60.0, clock=clock)
    for _ in range(20):  # an evening's traffic: 2,000 tokens/s
        tp.started(1000)
        clock.t += 0.5
        tp.finished(1000, ok=True)
    before = tp.tokens_per_s()
    assert before == pytest.approx(2000.0)
    clock.t += 3600.0  # an idle hour
    assert tp.tokens_per_s() == pytest.approx(before)
    tp.started(1000)  # the next burst's first call, still running
    clock.t += 0.4
    assert tp.tokens_per_s() == pytest.approx(before)
    tp.started(1000)
    clock.t += 0.4
    tp.finished(1000, ok=True)  # 0.8 s busy since the burst began, for the first call
    tp.finished(1000, ok=True)  # the second ends at the same instant: no more busy time
    # the evening's tokens and busy seconds, each call's decayed by the busy time after it
    tokens = sum(1000 * 0.5 ** (0.5 * k / 60) for k in range(20))
    seconds = sum(0.5 * 0.5 ** (0.5 * k / 60) for k in range(20))
    decay = 0.5 ** (0.8 / 60)
    assert tp.tokens_per_s() == pytest.approx((tokens * decay + 2000) / (seconds * decay + 0.8))


def test_a_measurement_is_not_made_up() -> None:
    clock = Clock()
    tp = Throughput(min_tokens=1, clock=clock)
    tp.started(1000)
    clock.t += 5.0
    assert tp.tokens_per_s() is None  # in flight: nothing measured yet
    tp.finished(1000, ok=False)
    assert tp.tokens_per_s() is None


class SlowEngineClient:
    """The fake engine behind a call that takes ``call_s`` of the injected clock, with the call
    in flight long enough (real time) for the other requests of a burst to be judged meanwhile."""

    def __init__(self, clock: Clock, call_s: float) -> None:
        self.inner = HttpxEngineClient(httpx.ASGITransport(app=FakeEngine().app()))
        self.clock, self.call_s = clock, call_s

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes]:
        self.clock.t += self.call_s
        await asyncio.sleep(0.1)
        return await self.inner.post_json(url, body)

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        return await self.inner.get(url, timeout_s)

    async def aclose(self) -> None:
        await self.inner.aclose()


def gateway_app(clock: Clock) -> FastAPI:
    """A gateway over the slow fake engine, the engines' estimate on ``clock``; one call holds
    512 tokens and the deadline is 30 s."""
    settings = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"request_timeout_s": 30.0, "accept_token_ids": True, "max_tokens_per_engine_call": 512},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    app = create_app(settings, engine_client=SlowEngineClient(clock, call_s=0.05))
    for engine in app.state.pool.engines:
        engine.throughput = Throughput(min_tokens=128, clock=clock)
    return app


async def serve(app: FastAPI, requests: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
            while not app.state.pool.any_ready:  # noqa: ASYNC110  (the pool exposes a flag)
                await asyncio.sleep(0.01)
            return await requests(client)


def ids_body(inputs: int, tokens: int = 250) -> dict[str, object]:
    return {"model": "all-MiniLM-L6-v2", "input": [[7 + i] * tokens for i in range(inputs)]}


def test_a_burst_after_an_idle_hour_is_served_through_the_gateway() -> None:
    """Eight concurrent requests of several engine calls each, an hour after the last
    traffic: every one is admitted (200), none refused with 413."""
    clock = Clock()
    app = gateway_app(clock)
    body = ids_body(8)  # 2,000 tokens: four engine calls

    async def send(client: httpx.AsyncClient, after_s: float) -> int:
        await asyncio.sleep(after_s)
        return (await client.post("/v1/embeddings", json=body)).status_code

    async def burst(client: httpx.AsyncClient) -> list[int]:
        # the first request's calls are in flight when the others arrive
        return list(await asyncio.gather(send(client, 0.0), *(send(client, 0.03) for _ in range(7))))

    async def evening_then_morning(client: httpx.AsyncClient) -> tuple[list[int], list[int]]:
        evening = await burst(client)
        assert app.state.pool.tokens_per_s() is not None
        clock.t += 3600.0
        return evening, await burst(client)

    evening, morning = asyncio.run(serve(app, evening_then_morning))
    assert evening == [200] * 8
    assert morning == [200] * 8


def test_the_refusal_is_sane_whatever_the_estimate() -> None:
    """An engine measured at 0.1 tokens/s: a request that fits one engine call is still
    served, and a larger one is told to send one call's worth, not "at most 1 tokens"."""
    clock = Clock()
    app = gateway_app(clock)
    for engine in app.state.pool.engines:
        engine.throughput.record(10, 100.0)

    async def two(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        small = await client.post("/v1/embeddings", json=ids_body(2))  # 500 tokens: one call
        large = await client.post("/v1/embeddings", json=ids_body(8))  # 2,000 tokens
        return small, large

    small, large = asyncio.run(serve(app, two))
    assert small.status_code == 200, small.text
    assert large.status_code == 413, large.text
    err = large.json()["error"]
    assert err["code"] == "request_exceeds_capacity"
    assert "Send at most 512 tokens per request" in err["message"]
