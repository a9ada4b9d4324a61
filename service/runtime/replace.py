"""`up` acts on its own forecast: an engine whose memory will run out within
``health.replace_below_hours`` is replaced before it does, one at a time.

Beside the old one when memory allows: start the replacement on a spare port, wait until
it is ready and warmed up, route new work to it, let the old engine finish what it holds,
then stop it. Without room for two, drain first: the gateway answers 503 with Retry-After
while the old engine stops and the new one starts. Outside Kubernetes this is the whole
rolling restart; under a restart controller, turn it off (``health.replace_engines``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import psutil

from embedserve.config import Settings
from embedserve.contracts.memory import MACHINE_RAM, GpuDevice, MemoryReport, ProcessMemory
from embedserve.health.sources.nvml import NvmlSource
from embedserve.health.sources.processes import read_processes
from embedserve.runtime.ports import check_free, check_owner
from embedserve.runtime.supervisor import ProcessSupervisor
from embedserve.upstream.pool import EnginePool

log = logging.getLogger(__name__)

#: make a supervisor for engine slot ``index`` listening on ``port``
MakeSupervisor = Callable[[int, int], ProcessSupervisor]


@dataclass(frozen=True)
class Due:
    index: int
    reason: str
    resource: str = "host"


def due(
    report: MemoryReport | None,
    settings: Settings,
    engine_rss: list[int],
    ages_s: list[float],
    since_last_s: float,
    engine_gpu_bytes: list[int] | None = None,
) -> Due | None:
    """Which engine to replace now, if any (pure: the tests drive it with reports). On a
    GPU that runs out, the engine there that holds the most of it (``engine_gpu_bytes``:
    NVML's figure for each engine's processes on its own GPU)."""
    h = settings.health
    below = h.replace_below_hours or h.warning_hours
    hours = report.estimated_hours_until_oom if report else None
    if report is None or hours is None or hours > below or since_last_s < h.replace_cooldown_s:
        return None
    resource = report.binding_resource or ""
    binding = report.resource(resource)
    if binding is not None and binding.limit_source == MACHINE_RAM:
        return None  # the whole machine's memory, not ours: a new engine would not help
    if resource.startswith("gpu:"):
        gpu = int(resource.split(":")[1])
        on_gpu = [i for i in range(len(ages_s)) if settings.engine_gpu(i) == gpu] or [len(ages_s) - 1]
        held = engine_gpu_bytes or [0] * len(ages_s)
        index = max(on_gpu, key=lambda i: held[i])
    else:  # host memory: the engine that holds the most
        index = max(range(len(engine_rss)), key=lambda i: engine_rss[i]) if engine_rss else 0
    if ages_s[index] < h.replace_min_age_s:
        return None
    reason = f"{resource} runs out in {hours * 60:.1f} min (replacing under {below * 60:.1f} min)"
    return Due(index, reason, resource)


class EngineReplacer:
    def __init__(
        self,
        settings: Settings,
        pool: EnginePool,
        supervisors: list[ProcessSupervisor],
        make: MakeSupervisor,
        warm_up: Callable[[str], Awaitable[tuple[int, float]]],
        close_gate: Callable[[str], None],
        open_gate: Callable[[], None],
        on_replaced: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        spare_ports: tuple[int, int] | None = None,
        nvml: NvmlSource | None = None,
    ) -> None:
        """``spare_ports``: (first, step) of the ports replacements listen on; default: the ones
        after this model's engines (several models: each its own series past all their engines).
        ``nvml``: the GPU source, opened once and read from a thread."""
        self.spare_ports = spare_ports or (settings.engine.port + settings.local_engine_count(), 1)
        self.settings = settings
        self.pool = pool
        self.supervisors = supervisors
        self.make = make
        self.warm_up = warm_up
        self.close_gate = close_gate
        self.open_gate = open_gate
        self.on_replaced = on_replaced
        self.clock = clock
        self.nvml = nvml or NvmlSource()
        self.started_at = [clock()] * len(supervisors)
        self.last = float("-inf")
        self.count = 0

    async def check(self, report: MemoryReport | None) -> Due | None:
        """Which engine to replace now, if any; the readings (the engines' processes from /proc, NVML
        when a GPU runs out) run in a thread, never on the gateway's event loop."""
        now = self.clock()
        gpu = report is not None and (report.binding_resource or "").startswith("gpu:")
        families, devices = await asyncio.to_thread(self._read, list(self.supervisors), gpu)
        rss = [f.rss_bytes if f else 0 for f in families]
        ages = [now - t for t in self.started_at]
        gpu_held = (
            [self._gpu_held(f, devices, self.settings.engine_gpu(i)) for i, f in enumerate(families)]
            if gpu else None
        )
        return due(report, self.settings, rss, ages, now - self.last, gpu_held)

    def _read(
        self, supervisors: list[ProcessSupervisor], gpu: bool
    ) -> tuple[list[ProcessMemory | None], list[GpuDevice]]:
        """Blocking: each engine and its children, as health counts them (one walk of /proc for
        all), and the GPUs when asked for."""
        found, _ = read_processes({s.name: s.pid or 0 for s in supervisors})
        devices = self.nvml.read().devices if gpu else []
        return [found.get(s.name) for s in supervisors], devices

    @staticmethod
    def _gpu_held(family: ProcessMemory | None, devices: list[GpuDevice], index: int) -> int:
        """What the engine's processes hold on GPU ``index`` (NVML)."""
        device = next((d for d in devices if d.index == index), None)
        if device is None or family is None:
            return 0
        return sum(b for pid, b in device.processes.items() if pid in family.pids)

    def _room(self, old: ProcessSupervisor, resource: str) -> bool:
        """Blocking: whether a replacement fits beside ``old`` on the resource that runs out: a
        fresh engine needs at most what the old one holds now (its leak included). Other engines
        on the same GPU are in the device's used memory already."""
        gpu = resource.startswith("gpu:")
        (family,), devices = self._read([old], gpu)
        if not gpu:
            return psutil.virtual_memory().available > 1.5 * (family.rss_bytes if family else 0)
        index = int(resource.split(":")[1])
        device = next((d for d in devices if d.index == index), None)
        held = self._gpu_held(family, devices, index)
        return device is not None and held > 0 and device.free_bytes > held

    def _spare_port(self) -> int:
        e = self.settings.engine
        first, step = self.spare_ports
        port = first + step * self.count
        check_free(e.host, port, "engine", "--engine-port", "EMBEDSERVE_ENGINE__PORT")
        return port

    async def replace(self, d: Due) -> None:
        old = self.supervisors[d.index]
        old_url = old.ready_url.removesuffix("/health")
        room = await asyncio.to_thread(self._room, old, d.resource)
        serving = self.pool.by_url(old_url)
        gpu = serving.gpu if serving else None
        log.warning("replacing an engine before it runs out of memory",
                    extra={"engine": old.name, "reason": d.reason, "beside": room})
        self.last = self.clock()
        self.count += 1
        port = self._spare_port()
        new = self.make(d.index, port)
        new_url = new.ready_url.removesuffix("/health")
        if not room:
            self.close_gate("replacing an engine")
            await self._stop(old, old_url)
        try:
            await new.start()
            await new.wait_ready()
            assert new.pid is not None
            check_owner(port, new.pid, new.name)
            self.pool.add(new_url, ready=False, gpu=gpu)
            tokens, seconds = await self.warm_up(new_url)
        except BaseException:
            await new.stop(2.0)  # no orphan; beside the old one, the old one keeps serving
            self.pool.remove(new_url)
            if not room:
                self.open_gate()
            raise
        self.pool.warmed(new_url, tokens, seconds)  # new work goes here from now on
        if room:
            await self._stop(old, old_url)
        else:
            self.open_gate()
        self.supervisors[d.index] = new
        self.started_at[d.index] = self.clock()
        self.on_replaced(d.reason)
        log.warning("engine replaced", extra={"old": old.name, "new": new.name, "url": new_url})

    async def _stop(self, old: ProcessSupervisor, url: str) -> None:
        """The old engine takes no new calls, finishes what it holds (at most one request
        deadline), then stops."""
        engine = self.pool.by_url(url)
        log.info("old engine draining", extra={"engine": old.name})
        if engine is not None:
            engine.retiring = True
            deadline = self.clock() + self.settings.gateway.request_timeout_s
            while engine.outstanding_calls and self.clock() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await old.stop(self.settings.gateway.graceful_shutdown_s)
        self.pool.remove(url)

    async def run(self, report: Callable[[], MemoryReport | None]) -> None:
        await run_replacers([self], report, self.settings.health.sample_interval_s)


async def run_replacers(
    replacers: list[EngineReplacer], report: Callable[[], MemoryReport | None], interval_s: float
) -> None:
    """One replacement at a time over all the models' engines, the cooldown shared: after one
    model's engine is replaced, no other model's is until the cooldown has passed."""
    while True:
        await asyncio.sleep(interval_s)
        current = report()
        for r in replacers:
            d = await r.check(current)
            if d is None:
                continue
            try:
                await r.replace(d)
            except Exception:
                log.exception("engine replacement failed; the old engine keeps serving")
            for other in replacers:
                other.last = r.last
            break
