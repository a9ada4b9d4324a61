"""HTTP client for one or more engines speaking SGLang's token-id /v1/embeddings (or, for a
reranker, its /encode: ``protocols.py``).

Picks the ready engine with the fewest outstanding tokens, marks an engine unready the
moment a call cannot reach it (so waiting clients get a prompt 503, not a hang), and
re-checks engines in the background; the check never runs inside a client's request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from embedserve.background import start_task, stop_tasks
from embedserve.contracts import hybrid, late_chunks, wire
from embedserve.contracts.hybrid import HybridOutputs, Output
from embedserve.contracts.memory import EngineStatus
from embedserve.contracts.wire import Matrix
from embedserve.upstream.client import AiohttpEngineClient, CallFailed, CallTimeout, EngineClient
from embedserve.upstream.protocols import EMBEDDINGS, EngineProtocol
from embedserve.upstream.throughput import Throughput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineError(Exception):
    """Base: ``status`` is what the gateway answers the client."""

    status = 503

    def __init__(self, message: str, engine: str | None = None) -> None:
        super().__init__(message)
        self.engine = engine


class EngineUnavailable(EngineError):
    status = 503


class EngineTimeout(EngineError):
    status = 504


class EngineRejected(EngineError):
    """The engine refused the input (4xx): the gateway let through what it should not have."""

    status = 400


@dataclass
class EngineState:
    url: str
    gpu: int | None = None  # which GPU a local engine runs on (several may share one)
    ready: bool = False
    retiring: bool = False  # being replaced: gets no new calls, finishes what it holds
    outstanding_tokens: int = 0
    outstanding_calls: int = 0
    consecutive_failures: int = 0
    last_success: float | None = None
    down_reason: str = ""  # why it is not ready now; cleared once it is
    # the last failure after the engine first became ready (a starting engine refusing
    # connections is no error), with its wall-clock time: history, kept after recovery
    last_error: str = ""
    last_error_at: float | None = None
    ever_ready: bool = False
    calls: int = 0
    inflight_since: dict[int, float] = field(default_factory=dict)
    # start of the oldest call that timed out with no success since: a call gives up after
    # the deadline, so without this a hung engine would never look older than one deadline
    stalled_since: float | None = None
    throughput: Throughput = field(default_factory=Throughput)
    cache_counters: tuple[float, float] | None = None  # prompt tokens, of which cached

    def stuck_for_s(self, now: float) -> float | None:
        """How long the oldest unanswered (or timed-out, unrecovered) call has waited."""
        starts = list(self.inflight_since.values())
        if self.stalled_since is not None:
            starts.append(self.stalled_since)
        return now - min(starts) if starts else None


SGLANG_PROMPT_TOKENS = "sglang:prompt_tokens_total"
SGLANG_CACHED_TOKENS = "sglang:cached_tokens_total"


def prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """(prompt tokens, cached tokens) summed over label sets; None when not exposed."""
    sums = {SGLANG_PROMPT_TOKENS: 0.0, SGLANG_CACHED_TOKENS: 0.0}
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += float(sample.value)
                    seen = True
    except ValueError:
        return None
    return (sums[SGLANG_PROMPT_TOKENS], sums[SGLANG_CACHED_TOKENS]) if seen else None


class EnginePool:
    def __init__(
        self,
        urls: list[str],
        model: str,
        *,
        request_timeout_s: float,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 10.0,
        unreachable_after_failures: int = 5,
        client: EngineClient | None = None,
        base64_vectors: bool = True,
        capacity_call_tokens: int = 0,
        gpus: list[int | None] | None = None,
        protocol: EngineProtocol = EMBEDDINGS,
    ) -> None:
        """``client`` replaces the network to the engines (tests use a fake engine);
        calls of at least ``capacity_call_tokens`` measure the engines' capacity; ``gpus``:
        each engine's GPU, where known; ``protocol``: how the model's rows are asked for
        (vectors, or a reranker's scores)."""
        self.protocol = protocol
        self._capacity_call_tokens = capacity_call_tokens
        self.engines = [
            EngineState(u.rstrip("/"), gpu=g, throughput=Throughput(min_tokens=capacity_call_tokens))
            for u, g in zip(urls, gpus or [None] * len(urls), strict=True)
        ]
        self._model = model
        self._timeout = request_timeout_s
        self._health_interval = health_interval_s
        self._health_timeout = health_timeout_s
        self._unreachable_after = unreachable_after_failures
        self._client = client
        self._base64 = base64_vectors
        self._checker: asyncio.Task[None] | None = None
        self._ready_event = asyncio.Event()
        self._call_ids = 0

    async def start(self) -> None:
        if self._client is None:  # the session belongs to the running loop
            self._client = AiohttpEngineClient(self._timeout)
        self._checker = start_task(
            "engine-health", self._check_loop, context={"model": self._model}, restart_after_s=0.5
        )

    async def stop(self) -> None:
        await stop_tasks(self._checker)
        if self._client:
            await self._client.aclose()

    # -- state -------------------------------------------------------------------------
    @property
    def model(self) -> str:
        return self._model

    @property
    def any_ready(self) -> bool:
        return any(e.ready for e in self.engines)

    @property
    def ever_ready(self) -> bool:
        return any(e.ever_ready for e in self.engines)

    def reachable(self) -> bool:
        """False once every engine that has served failed this many health checks in a row:
        the engines are gone, not busy (a busy SGLang answers its health check slowly)."""
        if self.any_ready or not self.ever_ready:
            return True
        return any(e.consecutive_failures < self._unreachable_after for e in self.engines)

    def statuses(self) -> list[EngineStatus]:
        return [
            EngineStatus(
                url=e.url,
                model=self._model,
                gpu=e.gpu,
                ready=e.ready,
                outstanding_tokens=e.outstanding_tokens,
                calls=e.calls,
                last_error=e.last_error,
                last_error_at=e.last_error_at,
            )
            for e in self.engines
        ]

    def tokens_per_s(self) -> float | None:
        """The ready engines' measured capacity together; ``None`` before any measurement."""
        rates = [r for e in self.engines if e.ready and (r := e.throughput.tokens_per_s())]
        return sum(rates) if rates else None

    def detail(self) -> str:
        states = (f"{e.url}: {'ready' if e.ready else e.down_reason or 'starting'}" for e in self.engines)
        return "; ".join(states)

    def forget_stuck(self, url: str) -> None:
        """After its process was killed, the engine's unanswered calls are history."""
        if engine := self.by_url(url):
            engine.inflight_since.clear()
            engine.stalled_since = None

    def by_url(self, url: str) -> EngineState | None:
        """The engine at ``url``; None once it has left the pool (an engine being replaced leaves
        before its supervisor is swapped for the new one's)."""
        return next((e for e in self.engines if e.url == url.rstrip("/")), None)

    def add(self, url: str, ready: bool = True, gpu: int | None = None) -> EngineState:
        """A new engine (one that replaces another): takes calls at once when ``ready``."""
        engine = EngineState(url.rstrip("/"), gpu=gpu, ready=ready, ever_ready=ready,
                             throughput=Throughput(min_tokens=self._capacity_call_tokens))
        self.engines.append(engine)
        return engine

    def remove(self, url: str) -> None:
        if engine := self.by_url(url):
            self.engines.remove(engine)

    def oldest_inflight_age_s(self) -> float | None:
        now = time.monotonic()
        ages = [a for e in self.engines if (a := e.stuck_for_s(now)) is not None]
        return max(ages) if ages else None

    def last_success_age_s(self) -> float | None:
        done = [e.last_success for e in self.engines if e.last_success is not None]
        return time.monotonic() - max(done) if done else None

    def _pick(self) -> EngineState:
        ready = [e for e in self.engines if e.ready and not e.retiring]
        if not ready:
            raise EngineUnavailable("no engine is ready")
        return min(ready, key=lambda e: (e.outstanding_tokens, e.outstanding_calls))

    def _mark_down(self, engine: EngineState, why: str) -> None:
        if engine.ready:
            log.warning("engine down", extra={"engine": engine.url, "reason": why})
        engine.ready = False
        engine.consecutive_failures += 1
        engine.down_reason = why
        if engine.ever_ready:
            engine.last_error, engine.last_error_at = why, time.time()

    # -- health ------------------------------------------------------------------------
    async def check_once(self) -> None:
        """Checks every engine; one check's failure is logged with its engine, and the others
        still count."""
        assert self._client is not None
        engines = list(self.engines)
        results = await asyncio.gather(*(self._check(e) for e in engines), return_exceptions=True)
        for engine, result in zip(engines, results, strict=True):
            if isinstance(result, Exception):
                log.error("engine health check failed", exc_info=result,
                          extra={"engine": engine.url, "model": self._model})
            elif isinstance(result, BaseException):
                raise result

    async def _check(self, engine: EngineState) -> None:
        assert self._client is not None
        answered = False
        try:
            status, _ = await self._client.get(f"{engine.url}/health", self._health_timeout)
            ok = answered = status == 200
            why = f"health answered {status}"
        except CallTimeout:
            # A busy engine answers /health slowly (SGLang runs a forward pass); recent
            # successful calls prove it is serving.
            recent = engine.last_success and time.monotonic() - engine.last_success < 10
            ok, why = bool(recent), "health check timed out"
        except CallFailed as exc:
            ok, why = False, f"unreachable: {exc}"
        if ok:
            if answered:  # it answered just now: whatever stalled before has passed
                engine.stalled_since = None
                await self._read_cache_counters(engine)
            self._mark_up(engine)
        else:
            self._mark_down(engine, why)

    def warmed(self, url: str, tokens: int, seconds: float) -> None:
        """The engine at ``url`` just answered its warm-up call: it serves from now on (not from
        the next health check, seconds away), and its capacity is that call's."""
        if engine := self.by_url(url):
            engine.throughput.record(tokens, seconds)
            self._mark_up(engine)

    def _mark_up(self, engine: EngineState) -> None:
        if not engine.ready:
            log.info("engine ready", extra={"engine": engine.url})
        engine.ready = engine.ever_ready = True
        engine.consecutive_failures = 0
        engine.down_reason = ""

    async def _read_cache_counters(self, engine: EngineState) -> None:
        """The engine's prefix-cache counters (SGLang with --enable-metrics), re-exported by
        the gateway so a load test through it can tell how much the cache served."""
        assert self._client is not None
        try:
            status, body = await self._client.get(f"{engine.url}/metrics", self._health_timeout)
        except (CallTimeout, CallFailed):
            return
        if status == 200:
            engine.cache_counters = prefix_cache_counters(body.decode("utf-8", "replace"))

    async def _check_loop(self) -> None:
        while True:
            await self.check_once()
            interval = self._health_interval if self.any_ready else 0.5
            await asyncio.sleep(interval)

    # -- calls -------------------------------------------------------------------------
    async def embed(self, batch: list[list[int]]) -> Matrix:
        """Vectors for token-id inputs, in order (a late-chunked input's, one per chunk, follow
        one another: ``contracts/late_chunks.py``). Raises an ``EngineError`` subclass."""
        body = self.protocol.encode(self._model, batch, self._base64)
        rows = late_chunks.expected_rows(batch)
        return await self._call(batch, self.protocol.path, body, lambda c: self.protocol.decode(c, rows))

    async def embed_outputs(self, batch: list[list[int]], outputs: list[Output]) -> HybridOutputs:
        """``outputs`` of a model that has them (``contracts/hybrid.py``), for token-id inputs,
        in order. Raises an ``EngineError`` subclass."""
        body = hybrid.encode_request(self._model, batch, outputs)
        return await self._call(batch, EMBEDDINGS.path, body,
                                lambda content: hybrid.decode_response(content, len(batch), outputs))

    async def _call(self, batch: list[list[int]], path: str, body: bytes, decode: Callable[[bytes], T]) -> T:
        """``body`` posted to ``path`` of the engine with the fewest outstanding tokens, and its
        answer read by ``decode``; the engine's state follows what happened."""
        assert self._client is not None
        engine = self._pick()
        tokens = sum(len(ids) for ids in batch)
        self._call_ids += 1
        call_id = self._call_ids
        engine.outstanding_tokens += tokens
        engine.outstanding_calls += 1
        engine.inflight_since[call_id] = time.monotonic()
        engine.throughput.started(tokens)
        ok = False
        try:
            status, content = await self._client.post_json(f"{engine.url}{path}", body)
            ok = status < 400
        except CallTimeout as exc:
            engine.stalled_since = engine.stalled_since or engine.inflight_since.get(call_id)
            raise EngineTimeout("the engine did not answer in time", engine.url) from exc
        except CallFailed as exc:
            self._mark_down(engine, f"call failed: {exc}")
            raise EngineUnavailable("the engine is unreachable", engine.url) from exc
        except asyncio.CancelledError:
            started = engine.inflight_since.get(call_id)
            if started is not None and time.monotonic() - started >= 0.9 * self._timeout:
                # abandoned at its deadline: to the hang detector, the engine did not answer
                engine.stalled_since = engine.stalled_since or started
            raise
        finally:
            engine.outstanding_tokens -= tokens
            engine.outstanding_calls -= 1
            engine.inflight_since.pop(call_id, None)
            engine.throughput.finished(tokens, ok)
        if status >= 500:
            self._mark_down(engine, f"engine answered {status}")
            raise EngineUnavailable(f"the engine failed ({status})", engine.url)
        if status >= 400:
            raise EngineRejected(wire.error_message(content), engine.url)
        engine.last_success = time.monotonic()
        engine.stalled_since = None
        engine.calls += 1
        try:
            return decode(content)
        except wire.WireError as exc:
            # the engine's fault: 503 to the client, never a 500
            raise EngineUnavailable(f"the engine returned an invalid response: {exc}", engine.url) from exc
