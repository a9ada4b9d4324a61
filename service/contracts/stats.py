"""The engine statistics file: how an engine process tells the health sampler about the
memory it owns.

Engines own the memory (SGLang's scheduler subprocess, the CPU engine); the gateway
process owns the probes. One JSON file per engine process, ``{stats_dir}/engine-{pid}.json``,
replaced atomically, connects them without a CUDA context or an RPC in the probe's path.
A file whose pid is gone is stale and skipped.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field


class EngineStats(BaseModel):
    """One engine process's memory figures; the field names are the file's keys."""

    model_config = ConfigDict(extra="ignore")

    pid: int = Field(default_factory=os.getpid)
    model: str = Field("", description="the model the engine serves")
    started_at: float = Field(default_factory=time.time)
    time: float = 0.0
    source: Literal["torch.cuda", "cpu"] = "cpu"
    device: int | None = None
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    inactive_split_bytes: int = 0
    max_reserved_bytes: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    batches: int = 0
    cache_clears: int = 0
    cache_clear_seconds_total: float = 0.0
    last_clear_time: float | None = None
    last_clear_freed_bytes: int = 0
    rss_bytes: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fragmentation(self) -> float | None:
        """Inactive-split / reserved: the share of reserved memory empty_cache() cannot return."""
        return self.inactive_split_bytes / self.reserved_bytes if self.reserved_bytes > 0 else None


def stats_path(stats_dir: str | Path, pid: int) -> Path:
    return Path(stats_dir) / f"engine-{pid}.json"


def write_stats(stats_dir: str | Path, stats: EngineStats) -> None:
    """Atomic replace, so a reader never sees half a file."""
    folder = Path(stats_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stats.time = time.time()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".engine-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(stats.model_dump_json())
        os.replace(tmp, stats_path(folder, stats.pid))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_all_stats(stats_dir: str | Path, check_pid: bool = True) -> list[EngineStats]:
    """Live engines' latest figures; unreadable files and dead processes are skipped.

    ``check_pid=False`` when the engines run in another PID namespace (another container).
    """
    folder = Path(stats_dir)
    if not folder.is_dir():
        return []
    out: list[EngineStats] = []
    for path in sorted(folder.glob("engine-*.json")):
        try:
            stats = EngineStats.model_validate_json(path.read_bytes())
        except (OSError, ValidationError):
            continue
        if not check_pid or _pid_alive(stats.pid):
            out.append(stats)
    return out
