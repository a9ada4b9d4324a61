"""GPU memory and busy share, read from outside the servers (NVML): an engine's memory lives in
SGLang's scheduler process, so only the driver sees all of it. Without a GPU every reading is
None (or empty), so the same steps run on a CPU-only machine."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from typing import Any

from embedserve.nvml import open_nvml
from embedserve.runtime.ports import family

GB = 1e9


class Nvml:
    """NVML opened once (``open_nvml``), read as often as needed; ``None`` readings without a driver."""

    def __init__(self) -> None:
        self.nv: Any = None
        with contextlib.suppress(Exception):
            self.nv = open_nvml()

    def _handles(self) -> list[Any]:
        return [self.nv.nvmlDeviceGetHandleByIndex(i) for i in range(self.nv.nvmlDeviceGetCount())]

    def read(self) -> tuple[dict[int, int], list[int]] | None:
        """(host pid -> bytes summed over the GPUs, each GPU's bytes in use)."""
        per_pid: dict[int, int] = {}
        try:
            handles = self._handles()
            for h in handles:
                for proc in self.nv.nvmlDeviceGetComputeRunningProcesses(h):
                    per_pid[int(proc.pid)] = per_pid.get(int(proc.pid), 0) + int(proc.usedGpuMemory or 0)
            return per_pid, [int(self.nv.nvmlDeviceGetMemoryInfo(h).used) for h in handles]
        except Exception:  # no driver (self.nv is None) included
            return None

    def busy(self) -> int | None:
        """GPU 0's utilisation: the share of the last sample period a kernel ran."""
        with contextlib.suppress(Exception):
            return int(self.nv.nvmlDeviceGetUtilizationRates(self._handles()[0]).gpu)
        return None

    def describe(self) -> list[str]:
        """Name, memory and driver of each GPU, for the report's "how it was produced" lines."""
        with contextlib.suppress(Exception):
            driver = self.nv.nvmlSystemGetDriverVersion()
            return [f"{self.nv.nvmlDeviceGetName(h)}, {self.nv.nvmlDeviceGetMemoryInfo(h).total // 2**20} "
                    f"MiB, {driver}" for h in self._handles()]
        return []

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()
        self.nv = None


def once(what: str = "read") -> Any:
    """One reading (``read``, ``describe``) on an NVML opened and closed for it."""
    nvml = Nvml()
    try:
        return getattr(nvml, what)()
    finally:
        nvml.close()


def gpu_used_gb() -> list[float] | None:
    """Memory in use on every visible GPU, in GB."""
    reading = once()
    return None if reading is None else [round(b / GB, 2) for b in reading[1]]


def tree_used_gb(roots: dict[str, list[int]]) -> dict[str, float]:
    """GPU memory of each named set of processes and all their descendants (`up` starts each
    engine in a session of its own, which a process group would miss); empty without NVML."""
    members = {name: {p for pid in pids for p in family(pid) | {pid}} for name, pids in roots.items()}
    reading = once()
    if reading is None:
        return {}
    return {name: round(sum(reading[0].get(p, 0) for p in pids) / GB, 2) for name, pids in members.items()}


class Sampler:
    """While a run lasts, every 0.5 s: the highest total GPU memory in use (and each GPU's at
    that moment) and GPU 0's busy share with its time, so that a run's busy figure is the median
    over its measured window (``busy_last``), not over the load generator's start-up."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peak: float | None = None
        self.per_gpu: list[float] | None = None
        self.busy: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        nvml = Nvml()
        while nvml.nv is not None and not self._stop.is_set():
            reading = nvml.read()
            if reading is not None and (self.peak is None or sum(reading[1]) / GB > self.peak):
                self.per_gpu = [round(b / GB, 2) for b in reading[1]]
                self.peak = round(sum(reading[1]) / GB, 2)
            if (share := nvml.busy()) is not None:
                self.busy.append((time.monotonic(), share))
            self._stop.wait(self.interval_s)
        nvml.close()

    def busy_last(self, seconds: float) -> float | None:
        """The median busy share over the last ``seconds`` before the sampler stopped."""
        if not self.busy:
            return None
        end = self.busy[-1][0]
        return statistics.median(b for t, b in self.busy if t >= end - seconds)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
