"""Background samplers: the target's ``/health/memory``, gauges of its ``/metrics``, and local
process resources."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from embedserve.contracts.memory import MemoryReport
from embedserve.loadtest.memseries import SOURCES, series


@dataclass
class MemorySampler:
    """Polls ``GET /health/memory``; a 404 (or 405), or an answer that is not embedserve's
    report, means the target has none: stop asking."""

    url: str
    interval_s: float
    t0: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    status: str = "not sampled yet"
    failures: int = 0
    first_answer: Any = None
    last_answer: Any = None

    async def sample_once(self, session: aiohttp.ClientSession) -> bool:
        """One sample; returns False when the endpoint is absent and sampling should stop."""
        try:
            async with session.get(self.url, allow_redirects=False,
                                   timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status in (404, 405):
                    self.status = f"absent (HTTP {r.status}): not sampled"
                    return False
                if r.status != 200:
                    self.failures += 1
                    self.status = f"last answer HTTP {r.status}"
                    return True
                body = await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            self.failures += 1
            self.status = f"last attempt failed: {type(e).__name__}"
            return True
        try:
            report = MemoryReport.model_validate_json(body)
        except ValidationError:
            self.status = "not an embedserve /health/memory report: not sampled"
            return False
        answer = report.model_dump(mode="json")
        self.samples.append({"t": round(time.perf_counter() - self.t0, 3), **series(report)})
        if self.first_answer is None:
            self.first_answer = answer
        self.last_answer = answer
        self.status = "sampled"
        return True

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while await self.sample_once(session):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            if stop.is_set():
                await self.sample_once(session)
                return

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "status": self.status, "failures": self.failures,
                "fields": SOURCES, "samples": self.samples,
                "first_answer": self.first_answer, "last_answer": self.last_answer}


def gauge_values(text: str, names: list[str]) -> dict[str, float | None]:
    """The named samples of a Prometheus page, summed over label sets; None when absent."""
    out: dict[str, float | None] = dict.fromkeys(names)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] = (out[s.name] or 0.0) + float(s.value)
    return out


@dataclass
class GaugeSampler:
    """Polls the target's ``/metrics`` for a few gauges (``--gauge``): how the server's own
    view of its load moved while the run drove it."""

    url: str
    names: list[str]
    interval_s: float
    t0: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0

    async def sample_once(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(self.url, allow_redirects=False,
                                   timeout=aiohttp.ClientTimeout(total=10)) as r:
                text = await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            text = None
        if text is None:
            self.failures += 1
            return
        values = gauge_values(text, self.names)
        self.samples.append({"t": round(time.perf_counter() - self.t0, 3), **values})

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample_once(session)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    def to_json(self, start_s: float, end_s: float) -> dict[str, Any]:
        """Every sample, and each gauge's median, min and max over the measured time."""
        measured: dict[str, Any] = {}
        for name in self.names:
            vs = [s[name] for s in self.samples if start_s <= s["t"] <= end_s and s[name] is not None]
            measured[name] = {"samples": len(vs), "median": float(np.median(vs)) if vs else None,
                              "min": min(vs, default=None), "max": max(vs, default=None)}
        return {"url": self.url, "failures": self.failures, "measured": measured,
                "samples": self.samples}


def _tree_rss(proc: psutil.Process) -> int:
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total


@dataclass
class ProcessSampler:
    """This load generator's CPU and RSS, the host's, and RSS of processes named by pid."""

    interval_s: float
    t0: float
    watch_pids: list[int] = field(default_factory=list)
    client: list[dict[str, float]] = field(default_factory=list)
    watched: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._me = psutil.Process()
        self._me.cpu_percent(None)
        psutil.cpu_percent(None)
        self._procs: dict[int, psutil.Process] = {}
        for pid in self.watch_pids:
            with contextlib.suppress(psutil.Error):
                self._procs[pid] = psutil.Process(pid)
            self.watched[str(pid)] = []

    def sample_once(self) -> None:
        t = round(time.perf_counter() - self.t0, 3)
        vm = psutil.virtual_memory()
        self.client.append({
            "t": t, "cpu_percent": self._me.cpu_percent(None),
            "rss_bytes": float(self._me.memory_info().rss),
            "host_cpu_percent": psutil.cpu_percent(None),
            "host_used_bytes": float(vm.total - vm.available),
        })
        for pid, proc in list(self._procs.items()):
            try:
                self.watched[str(pid)].append({
                    "t": t, "rss_bytes": float(proc.memory_info().rss),
                    "tree_rss_bytes": float(_tree_rss(proc))})
            except psutil.Error:
                del self._procs[pid]  # gone: keep what was sampled

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
        self.sample_once()

    def to_json(self) -> dict[str, Any]:
        return {"client": self.client, "watched_pids": self.watched}
