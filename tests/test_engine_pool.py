"""EnginePool routing: each call goes to the ready engine with the fewest outstanding
tokens (then the fewest outstanding calls), not round-robin."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import orjson
import pytest

from embedserve.contracts.wire import EngineRequest, encode_response
from embedserve.upstream.pool import EnginePool, EngineUnavailable

A, B, C = "http://a", "http://b", "http://c"


class GatedClient:
    """Engine calls that wait until the test releases them; records where each went."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []  # (engine, tokens)
        self.release = asyncio.Event()

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes]:
        req = EngineRequest.model_validate(orjson.loads(body))
        batch = req.batch()
        self.sent.append((url.removesuffix("/v1/embeddings"), sum(map(len, batch))))
        await self.release.wait()
        return 200, encode_response(req.model, np.ones((len(batch), 4), np.float32), 1, False)

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        return 200, b""

    async def aclose(self) -> None:
        pass


def _pool(urls: list[str], client: GatedClient) -> EnginePool:
    pool = EnginePool(urls, "m", request_timeout_s=10, client=client)
    for e in pool.engines:
        e.ready = True
    return pool


def test_pick_prefers_fewest_outstanding_tokens_then_calls() -> None:
    pool = _pool([A, B, C], GatedClient())
    a, b, c = pool.engines
    a.outstanding_tokens, b.outstanding_tokens, c.outstanding_tokens = 500, 20, 300
    assert pool._pick() is b
    b.outstanding_tokens = 300  # tie on tokens with c: fewer calls wins
    b.outstanding_calls, c.outstanding_calls = 3, 1
    assert pool._pick() is c
    c.ready = False  # only ready engines count, however idle
    c.outstanding_tokens = 0
    assert pool._pick() is b
    for e in pool.engines:
        e.ready = False
    with pytest.raises(EngineUnavailable):
        pool._pick()


def test_small_calls_avoid_the_engine_busy_with_a_long_one() -> None:
    """One 1000-token call on an engine, then three 10-token calls: round-robin would put
    the second small call on the busy engine; least-outstanding-tokens puts them all on
    the other until its load passes the long call's."""

    async def run() -> list[tuple[str, int]]:
        client = GatedClient()
        pool = _pool([A, B], client)
        calls = [asyncio.create_task(pool.embed([list(range(1000))]))]
        await asyncio.sleep(0)
        calls += [asyncio.create_task(pool.embed([[1] * 10])) for _ in range(3)]
        await asyncio.sleep(0)
        assert [e.outstanding_tokens for e in pool.engines] == [1000, 30]
        client.release.set()
        results = await asyncio.gather(*calls)
        assert all(r.shape == (1, 4) for r in results)
        assert [e.outstanding_tokens for e in pool.engines] == [0, 0]
        return client.sent

    assert asyncio.run(run()) == [(A, 1000), (B, 10), (B, 10), (B, 10)]


class FlakyHealthClient(GatedClient):
    """Health checks that fail while ``down`` is set (connection refused, as at start-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        from embedserve.upstream.client import CallFailed

        if self.down:
            raise CallFailed("ClientConnectorError")
        return 200, b""


def test_a_starting_engine_leaves_no_error_and_a_later_failure_is_dated() -> None:
    """A ready engine must not report the connection refused of its start-up forever; a
    failure after it served is kept, with its time, after it recovers."""
    import time

    client = FlakyHealthClient()
    pool = EnginePool([A], "m", request_timeout_s=10, client=client)

    async def check() -> None:
        await pool.check_once()

    asyncio.run(check())  # still starting: refused
    (status,) = pool.statuses()
    assert not status.ready and status.last_error == "" and status.last_error_at is None
    assert "unreachable" in pool.detail()
    client.down = False
    asyncio.run(check())
    (status,) = pool.statuses()
    assert status.ready and status.last_error == "" and pool.detail() == f"{A}: ready"
    client.down = True
    before = time.time()
    asyncio.run(check())  # a real failure, after it served
    client.down = False
    asyncio.run(check())
    (status,) = pool.statuses()
    assert status.ready and "unreachable" in status.last_error
    assert status.last_error_at is not None and before <= status.last_error_at <= time.time()


class BrokenCountersClient(GatedClient):
    """Health answers 200 but reading the engine's counters hits a bug, ``fails`` times."""

    def __init__(self, fails: int) -> None:
        super().__init__()
        self.fails = fails

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        if url.endswith("/metrics") and self.fails:
            self.fails -= 1
            raise KeyError("injected")
        return 200, b""


def test_a_failing_health_check_is_logged_with_its_engine_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> None:
        pool = EnginePool([A, B], "m", request_timeout_s=10, client=BrokenCountersClient(fails=1),
                          health_interval_s=0.01)
        await pool.start()
        for _ in range(200):
            if all(e.ready for e in pool.engines):
                break
            await asyncio.sleep(0.01)
        await pool.stop()
        assert all(e.ready for e in pool.engines)  # the other engine's check counted, then both

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    failed = [r for r in caplog.records if r.getMessage() == "engine health check failed"]
    assert len(failed) == 1 and failed[0].exc_info
    assert getattr(failed[0], "engine", None) in (A, B) and getattr(failed[0], "model", None) == "m"


def test_an_engine_that_left_the_pool_is_no_error() -> None:
    pool = _pool([A], GatedClient())
    pool.remove(A)
    assert pool.by_url(A) is None
    pool.forget_stuck(A)  # the watchdog's step for an engine being replaced
    pool.remove(A)


def test_a_warmed_engine_takes_calls_before_the_next_health_check() -> None:
    """`up` announces the stack once every engine answered its warm-up call; routing must not
    wait for the health loop (seconds later) to send work to the second engine."""
    pool = EnginePool([A, B], "m", request_timeout_s=10, client=GatedClient())
    a, b = pool.engines
    a.ready = True  # the health loop saw the first engine only
    a.outstanding_tokens = 100
    assert pool._pick() is a
    pool.warmed(B, 4096, 0.5)
    assert b.ready and b.ever_ready and pool._pick() is b
    assert b.throughput.tokens_per_s() == pytest.approx(8192)
    pool.warmed("http://gone", 1, 1.0)  # an engine that left the pool meanwhile: nothing to do
