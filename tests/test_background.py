"""Background tasks cannot die unseen: a crash is logged with its context and either restarts
the task or tells its owner; stopping a task that crashed never raises its error, and never
swallows the caller's own cancellation."""

from __future__ import annotations

import asyncio
import logging

import pytest

from embedserve.background import start_task, stop_tasks


def crashes(record: logging.LogRecord) -> bool:
    return record.getMessage() == "background task crashed"


def test_a_crash_is_logged_with_its_context_and_the_task_restarts(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []
    told: list[BaseException] = []
    third = asyncio.Event()

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError(f"crash {len(runs)}")
        third.set()
        await asyncio.Event().wait()  # the third run stays up

    async def go() -> None:
        task = start_task("flaky", flaky, context={"model": "m"}, restart_after_s=0, on_crash=told.append)
        await third.wait()
        await stop_tasks(task)
        assert task.done()

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())
    logged = [r for r in caplog.records if crashes(r)]
    assert [str(r.exc_info[1]) for r in logged if r.exc_info] == ["crash 1", "crash 2"]
    assert all(getattr(r, "task", "") == "flaky" and getattr(r, "model", "") == "m" for r in logged)
    assert [str(e) for e in told] == ["crash 1", "crash 2"]


def test_a_task_that_does_not_restart_tells_its_owner_and_stops_without_raising(
    caplog: pytest.LogCaptureFixture,
) -> None:
    told: list[BaseException] = []

    async def boom() -> None:
        raise ConnectionError("engine gone")

    async def go() -> None:
        task = start_task("announce", boom, on_crash=told.append)
        await asyncio.wait({task})
        await stop_tasks(task, None)  # what a shutdown does: no crash re-raised here

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())
    assert [type(e) for e in told] == [ConnectionError]
    assert len([r for r in caplog.records if crashes(r)]) == 1


def test_stopping_tasks_passes_the_callers_own_cancellation_on() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def go() -> bool:
        task = start_task("stubborn", forever)

        async def stopper() -> None:
            await stop_tasks(asyncio.create_task(asyncio.sleep(10)), task)

        outer = asyncio.create_task(stopper())
        await asyncio.sleep(0)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await stop_tasks(task)
        return outer.cancelled()

    assert asyncio.run(go())
