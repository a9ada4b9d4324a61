"""Where the time goes: a torch trace's GPU kernels by class and the idle gaps between them
(``summarise_trace``, for bench/kernel_profile.py), and py-spy over every process on the request's
path under load (``pyspy_under_load``: the gateway, SGLang's tokenizer manager, scheduler, detokenizer)."""

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

#: Kernel classes, the first that matches a kernel's full name: attention before GEMMs (FlashInfer's
#: and FA3's prefill kernels are CUTLASS templates), and by namespace, not "flash" (FlashInfer's
#: norms, RoPE and activations live in ``flashinfer::``); norms before copies (inductor names a
#: fused RMSNorm ``triton_red_fused__to_copy_add_mean_mul_pow_rsqrt``).
KERNEL_CLASSES = tuple((kind, re.compile(pattern, re.I)) for kind, pattern in (
    ("attention", r"flash::|flash_fwd|flash_?attn|fmha|attention|prefillwith|batchprefill|mha_"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|wgmma|scaled_mm"),
    ("norm", r"norm|rsqrt"), ("rope", r"rope|rotary"), ("activation", r"silu|gelu|act_and_mul|swiglu"),
    ("copy", r"copy|memcpy|memset|cat|gather|scatter|index|fill|store_?kv|kvcache")))
GAP_BUCKETS_US = ((10, "under 10 us"), (100, "10-100 us"), (1000, "0.1-1 ms"), (float("inf"), "over 1 ms"))


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_CLASSES if pattern.search(name)), "other")


def summarise_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """GPU time by kernel kind, and the idle gaps between kernels, from a Chrome trace's events
    (what torch.profiler writes). Times in ms."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    gpu = sorted((float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "")), str(e.get("cat", "")))
                 for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in kinds)
    if not gpu:
        return {"kernels": 0}
    by_kind: dict[str, float] = collections.defaultdict(float)
    top: dict[str, float] = collections.defaultdict(float)
    kind_top: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for _, dur, name, cat in gpu:
        kind = kernel_kind(name) if cat.lower() == "kernel" else "copy"
        by_kind[kind] += dur
        top[name[:90]] += dur
        kind_top[kind][name[:200]] += dur  # an elementwise kernel's functor comes late in its name
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
    return {
        "kernels": len(gpu), "span_ms": round(span * ms, 3), "gpu_busy_ms": round(busy * ms, 3),
        "gpu_busy_pct": round(100 * busy / span, 1) if span else None,
        "kernel_ms_by_kind": {k: round(v * ms, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "idle_ms_by_gap": {label: round(gaps[label] * ms, 3) for _, label in GAP_BUCKETS_US},
        "gaps_by_size": {label: gap_count[label] for _, label in GAP_BUCKETS_US},
        "top_kernels_ms": {k: round(v * ms, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]},
        "top_kernels_by_kind_ms": {kind: {k: round(v * ms, 3) for k, v in sorted(
            names.items(), key=lambda kv: -kv[1])[:3]} for kind, names in kind_top.items()}}


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


def pyspy_under_load(target: Any, load: Any, out: Path, *, gateway_port: int, engine_port: int,
                     runs: Path, seconds: float = 8.0) -> dict[str, Any]:
    """Starts ``load`` against ``target`` (a gateway) and, once warmed up, py-spy over the path's
    processes for ``seconds``. The GPU's side of it: bench/kernel_profile.py."""
    from measure import measure

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
    spies = {name: (pyspy(pids[name] or 0, seconds, path), path) for name, path in files.items()}
    loader.join(timeout=load.seconds + 300)
    result["pids"] = pids
    result["pyspy"] = {name: summarise_pyspy(path.read_text(), 200, seconds) if path.exists() else
                       {"missing": "py-spy not installed" if proc is None else "no output"}
                       for name, (proc, path) in spies.items()}
    return result
