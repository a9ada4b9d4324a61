"""Give the memory a large request freed back to the system.

Tokenising a large body takes the gateway hundreds of MiB for a moment (the tokenizer's
encodings and the ids, made in the tokenizer threads). Freed, that memory stays in glibc's
malloc arenas for reuse, not returned to the kernel, so the gateway's RSS stayed at its peak
while it idled (827 MiB, from 97, after 24 requests of 0.7-13 MiB: results/gateway-memory-cpu/);
fewer arenas (``MALLOC_ARENA_MAX=2``) kept about as much. ``malloc_trim(0)`` returns the free pages
of every arena: after a large request, in a worker thread, at most once a second and always
after the last one.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Callable

#: A request body at least this large is followed by a trim.
LARGE_BODY_BYTES = 1 << 20


def glibc_malloc_trim() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of the C library, or None where there is none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class MemoryTrimmer:
    """``request_done`` after each large request, on the event loop."""

    def __init__(
        self,
        trim: Callable[[], object] | None,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.trim = trim
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.trims = 0
        self._last = -min_interval_s
        self._pending = False

    def request_done(self) -> None:
        """A trim now, or when a second has passed since the last one; one pending at most."""
        if self.trim is None or self._pending:
            return
        self._pending = True
        delay = max(0.0, self._last + self.min_interval_s - self.clock())
        asyncio.get_running_loop().call_later(delay, self._start)

    def _start(self) -> None:
        self._pending = False
        self._last = self.clock()
        self.trims += 1
        assert self.trim is not None
        asyncio.get_running_loop().run_in_executor(None, self.trim)
