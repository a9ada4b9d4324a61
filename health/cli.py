"""``embedserve health``: the memory forecast of a running gateway, in a terminal.

Exit status (single shot): 0 no restart advised, 2 restart advised, 1 unreachable.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx
from pydantic import ValidationError

from embedserve.contracts.memory import MemoryReport, ProcessMemory


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{float(x) / 2**30:.2f}"


def _h(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 60:.0f}m" if x < 1 else f"{x:.1f}h"


def render(doc: MemoryReport, url: str) -> str:
    lines = [
        f"embedserve memory  {url}  {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"status: {doc.status}   restart advised: "
        f"{'YES' if doc.recommends_restart else 'no'}   binding: "
        f"{doc.binding_resource or '-'}   hours to OOM: "
        f"{_h(doc.estimated_hours_until_oom)} ({_h(doc.hours_lower)} .. {_h(doc.hours_upper)})",
        f"reason: {doc.reason}",
        "",
        f"{'resource':<9} {'used GiB':>9} {'peak':>8} {'limit':>8} {'GiB/h':>8} "
        f"{'95% interval':>15} {'to OOM':>8} {'window':>8} {'n':>6}  status / limit from",
    ]
    for name, r in doc.resources.items():
        lo, hi = r.slope_low_bytes_per_hour, r.slope_high_bytes_per_hour
        interval = "-" if lo is None else f"{_gib(lo)}..{_gib(hi)}"
        lines.append(
            f"{name:<9} {_gib(r.used_bytes):>9} {_gib(r.peak_bytes):>8} "
            f"{_gib(r.limit_bytes):>8} {_gib(r.slope_bytes_per_hour):>8} "
            f"{interval:>15} {_h(r.estimated_hours_until_oom):>8} "
            f"{_h(r.window_s / 3600):>8} {r.samples:>6}  "
            f"{r.status} / {r.limit_source} ({r.measure})"
        )
    lines.append("")
    if doc.gpu is None:
        lines.append(f"gpu: none ({doc.gpu_reason})")
    else:
        for d in doc.gpu.devices:
            lines.append(f"gpu {d.index} {d.name}: {_gib(d.used_bytes)} / {_gib(d.total_bytes)} GiB used")
    if doc.allocator:
        frag = doc.fragmentation
        lines.append(
            "allocator: "
            + ", ".join(
                f"pid {e.pid} reserved {_gib(e.reserved_bytes)} GiB allocated {_gib(e.allocated_bytes)} GiB"
                for e in doc.allocator
            )
            + f"; fragmentation {'-' if frag is None else f'{frag:.1%}'}, "
            f"retries {doc.num_alloc_retries}, OOMs {doc.num_ooms}, cache clears {doc.cache_clears}"
        )
    else:
        lines.append(f"allocator: none ({doc.allocator_reason})")
    for name, p in doc.processes.items():
        lines.append(process_line(name, p))
    return "\n".join(lines)


def process_line(name: str, p: ProcessMemory) -> str:
    """The process alone, then with its children: under ``up`` the gateway's children are
    the engines, which have lines of their own."""
    children = len(p.pids) - 1
    if children <= 0:
        return f"process {name} (pid {p.pid}): RSS {_gib(p.rss_bytes)} GiB"
    tree = f"{_gib(p.rss_bytes)} GiB with its {children} child process{'es' if children > 1 else ''}"
    if p.own_rss_bytes is None:
        return f"process {name} (pid {p.pid}): RSS {tree}"
    return f"process {name} (pid {p.pid}): RSS {_gib(p.own_rss_bytes)} GiB itself, {tree}"


def fetch(url: str, api_key: str | None, timeout: float) -> MemoryReport:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/health/memory", headers=headers, timeout=timeout)
    r.raise_for_status()
    return MemoryReport.model_validate_json(r.content)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="embedserve health",
        description="Print the memory forecast of a running gateway (its /health/memory). Exit "
        "status, single shot: 0 no restart advised, 2 restart advised, 1 unreachable.",
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    ap.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    ap.add_argument("--json", action="store_true", help="print the raw answer")
    ap.add_argument("--api-key", help="when gateway.protect_health is on")
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args(argv)
    try:
        return _loop(args)
    except KeyboardInterrupt:
        return 0


def _loop(args: argparse.Namespace) -> int:
    while True:
        try:
            doc = fetch(args.url, args.api_key, args.timeout)
            text = doc.model_dump_json(indent=2) if args.json else render(doc, args.url)
            code = 2 if doc.recommends_restart else 0
        except (httpx.HTTPError, ValidationError) as exc:
            text, code = f"cannot read {args.url}/health/memory: {exc}", 1
        if args.watch is None:
            print(text, file=sys.stdout if code != 1 else sys.stderr)
            return code
        if sys.stdout.isatty():
            print("\033[2J\033[H", end="")
        print(text, flush=True)
        time.sleep(args.watch)


if __name__ == "__main__":
    raise SystemExit(main())
