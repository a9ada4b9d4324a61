"""Resident memory of the named processes (engine, gateway, ...) and their children.

SGLang's model lives in a scheduler subprocess of the launcher, so each named process
counts together with its descendants. A pid that is gone reads as absent, not zero.
"""

from __future__ import annotations

import psutil

from embedserve.contracts.memory import ProcessMemory


def read_processes(named: dict[str, int]) -> tuple[dict[str, ProcessMemory], dict[str, str]]:
    """``(found, missing)``: memory per name, and why a name has none."""
    found: dict[str, ProcessMemory] = {}
    missing: dict[str, str] = {}
    for name, pid in named.items():
        try:
            proc = psutil.Process(pid)
            family = [proc, *proc.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError) as exc:
            missing[name] = f"pid {pid}: {type(exc).__name__}"
            continue
        total = 0
        own: int | None = None
        pids: list[int] = []
        for member in family:
            try:
                rss = member.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += rss
            pids.append(member.pid)
            if member.pid == pid:
                own = rss
        if not pids:
            missing[name] = f"pid {pid}: gone"
            continue
        found[name] = ProcessMemory(name=name, pid=pid, rss_bytes=total, own_rss_bytes=own, pids=pids)
    return found, missing


def machine_memory() -> tuple[int, int]:
    """``(total, used)`` of the machine, used = total - available (the kernel's view)."""
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.total - vm.available)
