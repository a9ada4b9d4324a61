"""Request priority in the coalescer: the most urgent waiting work goes first, less urgent work
ages into the urgent turns instead of starving, and a simulated run (an injected clock, an engine
whose calls cost simulated time) keeps interactive requests' P95 flat while a bulk client
saturates the engine, and the bulk client finishes. Timed targets live in
``bench/priority.py``; nothing here sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from fastapi.testclient import TestClient

from embedserve.contracts.wire import Matrix
from embedserve.core.coalesce import Coalescer
from embedserve.gateway.priority import priority_label
from tests.fake_engine import FakeEngine
from tests.test_coalesce import SteppedEngine, settle
from tests.test_gateway_unit import make_client, wait_ready
from tests.test_throughput import Clock


def test_the_most_urgent_request_goes_first() -> None:
    async def go(urgent: int) -> list[list[list[int]]]:
        engine = SteppedEngine()
        c = Coalescer(engine.embed, token_budget=4, max_wait_s=0, max_concurrent_calls=1)
        await c.start()
        bulk = [asyncio.create_task(c.embed([[1]] * 4, priority=10)) for _ in range(8)]
        await settle()  # the first call is with the engine
        small = asyncio.create_task(c.embed([[2]], priority=urgent))
        await settle()
        engine.release.release()
        await settle()
        for _ in range(40):
            engine.release.release()
            await settle()
        assert small.done() and all(b.done() for b in bulk)
        await c.stop()
        return engine.calls

    calls = asyncio.run(go(urgent=0))
    assert calls[1] == [[2]]  # ahead of the eight bulk requests waiting, and alone in its call
    same = asyncio.run(go(urgent=10))
    assert [2] not in same[1]  # at the same priority it waits for its turn behind them


def test_less_urgent_work_ages_into_the_urgent_turns() -> None:
    """Urgent requests keep the engine busy: the bulk request gets nothing until it has waited
    ``aging_s``, then one input per turn among them."""

    async def go() -> tuple[list[list[list[int]]], int, int]:
        engine = SteppedEngine()
        clock = Clock()
        aged: list[int] = []
        c = Coalescer(engine.embed, token_budget=2, max_wait_s=0, max_concurrent_calls=1,
                      aging_s=5.0, on_aged=lambda: aged.append(1), clock=clock)
        await c.start()
        urgent = [asyncio.create_task(c.embed([[2]] * 2)) for _ in range(2)]
        await settle()
        bulk = asyncio.create_task(c.embed([[9]] * 2, priority=3))
        for _ in range(20):  # 4 s of urgent work, always more waiting
            urgent.append(asyncio.create_task(c.embed([[2]] * 2)))
            await settle()
            clock.t += 0.2
            engine.release.release()
            await settle()
        served_before = sum(ids == [9] for call in engine.calls for ids in call)
        clock.t += 1.0  # past the bound
        while not bulk.done():
            urgent.append(asyncio.create_task(c.embed([[2]] * 2)))
            await settle()
            engine.release.release()
            await settle()
        while not all(u.done() for u in urgent):
            engine.release.release()
            await settle()
        await c.stop()
        assert c.stats.aged == 1
        return engine.calls, served_before, len(aged)

    calls, served_before, aged = asyncio.run(go())
    assert served_before == 0  # delayed while urgent work waited ...
    assert aged == 1  # ... and then served, counted once in the metrics
    assert calls[-1] == [[2], [2]]  # the urgent work still went on beside it


@dataclass
class Run:
    interactive_s: list[float] = field(default_factory=list)
    bulk_done: int = 0
    calls: int = 0


class TimedEngine:
    """An engine whose calls take simulated time: ``fixed_s`` plus ``per_token_s`` a token."""

    def __init__(self, fixed_s: float, per_token_s: float) -> None:
        self.fixed_s, self.per_token_s = fixed_s, per_token_s
        self.waiting: list[tuple[list[list[int]], asyncio.Future[None]]] = []

    async def embed(self, batch: list[list[int]]) -> Matrix:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append((batch, done))
        await done
        return np.ones((len(batch), 2), dtype=np.float32)

    def cost(self, batch: list[list[int]]) -> float:
        return self.fixed_s + self.per_token_s * sum(map(len, batch))


BUDGET = 512  # the CPU engine's default call
FIXED_S, PER_TOKEN_S = 0.005, 0.0002  # ~0.1 s a full call: about the bundled model on two cores


async def _settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


def simulate(bulk_workers: int, bulk_priority: int) -> Run:
    """Interactive requests (one 16-token input, priority 0) every 0.5 s for 30 s, while
    ``bulk_workers`` closed-loop clients send requests of 8 inputs of 128 tokens back to back,
    about 40 s of the engine's work in all."""
    bulk_requests = -(-200 // bulk_workers) if bulk_workers else 0

    async def go() -> Run:
        clock = Clock()
        engine = TimedEngine(FIXED_S, PER_TOKEN_S)
        c = Coalescer(engine.embed, token_budget=BUDGET, max_wait_s=0, max_concurrent_calls=1,
                      aging_s=30.0, clock=clock)
        await c.start()
        run = Run()

        async def interactive(sent: float) -> None:
            await c.embed([[3] * 16])
            run.interactive_s.append(clock.t - sent)

        async def bulk() -> None:
            for _ in range(bulk_requests):
                await c.embed([[4] * 128] * 8, priority=bulk_priority)
                run.bulk_done += 1

        tasks = [asyncio.create_task(bulk()) for _ in range(bulk_workers)]
        arrivals = [0.5 * i for i in range(1, 61)]
        while True:
            await _settle()
            done: asyncio.Future[None] | None = None
            if engine.waiting:
                batch, done = engine.waiting.pop(0)
                clock.t += engine.cost(batch)
                run.calls += 1
            elif not all(t.done() for t in tasks):
                raise AssertionError("a client waits, but no engine call is running")
            elif arrivals:
                clock.t = max(clock.t, arrivals[0])
            else:
                break
            while arrivals and arrivals[0] <= clock.t:  # arrived while the call ran
                tasks.append(asyncio.create_task(interactive(arrivals.pop(0))))
            await _settle()
            if done is not None:
                done.set_result(None)
        await c.stop()
        return run

    return asyncio.run(go())


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def test_a_priority_run_keeps_interactive_p95_flat_and_bulk_finishes() -> None:
    alone = simulate(bulk_workers=0, bulk_priority=10)
    full_call = FIXED_S + PER_TOKEN_S * BUDGET
    bound = p95(alone.interactive_s) + full_call  # the call running when it came, then its own
    for workers in (8, 32):
        run = simulate(bulk_workers=workers, bulk_priority=10)
        assert run.bulk_done == workers * -(-200 // workers)  # delayed, never starved
        assert p95(run.interactive_s) <= bound, (workers, p95(run.interactive_s), bound)
        assert len(run.interactive_s) == len(alone.interactive_s)
    # the same bulk client at the interactive requests' priority: they wait their turn behind it
    same = simulate(bulk_workers=32, bulk_priority=0)
    assert p95(same.interactive_s) > 3 * bound


def test_priority_labels_are_bounded() -> None:
    assert [priority_label(p) for p in (-1000, -3, 0, 7, 10**9)] == ["-10", "-3", "0", "7", "10"]


@pytest.fixture(scope="module")
def fake_gateway() -> Iterator[TestClient]:
    with make_client(FakeEngine()) as c:
        wait_ready(c)
        yield c


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "hi"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
        ("/rerank", {"query": "q", "texts": ["d"]}),
        ("/v1/score", {"text_1": "q", "text_2": ["d"]}),
        ("/v2/embed", {"texts": ["hi"], "embedding_types": ["float"]}),
        ("/v1/embed", {"texts": ["hi"]}),
    ],
)
def test_every_route_takes_an_integer_priority(
    path: str, body: dict[str, object], fake_gateway: TestClient
) -> None:
    ok = fake_gateway.post(path, json={**body, "priority": -5})
    assert ok.status_code == 200, ok.text
    bad = fake_gateway.post(path, json={**body, "priority": "high"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
    metrics = fake_gateway.get("/metrics").text
    assert 'embedserve_priority_queue_seconds_count{priority="-5"}' in metrics


