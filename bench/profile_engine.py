"""Where an engine's time goes under load (``profile_under_load``): SGLang's torch profile of its
scheduler (GPU kernels by kind, the gaps between them) and py-spy over every process on the
request's path (the gateway, SGLang's HTTP + tokenizer manager, scheduler and detokenizer)."""

from __future__ import annotations

import collections
import gzip
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from embedserve.runtime.ports import listener_pids

GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|wgmma|scaled_mm", re.I)
ATTENTION = re.compile(r"flash|fmha|attention|batchprefill|prefill|mha_", re.I)
GAP_BUCKETS_US = ((10, "under 10 us"), (100, "10-100 us"), (1000, "0.1-1 ms"), (float("inf"), "over 1 ms"))


def kernel_kind(name: str) -> str:
    """Attention first: FlashInfer's prefill kernels are CUTLASS templates, so their names
    match the GEMM pattern too."""
    return "attention" if ATTENTION.search(name) else "gemm" if GEMM.search(name) else "other"


def summarise_trace(events: list[dict[str, Any]], steps: int | None = None) -> dict[str, Any]:
    """GPU time by kernel kind, and the idle gaps between kernels, from a Chrome trace's events
    (what torch.profiler writes). Times in ms."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    gpu = sorted((float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "")), str(e.get("cat", "")))
                 for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in kinds)
    if not gpu:
        return {"kernels": 0}
    by_kind: dict[str, float] = collections.defaultdict(float)
    top: dict[str, float] = collections.defaultdict(float)
    for _, dur, name, cat in gpu:
        by_kind[kernel_kind(name) if cat.lower() == "kernel" else "memcpy/memset"] += dur
        top[name[:90]] += dur
    busy = 0.0
    gaps: dict[str, float] = collections.defaultdict(float)
    gap_count: collections.Counter[str] = collections.Counter()
    end = gpu[0][0]
    for ts, dur, _, _ in gpu:
        if ts > end:
            gap = ts - end
            label = next(label for limit, label in GAP_BUCKETS_US if gap < limit)
            gaps[label] += gap
            gap_count[label] += 1
        busy += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
    span = end - gpu[0][0]
    ms = 1e-3
    out: dict[str, Any] = {
        "kernels": len(gpu), "span_ms": round(span * ms, 3), "gpu_busy_ms": round(busy * ms, 3),
        "gpu_busy_pct": round(100 * busy / span, 1) if span else None,
        "kernel_ms_by_kind": {k: round(v * ms, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "idle_ms_by_gap": {label: round(gaps[label] * ms, 3) for _, label in GAP_BUCKETS_US},
        "gaps_by_size": {label: gap_count[label] for _, label in GAP_BUCKETS_US},
        "top_kernels_ms": {k: round(v * ms, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]}}
    if steps:
        out["steps"] = steps
        out["per_step_ms"] = {"span": round(span * ms / steps, 3), "gpu_busy": round(busy * ms / steps, 3)}
    return out


def load_trace(path: Path) -> list[dict[str, Any]]:
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        doc = json.load(f)
    return list(doc.get("traceEvents", doc) if isinstance(doc, dict) else doc)


def summarise_pyspy(text: str, rate_hz: float, seconds: float, top: int = 12) -> dict[str, Any]:
    """py-spy's raw (collapsed) output recorded with ``--threads``: each thread's share of the
    time it was on a CPU, and the functions the busiest thread spent it in (inclusive and own)."""
    per_thread: collections.Counter[str] = collections.Counter()
    stacks: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        per_thread[thread] += int(count)
        stacks[thread][";".join(frames)] += int(count)
    ticks = rate_hz * seconds
    threads = {t: round(100 * n / ticks, 1) for t, n in per_thread.most_common(6)}
    if not per_thread:
        return {"threads_cpu_pct": {}}
    busiest = per_thread.most_common(1)[0][0]
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for stack, n in stacks[busiest].items():
        frames = [_short(f) for f in stack.split(";") if f]
        for f in set(frames):
            inclusive[f] += n
        if frames:
            own[frames[-1]] += n
    total = per_thread[busiest]
    return {"threads_cpu_pct": threads, "busiest_thread": busiest,
            "inclusive_pct": {f: round(100 * n / total, 1) for f, n in inclusive.most_common(top)},
            "own_pct": {f: round(100 * n / total, 1) for f, n in own.most_common(top)}}


def _short(frame: str) -> str:
    """``func (path/to/module.py:123)`` -> ``func (module.py)``."""
    m = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame.strip())
    return f"{m.group(1)} ({Path(m.group(2)).name})" if m else frame.strip()


# -- on the GPU host -------------------------------------------------------------------------------

def listener_pid(port: int) -> int | None:
    """The process listening on a TCP port."""
    return next((pid for pid in listener_pids(port) if pid), None)


def sglang_processes(main_pid: int) -> dict[str, int]:
    """SGLang's HTTP process and the children it names by role (setproctitle)."""
    found = {"sglang http": main_pid}
    for child in psutil.Process(main_pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        for role in ("scheduler", "detokenizer"):
            if role in title and f"sglang {role}" not in found:
                found[f"sglang {role}"] = child.pid
    return found


def pyspy(pid: int, seconds: float, out: Path, rate_hz: int = 200) -> subprocess.Popen[bytes] | None:
    # pip --target puts the binary in the target's bin/ (the offline hosts' /tmp/site)
    exe = shutil.which("py-spy") or next(
        (str(p / "bin" / "py-spy") for p in map(Path, sys.path) if (p / "bin" / "py-spy").exists()), None)
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", str(rate_hz), "--format", "raw", "--threads", "--nonblocking",
                             "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def profile_under_load(target: Any, load: Any, out: Path, *, gateway_port: int, engine_port: int,
                       runs: Path, pyspy_s: float = 8.0, steps: int = 40) -> dict[str, Any]:
    """Starts ``load`` against ``target`` (a gateway) and, once warmed up, py-spy over the
    path's processes for ``pyspy_s``, then the engine's torch profile for ``steps`` batches;
    summarises both. ``load`` must last for both (about 24 s)."""
    from measure import measure
    from procs import http_post_json

    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: result.update(row=measure(
        f"profile-{out.name}", target, load, runs, seed=50, tags={"case": "profile"})))
    loader.start()
    time.sleep(load.warmup + 4)  # the loadtest's own start-up, then its warm-up
    pids = {"gateway": listener_pid(gateway_port)}
    if engine := listener_pid(engine_port):
        pids.update(sglang_processes(engine))
    files = {name: out / f"{name.replace(' ', '-')}.txt" for name, pid in pids.items() if pid}
    spies = {name: (pyspy(pids[name] or 0, pyspy_s, path), path) for name, path in files.items()}
    for proc, _ in spies.values():  # py-spy first: the torch profile's export (gzip in the
        if proc:                    # scheduler) would otherwise fill its samples
            proc.wait(timeout=pyspy_s + 60)
    trace_dir = out / "torch"
    # GPU activity only: recording every CPU op slowed the engine sixfold, which stretches
    # the gaps between kernels that the profile is meant to show
    body = {"output_dir": str(trace_dir), "num_steps": steps, "activities": ["GPU"]}
    try:
        http_post_json(f"http://127.0.0.1:{engine_port}/start_profile", body, timeout=60)
    except ValueError:
        pass  # SGLang answers in plain text
    except Exception as exc:  # recorded, the rest goes on
        result["torch_error"] = repr(exc)[:300]
    loader.join(timeout=load.seconds + 300)
    result["pids"] = pids
    result["pyspy"] = {name: summarise_pyspy(path.read_text(), 200, pyspy_s) if path.exists() else
                       {"missing": "py-spy not installed" if proc is None else "no output"}
                       for name, (proc, path) in spies.items()}
    deadline = time.time() + 60
    traces: list[Path] = []
    while time.time() < deadline and not traces and "torch_error" not in result:  # none coming
        traces = sorted(trace_dir.glob("*.json*")) if trace_dir.exists() else []
        time.sleep(1)
    if traces:
        time.sleep(2)  # the file may still be being written
        result["torch_trace"] = {"file": traces[0].name, "mb": round(traces[0].stat().st_size / 2**20, 1),
                                 **summarise_trace(load_trace(traces[0]), steps)}
    return result
