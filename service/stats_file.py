"""The allocator-statistics channel between engine processes and the health probe.

Engines own the memory (SGLang's scheduler subprocess, the CPU engine), the gateway
process owns the probe; a JSON file per engine process in a shared folder connects them
without a CUDA context or an RPC in the probe's path (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class EngineStats:
    """One engine process's memory figures; field names are the file's keys."""

    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)
    time: float = 0.0
    source: str = "cpu"
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
            json.dump(asdict(stats), fh)
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
    """Live engines' latest figures; files of dead processes are skipped.

    ``check_pid=False`` when the engines run in another PID namespace (another container).
    """
    folder = Path(stats_dir)
    if not folder.is_dir():
        return []
    known = set(EngineStats.__dataclass_fields__)
    out: list[EngineStats] = []
    for path in sorted(folder.glob("engine-*.json")):
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(raw, dict) or "pid" not in raw:
            continue
        if check_pid and not _pid_alive(int(raw["pid"])):
            continue
        out.append(EngineStats(**{k: v for k, v in raw.items() if k in known}))
    return out
