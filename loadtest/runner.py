"""The runner: sends planned requests open loop (Poisson) or closed loop (concurrency),
records every attempt, honours 429 Retry-After, and stops at its limits."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import errno
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from embedserve.loadtest import records as R
from embedserve.loadtest.records import Recorder
from embedserve.loadtest.traffic import Planned, RequestFactory, poisson_arrivals, prefetcher


@dataclass
class RunConfig:
    """Limits and shape of one run. ``duration_s`` and ``requests`` exclude warm-up."""

    url: str
    mode: Literal["open", "closed"] = "closed"
    rate: float = 1.0
    concurrency: int = 1
    duration_s: float | None = None
    requests: int | None = None
    warmup_s: float = 0.0
    warmup_requests: int = 0
    timeout_s: float = 60.0
    # None: one connection per request in flight (concurrency; open loop: max_in_flight).
    # HTTP/1.1 carries one request at a time per connection, so fewer connections than
    # requests in flight queue requests inside the client: the run then measures aiohttp's
    # pool wait (a 4 s P95 tail on the lab at 512 in flight over 256 connections), not the target.
    max_connections: int | None = None
    max_in_flight: int = 1024
    retries_429: int = 3
    max_retry_after_s: float = 60.0
    max_run_s: float = 7 * 24 * 3600.0
    drain_s: float | None = None
    headers: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    build_workers: int = 0  # processes building requests ahead; 0: one thread

    def __post_init__(self) -> None:
        if self.duration_s is None and self.requests is None:
            raise ValueError("a run needs a duration or a request count")
        if self.mode == "open" and self.rate <= 0:
            raise ValueError("open loop needs --rate > 0")
        if self.mode == "closed" and self.concurrency < 1:
            raise ValueError("closed loop needs --concurrency >= 1")
        if self.mode == "closed" and self.max_connections is not None \
                and self.max_connections < self.concurrency:
            raise ValueError(f"--max-connections {self.max_connections} < --concurrency "
                             f"{self.concurrency}: the extra requests would wait in the client")

    @property
    def connection_limit(self) -> int:
        """Two spare connections: the memory sampler shares the session and must neither
        wait for a load request's connection nor take one."""
        if self.max_connections is not None:
            return self.max_connections
        return (self.concurrency if self.mode == "closed" else self.max_in_flight) + 2


@dataclass
class RunOutcome:
    """What the run produced, for the report."""

    rec: Recorder
    measured_start: float
    measured_end: float
    stop_reason: str
    dropped_arrivals: int
    dispatch_lag_ms_max: float
    error_samples: dict[str, str]
    wall_s: float


def retry_after_s(value: str | None, default: float = 1.0) -> float:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return default
    return max(0.0, when.timestamp() - time.time())


def _classify(exc: BaseException) -> int:
    if isinstance(exc, TimeoutError):
        return R.TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_err = getattr(exc, "os_error", None)
        if isinstance(os_err, ConnectionRefusedError) or (
            getattr(os_err, "errno", None) == errno.ECONNREFUSED
        ):
            return R.REFUSED
        return R.CLIENT_ERROR
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return R.DISCONNECTED
    return R.CLIENT_ERROR


class Runner:
    """One run against one URL. Call ``await run(next_request)``; ``stop()`` ends it early."""

    def __init__(self, cfg: RunConfig, on_tick: Callable[[Runner], None] | None = None) -> None:
        self.cfg = cfg
        self.rec = Recorder()
        self.on_tick = on_tick
        self.t0 = 0.0
        self.issued = 0
        self.in_flight = 0
        self.dropped = 0
        self.errors = 0
        self.throttled = 0
        self.lag_max = 0.0
        self.stop_reason = ""
        self.error_samples: dict[str, str] = {}
        self._stop = asyncio.Event()
        self._not_before = 0.0
        self._measured_start: float | None = None
        self._dispatch_end = 0.0

    # -- limits ---------------------------------------------------------------
    @property
    def total_requests(self) -> int | None:
        c = self.cfg
        return None if c.requests is None else c.requests + c.warmup_requests

    @property
    def end_time(self) -> float:
        c = self.cfg
        if c.duration_s is None:
            return c.max_run_s
        return min(c.warmup_s + c.duration_s, c.max_run_s)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def stop(self, reason: str = "stopped by user") -> None:
        if not self._stop.is_set():
            self.stop_reason = self.stop_reason or reason
            self._stop.set()

    def _may_issue(self) -> bool:
        if self._stop.is_set():
            return False
        total = self.total_requests
        if total is not None and self.issued >= total:
            self.stop_reason = self.stop_reason or "request count reached"
            return False
        if self.now() >= self.end_time:
            self.stop_reason = self.stop_reason or (
                "duration reached" if self.cfg.duration_s is not None else "max run time reached")
            return False
        return True

    def is_warm(self, index: int, t: float) -> bool:
        return index < self.cfg.warmup_requests or t < self.cfg.warmup_s

    # -- one request ----------------------------------------------------------
    async def _attempt(self, session: aiohttp.ClientSession, p: Planned
                       ) -> tuple[int, int, str | None]:
        """(code, usage prompt tokens or -1, Retry-After)."""
        try:
            async with session.post(self.cfg.url, data=p.body, allow_redirects=False) as r:
                body = await r.read()
                if 200 <= r.status < 300:
                    try:
                        doc = orjson.loads(body)
                        data = doc["data"]
                        usage = (doc.get("usage") or {}).get("prompt_tokens", -1)
                    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                        self._sample_error(R.BAD_RESPONSE, body)
                        return R.BAD_RESPONSE, -1, None
                    if len(data) != p.n_inputs:
                        self._sample_error(R.BAD_RESPONSE, b"%d vectors for %d inputs"
                                           % (len(data), p.n_inputs))
                        return R.BAD_RESPONSE, -1, None
                    return r.status, int(usage) if isinstance(usage, int) else -1, None
                self._sample_error(r.status, body)
                return r.status, -1, r.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as e:
            code = _classify(e)
            self._sample_error(code, repr(e).encode())
            return code, -1, None

    def _sample_error(self, code: int, body: bytes) -> None:
        key = R.code_name(code)
        if key not in self.error_samples and len(self.error_samples) < 32:
            self.error_samples[key] = body[:400].decode("utf-8", "replace")

    async def _wait_gate(self) -> bool:
        """Wait out a 429's Retry-After; False if the run stopped meanwhile."""
        delay = self._not_before - time.perf_counter()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
        return not self._stop.is_set() or delay <= 0

    async def _send(self, session: aiohttp.ClientSession, p: Planned) -> None:
        self.in_flight += 1
        try:
            for attempt in range(self.cfg.retries_429 + 1):
                if not await self._wait_gate():
                    return
                t_send = self.now()
                if self._measured_start is None and not self.is_warm(p.index, t_send):
                    self._measured_start = t_send
                code, usage = R.CANCELLED, -1
                try:
                    code, usage, retry_after = await self._attempt(session, p)
                finally:
                    self.rec.add(t_send, self.now() - t_send, code, p.tokens, usage,
                                 p.n_inputs, self.is_warm(p.index, t_send))
                if code == 429:
                    self.throttled += 1
                elif not 200 <= code < 300:
                    self.errors += 1
                if code != 429 or attempt == self.cfg.retries_429:
                    return
                wait = min(retry_after_s(retry_after), self.cfg.max_retry_after_s)
                self._not_before = max(self._not_before, time.perf_counter() + wait)
        finally:
            self.in_flight -= 1

    # -- loops ----------------------------------------------------------------
    async def _closed(self, session: aiohttp.ClientSession,
                      get: Callable[[], Awaitable[Planned]]) -> None:
        async def worker() -> None:
            while self._may_issue():
                self.issued += 1
                p = await get()
                await self._send(session, p)

        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency)))

    async def _open(self, session: aiohttp.ClientSession,
                    get: Callable[[], Awaitable[Planned]]) -> set[asyncio.Task[None]]:
        tasks: set[asyncio.Task[None]] = set()
        for due in poisson_arrivals(self.cfg.rate, self.cfg.seed):
            delay = due - self.now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
            if due >= self.end_time:
                self.stop_reason = self.stop_reason or (
                    "duration reached" if self.cfg.duration_s is not None
                    else "max run time reached")
                break
            if not self._may_issue():
                break
            if self.in_flight >= self.cfg.max_in_flight:
                self.dropped += 1  # the target is this far behind: don't pile up more
                continue
            self.issued += 1
            p = await get()
            self.lag_max = max(self.lag_max, self.now() - due)
            task = asyncio.create_task(self._send(session, p))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return tasks

    async def _ticker(self) -> None:
        while not self._stop.is_set():
            if self.on_tick:
                self.on_tick(self)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.5)

    async def run(self, make: Callable[[], Planned] | RequestFactory,
                  extra: Callable[[aiohttp.ClientSession, asyncio.Event],
                                  list[Awaitable[Any]]] | None = None) -> RunOutcome:
        """Run to the limits. ``extra`` starts side tasks (samplers) on the same session."""
        c = self.cfg
        prefetch = prefetcher(make, c.build_workers)
        await prefetch.prime(c.concurrency if c.mode == "closed" else None)
        self.t0 = time.perf_counter()
        connector = aiohttp.TCPConnector(limit=c.connection_limit, force_close=False)
        timeout = aiohttp.ClientTimeout(total=c.timeout_s)
        headers = {"Content-Type": "application/json", **c.headers}
        side_stop = asyncio.Event()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         headers=headers) as session:
            side = [asyncio.ensure_future(a) for a in (extra(session, side_stop) if extra else [])]
            ticker = asyncio.create_task(self._ticker())
            tasks: set[asyncio.Task[None]] = set()
            try:
                if c.mode == "closed":
                    await self._closed(session, prefetch.get)
                else:
                    tasks = await self._open(session, prefetch.get)
                # a closed loop stops sending at end_time; the answers still in flight
                # then are counted, but the drain after it is no time of the measured load
                self._dispatch_end = min(self.now(), self.end_time)
                if tasks:
                    drain = c.drain_s if c.drain_s is not None else c.timeout_s + 1.0
                    _, pending = await asyncio.wait(tasks, timeout=drain)
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
            finally:
                prefetch.close()
                self.stop(self.stop_reason or "done")
                side_stop.set()
                await asyncio.gather(ticker, *side, return_exceptions=True)
        if self.on_tick:
            self.on_tick(self)
        return self._outcome()

    def snapshot(self) -> RunOutcome:
        """The run so far (for periodic checkpoints while it is still going)."""
        start = self._measured_start if self._measured_start is not None else self.cfg.warmup_s
        now = self.now()
        return RunOutcome(self.rec, start, max(now, start), "running (checkpoint)",
                          self.dropped, round(self.lag_max * 1000, 3),
                          dict(self.error_samples), now)

    def _outcome(self) -> RunOutcome:
        rec = self.rec
        start = self._measured_start if self._measured_start is not None else self.cfg.warmup_s
        if self.cfg.duration_s is not None and self.stop_reason == "duration reached":
            end = self._dispatch_end
        else:
            measured = [t + lat for t, lat, w in zip(rec.t, rec.latency, rec.warm, strict=True)
                        if not w]
            end = max(measured, default=self._dispatch_end)
        return RunOutcome(rec, start, max(end, start), self.stop_reason, self.dropped,
                          round(self.lag_max * 1000, 3), self.error_samples, self.now())
