"""A leak drill: an engine that grows its memory at a set rate on purpose, so an operator
can watch the forecast, the probes and `up`'s replacement work on their own hardware
before trusting them. Only ever on through ``embedserve up --drill-leak RATE``."""

from __future__ import annotations

import asyncio
import re

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_PER = {"s": 1.0, "min": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?i?b)\s*/\s*(s|min|h)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """Bytes per second from ``200MiB/min``, ``25MB/s``, ``1GiB/h``; ``ValueError`` says why not."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"'{text}' is not a rate like 200MiB/min, 25MB/s or 1GiB/h")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()] / _PER[m.group(3).lower()]
    if value <= 0:
        raise ValueError(f"'{text}': the rate must be above zero")
    return value


class HostLeak:
    """Holds ``bytes_per_s`` more host memory every second, written so that it is resident."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.held: list[bytearray] = []

    @property
    def leaked_bytes(self) -> int:
        return sum(len(b) for b in self.held)

    def step(self, seconds: float = 1.0) -> None:
        self.held.append(bytearray(b"\x01") * int(self.bytes_per_s * seconds))

    async def run(self) -> None:
        while True:
            self.step()
            await asyncio.sleep(1.0)
