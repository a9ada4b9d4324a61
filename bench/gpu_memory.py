"""GPU memory in use, read from outside the engine (NVML, else nvidia-smi): the engine's
memory lives in SGLang's scheduler process, so only the driver sees all of it. Without a
GPU every reading is None, so the same steps run on a CPU-only machine."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
from typing import Any

GB = 1e9


def gpu_used_gb() -> list[float] | None:
    """Memory in use on every visible GPU, in GB; None without a GPU driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return _from_smi()
    try:
        return [round(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used / GB, 2)
                for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def tree_used_gb(roots: dict[str, list[int]]) -> dict[str, float]:
    """GPU memory of each named set of processes and all their descendants (a stack: `up`
    starts each engine in a session of its own, so a process group misses them), over all
    GPUs, from NVML's per-process figures; empty without NVML."""
    import psutil

    members: dict[str, set[int]] = {}
    for name, pids in roots.items():
        found = set(pids)
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                found.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        members[name] = found
    reader = ProcessGpuReader()
    try:
        reading = reader.read()
    finally:
        reader.close()
    if reading is None:
        return {}
    per_pid, _ = reading
    return {name: round(sum(per_pid.get(p, 0) for p in pids) / GB, 2) for name, pids in members.items()}


class ProcessGpuReader:
    """NVML's memory per process (host pid -> bytes, summed over the GPUs) and each GPU's
    memory in use, read as often as needed after one nvmlInit; ``read`` returns None
    without a GPU driver."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:
            self._nvml = None

    def read(self) -> tuple[dict[int, int], list[int]] | None:
        nv = self._nvml
        if nv is None:
            return None
        per_pid: dict[int, int] = {}
        used: list[int] = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                used.append(int(nv.nvmlDeviceGetMemoryInfo(handle).used))
                for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                    pid = int(proc.pid)
                    per_pid[pid] = per_pid.get(pid, 0) + int(proc.usedGpuMemory or 0)
        except Exception:
            return None
        return per_pid, used

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None


def _from_smi() -> list[float] | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return [round(float(x) * 2**20 / GB, 2) for x in out.split()]  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def gpu_description() -> list[str]:
    """Name and memory of each GPU, for the report's "how it was produced" lines."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


class PeakSampler:
    """The highest total GPU memory in use while a run lasts (every 0.5 s, in a thread)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peak: float | None = None
        self.per_gpu: list[float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            used = gpu_used_gb()
            if used is not None and (self.peak is None or sum(used) > self.peak):
                self.peak, self.per_gpu = round(sum(used), 2), used
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
