"""One measured run, condensed to a row: `embedserve loadtest` (or bench/crosscheck.py, or an
in-process side's own loop) against one side, with what the rules put beside the throughput
(bench/README.md): cache hits, GPU memory and busy share, the side's RSS, CPU per request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from random import Random
from typing import Any

import psutil
from gpu import Sampler, tree_used_gb
from harness import Host, Side
from procs import child_env, embedserve_cmd, http_get, http_post_json
from prometheus_client.parser import text_string_to_metric_families

from embedserve.health.sources.processes import read_processes
from embedserve.loadtest.cachehits import hit_rate, scrape_urls
from embedserve.loadtest.mixes import SEED_BUCKETS
from embedserve.loadtest.textbuild import WordBuilder

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Load:
    """What to send: a length mix, inputs per request and how many requests in flight."""

    mix: str  # loadtest --mix: "uniform:16-512", "seed", "fixed:20", ...
    conc: int
    inputs: str = "1"
    seconds: float = 20.0
    warmup: float = 3.0
    repeated_content: bool = False  # labelled scenario: inputs may repeat on purpose
    words: bool = False  # lengths in words, no tokenizer (loadtest's word builder)
    encoding: str | None = None  # encoding_format sent
    batches: tuple[int, ...] = ()  # what an in-process side runs for it (default: inputs)
    rerank: int = 0  # a rerank load: passages per request, one query of 8 words
    outputs: str | None = None  # the model's outputs asked (loadtest --outputs), e.g. "dense,sparse"

    def scaled(self, factor: float) -> Load:
        return dataclasses.replace(self, seconds=max(2.0, round(self.seconds * factor, 1)),
                                   warmup=max(0.0, round(self.warmup * factor, 1)))


@dataclass(frozen=True)
class Case:
    """One row of a comparison: ``rounds`` runs per side, the sides' order turned each round."""

    name: str
    load: Load
    rounds: int = 1


@dataclass
class Target:
    url: str  # the full embeddings URL
    model_dir: str
    model: str  # the name sent
    ids: bool  # token ids (a raw engine), else texts of the same token counts
    cap: int  # longest input sent
    metrics: list[str]  # /metrics pages with the prefix-cache counters
    front_pid: int | None = None  # embedserve's gateway: its CPU per request, its time per stage
    tree_pid: int | None = None  # the side's process tree: its GPU memory and RSS
    in_process: bool = False
    timeout_s: float = 300.0  # a request unanswered this long counts as an error
    rerank_url: str | None = None
    wrap: tuple[str, str] = ("{}", "{}")  # Side.wrap


def target(host: Host, side: Side) -> Target:
    base = f"http://127.0.0.1:{side.port}"
    metrics = [f"http://127.0.0.1:{p}/metrics" for p in side.engine_ports()] or [base + "/metrics"]
    own = (host.work.state["procs"].get(side.key) or {}).get("pid")
    return Target(base + side.kind.route, host.model(side.shape), host.served_name(side.shape),
                  side.takes_ids, host.cap_of(side.shape), metrics, own if side.kind.front else None,
                  own, side.kind.in_process, side.kind.timeout_s,
                  base + side.kind.rerank if side.kind.rerank else None, side.wrap)


def loadtest_argv(t: Target, load: Load, out: Path, seed: int) -> list[str]:
    """Raw engines get token ids clamped to the cap, gateways texts of the same token counts
    (same seed, same lengths); every input unique unless the load says repeated content."""
    argv = [*embedserve_cmd(), "loadtest", t.url, "--model", t.model, "--mix", load.mix,
            "--inputs", load.inputs, "--concurrency", str(load.conc), "--duration", f"{load.seconds:g}",
            "--warmup", f"{load.warmup:g}", "--seed", str(seed), "--out", str(out), "--no-progress",
            "--no-plots", "--health-url", "none", "--timeout", f"{t.timeout_s:g}", "--max-tokens", str(t.cap)]
    argv += [] if load.words else ["--tokenizer", t.model_dir]
    argv += ["--input", "ids"] if t.ids else []
    argv += ["--encoding-format", load.encoding] if load.encoding else []
    argv += ["--outputs", load.outputs] if load.outputs else []
    argv += ["--repeat-rate", "0.5"] if load.repeated_content else []
    return argv


def row_from(doc: dict[str, Any]) -> dict[str, Any]:
    """The figures of one loadtest results.json that the tables use."""
    m = doc["measured"]
    lat = m.get("latency_ms", {})
    span = float(m.get("duration_s") or 0.0)
    return {"seconds": m.get("duration_s"), "requests": m.get("ok", 0),
            "tok_s": round(float(m.get("tokens_per_s") or 0.0)),
            "req_s": round(float(m.get("requests_per_s") or 0.0), 2),
            "inputs_s": round(m.get("inputs_ok", 0) / span, 1) if span else None,
            "p50_ms": lat.get("p50"), "p95_ms": lat.get("p95"), "p99_ms": lat.get("p99"),
            "errors": m.get("errors", 0), "throttled_429": m.get("throttled_429", 0),
            "prefix_cache_hit_rate": (doc.get("prefix_cache") or {}).get("hit_rate"),
            "answered_with_warmup": (doc.get("totals") or {}).get("ok")}


def run_loadtest(t: Target, load: Load, out: Path, seed: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "client.log", "ab") as log:
        subprocess.run(loadtest_argv(t, load, out, seed), env=child_env(), stdout=log,
                       stderr=subprocess.STDOUT, timeout=load.seconds + load.warmup + t.timeout_s + 60,
                       check=False)
    if not (out / "results.json").exists():
        raise RuntimeError(f"loadtest wrote no results; see {out / 'client.log'}")
    return row_from(json.loads((out / "results.json").read_text()))


def crosscheck_lengths(mix: str) -> str:
    """A loadtest length mix as bench/crosscheck.py's weighted ranges; a mix it cannot send
    (real texts from a file) is refused rather than replaced by another."""
    kind, _, rest = mix.partition(":")
    if kind == "seed" and not rest:
        return ",".join(f"{w}:{lo}-{hi}" for w, lo, hi in SEED_BUCKETS)
    if kind in ("uniform", "fixed", "buckets"):
        return {"uniform": f"1:{rest}", "fixed": f"1:{rest}-{rest}", "buckets": rest}[kind]
    raise ValueError(f"bench/crosscheck.py cannot send the mix {mix!r}")


def run_crosscheck(t: Target, load: Load, seed: int, requests: int | None = None) -> dict[str, Any]:
    """bench/crosscheck.py with the same lengths (clamped to the cap, as loadtest's --max-tokens does),
    inputs per request and in-flight count, for the load's time or exactly ``requests`` requests; the
    target's prefix-cache counters read before and after (crosscheck.py reads none)."""
    span = ["--requests", str(requests)] if requests else ["--seconds", f"{load.seconds:g}", "--warmup",
                                                           f"{load.warmup:g}"]
    argv = [sys.executable, str(HERE / "crosscheck.py"), t.url, "--model", t.model, "--concurrency",
            str(load.conc), *span,
            "--seed", str(seed + 1000), "--batch", load.inputs.split("-")[-1], "--cap", str(t.cap),
            "--ids" if t.ids else "--text", crosscheck_lengths(load.mix), "--tokenizer", t.model_dir]
    if load.rerank:  # the rerank route, pairs counted as run_rerank counts them
        argv[2] = str(t.rerank_url)
        argv += ["--rerank", str(load.rerank), "--wrap", *t.wrap]
    before = asyncio.run(scrape_urls(t.metrics, {}))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=load.seconds + 300, env=child_env(),
                          check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"crosscheck failed: {done.stderr[-800:]}")
    after = asyncio.run(scrape_urls(t.metrics, {}))
    row = dict(json.loads(lines[-1]))
    row["prefix_cache_hit_rate"] = hit_rate(before, after, t.metrics, load.repeated_content)["hit_rate"]
    return row


def run_in_process(t: Target, load: Load, seed: int, batch: int) -> dict[str, Any]:
    """An in-process side's own loop (bench/inprocess.py): the same kind of texts, ``batch`` at
    a time, for the load's duration."""
    words = int(load.mix.removeprefix("fixed:"))
    body = {"batch": batch, "words": words, "seconds": load.seconds, "seed": seed}
    row = http_post_json(t.url.removesuffix("/v1/embeddings") + "/run", body, timeout=load.seconds + 120)
    return {**row, "tok_s": round(row["inputs_s"] * words)}


def run_rerank(t: Target, load: Load, seed: int) -> dict[str, Any]:
    """Rerank requests in a closed loop (``load.rerank`` passages of the mix's words and a query,
    every text unique), counted after the warm-up: pairs (passages) scored per second."""
    import httpx

    words, builder, rng = int(load.mix.removeprefix("fixed:")), WordBuilder(seed), Random(seed)
    serial, lat, before = count(), [], asyncio.run(scrape_urls(t.metrics, {}))
    errors, start = 0, time.monotonic() + load.warmup

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while (t0 := time.monotonic()) < start + load.seconds:
            texts = [builder.build(words if i else 8, rng, next(serial))[0] for i in range(load.rerank + 1)]
            body = {"model": t.model, "query": t.wrap[0].format(texts[0]),
                    "documents": [t.wrap[1].format(x) for x in texts[1:]]}
            ok = (await client.post(str(t.rerank_url), json=body)).status_code == 200
            if t0 >= start and ok:
                lat.append(time.monotonic() - t0)
            errors += t0 >= start and not ok

    async def run() -> None:
        async with httpx.AsyncClient(timeout=t.timeout_s) as client:
            await asyncio.gather(*(worker(client) for _ in range(load.conc)))

    asyncio.run(run())
    pairs, after = len(lat) * load.rerank / load.seconds, asyncio.run(scrape_urls(t.metrics, {}))
    return {"inputs_s": round(pairs, 1), "tok_s": round(pairs * words), "requests": len(lat),
            "errors": errors, "p50_ms": round(1000 * statistics.median(lat), 2) if lat else None,
            "seconds": load.seconds,  # a prompt template's shared prefix may be served from a cache
            "prefix_cache_hit_rate": hit_rate(before, after, t.metrics, True)["hit_rate"]}


def cpu_seconds(pid: int | None, main_thread: bool = False) -> float | None:
    """User + system CPU of a process, or of its main thread (the gateway's event loop)."""
    with contextlib.suppress(psutil.Error, StopIteration, ValueError):
        proc = psutil.Process(pid or -1)  # no pid: ValueError
        times = next(t[1:3] for t in proc.threads() if t.id == pid) if main_thread else proc.cpu_times()[:2]
        return float(sum(times))
    return None


def stage_seconds(t: Target) -> dict[str, list[float]]:
    """An embedserve gateway's time in each stage of its requests so far (``embedserve_stage_seconds``:
    tokenize, queue for an engine call, the engine call), as [sum, count]; {} for other sides."""
    got: dict[str, list[float]] = {}
    with contextlib.suppress(ValueError):
        text = http_get(t.url.split("/v1/")[0] + "/metrics")[1] if t.front_pid else ""
        for s in (s for f in text_string_to_metric_families(text) if f.name == "embedserve_stage_seconds"
                  for s in f.samples if s.name.endswith(("_sum", "_count"))):
            got.setdefault(s.labels["stage"], [0.0, 0.0])[s.name.endswith("_count")] += s.value
    return got


#: SGLang's per-batch counters (``--enable-metrics``; the GPU seconds with its device timer on,
#: SGLANG_ENABLE_METRICS_DEVICE_TIMER=1) and vLLM's tokens per engine step, by sample name.
PASS_SAMPLES = {"sglang:cuda_graph_passes_total": "passes", "sglang:realtime_tokens_total": "tokens",
                "sglang:forward_execution_seconds_total": "forward_s",
                "vllm:iteration_tokens_total_count": "passes", "vllm:iteration_tokens_total_sum": "tokens"}
PREFILL_MODES = ("prefill_cuda_graph", "prefill_none", "prefill_compute")  # not decode, not cache hits


def pass_counts(text: str) -> dict[str, float]:
    """Forward passes, the tokens they computed, those run as a CUDA graph and the GPU seconds
    inside them, from one /metrics page (a page that does not parse counts nothing)."""
    got: dict[str, float] = {}
    with contextlib.suppress(ValueError):
        for s in (s for f in text_string_to_metric_families(text) for s in f.samples):
            if s.name in PASS_SAMPLES and (mode := s.labels.get("mode", "prefill_none")) in PREFILL_MODES:
                got[PASS_SAMPLES[s.name]] = got.get(PASS_SAMPLES[s.name], 0.0) + s.value
                if mode == "prefill_cuda_graph":
                    got["graph_passes"] = got.get("graph_passes", 0.0) + s.value
    return got


def engine_passes(t: Target) -> dict[str, float]:
    """``pass_counts`` summed over the side's metrics pages (each engine's, or the server's)."""
    got: dict[str, float] = {}
    for status, text in map(http_get, t.metrics):
        for k, v in pass_counts(text if status == 200 else "").items():
            got[k] = got.get(k, 0.0) + v
    return got


def pass_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A run's tokens per forward pass, share of passes run as a CUDA graph and GPU ms inside the
    passes per 1,000 tokens: the batches the engine formed, which throughput and busy share hide."""
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    if d.get("passes", 0.0) <= 0 or d.get("tokens", 0.0) <= 0:
        return {}  # not exposed, or the engine restarted
    out = {"engine_passes": int(d["passes"]), "engine_tokens_per_pass": round(d["tokens"] / d["passes"], 1)}
    if "graph_passes" in d:
        out["engine_graph_passes_pct"] = round(100 * d["graph_passes"] / d["passes"], 1)
    if "forward_s" in d:
        out["engine_forward_ms_per_1k_tokens"] = round(1e6 * d["forward_s"] / d["tokens"], 3)
    return out


def children_cpu() -> float:
    """The client's CPU: the waited-for children (loadtest, crosscheck.py) and this process (the
    rerank client runs here)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_CHILDREN,
                                                                       resource.RUSAGE_SELF)))


def measure(name: str, t: Target, load: Load, runs: Path, *, seed: int = 0,
            tags: dict[str, Any] | None = None, client: str = "loadtest",
            batch: int | None = None) -> dict[str, Any]:
    """One run to its end, as a row."""
    client = "in-process" if t.in_process else "rerank" if load.rerank and client != "crosscheck" else client
    front0, loop0 = cpu_seconds(t.front_pid), cpu_seconds(t.front_pid, main_thread=True)
    client0, host0, stages0, t0 = children_cpu(), psutil.cpu_times(), stage_seconds(t), time.monotonic()
    passes0 = engine_passes(t)
    with Sampler() as gpu:
        if client == "in-process":
            row = run_in_process(t, load, seed, batch or int(load.inputs))
        elif client == "rerank":
            row = run_rerank(t, load, seed)
        elif client == "crosscheck":
            row = run_crosscheck(t, load, seed)
        else:
            row = run_loadtest(t, load, runs / name, seed)
    wall = time.monotonic() - t0
    front1, loop1 = cpu_seconds(t.front_pid), cpu_seconds(t.front_pid, main_thread=True)
    answered = row.pop("answered_with_warmup", None) or row.get("requests")
    if front0 is not None and front1 is not None:
        row["gateway_cpu_pct"] = round(100 * (front1 - front0) / wall, 1)
        if answered:
            row["gateway_cpu_ms_per_request"] = round(1000 * (front1 - front0) / answered, 3)
            if loop0 is not None and loop1 is not None:
                row["gateway_loop_cpu_ms_per_request"] = round(1000 * (loop1 - loop0) / answered, 3)
    # where a gateway's requests spent their time: tokenising, waiting for an engine call, in the call
    if (done := {k: [a - b for a, b in zip(v, stages0.get(k, [0.0, 0.0]), strict=True)]
                 for k, v in stage_seconds(t).items()}):
        row["stage_ms_per_request"] = {k: round(1000 * s / n, 2) for k, (s, n) in done.items() if n}
    row.update(pass_figures(passes0, engine_passes(t)))
    # a client or host out of cores caps a row as surely as the server does
    row["client_cpu_pct"] = round(100 * (children_cpu() - client0) / wall, 1)
    host = [b - a for a, b in zip(host0, psutil.cpu_times(), strict=True)]  # every core, all tick kinds
    idle = host[3] + (host[4] if len(host) > 4 else 0.0)  # idle + iowait
    row["host_cpu_busy_pct"] = round(100 * (1 - idle / max(sum(host), 1e-9)), 1)
    row["load_average"] = round(os.getloadavg()[0], 2)
    row["gpu_busy_pct"] = gpu.busy_last(load.seconds)
    if t.tree_pid is not None:
        row["side_gpu_gb"] = tree_used_gb({"side": [t.tree_pid]}).get("side")
        tree = read_processes({"side": t.tree_pid})[0].get("side")  # with its descendants, as health reads it
        row["rss_mib"] = round(tree.rss_bytes / 2**20, 1) if tree else None
    row = {"name": name, **(tags or {}), "client": client, "mix": load.mix, "inputs": load.inputs,
           "conc": load.conc, **row, "gpu_used_gb": gpu.peak, "gpu_used_per_gpu_gb": gpu.per_gpu}
    if batch is not None:
        row["batch"] = batch
    if load.repeated_content:
        row["repeated_content"] = True
    print(json.dumps(row), flush=True)
    return row
