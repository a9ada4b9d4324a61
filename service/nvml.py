"""NVML (nvidia-ml-py): GPU facts without a CUDA context, so no process but an engine ever
holds GPU memory. Without a driver ``nvmlInit`` raises; callers degrade instead of crash."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")


def open_nvml() -> ModuleType:
    """The initialised ``pynvml`` module; raises without a driver (or without the package)."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


@contextlib.contextmanager
def nvml_session() -> Iterator[ModuleType | None]:
    """``pynvml`` for the duration of a block, or ``None`` where NVML is unavailable."""
    try:
        nv = open_nvml()
    except Exception:
        yield None
        return
    try:
        yield nv
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()


def gpu_count() -> int:
    with nvml_session() as nv:
        return int(nv.nvmlDeviceGetCount()) if nv else 0


def first_visible_gpu() -> int:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _query_gpu(index: int | None, read: Callable[[ModuleType, Any], T]) -> T | None:
    """``read(pynvml, handle)`` for a GPU (default: the first visible one); None without one."""
    with nvml_session() as nv:
        if nv is None:
            return None
        try:
            return read(nv, nv.nvmlDeviceGetHandleByIndex(first_visible_gpu() if index is None else index))
        except Exception:
            return None


def gpu_total_bytes(index: int | None = None) -> int | None:
    """Total memory of a GPU (default: the first visible one); None without one."""
    return _query_gpu(index, lambda nv, handle: int(nv.nvmlDeviceGetMemoryInfo(handle).total))


def gpu_compute_capability(index: int | None = None) -> tuple[int, int] | None:
    """(major, minor) of a GPU (default: the first visible one), e.g. (9, 0) for Hopper;
    None without one."""

    def read(nv: ModuleType, handle: Any) -> tuple[int, int]:
        major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)

    return _query_gpu(index, read)
