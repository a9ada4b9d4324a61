"""How many cores this process may use: its CPU affinity, capped by its cgroup's CPU quota.

``os.cpu_count()`` is the host's count; in a container limited to two CPUs on a 64-core
host it would start 64 compute threads that the quota then throttles.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup allows (``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us`` of v1), the tightest along the process's cgroup path; None: no limit."""
    limits: list[float] = []
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hierarchy == "0" and not controllers
        if v2:  # one unified tree
            base = root
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).exists() else root / "cpu"
        else:
            continue
        folder = base / path.lstrip("/")
        while True:  # from the process's own cgroup up to the mount's root
            limit = _limit(folder, v2)
            if limit is not None:
                limits.append(limit)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(limits) if limits else None


def _limit(folder: Path, v2: bool) -> float | None:
    if v2:
        quota, _, period = (_read(folder / "cpu.max") or "max").partition(" ")
    else:
        quota, period = _read(folder / "cpu.cfs_quota_us") or "-1", _read(folder / "cpu.cfs_period_us") or ""
    try:
        q, p = float(quota), float(period)
    except ValueError:  # "max": no limit
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The cores this process may run on: its affinity, capped by the cgroup quota (rounded up)."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores
