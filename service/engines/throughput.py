"""Token rates over an exponentially decaying window, on an injected clock.

``Throughput``: how many tokens an engine embeds per second of busy time (time with a large
call in flight), weighted towards the last minutes: the measured capacity the gateway quotes
when it refuses a request that could not finish before its deadline, and the denominator of
the load signal autoscalers scale on.

Only large calls count (at least ``min_tokens``, a quarter of the call budget): a call of
a few tokens costs the engine's fixed per-call time, so at low load small calls would make
the engine look many times slower than it is to the large request being judged.

``DecayedRate``: tokens per second of wall time, the same way: the tokens the gateway is
offered per second, the load signal's numerator."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class DecayedRate:
    """Tokens and seconds both decay with one half-life, so their ratio weighs recent
    seconds most and forgets nothing abruptly. Tokens arrive as counts (``add``) or accrue
    at a level per second (``set_level``: the ratio is then the level's time average)."""

    def __init__(self, half_life_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s = half_life_s
        self._clock = clock
        self._tokens = 0.0
        self._seconds = 0.0
        self._level = 0.0
        self._last = clock()

    def _counting(self) -> bool:
        """Whether the time passing now counts (always, for a wall-time rate)."""
        return True

    def _advance(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        if elapsed > 0:
            decay = 0.5 ** (elapsed / self.half_life_s)
            # the interval just past, each instant weighed by its own decay since
            weight = -math.expm1(-elapsed / self.half_life_s * math.log(2)) * self.half_life_s / math.log(2)
            self._tokens = self._tokens * decay + self._level * weight
            self._seconds = self._seconds * decay + (weight if self._counting() else 0.0)
            self._last = now

    def add(self, tokens: float) -> None:
        self._advance()
        self._tokens += tokens

    def set_level(self, per_s: float) -> None:
        """From now on tokens accrue at ``per_s`` (e.g. tokens in flight: token-seconds)."""
        self._advance()
        self._level = per_s

    def tokens_per_s(self) -> float | None:
        """``None`` until some time has counted."""
        self._advance()
        if self._seconds <= 0:
            return None
        return self._tokens / self._seconds


class Throughput(DecayedRate):
    def __init__(
        self, min_tokens: int = 0, half_life_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(half_life_s, clock)
        self.min_tokens = min_tokens
        self._in_flight = 0

    def _counting(self) -> bool:
        return self._in_flight > 0

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
        self._seconds += seconds

    def tokens_per_s(self) -> float | None:
        """``None`` until something was measured."""
        return super().tokens_per_s() or None
