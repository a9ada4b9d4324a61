"""Compute threads follow the cores the process may use: affinity, capped by the cgroup quota
(v2 ``cpu.max``, v1 ``cfs_quota_us``/``cfs_period_us``), the tightest level winning."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from embedserve.engines.cores import cgroup_cpu_quota, usable_cores


def tree(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_cgroup)
    return root, proc


def test_v2_quota_along_the_path(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, "0::/kube/pod1\n", {
        "cpu.max": "max 100000\n",
        "kube/cpu.max": "300000 100000\n",
        "kube/pod1/cpu.max": "150000 100000\n",
    })
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert usable_cores(root, proc) == min(2, len(os.sched_getaffinity(0)))  # 1.5 CPUs: 2 threads


def test_v2_without_a_limit(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) is None
    assert usable_cores(root, proc) == len(os.sched_getaffinity(0))


def test_v1_quota(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_cpu_quota(root, proc) == 1.0
    assert usable_cores(root, proc) == 1


@pytest.mark.parametrize("text", ["", "0::/\n"])
def test_no_cgroup_files_means_no_limit(tmp_path: Path, text: str) -> None:
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(text)
    assert cgroup_cpu_quota(tmp_path / "absent", proc) is None
