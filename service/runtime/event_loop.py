"""The event loop the gateway process runs on (``gateway.event_loop``).

One loop carries every request the gateway answers (parsing, admission, merging, the engine
calls and the replies), so its CPU per request caps the requests a second of one gateway
process. uvloop runs the same asyncio code on libuv; on one H200 the 0.6B measured no faster
with it (results/gpu-small-model/), so asyncio's own loop is the default.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when asked for and installed; None (asyncio's own) otherwise."""
    if name != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        log.warning("event_loop_fallback", extra={"wanted": "uvloop", "using": "asyncio",
                                                  "why": "uvloop is not installed"})
        return None
    log.info("event_loop", extra={"using": "uvloop"})
    return uvloop.new_event_loop


def run_on(name: str, main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the named loop."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(main)
