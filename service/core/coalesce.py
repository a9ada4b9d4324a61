"""Coalesce the inputs of concurrent requests into engine calls under a token budget.

A call is dispatched as soon as a slot is free, so an idle engine adds no wait; while all
slots are busy, inputs accumulate and leave together in the next call (optionally after a
short, bounded ``max_wait``). Requests take turns, one input each, so a request of a
thousand inputs cannot make a one-input request wait behind all of them. Inputs whose
request was abandoned (client gone, deadline passed) are never sent, and an engine call
whose inputs were all abandoned is cancelled.

A request's ``priority`` (vLLM's meaning: lower first, default 0) orders the turns: a call
takes from the most urgent requests waiting, in turn, and from no less urgent one. A request
that has waited ``aging_s`` takes its turns among the most urgent ones, so low priority is
delayed, never starved.

A request may ask a model's sparse or ColBERT outputs (``contracts/hybrid.py``) instead of, or
beside, its dense vector: a call carries the inputs of requests that ask the same outputs (the
turns of the others wait for the next call, at the head of the line), so a dense request's call
stays the plain one and an answer holds only what its inputs asked for.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from embedserve.background import start_task, stop_tasks
from embedserve.contracts import late_chunks
from embedserve.contracts.hybrid import HybridOutputs, Output
from embedserve.contracts.wire import Matrix
from embedserve.core import hybrid
from embedserve.core.tracing import RequestTrace, engine_call, request_trace

#: One engine call: token-id inputs in, their vectors out (the engine pool's ``embed``), one per
#: input, or per chunk of a late-chunked input (``contracts/late_chunks.py``).
EmbedBatch = Callable[[list[list[int]]], Awaitable[Matrix]]
#: One engine call for other outputs than the dense vector alone (the pool's ``embed_outputs``).
OutputsBatch = Callable[[list[list[int]], list[Output]], Awaitable[HybridOutputs]]
#: The outputs a request asks; None: the dense vector alone, on the plain wire.
Outputs = tuple[Output, ...] | None


@dataclass(slots=True)
class _Item:
    ids: list[int]
    future: asyncio.Future[np.ndarray | HybridOutputs]
    enqueued: float
    dispatched: float = 0.0
    engine_s: float = 0.0
    trace: RequestTrace | None = None


@dataclass(slots=True, eq=False)  # found in a line by identity
class _Turns:
    """One request's inputs still waiting, and where they wait."""

    items: deque[_Item]
    enqueued: float
    level: int  # the priority its turns are taken at: its own, or the most urgent once aged
    outputs: Outputs = None  # only requests that ask the same outputs share a call


@dataclass(slots=True)
class StageTimes:
    queue_s: float = 0.0
    engine_s: float = 0.0


@dataclass
class CoalescerStats:
    batches: int = 0
    inputs: int = 0
    dropped_abandoned: int = 0
    cancelled_calls: int = 0
    aged: int = 0  # requests that waited past the aging bound


class Coalescer:
    def __init__(
        self,
        embed: EmbedBatch,
        *,
        token_budget: int,
        max_wait_s: float,
        max_concurrent_calls: int = 8,
        max_inputs_per_call: int = 256,
        aging_s: float = 10.0,
        on_aged: Callable[[], object] = lambda: None,
        clock: Callable[[], float] | None = None,
        embed_outputs: OutputsBatch | None = None,
    ) -> None:
        """``aging_s``: how long a request waits at its own priority before it takes its turns
        among the most urgent requests (``on_aged`` is called for each); ``clock``: seconds
        (default: ``time.monotonic``, looked up at each call); ``embed_outputs``: the call for
        requests that ask other outputs than the dense vector alone."""
        self._embed = embed
        self._embed_outputs = embed_outputs
        self._aging_s = aging_s
        self._on_aged = on_aged
        self._clock = clock or (lambda: time.monotonic())
        self._budget = token_budget
        self._max_wait = max_wait_s
        self._max_inputs = max_inputs_per_call
        self._slots = asyncio.Semaphore(max_concurrent_calls)
        self._levels: dict[int, deque[_Turns]] = {}  # priority -> the requests waiting at it, in turn
        self._queued_inputs = 0
        self._queued_tokens = 0
        self._wakeup = asyncio.Event()
        self._inflight_calls = 0
        self._task: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()
        self.stats = CoalescerStats()

    @property
    def token_budget(self) -> int:
        """The most tokens one engine call holds."""
        return self._budget

    @property
    def queued_inputs(self) -> int:
        return self._queued_inputs

    async def start(self) -> None:
        """The one task that sends every call: after a crash (logged) the inputs waiting get its
        error at once, not their deadline's 504, and it starts again."""
        self._task = start_task("coalescer", self._run, restart_after_s=0.1, on_crash=self._drop_waiting)

    async def stop(self) -> None:
        await stop_tasks(self._task)
        self._drop_waiting(None)

    def _drop_waiting(self, error: BaseException | None) -> None:
        """Every waiting input is answered: with ``error``, or cancelled."""
        for level in self._levels.values():
            for turns in level:
                for item in turns.items:
                    if item.future.done():
                        continue
                    if error is None:
                        item.future.cancel()
                    else:
                        item.future.set_exception(error)
        self._levels.clear()
        self._queued_inputs = self._queued_tokens = 0

    async def embed(self, inputs: list[list[int]], priority: int = 0) -> tuple[Matrix, StageTimes]:
        if not inputs:  # nothing to queue: a request always has at least one input in line
            return np.empty((0, 0), dtype=np.float32), StageTimes()
        vectors, times = await self._queued(inputs, priority, None)
        return np.vstack(vectors), times  # type: ignore[arg-type]  # an input's rows (late chunks) follow one another

    async def embed_outputs(
        self, inputs: list[list[int]], outputs: tuple[Output, ...], priority: int = 0
    ) -> tuple[HybridOutputs, StageTimes]:
        """``outputs`` (in the wire's order) for each of ``inputs``, in order."""
        parts, times = await self._queued(inputs, priority, outputs)
        return hybrid.join(parts), times  # type: ignore[arg-type]  # the answers of an outputs call

    async def _queued(
        self, inputs: list[list[int]], priority: int, outputs: Outputs
    ) -> tuple[list[np.ndarray | HybridOutputs], StageTimes]:
        """Each input's answer, once the calls that carried them are back."""
        loop = asyncio.get_running_loop()
        now = self._clock()
        trace = request_trace.get()
        items = [_Item(ids, loop.create_future(), now, trace=trace) for ids in inputs]
        if trace is not None:
            trace.queued(inputs)
        self._levels.setdefault(priority, deque()).append(_Turns(deque(items), now, priority, outputs))
        self._queued_inputs += len(items)
        self._queued_tokens += sum(len(ids) for ids in inputs)
        self._wakeup.set()
        try:
            vectors = await asyncio.gather(*(it.future for it in items))
        except BaseException:
            for it in items:
                if not it.future.done():
                    it.future.cancel()
                elif not it.future.cancelled():
                    it.future.exception()  # retrieved: no "never retrieved" noise
            raise
        if trace is not None:
            trace.answered()
        times = StageTimes(
            queue_s=max(it.dispatched - it.enqueued for it in items),
            engine_s=max(it.engine_s for it in items),
        )
        return vectors, times

    def _age(self) -> None:
        """Requests that waited ``aging_s`` at a less urgent priority join the most urgent turns.
        A scan of the less urgent requests once per call, and only while priorities are mixed."""
        if len(self._levels) < 2:
            return
        top = min(self._levels)
        due = self._clock() - self._aging_s
        for priority in [p for p in self._levels if p != top]:
            waiting = self._levels[priority]
            if all(t.enqueued > due for t in waiting):
                continue
            for turns in waiting:
                if turns.enqueued <= due:
                    turns.level = top
                    self._levels[top].append(turns)
                    self.stats.aged += 1
                    self._on_aged()
            kept = deque(t for t in waiting if t.level == priority)
            if kept:
                self._levels[priority] = kept
            else:
                del self._levels[priority]

    def _take(self) -> tuple[list[_Item], Outputs]:
        """The next call's inputs and the outputs they ask: one from each waiting request of the
        most urgent priority in turn, within the budget, among the requests that ask what the
        first one asks (the others keep their place at the head of the line). A call carries one
        priority's inputs: urgent work is not held up by less urgent inputs topping its call up
        (the CPU engine's time is per token, and SGLang batches concurrent calls itself)."""
        self._age()
        batch: list[_Item] = []
        tokens = 0
        taking = 0
        outputs: Outputs = None
        passed: _Turns | None = None  # the first request passed over for asking other outputs
        while self._levels and len(batch) < self._max_inputs:
            level = min(self._levels)
            if batch and level != taking:
                break
            taking = level
            waiting = self._levels[level]
            if batch and waiting[0].outputs != outputs:
                at = next((i for i, t in enumerate(waiting) if t.outputs == outputs), None)
                if at is None:
                    break
                passed = passed or waiting[0]
                waiting.rotate(-at)  # the turns keep their circular order
            outputs = waiting[0].outputs
            queue = waiting[0].items
            item = queue[0]
            abandoned = item.future.done()
            if not abandoned and batch and tokens + len(item.ids) > self._budget:
                break
            queue.popleft()
            self._queued_inputs -= 1
            self._queued_tokens -= len(item.ids)
            if abandoned:
                self.stats.dropped_abandoned += 1
            else:
                tokens += len(item.ids)
                batch.append(item)
            if not queue:
                waiting.popleft()
                if not waiting:
                    del self._levels[level]
            elif not abandoned:
                waiting.rotate(-1)  # this request's turn is over: to the back of the line
        if passed is not None and passed in self._levels.get(taking, ()):  # eq=False: identity
            waiting = self._levels[taking]
            waiting.rotate(-waiting.index(passed))  # its turn comes first in the next call
        return batch, outputs

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                while not self._levels:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                if self._inflight_calls and self._max_wait and self._queued_tokens < self._budget:
                    await asyncio.sleep(self._max_wait)
                batch, outputs = self._take()
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                continue
            task = asyncio.create_task(self._dispatch(batch, outputs))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _dispatch(self, batch: list[_Item], outputs: Outputs) -> None:
        self._inflight_calls += 1
        start = self._clock()
        for item in batch:
            item.dispatched = start
        ids = [it.ids for it in batch]
        traces = [it.trace for it in batch if it.trace is not None]
        call_trace = engine_call(traces, ids) if traces else None  # sets the call's traceparent
        call: asyncio.Future[Matrix | HybridOutputs]
        if outputs is None:
            call = asyncio.ensure_future(self._embed(ids))
        else:
            assert self._embed_outputs is not None, "a request for outputs needs embed_outputs"
            call = asyncio.ensure_future(self._embed_outputs(ids, list(outputs)))
        if call_trace is not None:
            call.add_done_callback(call_trace.end)

        def cancel_if_abandoned(_: object) -> None:
            if not call.done() and all(it.future.done() for it in batch):
                call.cancel()  # nobody waits for these vectors: free the engine

        for item in batch:
            item.future.add_done_callback(cancel_if_abandoned)
        try:
            await asyncio.wait({call})
        finally:
            self._inflight_calls -= 1
            self._slots.release()
        if call.cancelled():
            self.stats.cancelled_calls += 1
            return
        exc = call.exception()
        if exc is not None:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        answer = call.result()
        vectors = (
            hybrid.split(answer, len(ids))
            if isinstance(answer, HybridOutputs)
            else late_chunks.per_input(answer, ids)
        )
        elapsed = self._clock() - start
        self.stats.batches += 1
        self.stats.inputs += len(batch)
        for item, vec in zip(batch, vectors, strict=True):
            item.engine_s = elapsed
            if not item.future.done():
                item.future.set_result(vec)
