"""A leak drill: an engine that grows its memory at a set rate on purpose, so an operator
can watch the forecast, the probes and `up`'s replacement work on their own hardware
before trusting them. Only ever on through ``embedserve up --drill-leak RATE``: the CPU
engine grows host memory, an SGLang engine GPU memory (in its scheduler, through the
plugin)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_PER = {"s": 1.0, "min": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?i?b)\s*/\s*(s|min|h)\s*$", re.IGNORECASE)

#: set only by ``embedserve up --drill-leak`` on the engines it starts: bytes per second
LEAK_ENV = "EMBEDSERVE_DRILL_LEAK_BYTES_PER_S"


def parse_rate(text: str) -> float:
    """Bytes per second from ``200MiB/min``, ``25MB/s``, ``1GiB/h``; ``ValueError`` says why not."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"'{text}' is not a rate like 200MiB/min, 25MB/s or 1GiB/h")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()] / _PER[m.group(3).lower()]
    if value <= 0:
        raise ValueError(f"'{text}': the rate must be above zero")
    return value


def host_bytes(n: int) -> bytearray:
    """Written, so that it is resident rather than merely reserved."""
    return bytearray(b"\x01") * n


class Leak:
    """Holds ``bytes_per_s`` more memory every second since the first ``catch_up``, in
    chunks from ``alloc`` (host bytes, or a GPU tensor). ``catch_up`` is cheap when nothing
    is due, so a hot loop such as SGLang's scheduler may call it every iteration."""

    def __init__(
        self,
        bytes_per_s: float,
        alloc: Callable[[int], Any] = host_bytes,
        chunk_bytes: int = 16 * 2**20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bytes_per_s = bytes_per_s
        self.alloc = alloc
        self.chunk_bytes = chunk_bytes
        self.clock = clock
        self.started: float | None = None
        self.held: list[Any] = []
        self.leaked_bytes = 0

    def catch_up(self) -> None:
        now = self.clock()
        if self.started is None:
            self.started = now
            return
        due = self.bytes_per_s * (now - self.started) - self.leaked_bytes
        while due >= self.chunk_bytes:
            self.held.append(self.alloc(self.chunk_bytes))
            self.leaked_bytes += self.chunk_bytes
            due -= self.chunk_bytes

    async def run(self, every_s: float = 0.25) -> None:
        while True:
            self.catch_up()
            await asyncio.sleep(every_s)
