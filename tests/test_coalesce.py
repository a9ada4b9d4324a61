"""Coalescing: requests take turns, abandoned inputs are never sent, and a call nobody
waits for any more is cancelled. Driven step by step (no clocks): each engine call waits
until the test releases it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest

from embedserve.contracts.wire import Matrix
from embedserve.core.coalesce import Coalescer


class SteppedEngine:
    """Records each call's inputs and answers only when released."""

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []
        self.release = asyncio.Semaphore(0)
        self.cancelled = 0

    async def embed(self, batch: list[list[int]]) -> Matrix:
        self.calls.append(batch)
        try:
            await self.release.acquire()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return np.asarray([[float(ids[0]), 1.0] for ids in batch], dtype=np.float32)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_small_request_is_not_queued_behind_a_big_one() -> None:
    async def go() -> tuple[int, list[list[list[int]]]]:
        engine = SteppedEngine()
        c = Coalescer(engine.embed, token_budget=4, max_wait_s=0, max_concurrent_calls=1)
        await c.start()
        big = asyncio.create_task(c.embed([[1]] * 40))  # ten calls' worth on its own
        await settle()
        small = asyncio.create_task(c.embed([[2]]))
        await settle()
        calls_until_small = 0
        while not small.done():
            engine.release.release()
            calls_until_small += 1
            await settle()
        vectors, _ = small.result()
        assert vectors[0][0] == 2.0
        while not big.done():
            engine.release.release()
            await settle()
        assert len(big.result()[0]) == 40
        await c.stop()
        return calls_until_small, engine.calls

    calls_until_small, calls = asyncio.run(go())
    assert calls_until_small == 2  # the call in flight, then its own: first come, first served would be 11
    assert calls[1] == [[1], [2], [1], [1]]  # one input each in turn, then the big one fills the budget


def test_an_abandoned_request_sends_nothing_and_its_call_is_cancelled() -> None:
    async def go() -> tuple[SteppedEngine, Coalescer]:
        engine = SteppedEngine()
        c = Coalescer(engine.embed, token_budget=4, max_wait_s=0, max_concurrent_calls=1)
        await c.start()
        gone = asyncio.create_task(c.embed([[7]] * 12))
        await settle()
        assert len(engine.calls) == 1  # the first four are with the engine
        gone.cancel()
        await settle()
        assert engine.cancelled == 1  # nobody waits for them any more
        kept = asyncio.create_task(c.embed([[3]]))
        await settle()
        engine.release.release()
        await settle()
        assert kept.done() and kept.result()[0][0][0] == 3.0
        await c.stop()
        return engine, c

    engine, c = asyncio.run(go())
    assert engine.calls == [[[7]] * 4, [[3]]]  # the other eight were never sent
    assert c.stats.dropped_abandoned == 8 and c.stats.cancelled_calls == 1


def test_an_empty_batch_is_answered_and_leaves_the_coalescer_serving() -> None:
    async def go() -> None:
        engine = SteppedEngine()
        c = Coalescer(engine.embed, token_budget=4, max_wait_s=0, max_concurrent_calls=1)
        await c.start()
        vectors, _ = await asyncio.wait_for(c.embed([]), 1)
        assert len(vectors) == 0 and c.queued_inputs == 0
        after = asyncio.create_task(c.embed([[7]]))
        await settle()
        engine.release.release()
        vectors, _ = await asyncio.wait_for(after, 1)  # not its deadline's 504: the task still runs
        assert vectors[0][0] == 7.0 and engine.calls == [[[7]]]
        await c.stop()

    asyncio.run(go())


def test_a_crash_answers_the_waiting_inputs_at_once_is_logged_and_the_task_restarts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fault injection: the next call's inputs cannot be taken once. What waited gets the crash
    now (its request answers 500, not its deadline's 504); the task restarts and serves."""

    async def go() -> None:
        engine = SteppedEngine()
        c = Coalescer(engine.embed, token_budget=4, max_wait_s=0, max_concurrent_calls=1)
        take = c._take

        def broken() -> Any:
            c._take = take  # type: ignore[method-assign]
            raise RuntimeError("injected")

        c._take = broken  # type: ignore[method-assign]
        await c.start()
        with pytest.raises(RuntimeError, match="injected"):
            await asyncio.wait_for(c.embed([[1], [2]]), 1)
        assert c.queued_inputs == 0
        engine.release.release()
        vectors, _ = await asyncio.wait_for(c.embed([[3]]), 2)  # taken once the task has restarted
        assert vectors[0][0] == 3.0
        await c.stop()

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())
    crash = [r for r in caplog.records if r.getMessage() == "background task crashed"]
    assert len(crash) == 1 and crash[0].exc_info and getattr(crash[0], "task", None) == "coalescer"
