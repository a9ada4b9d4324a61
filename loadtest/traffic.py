"""Traffic generation: request bodies (deterministic from the seed) and arrival times."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import random
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from embedserve.loadtest.mixes import BucketMix, FileMix, Mix

InputKind = Literal["text", "ids"]


class Builder(Protocol):
    """What the factory needs from a text builder (``TextBuilder`` or ``WordBuilder``)."""

    @property
    def min_len(self) -> int: ...

    def count(self, text: str) -> int: ...

    def build(self, n_tokens: int, rng: random.Random, serial: int | None = None
              ) -> tuple[str, int]: ...


@dataclass(frozen=True)
class Planned:
    """One request, ready to send."""

    index: int
    body: bytes
    n_inputs: int
    tokens: int  # tokens the client built/measured, special tokens included


REPEAT_HISTORY = 1024  # a repeated input copies one of the last this many new inputs


@dataclass
class ContentStats:
    """What the inputs built so far repeat: the labelled repeated-content scenario's rates
    (counted as built; the prefetcher builds up to 64 requests ahead of the wire)."""

    inputs: int = 0
    tokens: int = 0
    repeated_inputs: int = 0  # exact copies of an earlier input of the run
    repeated_tokens: int = 0
    shared_prefix_tokens: int = 0  # tokens of the shared prefix, summed over the inputs

    def to_json(self) -> dict[str, Any]:
        return {"inputs_built": self.inputs, "tokens_built": self.tokens,
                "repeated_inputs": self.repeated_inputs,
                "repeated_input_fraction": round(self.repeated_inputs / self.inputs, 6)
                if self.inputs else 0.0,
                "repeated_token_fraction": round(self.repeated_tokens / self.tokens, 6)
                if self.tokens else 0.0,
                "shared_prefix_token_fraction": round(self.shared_prefix_tokens / self.tokens, 6)
                if self.tokens else 0.0}

    def add(self, other: ContentStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class RequestFactory:
    """Makes request ``i`` of a run; the same seed gives the same sequence of bodies.

    Every new input gets the next serial number, which the builder spells as the input's
    unique marker: no two inputs of a run share more than a few leading tokens. Only
    ``repeat_rate`` (exact copies of recent inputs) and the builder's shared prefix repeat
    content, and ``stats`` counts both; a ``file:`` mix sends the file's texts as they are
    and counts a text sent twice as repeated."""

    mix: Mix
    builder: Builder
    input_kind: InputKind = "text"
    inputs_per_request: tuple[int, int] = (1, 1)
    model: str = "default"
    seed: int = 0
    max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    repeat_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.input_kind == "ids" and not hasattr(self.builder, "ids"):
            raise ValueError("sending token ids needs the target model's tokenizer (--tokenizer)")
        if not 0.0 <= self.repeat_rate <= 1.0:
            raise ValueError(f"--repeat-rate must be within 0-1, got {self.repeat_rate:g}")
        self._rng = random.Random(self.seed)
        self._next = 0
        self._serial = 0
        self._history: list[tuple[str | list[int], int]] = []
        self._sent_texts = bytearray(len(self.mix.texts)) if isinstance(self.mix, FileMix) else None
        self.stats = ContentStats()
        b: Any = self.builder
        # tokens of the shared prefix in each input (words without a tokenizer)
        self._prefix_n = len(getattr(b, "prefix_ids", ())) or len(getattr(b, "prefix", "").split())

    def _new(self) -> tuple[str | list[int], int]:
        b: Any = self.builder
        if isinstance(self.mix, FileMix):
            i = self.mix.pick_index(self._rng)
            prefix = getattr(b, "prefix", "")
            text = f"{prefix} {self.mix.texts[i]}" if prefix else self.mix.texts[i]
            if self.input_kind == "ids":
                ids = b.encode(text, self.max_tokens)
                item: tuple[str | list[int], int] = (ids, len(ids))
            else:
                item = (text, b.count(text))
            assert self._sent_texts is not None
            if self._sent_texts[i]:
                self.stats.repeated_inputs += 1
                self.stats.repeated_tokens += item[1]
            self._sent_texts[i] = 1
            return item
        assert isinstance(self.mix, BucketMix)
        n = max(self.mix.sample(self._rng, self.max_tokens), b.min_len)
        serial, self._serial = self._serial, self._serial + 1
        if self.input_kind == "ids":
            ids = b.ids(n, self._rng, serial)
            return ids, len(ids)
        return b.build(n, self._rng, serial)

    def _one(self) -> tuple[str | list[int], int]:
        if self.repeat_rate and self._history and self._rng.random() < self.repeat_rate:
            item = self._history[self._rng.randrange(len(self._history))]
            self.stats.repeated_inputs += 1
            self.stats.repeated_tokens += item[1]
        else:
            item = self._new()
            if self.repeat_rate:
                if len(self._history) < REPEAT_HISTORY:
                    self._history.append(item)
                else:
                    self._history[self.stats.inputs % REPEAT_HISTORY] = item
        self.stats.inputs += 1
        self.stats.tokens += item[1]
        self.stats.shared_prefix_tokens += self._prefix_n
        return item

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


    @property
    def chunkable(self) -> bool:
        """No state carried from one request to the next (no repeats of earlier inputs, no
        file whose texts are counted as sent), so chunks can be built anywhere."""
        return isinstance(self.mix, BucketMix) and not self.repeat_rate

    def for_chunks(self) -> RequestFactory:
        """This factory, its builder's corpus grown for the longest input up front."""
        if reserve := getattr(self.builder, "reserve", None):
            assert isinstance(self.mix, BucketMix)
            reserve(min(self.mix.max_len, self.max_tokens or self.mix.max_len))
        return self

    def make_chunk(self, chunk: int) -> tuple[list[Planned], ContentStats]:
        """Requests ``chunk * CHUNK`` up to the next chunk: a function of the seed and the
        chunk number alone (own random stream, own range of input serials), so several
        processes can build a run's requests and the run still sends the same sequence."""
        f = dataclasses.replace(self, seed=self.seed * 1_000_003 + chunk)
        f._next = chunk * CHUNK
        f._serial = chunk * CHUNK * self.inputs_per_request[1]
        return [f.make() for _ in range(CHUNK)], f.stats


CHUNK = 16  # requests a build process makes per task


Built = tuple[list[Planned], ContentStats | None]  # a task's requests, and its counters if kept apart


class Prefetcher:
    """Builds requests ahead on one worker thread, in order, so the event loop never
    blocks on tokenisation (the tokenizer releases the GIL) and the sequence stays fixed."""

    def __init__(self, make: Callable[[], Planned], depth: int = 64) -> None:
        self._start(ThreadPoolExecutor(1, thread_name_prefix="loadtest-build"),
                    lambda _task: ([make()], None), depth, per_task=1)

    def _start(self, pool: Executor, task: Callable[[int], Built], ahead: int,
               stats: ContentStats | None = None, *, per_task: int) -> None:
        """``task(i)`` builds the i-th batch of ``per_task`` requests on ``pool``, ``ahead`` tasks at
        a time; counters a task returns are added to ``stats`` as its requests are taken."""
        self._pool, self._task, self._ahead, self._stats = pool, task, ahead, stats
        self._per_task = per_task
        self._futs: deque[asyncio.Future[Built]] = deque()
        self._next_task = 0
        self._ready: deque[Planned] = deque()

    def _fill(self) -> None:
        loop = asyncio.get_running_loop()
        while len(self._futs) < self._ahead:
            self._futs.append(loop.run_in_executor(self._pool, self._task, self._next_task))
            self._next_task += 1

    async def prime(self, first: int | None = None) -> None:
        """Build the requests a run sends at once (``first``; all the tasks ahead when None) before
        the clock starts; the rest are built during the warm-up."""
        self._fill()
        need = len(self._futs) if first is None else min(len(self._futs), -(-first // self._per_task))
        await asyncio.gather(*list(self._futs)[:need])

    async def get(self) -> Planned:
        if not self._ready:
            self._fill()
            planned, stats = await self._futs.popleft()
            if stats is not None and self._stats is not None:
                self._stats.add(stats)
            self._ready.extend(planned)
        return self._ready.popleft()

    def close(self) -> None:
        for f in self._futs:
            f.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


_worker_factory: RequestFactory | None = None


def _init_build_worker(factory: RequestFactory) -> None:
    global _worker_factory
    _worker_factory = factory


def _build_chunk(chunk: int) -> Built:
    assert _worker_factory is not None
    return _worker_factory.make_chunk(chunk)


class ProcessPrefetcher(Prefetcher):
    """Builds requests ahead in ``workers`` processes, a chunk each, handed out in order.

    Building a text of an exact length tokenises it once or more: with Qwen3's tokenizer about
    1 ms of a core per seed-mix input on a 2-core VM, which a build thread shares with the
    client's event loop under the GIL. Processes take that off the loop, for targets that
    answer thousands of requests a second. The factory's counters grow as chunks are taken.
    Forked where the platform can: a spawned process imports this package and loads the tokenizer
    again, a second or more before the first request of every run."""

    def __init__(self, factory: RequestFactory, workers: int) -> None:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                                   initializer=_init_build_worker, initargs=(factory.for_chunks(),))
        self._start(pool, _build_chunk, 4 * workers, factory.stats, per_task=CHUNK)


def auto_build_workers(cores: int | None = None) -> int:
    """Build processes when ``--build-workers`` is not given: none on a small machine,
    where they would take cores from the server under test; else a quarter of the cores,
    at most 4."""
    cores = cores or os.cpu_count() or 1
    return 0 if cores <= 4 else min(4, cores // 4)


def prefetcher(source: Callable[[], Planned] | RequestFactory,
               workers: int = 0) -> Prefetcher | ProcessPrefetcher:
    """Where a run's requests come from: build processes when asked for and the factory's
    requests do not depend on each other, else one thread."""
    if isinstance(source, RequestFactory):
        if workers > 0 and source.chunkable:
            return ProcessPrefetcher(source, workers)
        return Prefetcher(source.make)
    return Prefetcher(source)


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Offsets in seconds from the start of an open-loop run: exponential gaps at ``rate``/s."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed ^ 0x5EED)
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t
