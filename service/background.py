"""Background tasks that cannot die unseen. A crash is logged with the task's name, its context
and the traceback; then the task either starts again (a loop that can recover) or tells its
owner, who stops what depends on it. Awaiting such a task never raises its crash, so a shutdown
that cancels and awaits it always gets past it to what comes next (stopping the engines)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

log = logging.getLogger(__name__)


def start_task(
    name: str,
    run: Callable[[], Awaitable[None]],
    *,
    context: Mapping[str, object] | None = None,
    restart_after_s: float | None = None,
    on_crash: Callable[[BaseException], None] | None = None,
) -> asyncio.Task[None]:
    """``run()`` as the task ``name``. When it raises (anything but its cancellation), the crash
    is logged, ``on_crash`` is told (to answer what waited on the task, or to stop the service),
    and ``run()`` starts again after ``restart_after_s``; with no restart the task ends."""
    fields = {"task": name, **(context or {})}

    async def guarded() -> None:
        while True:
            try:
                await run()
                return
            except Exception as exc:
                then = "stops" if restart_after_s is None else f"restarts in {restart_after_s:g} s"
                log.error("background task crashed", exc_info=exc, extra={**fields, "then": then})
                if on_crash is not None:
                    on_crash(exc)
                if restart_after_s is None:
                    return
            await asyncio.sleep(restart_after_s)

    return asyncio.create_task(guarded(), name=name)


async def stop_tasks(*tasks: asyncio.Task[None] | None) -> None:
    """Cancel ``tasks`` and wait until each has ended. Their own errors stay theirs (logged where
    they crashed); only a cancellation of the caller itself propagates."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    if live:
        await asyncio.wait(live)
    for task in live:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task ended with an error", exc_info=exc, extra={"task": task.get_name()})
