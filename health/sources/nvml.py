"""GPU memory through NVML (nvidia-ml-py): device totals and per-process use.

NVML reads the driver's accounting; it never creates a CUDA context, so the probe costs
no GPU memory. Without a driver ``nvmlInit`` raises ``NVMLError_LibraryNotFound``: the
source then reports ``available = False`` with the reason, and is retried rarely.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from embedserve.contracts.memory import GpuDevice


@dataclass
class GpuReading:
    available: bool
    reason: str | None = None
    devices: list[GpuDevice] = field(default_factory=list)


class NvmlSource:
    """Lazily initialised; a missing driver is remembered and retried every ``retry_s``."""

    def __init__(self, retry_s: float = 300.0) -> None:
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._initialised = False
        self._failed_at: float | None = None
        self._reason: str | None = None
        self._nvml: Any = None

    def _init(self) -> bool:
        if self._initialised:
            return True
        if self._failed_at is not None and time.monotonic() - self._failed_at < self._retry_s:
            return False
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError
            self._failed_at = time.monotonic()
            self._reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return False
        self._nvml = pynvml
        self._initialised = True
        self._reason = None
        return True

    def read(self) -> GpuReading:
        with self._lock:
            if not self._init():
                return GpuReading(available=False, reason=self._reason)
            try:
                return GpuReading(available=True, devices=self._read_devices())
            except Exception as exc:
                return GpuReading(available=False, reason=f"NVML query failed: {exc}")

    def _read_devices(self) -> list[GpuDevice]:
        nv = self._nvml
        out: list[GpuDevice] = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            reserved: int | None = None
            try:
                info = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
                reserved = int(info.reserved)
            except Exception:
                info = nv.nvmlDeviceGetMemoryInfo(handle)
            name = nv.nvmlDeviceGetName(handle)
            procs: dict[int, int] = {}
            try:
                for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = proc.usedGpuMemory
                    if used is not None:  # None when the driver withholds it
                        procs[int(proc.pid)] = procs.get(int(proc.pid), 0) + int(used)
            except Exception:
                pass
            out.append(
                GpuDevice(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    total_bytes=int(info.total),
                    used_bytes=int(info.used),
                    free_bytes=int(info.free),
                    reserved_bytes=reserved,
                    processes=procs,
                )
            )
        return out

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                with contextlib.suppress(Exception):
                    self._nvml.nvmlShutdown()
                self._initialised = False
