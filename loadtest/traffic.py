"""Traffic generation: request bodies (deterministic from the seed) and arrival times."""

from __future__ import annotations

import asyncio
import json
import random
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from embedserve.loadtest.mixes import BucketMix, FileMix, Mix

InputKind = Literal["text", "ids"]


class Builder(Protocol):
    """What the factory needs from a text builder (``TextBuilder`` or ``WordBuilder``)."""

    @property
    def min_len(self) -> int: ...

    def count(self, text: str) -> int: ...

    def build(self, n_tokens: int, rng: random.Random) -> tuple[str, int]: ...


@dataclass(frozen=True)
class Planned:
    """One request, ready to send."""

    index: int
    body: bytes
    n_inputs: int
    tokens: int  # tokens the client built/measured, special tokens included


@dataclass
class RequestFactory:
    """Makes request ``i`` of a run; the same seed gives the same sequence of bodies."""

    mix: Mix
    builder: Builder
    input_kind: InputKind = "text"
    inputs_per_request: tuple[int, int] = (1, 1)
    model: str = "default"
    seed: int = 0
    max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_kind == "ids" and not hasattr(self.builder, "ids"):
            raise ValueError("sending token ids needs the target model's tokenizer (--tokenizer)")
        self._rng = random.Random(self.seed)
        self._next = 0

    def _one(self) -> tuple[str | list[int], int]:
        b: Any = self.builder
        if isinstance(self.mix, FileMix):
            text = self.mix.pick(self._rng)
            if self.input_kind == "ids":
                ids = b.encode(text, self.max_tokens)
                return ids, len(ids)
            return text, b.count(text)
        assert isinstance(self.mix, BucketMix)
        n = max(self.mix.sample(self._rng, self.max_tokens), b.min_len)
        if self.input_kind == "ids":
            ids = b.ids(n, self._rng)
            return ids, len(ids)
        return b.build(n, self._rng)

    def make(self) -> Planned:
        """The next request of the sequence (call from one thread only)."""
        lo, hi = self.inputs_per_request
        n_inputs = lo if lo == hi else self._rng.randint(lo, hi)
        inputs, tokens = [], 0
        for _ in range(n_inputs):
            item, n = self._one()
            inputs.append(item)
            tokens += n
        body = {"model": self.model, "input": inputs, **self.extra}
        idx, self._next = self._next, self._next + 1
        return Planned(idx, json.dumps(body, ensure_ascii=False).encode(), n_inputs, tokens)


class Prefetcher:
    """Builds requests ahead on one worker thread, in order, so the event loop never
    blocks on tokenisation (the tokenizer releases the GIL) and the sequence stays fixed."""

    def __init__(self, make: Callable[[], Planned], depth: int = 64) -> None:
        self._make = make
        self._depth = depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loadtest-build")
        self._futs: deque[asyncio.Future[Planned]] = deque()

    def _fill(self) -> None:
        loop = asyncio.get_running_loop()
        while len(self._futs) < self._depth:
            self._futs.append(loop.run_in_executor(self._pool, self._make))

    async def prime(self) -> None:
        """Build the first ``depth`` requests before the clock starts."""
        self._fill()
        await asyncio.gather(*self._futs)

    async def get(self) -> Planned:
        self._fill()
        return await self._futs.popleft()

    def close(self) -> None:
        for f in self._futs:
            f.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Offsets in seconds from the start of an open-loop run: exponential gaps at ``rate``/s."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed ^ 0x5EED)
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t
