"""One measured run: `embedserve loadtest` (or bench/crosscheck.py) against a target, with the
GPU memory peak and the target's prefix-cache hit rate recorded next to its throughput."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cachestats
from gpu_memory import PeakSampler
from procs import child_env, embedserve_cmd

from embedserve.loadtest.mixes import SEED_BUCKETS

HERE = Path(__file__).resolve().parent

# Flags of `embedserve loadtest` that newer releases have; each is passed only when
# `embedserve loadtest --help` lists it. First name found wins.
UNIQUE_INPUT_FLAGS = ("--unique", "--unique-inputs")  # inputs no prefix cache can serve
RAW_ENGINE_IDS_FLAGS = ("--raw-engine", "--ids-to-engine")  # token ids sent on purpose
INPUT_TYPE_FLAGS = ("--input-type",)  # query | document
BUILD_WORKERS_FLAGS = ("--build-workers",)  # processes that build inputs ahead


@functools.cache
def loadtest_help() -> str:
    try:
        return subprocess.run([*embedserve_cmd(), "loadtest", "--help"], capture_output=True, text=True,
                              timeout=120, env=child_env()).stdout
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return ""


def supported(candidates: tuple[str, ...]) -> str | None:
    text = loadtest_help()
    return next((f for f in candidates if f"{f} " in text or f"{f}\n" in text or f"{f}," in text), None)


@dataclass
class Load:
    """What to send: a length mix, inputs per request and how many requests in flight."""

    mix: str  # loadtest --mix: "uniform:16-512", "seed", ...
    conc: int
    inputs: str = "1"
    seconds: float = 20.0
    warmup: float = 3.0
    input_type: str | None = None  # "query": the gateway adds the model's instruction prefix
    repeated_content: bool = False  # labelled scenario: inputs may repeat on purpose
    build_workers: int | None = None  # loadtest --build-workers; None: its default

    def scaled(self, factor: float) -> Load:
        return dataclasses.replace(self, seconds=max(2.0, round(self.seconds * factor, 1)),
                                   warmup=max(0.0, round(self.warmup * factor, 1)))


@dataclass
class Target:
    """Where to send it: a raw engine (token ids) or a gateway (texts)."""

    url: str  # base URL
    model_dir: str
    raw: bool  # raw engine: token ids; else texts of the same token counts
    engine_urls: list[str] = field(default_factory=list)  # for the cache counters
    cap: int = 8191  # longest input the engine accepts (context length minus one)
    gateway_pid: int | None = None
    timeout_s: float = 300.0  # a request unanswered this long counts as an error


def loadtest_argv(t: Target, load: Load, out: Path, seed: int) -> list[str]:
    """`embedserve loadtest` for one run: raw engines get token ids clamped to the cap, the
    gateway texts of the same token counts (same seed, same lengths)."""
    argv = [*embedserve_cmd(), "loadtest", t.url, "--tokenizer", t.model_dir, "--model",
            Path(t.model_dir).name, "--mix", load.mix, "--inputs", load.inputs,
            "--concurrency", str(load.conc), "--duration", f"{load.seconds:g}",
            "--warmup", f"{load.warmup:g}", "--seed", str(seed), "--out", str(out),
            "--no-progress", "--no-plots", "--health-url", "none", "--timeout", f"{t.timeout_s:g}",
            "--max-tokens", str(t.cap)]
    if t.raw:
        argv += ["--input", "ids"]
        if flag := supported(RAW_ENGINE_IDS_FLAGS):
            argv.append(flag)
    if load.build_workers is not None and supported(BUILD_WORKERS_FLAGS):
        argv += ["--build-workers", str(load.build_workers)]
    if not load.repeated_content and (flag := supported(UNIQUE_INPUT_FLAGS)):
        argv.append(flag)
    if load.input_type:
        flag = supported(INPUT_TYPE_FLAGS)
        if not flag:
            raise RuntimeError("this embedserve loadtest cannot send input_type; use crosscheck")
        argv += [flag, load.input_type]
    return argv


def row_from(doc: dict[str, Any]) -> dict[str, Any]:
    """The figures of one loadtest results.json that the tables use."""
    m = doc["measured"]
    lat = m.get("latency_ms", {})
    return {"seconds": m.get("duration_s"), "requests": m.get("ok", 0),
            "tok_s": round(float(m.get("tokens_per_s") or 0.0)),
            "req_s": round(float(m.get("requests_per_s") or 0.0), 2),
            "p50_ms": lat.get("p50"), "p95_ms": lat.get("p95"), "p99_ms": lat.get("p99"),
            "errors": m.get("errors", 0), "throttled_429": m.get("throttled_429", 0),
            "prefix_cache_hit_rate": find_hit_rate(doc),
            "answered_with_warmup": (doc.get("totals") or {}).get("ok")}


def find_hit_rate(doc: dict[str, Any]) -> float | None:
    """The loadtest report's hit rate: its ``prefix_cache`` section (read from the target's
    /metrics: SGLang's, the gateway's or vLLM's counters), else ``prefix_cache_hit_rate`` at
    the top level or in a section."""
    if isinstance((doc.get("prefix_cache") or {}).get("hit_rate"), int | float):
        return float(doc["prefix_cache"]["hit_rate"])
    if isinstance(doc.get("prefix_cache_hit_rate"), int | float):
        return float(doc["prefix_cache_hit_rate"])
    for value in doc.values():
        if isinstance(value, dict) and isinstance(value.get("prefix_cache_hit_rate"), int | float):
            return float(value["prefix_cache_hit_rate"])
    return None


def children_cpu_seconds() -> float:
    """User + system CPU time of the waited-for child processes (and theirs)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def host_cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole host from /proc/stat (None elsewhere)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of one process, from /proc (None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, t: Target, load: Load, runs_dir: Path, *, seed: int = 0,
            tags: dict[str, Any] | None = None, client: str = "loadtest") -> dict[str, Any]:
    """One run to its end, condensed to a row: throughput, latency, GPU memory peak, prefix
    cache hit rate (loadtest's own figure, else SGLang's counters before and after) and the
    gateway's CPU use."""
    out = runs_dir / name
    before = cachestats.snapshot(t.engine_urls) if t.engine_urls else None
    cpu0, t0 = (cpu_seconds(t.gateway_pid) if t.gateway_pid else None), time.monotonic()
    client0, host0 = children_cpu_seconds(), host_cpu_ticks()
    with PeakSampler() as peak:
        if client == "crosscheck":
            row = run_crosscheck(t, load, seed)
        else:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "client.log", "ab") as log:
                subprocess.run(loadtest_argv(t, load, out, seed), env=child_env(), stdout=log,
                               stderr=subprocess.STDOUT,
                               timeout=load.seconds + load.warmup + t.timeout_s + 60,
                               check=False)
            results = out / "results.json"
            if not results.exists():
                raise RuntimeError(f"loadtest wrote no results; see {out / 'client.log'}")
            row = row_from(json.loads(results.read_text()))
    after = cachestats.snapshot(t.engine_urls) if t.engine_urls else None
    if row.get("prefix_cache_hit_rate") is None:
        row["prefix_cache_hit_rate"] = cachestats.hit_rate(before, after)
    wall = time.monotonic() - t0
    if cpu0 is not None and t.gateway_pid and (cpu1 := cpu_seconds(t.gateway_pid)) is not None:
        row["gateway_cpu_pct"] = round(100 * (cpu1 - cpu0) / wall, 1)
        if answered := row.get("answered_with_warmup"):
            row["gateway_cpu_ms_per_request"] = round(1000 * (cpu1 - cpu0) / answered, 3)
    # the client's own CPU (its build processes included) and the whole host's: a client or
    # host out of cores caps a row as surely as the server does
    row["client_cpu_pct"] = round(100 * (children_cpu_seconds() - client0) / wall, 1)
    if host0 and (host1 := host_cpu_ticks()):
        row["host_cpu_busy_pct"] = round(100 * (host1[0] - host0[0]) / max(host1[1] - host0[1], 1), 1)
    row = {"name": name, **(tags or {}), "client": client, "mix": load.mix, "inputs": load.inputs,
           "conc": load.conc, **row, "gpu_used_gb": peak.peak, "gpu_used_per_gpu_gb": peak.per_gpu}
    if load.repeated_content:
        row["repeated_content"] = True
    print(json.dumps(row), flush=True)
    return row


def crosscheck_lengths(mix: str) -> str:
    """A loadtest length mix as bench/crosscheck.py's weighted ranges; a mix it cannot send
    (real texts from a file) is refused rather than replaced by another."""
    kind, _, rest = mix.partition(":")
    if kind == "seed" and not rest:
        return ",".join(f"{w}:{lo}-{hi}" for w, lo, hi in SEED_BUCKETS)
    if kind == "uniform":
        return f"1:{rest}"
    if kind == "fixed":
        return f"1:{rest}-{rest}"
    if kind == "buckets":
        return rest
    raise ValueError(f"bench/crosscheck.py cannot send the mix {mix!r}")


def run_crosscheck(t: Target, load: Load, seed: int) -> dict[str, Any]:
    """bench/crosscheck.py with the same lengths (clamped to the cap, as loadtest's
    --max-tokens does), inputs per request and in-flight count."""
    argv = [sys.executable, str(HERE / "crosscheck.py"), t.url.rstrip("/") + "/v1/embeddings",
            "--model", Path(t.model_dir).name, "--concurrency", str(load.conc),
            "--seconds", f"{load.seconds:g}", "--warmup", f"{load.warmup:g}", "--seed", str(seed + 1000),
            "--batch", load.inputs.split("-")[-1], "--cap", str(t.cap)]
    argv += ["--ids" if t.raw else "--text", crosscheck_lengths(load.mix), "--tokenizer", t.model_dir]
    if load.input_type:
        argv += ["--input-type", load.input_type]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=load.seconds + 300,
                          env=child_env(), check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"crosscheck failed: {done.stderr[-800:]}")
    return json.loads(lines[-1])
