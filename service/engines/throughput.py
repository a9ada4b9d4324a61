"""How many tokens an engine embeds per second of busy time (time with a large call in
flight), weighted towards the last minutes: the measured capacity the gateway quotes when
it refuses a request that could not finish before its deadline.

Only large calls count (at least ``min_tokens``, a quarter of the call budget): a call of
a few tokens costs the engine's fixed per-call time, so at low load small calls would make
the engine look many times slower than it is to the large request being judged."""

from __future__ import annotations

import time
from collections.abc import Callable


class Throughput:
    def __init__(
        self, min_tokens: int = 0, half_life_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.min_tokens = min_tokens
        self.half_life_s = half_life_s
        self._clock = clock
        self._tokens = 0.0
        self._busy_s = 0.0
        self._in_flight = 0
        self._last = clock()

    def _advance(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        if elapsed > 0:
            decay = 0.5 ** (elapsed / self.half_life_s)
            self._tokens *= decay
            self._busy_s = self._busy_s * decay + (elapsed if self._in_flight else 0.0)
            self._last = now

    def counts(self, tokens: int) -> bool:
        return tokens >= self.min_tokens

    def started(self, tokens: int) -> None:
        if self.counts(tokens):
            self._advance()
            self._in_flight += 1

    def finished(self, tokens: int, ok: bool) -> None:
        """A call of ``tokens`` ended; a failed one embedded nothing."""
        if self.counts(tokens):
            self._advance()
            self._in_flight = max(0, self._in_flight - 1)
            self._tokens += tokens if ok else 0

    def record(self, tokens: int, seconds: float) -> None:
        """A measurement made elsewhere (the start-up warm-up call)."""
        self._advance()
        self._tokens += tokens
        self._busy_s += seconds

    def tokens_per_s(self) -> float | None:
        """``None`` until something was measured."""
        self._advance()
        if self._tokens <= 0 or self._busy_s <= 0:
            return None
        return self._tokens / self._busy_s
