"""The background sampler: read the sources, keep the history, precompute the forecast.

Each tick runs in a worker thread (driver and file reads block) and ends by swapping in
one immutable ``MemoryState``; requests only read that reference, so they never wait.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from embedserve.background import start_task, stop_tasks
from embedserve.config import HealthSettings
from embedserve.contracts.memory import (
    Advice,
    MemoryReport,
    ResourceForecast,
    SamplerEvent,
    SamplerInfo,
    Thresholds,
)
from embedserve.health.engine_view import EngineView
from embedserve.health.forecast import ForecastParams, forecast_resource
from embedserve.health.history import Event, History, Sample
from embedserve.health.reading import Reading, SourceConfig, take_reading
from embedserve.health.report import advice, build_report
from embedserve.health.sources.nvml import NvmlSource

log = logging.getLogger(__name__)

PERSIST_EVERY_S = 60.0


@dataclass(frozen=True)
class MemoryState:
    time: float
    reading: Reading
    forecasts: dict[str, ResourceForecast]
    report: MemoryReport = field(repr=False)

    @property
    def advice(self) -> Advice:
        return self.report


def fit_start(history: History, params: ForecastParams, clears_reset: bool) -> tuple[float, str]:
    """Where the fit may begin: after the warm-up that follows the last (re)start, or an
    isolated cache clear (one that follows the previous by at least ``min_span_s``).
    Routine clears, more frequent than that, are spanned by the peak envelope instead."""
    start_ev = history.last_event("restart", "probe_start")
    origin = start_ev.time if start_ev else 0.0
    start = origin + params.warmup_s
    why = "the engine restart" if start_ev and start_ev.kind == "restart" else "start"
    if params.warmup_s > 0:
        why += " and its warm-up"
    if clears_reset:
        clears = [e for e in history.events if e.kind == "cache_clear" and e.time >= origin]
        if clears:
            prev = clears[-2].time if len(clears) > 1 else origin
            if clears[-1].time - prev >= params.min_span_s and clears[-1].time > start:
                start, why = clears[-1].time, "the last cache clear"
    return start, why


class MemoryMonitor:
    def __init__(
        self,
        health: HealthSettings,
        source_cfg: SourceConfig,
        engine_view: Callable[[], EngineView],
        process_pids: Callable[[], dict[str, int]],
        nvml: NvmlSource | None = None,
    ) -> None:
        self.health = health
        self.params = ForecastParams.from_settings(health)
        self.source_cfg = source_cfg
        self.engine_view = engine_view
        self.process_pids = process_pids
        self.nvml = nvml or NvmlSource()
        self.history = (
            History.load(health.persist_path, health.history_max_samples)
            if health.persist_path
            else History(health.history_max_samples)
        )
        self.state: MemoryState | None = None
        self._identity: str | None = None
        self._clears: int | None = None
        self._last_persist = 0.0
        self._task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()

    # one tick ----------------------------------------------------------------------
    def _engine_identity(self, reading: Reading) -> str:
        try:
            restarts = self.engine_view().restarts
        except Exception:
            restarts = -1
        return f"restarts={restarts} engines={list(reading.allocator.identity)}"

    def _note_events(self, reading: Reading) -> None:
        identity = self._engine_identity(reading)
        if self._identity is None:
            prior = self.history.last_event("restart", "probe_start")
            if prior is None or prior.detail != identity:
                started = [e.started_at for e in reading.allocator.engines]
                origin = min(started) if started else reading.time
                kind = "probe_start" if prior is None else "restart"
                self.history.add_event(Event(min(origin, reading.time), kind, identity))
        elif identity != self._identity:
            self.history.add_event(Event(reading.time, "restart", identity))
            self._clears = None
        clears = reading.allocator.cache_clears
        if self._clears is not None and clears > self._clears:
            when = reading.allocator.last_clear_time or reading.time
            self.history.add_event(Event(min(when, reading.time), "cache_clear", f"{clears - self._clears}"))
        self._identity, self._clears = identity, clears

    def tick(self) -> MemoryState:
        """Blocking: one reading, history and forecast. Safe to call from a thread."""
        with self._lock:
            return self._tick()

    def _tick(self) -> MemoryState:
        pids = self.process_pids()
        reading = take_reading(self.nvml, self.source_cfg, pids)
        self._note_events(reading)
        self.history.append(Sample(reading.time, {k: v.used_bytes for k, v in reading.resources.items()}))
        forecasts: dict[str, ResourceForecast] = {}
        for name, level in reading.resources.items():
            start, why = fit_start(self.history, self.params, name.startswith("gpu"))
            t, y = self.history.series(name)
            forecasts[name] = forecast_resource(
                name, t, y, level.limit_bytes, level.limit_source, start, self.params, why
            )
        verdict = advice(forecasts, self.health.warning_hours, self.health.critical_hours)
        report = build_report(reading, forecasts, verdict, self._thresholds(), self._sampler_info(reading))
        state = MemoryState(reading.time, reading, forecasts, report)
        self.state = state
        self._maybe_persist(reading.time)
        return state

    def _thresholds(self) -> Thresholds:
        p = self.params
        return Thresholds(
            warning_hours=self.health.warning_hours,
            critical_hours=self.health.critical_hours,
            horizon_cap_hours=p.horizon_cap_hours,
            warmup_s=p.warmup_s,
            min_span_s=p.min_span_s,
            min_samples=p.min_samples,
            window_s=p.window_s,
            envelope_s=p.envelope_s,
        )

    def _sampler_info(self, reading: Reading) -> SamplerInfo:
        return SamplerInfo(
            interval_s=self.health.sample_interval_s,
            history_samples=len(self.history),
            sample_duration_s=reading.duration_s,
            events=[
                SamplerEvent(time=e.time, kind=e.kind, detail=e.detail)
                for e in list(self.history.events)[-5:]
            ],
        )

    def _maybe_persist(self, now: float, force: bool = False) -> None:
        path = self.health.persist_path
        if force:
            with self._lock:
                self._save(path)
            return
        if not path or now - self._last_persist < PERSIST_EVERY_S:
            return
        self._save(path)
        self._last_persist = now

    def _save(self, path: str | None) -> None:
        if not path:
            return
        try:
            self.history.save(path)
        except OSError as exc:
            log.warning("cannot persist memory history to %s: %s", path, exc)

    # background loop ---------------------------------------------------------------
    async def _run(self) -> None:
        interval = self.health.sample_interval_s
        while True:
            began = time.monotonic()
            try:
                await asyncio.to_thread(self.tick)
            except Exception:
                log.exception("memory sample failed")
            await asyncio.sleep(max(interval - (time.monotonic() - began), 0.0))

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = start_task("embedserve-health-sampler", self._run,
                                    restart_after_s=self.health.sample_interval_s)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks(task)
        if self.state is not None:
            await asyncio.to_thread(self._maybe_persist, time.time(), True)
        await asyncio.to_thread(self.nvml.close)
