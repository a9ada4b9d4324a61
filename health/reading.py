"""One sampling tick: every source read once, and the limited resources derived from it.

Resources are what can run out: ``gpu:<index>`` per device and ``host``. Each has a used
figure and a limit, with the limit's origin named so an operator can check it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from embedserve.config import Settings
from embedserve.contracts.memory import MACHINE_RAM
from embedserve.health.sources.allocator import AllocatorReading, read_allocator
from embedserve.health.sources.cgroup import CgroupReading, read_cgroup
from embedserve.health.sources.nvml import GpuReading, NvmlSource
from embedserve.health.sources.processes import ProcessMemory, machine_memory, read_processes


@dataclass(frozen=True)
class ResourceLevel:
    used_bytes: float
    limit_bytes: float | None
    limit_source: str | None
    measure: str  # what "used" is


@dataclass
class Reading:
    time: float
    gpu: GpuReading
    allocator: AllocatorReading
    processes: dict[str, ProcessMemory]
    processes_missing: dict[str, str]
    cgroup: CgroupReading
    machine_total_bytes: int
    machine_used_bytes: int
    duration_s: float = 0.0
    resources: dict[str, ResourceLevel] = field(default_factory=dict)


@dataclass
class SourceConfig:
    stats_dir: str | None
    check_pid: bool = True
    gpu_limit_bytes: int | None = None
    host_limit_bytes: int | None = None
    cgroup_root: str = "/sys/fs/cgroup"
    proc_cgroup: str = "/proc/self/cgroup"

    @classmethod
    def from_settings(cls, settings: Settings) -> SourceConfig:
        return cls(
            stats_dir=settings.engine.stats_dir,
            gpu_limit_bytes=settings.health.gpu_memory_limit_bytes,
            host_limit_bytes=settings.health.host_memory_limit_bytes,
        )


def take_reading(nvml: NvmlSource, cfg: SourceConfig, pids: dict[str, int]) -> Reading:
    """Blocking (file and driver reads, a few ms): call it from a worker thread."""
    t0 = time.perf_counter()
    allocator = read_allocator(cfg.stats_dir, cfg.check_pid)
    procs, missing = read_processes(pids)
    _add_engine_processes(procs, missing, allocator)
    total, used = machine_memory()
    reading = Reading(
        time=time.time(),
        gpu=nvml.read(),
        allocator=allocator,
        processes=procs,
        processes_missing=missing,
        cgroup=read_cgroup(cfg.cgroup_root, cfg.proc_cgroup),
        machine_total_bytes=total,
        machine_used_bytes=used,
    )
    reading.resources = derive_resources(reading, cfg)
    reading.duration_s = time.perf_counter() - t0
    return reading


def _add_engine_processes(
    procs: dict[str, ProcessMemory], missing: dict[str, str], allocator: AllocatorReading
) -> None:
    """Engines that publish stats count even when the gateway did not start them (an
    engine container sharing the pod's PID namespace): ``engine[<pid>]``."""
    known = {pid for p in procs.values() for pid in p.pids}
    extra = {f"engine[{e.pid}]": e.pid for e in allocator.engines if e.pid not in known}
    if extra:
        found, lost = read_processes(extra)
        procs.update(found)
        missing.update(lost)


def outermost(procs: dict[str, ProcessMemory]) -> list[ProcessMemory]:
    """The named processes that are no descendant of another named one: each counts with
    its descendants, so under `up` the gateway's figure already holds its engines'."""
    out: dict[int, ProcessMemory] = {}
    for p in procs.values():
        if not any(q.pid != p.pid and p.pid in q.pids for q in procs.values()):
            out.setdefault(p.pid, p)
    return list(out.values())


def derive_resources(r: Reading, cfg: SourceConfig) -> dict[str, ResourceLevel]:
    out: dict[str, ResourceLevel] = {}
    our_pids = {pid for p in r.processes.values() for pid in p.pids}
    for dev in r.gpu.devices:
        name = f"gpu:{dev.index}"
        if cfg.gpu_limit_bytes is not None:
            ours = sum(b for pid, b in dev.processes.items() if pid in our_pids)
            if ours:
                out[name] = ResourceLevel(
                    ours, cfg.gpu_limit_bytes, "settings", "NVML memory of our processes"
                )
            else:
                out[name] = ResourceLevel(dev.used_bytes, cfg.gpu_limit_bytes, "settings", "NVML device used")
        else:
            out[name] = ResourceLevel(dev.used_bytes, dev.total_bytes, "device total", "NVML device used")
    if not r.gpu.available:
        # No NVML: the allocator's reserved memory is the best GPU figure there is.
        per_device: dict[int, float] = {}
        for e in r.allocator.engines:
            if e.source != "cpu" and e.device is not None:
                per_device[e.device] = per_device.get(e.device, 0.0) + e.reserved_bytes
        for index, reserved in per_device.items():
            limit = cfg.gpu_limit_bytes
            out[f"gpu:{index}"] = ResourceLevel(
                reserved,
                limit,
                "settings" if limit is not None else None,
                "allocator reserved (no NVML)",
            )
    if cfg.host_limit_bytes is not None and r.processes:
        rss = float(sum(p.rss_bytes for p in outermost(r.processes)))
        out["host"] = ResourceLevel(rss, cfg.host_limit_bytes, "settings", "RSS of our processes")
    elif r.cgroup.available and r.cgroup.limit_bytes is not None:
        ws = r.cgroup.working_set_bytes or r.cgroup.current_bytes or 0
        out["host"] = ResourceLevel(
            float(ws),
            r.cgroup.limit_bytes,
            f"cgroup v{r.cgroup.version} limit",
            "cgroup working set",
        )
    else:
        out["host"] = ResourceLevel(
            float(r.machine_used_bytes), r.machine_total_bytes, MACHINE_RAM, "machine used"
        )
    return out
