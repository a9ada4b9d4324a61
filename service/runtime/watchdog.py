"""`up`'s hung-engine watchdog. Liveness fails at ``hang_after_s`` so Kubernetes restarts a hung
pod; without Kubernetes `up` kills the engine itself (its supervisor restarts it), a little later
so the two never race."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from embedserve.runtime.supervisor import ProcessSupervisor
from embedserve.upstream.pool import EnginePool

#: one model's engines: their supervisors (a replacement swaps its own in) and the gateway's pool
Engines = tuple[Sequence[ProcessSupervisor], EnginePool]


def kill_hung(supervisors: Sequence[ProcessSupervisor], pool: EnginePool, now: float, after_s: float) -> None:
    """Kill each engine whose oldest call has waited longer than ``after_s``. An engine out of the
    pool (the old one of a drain-first replacement, stopped before its successor is swapped in)
    has no calls to wait on."""
    for sup in list(supervisors):
        url = sup.ready_url.removesuffix("/health")
        engine = pool.by_url(url)
        stuck = engine.stuck_for_s(now) if engine else None
        if stuck is not None and stuck > after_s:
            sup.kill(f"a call has waited {stuck:.0f} s (limit {after_s:.0f} s)")
            pool.forget_stuck(url)


async def watch_hung(
    models: Sequence[Engines], hang_after_s: float, clock: Callable[[], float] = time.monotonic
) -> None:
    after = 1.5 * hang_after_s
    while True:
        await asyncio.sleep(min(5.0, after / 4))
        now = clock()
        for supervisors, pool in models:
            kill_hung(supervisors, pool, now, after)
