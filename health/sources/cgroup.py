"""The container's memory as the OOM killer sees it: cgroup v2, with a v1 fallback.

Reports ``current`` (all charged memory), ``working_set`` (current minus inactive file
cache, what the kubelet evicts on) and ``limit`` (``None`` when unlimited).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "unlimited" as a huge page-aligned number; anything above this is no limit.
_UNLIMITED = 1 << 60


@dataclass
class CgroupReading:
    available: bool
    version: int | None = None
    current_bytes: int | None = None
    working_set_bytes: int | None = None
    limit_bytes: int | None = None
    reason: str | None = None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _stat_value(path: Path, *keys: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    table = dict(line.split(maxsplit=1) for line in lines if " " in line)
    for key in keys:
        if key in table:
            try:
                return int(table[key])
            except ValueError:
                continue
    return 0


def _own_cgroup_dir(root: Path, proc_cgroup: Path, controller: str | None) -> Path | None:
    """The cgroup folder of this process; in a container that is usually ``root`` itself."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if (controller is None and controllers == "") or (
            controller is not None and controller in controllers.split(",")
        ):
            candidate = root / rel.lstrip("/")
            return candidate if candidate.is_dir() else root
    return None


def read_cgroup(
    root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup"
) -> CgroupReading:
    base = Path(root)
    own = _own_cgroup_dir(base, Path(proc_cgroup), None)
    for folder in (own, base):
        if folder is not None and (folder / "memory.current").exists():
            current = _read_int(folder / "memory.current")
            inactive = _stat_value(folder / "memory.stat", "inactive_file")
            return CgroupReading(
                available=current is not None,
                version=2,
                current_bytes=current,
                working_set_bytes=None if current is None else max(current - inactive, 0),
                limit_bytes=_read_int(folder / "memory.max"),
            )
    v1_root = base / "memory"
    for folder in (_own_cgroup_dir(v1_root, Path(proc_cgroup), "memory"), v1_root):
        if folder is not None and (folder / "memory.usage_in_bytes").exists():
            current = _read_int(folder / "memory.usage_in_bytes")
            inactive = _stat_value(folder / "memory.stat", "total_inactive_file", "inactive_file")
            return CgroupReading(
                available=current is not None,
                version=1,
                current_bytes=current,
                working_set_bytes=None if current is None else max(current - inactive, 0),
                limit_bytes=_read_int(folder / "memory.limit_in_bytes"),
            )
    return CgroupReading(available=False, reason=f"no cgroup memory controller under {base}")
