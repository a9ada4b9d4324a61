"""Token rates over an exponentially decaying window, on an injected clock.

``Throughput``: how many tokens an engine embeds per second of busy time (time with a large
call in flight), weighted towards the last busy minutes: the measured capacity the gateway quotes
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

    def _advance(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        if elapsed > 0:
            decay = 0.5 ** (elapsed / self.half_life_s)
            # the interval just past, each instant weighed by its own decay since
            weight = -math.expm1(-elapsed / self.half_life_s * math.log(2)) * self.half_life_s / math.log(2)
            self._tokens = self._tokens * decay + self._level * weight
            self._seconds = self._seconds * decay + weight
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


class Throughput:
    """Tokens over busy seconds, both decaying with a half-life of busy time, not wall time:
    an idle night leaves the estimate as the last busy minutes left it, instead of shrinking
    both towards zero, where one call in flight would outweigh everything known.

    A busy stretch is counted when a call ends, with that call's tokens: time with calls in
    flight is never counted as work that embedded nothing. A call that failed or was
    cancelled shows nothing of the engine's rate, so its stretch is left out."""

    def __init__(
        self, min_tokens: int = 0, half_life_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.min_tokens = min_tokens
        self.half_life_s = half_life_s
        self._clock = clock
        self._tokens = 0.0
        self._seconds = 0.0
        self._in_flight = 0
        self._busy_since = 0.0  # where the busy time not yet counted begins

    def counts(self, tokens: int) -> bool:
        return tokens >= self.min_tokens

    def started(self, tokens: int) -> None:
        if self.counts(tokens):
            if self._in_flight == 0:
                self._busy_since = self._clock()
            self._in_flight += 1

    def finished(self, tokens: int, ok: bool) -> None:
        """A call of ``tokens`` ended; the busy time since the last call ended is its."""
        if self.counts(tokens) and self._in_flight > 0:
            now = self._clock()
            if ok:
                self.record(tokens, now - self._busy_since)
            self._busy_since = now
            self._in_flight -= 1

    def record(self, tokens: int, seconds: float) -> None:
        """``tokens`` embedded in ``seconds`` of busy time (a call, or the start-up warm-up)."""
        decay = 0.5 ** (max(seconds, 0.0) / self.half_life_s)
        self._tokens = self._tokens * decay + tokens
        self._seconds = self._seconds * decay + max(seconds, 0.0)

    def tokens_per_s(self) -> float | None:
        """``None`` until something was measured."""
        if self._seconds <= 0 or self._tokens <= 0:
            return None
        return self._tokens / self._seconds
