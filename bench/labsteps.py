"""The soak, perf and scale visits: steps for ``lab.py run --visit soak|perf|scale``.

They share lab.py's bookkeeping (results.json in LAB_DIR, resumable steps, detached
processes, $OUT export) and drive everything through the project's own commands:
``embedserve up`` / ``embedserve gateway`` (python -m service.cli) and ``embedserve
loadtest`` (python -m loadtest.cli), so the lab measures what users run. Figures and
tables come from labreport.py. The runbook is docs/LAB-RUNBOOK.md.

With ``LAB_DEVICE=cpu`` the same steps run against the CPU engine and tiny checkpoints,
durations multiplied by ``LAB_TIME_SCALE`` (e.g. 0.05): a rehearsal of the orchestration.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import lab
import labreport as lr
from service.settings import GatewaySettings

TIME_SCALE = float(os.environ.get("LAB_TIME_SCALE", "1"))
CPU = lab.DEVICE == "cpu"
LT_DIR = lab.LAB / "lt"
SOAK_DIR = lab.LAB / "soak"
# coalescing knobs for the short single-input sweep: "calls:wait_ms,..." (LAB_SWEEP overrides)
SWEEP = os.environ.get("LAB_SWEEP", "2:0,2:2,2:5,4:0,4:2,4:5,8:0,8:2,8:5")
SOAK_S = float(os.environ.get("LAB_SOAK_S", "900"))  # issue 3: at least 15 minutes


def secs(x: float) -> float:
    """A duration of the full-size visit, scaled for rehearsals (never under 2 s)."""
    return max(2.0, round(x * TIME_SCALE, 1))


def parse_sweep(spec: str) -> list[tuple[int, float]]:
    """``"2:0,4:2.5"`` -> [(2, 0.0), (4, 2.5)]: engine calls per engine, batch max wait ms."""
    out = []
    for part in spec.split(","):
        calls, wait = part.strip().split(":")
        out.append((int(calls), float(wait)))
    return out


# --- processes -------------------------------------------------------------------------------
def stack_env(shape: str, port: int, *, replicas: int = 1, urls: list[str] | None = None,
              knobs: tuple[int, float] | None = None, extra: dict[str, str] | None = None
              ) -> dict[str, str]:
    """Settings for ``embedserve up`` (engines started by it) or ``gateway`` (``urls``)."""
    env = {**lab.engine_env(shape), "EMBEDSERVE_GATEWAY__PORT": str(port),
           "EMBEDSERVE_ENGINE__REPLICAS": str(replicas), "EMBEDSERVE_LOG_LEVEL": "WARNING"}
    if urls:
        env |= {"EMBEDSERVE_ENGINE__KIND": "external", "EMBEDSERVE_ENGINE__URLS": json.dumps(urls)}
    else:  # never "auto": a soak that quietly fell back to the CPU engine would mislead
        env["EMBEDSERVE_ENGINE__KIND"] = "cpu" if CPU else "sglang"
    if knobs:
        env |= {"EMBEDSERVE_GATEWAY__ENGINE_CALLS_PER_ENGINE": str(knobs[0]),
                "EMBEDSERVE_GATEWAY__BATCH_MAX_WAIT_MS": str(knobs[1])}
    return env | (extra or {})


def port_busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_stack(res: dict[str, Any], tag: str, cmd: str, env: dict[str, str]) -> dict[str, Any]:
    """``embedserve up|gateway`` in its own session (it outlives the device call)."""
    port = int(env["EMBEDSERVE_GATEWAY__PORT"])
    if port_busy(port):
        raise RuntimeError(f"port {port} is taken: a stack of an earlier step or run still holds it")
    pid = lab.spawn_detached([sys.executable, "-m", "service.cli", cmd], lab.LAB / f"stack-{tag}.log",
                             lab.child_env(env))
    info = {"pid": pid, "cmd": cmd, "launched_at": time.time(),
            "port": int(env["EMBEDSERVE_GATEWAY__PORT"]),
            "env": {k: v for k, v in env.items() if "GATEWAY" in k or "REPLICAS" in k or "KIND" in k}}
    res.setdefault("stacks", {})[tag] = info
    lab.note(res, f"started {cmd} '{tag}' pid {pid} on port {info['port']}")
    return info


def wait_ok(url: str, until: float) -> float | None:
    """Poll ``url`` until it answers 200 (the time) or ``until`` passes (None)."""
    with httpx.Client(timeout=5) as c:
        while time.time() < until:
            with contextlib.suppress(httpx.HTTPError):
                if c.get(url).status_code == 200:
                    return time.time()
            time.sleep(1)
    return None


def stop_group(pid: int, wait_s: float = 90) -> bool:
    """SIGTERM the process group (``up`` drains and stops its engines); SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    until = time.time() + wait_s
    while time.time() < until:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it when it is our own child
        if lab.pgid_of(pid) is None:
            return True
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return False


def gpu_used_gb() -> list[float]:
    """Used memory of every GPU (NVML); empty without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        return [round(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used / lab.GB, 2)
                for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


# --- loadtest ----------------------------------------------------------------------------------
def loadtest_argv(target: str, out: Path, *, model_dir: str, mix: str, duration: float,
                  conc: int | None = None, rate: float | None = None, warmup: float = 0.0,
                  inputs: str = "1", ids: bool = False, seed: int = 0,
                  extra: list[str] | None = None) -> list[str]:
    """``embedserve loadtest`` for one run: raw engines get token ids clamped to the cap,
    the gateway gets texts of the same token counts (same seed -> same lengths)."""
    argv = [sys.executable, "-m", "loadtest.cli", target, "--tokenizer", model_dir,
            "--model", Path(model_dir).name, "--mix", mix, "--inputs", inputs,
            "--duration", f"{duration:g}", "--warmup", f"{warmup:g}", "--seed", str(seed),
            "--out", str(out), "--no-progress", "--timeout", "300"]
    argv += ["--rate", f"{rate:g}"] if rate else ["--concurrency", str(conc or 1)]
    if ids:
        argv += ["--input", "ids", "--max-tokens", str(lab.CAP)]
    return argv + (extra or ["--no-plots", "--health-url", "none"])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of one process (not its children), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadtest(name: str, target: str, *, gateway_pid: int | None = None, **kw: Any) -> dict[str, Any]:
    """One run, to the end; its condensed row (tags from ``kw['tags']``), with the gateway
    process's CPU use over the run (warm-up included) when ``gateway_pid`` is given."""
    tags = kw.pop("tags", {})
    out = LT_DIR / name
    argv = loadtest_argv(target, out, **kw)
    cpu0, t0 = (cpu_seconds(gateway_pid) if gateway_pid else None), time.monotonic()
    with open(lab.LAB / "loadtest.log", "ab") as log:
        subprocess.run(argv, cwd=lab.ROOT, env=lab.child_env(), stdout=log, stderr=subprocess.STDOUT,
                       timeout=kw["duration"] + kw.get("warmup", 0) + 180, check=False)
    if cpu0 is not None and gateway_pid and (cpu1 := cpu_seconds(gateway_pid)) is not None:
        tags["gw_cpu_pct"] = round(100 * (cpu1 - cpu0) / (time.monotonic() - t0), 1)
    doc = json.loads((out / "results.json").read_text())
    row = lr.row_from(doc, name=name, **tags)
    print(json.dumps(row), flush=True)
    return row


def raw_url(shape: str) -> str:
    return f"http://127.0.0.1:{lab.ENGINES[shape]['port']}/v1/embeddings"


# --- generic steps -----------------------------------------------------------------------------
def step_up(res: dict[str, Any], shape: str, budget_end: float, *, tag: str, model: str,
            replicas: int = 1, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """``embedserve up`` for ``model`` (engine(s) + gateway on 8000) once its checkpoint exists."""
    done = lab.LAB / f"model-{model}.done"
    while not done.exists():
        if time.time() > budget_end - 5:
            raise TimeoutError(f"model {model} not built yet")
        time.sleep(2)
    env = stack_env(model, lab.GATEWAY_PORT, replicas=replicas, extra=extra)
    info = start_stack(res, tag, "up", env)
    return {"pid": info["pid"], "replicas": replicas}


def step_ready(res: dict[str, Any], shape: str, budget_end: float, *, tag: str) -> dict[str, Any]:
    """Until ``up`` printed its banner (every engine ready and warmed up; the gateway's
    /health/ready already passes with one engine of several); resumable."""
    info = res["stacks"][tag]
    log = lab.LAB / f"stack-{tag}.log"
    while "embedserve is up" not in log.read_text(errors="replace"):
        if lab.pgid_of(info["pid"]) is None:
            raise RuntimeError(f"stack {tag} exited; see stack-{tag}.log")
        if time.time() > budget_end - 5:
            raise TimeoutError(f"stack {tag} not ready yet")
        time.sleep(1)
    t = time.time()
    if wait_ok(f"http://127.0.0.1:{info['port']}/health/ready", t + 30) is None:
        raise RuntimeError(f"stack {tag}: banner printed but /health/ready fails")
    return {"ready_after_s": round(t - info["launched_at"], 1), "gpu_used_gb": gpu_used_gb()}


def step_stop(res: dict[str, Any], shape: str, budget_end: float, *, tag: str) -> dict[str, Any]:
    info = res["stacks"][tag]
    clean = stop_group(info["pid"])
    info["stopped"] = True
    return {"clean": clean, "gpu_used_gb_after": gpu_used_gb()}


def step_stop_all(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Every engine and stack this visit started (the device host is given back anyway;
    a CPU rehearsal must not leave them running)."""
    stopped = []
    for group in ("stacks", "engines"):
        for tag, info in res.get(group, {}).items():
            if not info.get("stopped"):
                stop_group(info["pid"], 60)
                info["stopped"] = True
                stopped.append(tag)
    return {"stopped": stopped, "fi_cache_tgz_mb": pack_fi_cache(res)}


def pack_fi_cache(res: dict[str, Any]) -> float | None:
    """The FlashInfer JIT cache as fi-cache.tgz in $OUT: put it in a bundle folder and
    stage.sh unpacks it, so the next visit's first launch is warm (a fresh host: 116 s, not 301 s)."""
    cache = Path(lab.FI_CACHE)
    if CPU or not cache.is_dir():
        return None
    tgz = lab.LAB / "fi-cache.tgz"
    subprocess.run(["tar", "czf", str(tgz), "-C", str(cache), "."], check=True)
    size_mb = tgz.stat().st_size / 2**20
    if size_mb < 48:  # one device transfer carries 64 MiB in all
        res.setdefault("export", {})["fi-cache.tgz"] = str(tgz)
    return round(size_mb, 1)


# --- soak (issue 3) ------------------------------------------------------------------------------
def step_capacity(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Closed loop at saturation with the soak's traffic, to size the soak's rate."""
    row = loadtest("capacity", f"http://127.0.0.1:{lab.GATEWAY_PORT}", model_dir=lab.ENGINES["4b"]["model"],
                   mix="seed", inputs="1-16", conc=32, duration=secs(30), warmup=secs(8), seed=3,
                   tags={"case": "capacity", "side": "gateway"})
    if not row["requests"]:
        raise RuntimeError("the capacity run got no answer")
    return {"row": row, "rate": lr.soak_rate(row["req_s"])}


def step_soak_start(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """The soak, detached: open loop at ~85% of capacity, sampling /health/memory."""
    rate = res["steps"]["capacity"]["rate"]
    duration, warmup = secs(SOAK_S), secs(30)
    extra = ["--health-url", "/health/memory", "--sample-interval", "5", "--window", f"{secs(60):g}",
             "--checkpoint-every", f"{secs(60):g}", "--watch-pid", str(res["stacks"]["soak"]["pid"]),
             "--max-error-rate", "0.001", "--max-p95-drift", "0.25", "--max-memory-growth-mib", "512",
             "--memory-series", "GPU|engine|gateway|pid"]
    gateway = f"http://127.0.0.1:{lab.GATEWAY_PORT}"
    argv = loadtest_argv(gateway, SOAK_DIR, model_dir=lab.ENGINES["4b"]["model"],
                         mix="seed", inputs="1-16", rate=rate, duration=duration, warmup=warmup,
                         seed=11, extra=extra)
    rc = lab.LAB / "soak.rc"
    rc.unlink(missing_ok=True)
    script = " ".join(map(quote, argv)) + f"; echo $? > {rc}"
    pid = lab.spawn_detached(["bash", "-c", script], lab.LAB / "soak.log", lab.child_env())
    res["export"] = {"soak-results.json": str(SOAK_DIR / "results.json"),
                     "soak-summary.md": str(SOAK_DIR / "summary.md")}
    return {"pid": pid, "rate": rate, "duration_s": duration, "warmup_s": warmup,
            "ends_at": time.time() + duration + warmup, "argv": argv[2:]}


def quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def step_soak_wait(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Until the soak ends; meanwhile the plugin's allocator figures and NVML every 10 s
    (appended to soak-alloc.jsonl, so a wait split over device calls loses nothing)."""
    rc = lab.LAB / "soak.rc"
    samples = lab.LAB / "soak-alloc.jsonl"
    port = lab.ENGINES["4b"]["port"]
    while not rc.exists():
        if time.time() > budget_end - 15:
            left = res["steps"]["soak-start"]["ends_at"] - time.time()
            raise TimeoutError(f"soak still running (~{left:.0f} s left)")
        rec = {"t": time.time(), "gpu_used_gb": gpu_used_gb(),
               "engines": [{k: st.get(k) for k in ("pid", "allocated_bytes", "reserved_bytes",
                                                   "inactive_split_bytes", "cache_clears", "batches")}
                           for st in lab.read_engine_stats(port)]}
        with open(samples, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        time.sleep(10 * min(1.0, TIME_SCALE * 4))
    return {"rc": int(rc.read_text().strip() or -1)}


def alloc_drift(path: Path, after_t: float) -> dict[str, Any]:
    """First vs last allocator sample after warm-up (summed over the engine's schedulers)."""
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    recs = [r for r in recs if r["t"] >= after_t and r["engines"]]
    if not recs:
        return {}

    def tot(r: dict[str, Any], k: str, unit: float = lab.GB) -> float:
        return round(sum(e.get(k) or 0 for e in r["engines"]) / unit, 3)

    first, last = recs[0], recs[-1]
    return {k + "_gb": {"first": tot(first, k), "last": tot(last, k),
                        "max": max(tot(r, k) for r in recs)}
            for k in ("allocated_bytes", "reserved_bytes", "inactive_split_bytes")} | {
        "gpu_used_gb": {"first": first["gpu_used_gb"], "last": last["gpu_used_gb"]},
        "cache_clears": tot(last, "cache_clears", 1) - tot(first, "cache_clears", 1),
        "samples": len(recs)}


def step_soak_summary(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    doc = json.loads((SOAK_DIR / "results.json").read_text())
    start = res["steps"]["soak-start"]
    row = lr.row_from(doc, case="soak", side="gateway")
    cap = res["steps"]["capacity"]["row"]
    res["export"] = {"soak-results.json": str(SOAK_DIR / "results.json"),
                     "soak-summary.md": str(SOAK_DIR / "summary.md"),
                     **{p.name: str(p) for p in sorted(SOAK_DIR.glob("*.png"))}}
    return {"row": row, "rate": start["rate"], "capacity_tok_s": cap["tok_s"],
            "load_vs_capacity": round(row["tok_s"] / cap["tok_s"], 3) if cap["tok_s"] else None,
            "growth_after_warmup": doc["memory"]["growth_after_warmup"],
            "verdict": doc["verdict"], "stop_reason": doc["meta"].get("stop_reason"),
            "allocator": alloc_drift(lab.LAB / "soak-alloc.jsonl", time.time() - start["duration_s"])}


# --- perf side by side (issue 7) -----------------------------------------------------------------
# case, mix, concurrency, seconds per run, rounds (raw and gateway alternate within a round)
PERF_PLAN: list[tuple[str, str, int, float, int]] = [
    ("short", "uniform:16-512", 64, 20, 2),
    ("medium", "uniform:512-2048", 64, 15, 1),
    ("long", "uniform:8000-8192", 8, 15, 1),
    ("low", "uniform:16-512", 1, 5, 6),  # SGLang's own P50 at 1 in flight swings by ms
]
LOW_PLAN = PERF_PLAN[-1:]


def start_gateways(res: dict[str, Any], shape: str, knobs: list[tuple[int, float]], base_port: int
                   ) -> list[dict[str, Any]]:
    """One ``embedserve gateway`` per knob setting in front of the raw engine, ready."""
    url = f"http://127.0.0.1:{lab.ENGINES[shape]['port']}"
    infos = [start_stack(res, f"gw-{shape}-{c}-{w:g}", "gateway",
                         stack_env(shape, base_port + i, urls=[url], knobs=(c, w)))
             | {"knobs": [c, w]} for i, (c, w) in enumerate(knobs)]
    for info in infos:
        if wait_ok(f"http://127.0.0.1:{info['port']}/health/ready", time.time() + 120) is None:
            raise RuntimeError(f"gateway on {info['port']} not ready")
    return infos


def step_sweep(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Short single inputs through the gateway for each coalescing setting; raw SGLang runs
    interleaved every third setting to show the engine's own drift."""
    knobs = parse_sweep(SWEEP)
    gws = start_gateways(res, shape, knobs, 8100)
    model = lab.ENGINES[shape]["model"]
    common = {"model_dir": model, "mix": "uniform:16-512", "conc": 64, "duration": secs(12),
              "warmup": secs(3), "seed": 5}
    rows = []
    try:
        for i, gw in enumerate(gws):
            if i % 3 == 0:
                rows.append(loadtest(f"sweep-{shape}-raw-{i}", raw_url(shape), ids=True, **common,
                                     tags={"case": "short", "side": "raw"}))
            c, w = gw["knobs"]
            rows.append(loadtest(f"sweep-{shape}-{c}-{w:g}", f"http://127.0.0.1:{gw['port']}",
                                 gateway_pid=gw["pid"], **common,
                                 tags={"case": "short", "side": "gateway", "calls": c, "wait_ms": w}))
    finally:
        for gw in gws:
            stop_group(gw["pid"], 20)
    best = lr.pick_best(rows)
    return {"rows": rows, "best": best and {"calls": best["calls"], "wait_ms": best["wait_ms"]}}


def vector_check(shape: str, gateway_port: int) -> dict[str, Any]:
    """The same token ids through the gateway (which asks SGLang for base64) and straight to
    SGLang (floats). On a GPU, bf16 results depend on which inputs share a forward pass, and
    SGLang's scheduler may split one request's inputs over passes. So the verdict compares
    each input sent alone both ways ("hop"); the batched comparisons are recorded next to
    raw SGLang's own spread between repeats of the same batched request."""
    import random

    import numpy as np

    rng = random.Random(7)
    ids = [[rng.randrange(100, 3000) for _ in range(min(n, lab.CAP - 1))] for n in (8, 300, 2000)]
    name = Path(lab.ENGINES[shape]["model"]).name
    raw, gw = raw_url(shape), f"http://127.0.0.1:{gateway_port}/v1/embeddings"

    def ask(c: httpx.Client, url: str, batch: list[list[int]]) -> Any:
        data = c.post(url, json={"model": name, "input": batch}).raise_for_status().json()["data"]
        return np.asarray([d["embedding"] for d in sorted(data, key=lambda d: d["index"])],
                          dtype=np.float64)

    def cos(a: Any, b: Any) -> list[float]:
        v = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        return [round(float(x), 6) for x in v]

    tokens = [len(x) for x in ids]
    try:
        with httpx.Client(timeout=120) as c:
            raw_batches = [ask(c, raw, ids) for _ in range(3)]
            gw_batch = ask(c, gw, ids)
            raw_alone = np.vstack([ask(c, raw, [x]) for x in ids])
            gw_alone = np.vstack([ask(c, gw, [x]) for x in ids])
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        return {"ok": False, "error": repr(exc)[:300], "min_cos": None, "tokens": tokens}
    hop = cos(gw_alone, raw_alone)
    others = [*raw_batches[1:], raw_alone]
    spread = [min(v) for v in zip(*(cos(raw_batches[0], o) for o in others), strict=True)]
    batched = cos(gw_batch, raw_batches[0])
    return {"tokens": tokens, "hop_cos": hop, "raw_spread_cos": spread, "batch_cos": batched,
            "min_cos": min(batched), "ok": min(hop) >= 0.9999}


def step_perf(res: dict[str, Any], shape: str, budget_end: float, *,
              plan: list[tuple[str, str, int, float, int]] = PERF_PLAN) -> dict[str, Any]:
    """Raw SGLang (token ids) and our gateway in front of it (texts), alternating, per case;
    the gateway's knobs are the sweep's best, or its defaults when no sweep ran."""
    best = res["steps"].get("sweep-4b", {}).get("best") or {}
    defaults = GatewaySettings()
    knobs = (int(best.get("calls", defaults.engine_calls_per_engine)),
             float(best.get("wait_ms", defaults.batch_max_wait_ms)))
    gw = start_gateways(res, shape, [knobs], 8000 + (10 if shape == "0.6b" else 0))[0]
    model = lab.ENGINES[shape]["model"]
    rows = []
    try:
        check = vector_check(shape, gw["port"])
        lab.note(res, f"vectors {shape}, gateway vs raw: {check}")
        # one unmeasured round first: JIT-free by now, but the first seconds still run cold
        loadtest(f"perf-{shape}-warm", raw_url(shape), ids=True, model_dir=model, mix="uniform:16-512",
                 conc=64, duration=secs(8), tags={"case": "warm-up", "side": "raw"})
        for case, mix, conc, dur, rounds in plan:
            for rnd in range(rounds):
                sides = [("raw", raw_url(shape)), ("gateway", f"http://127.0.0.1:{gw['port']}")]
                for side, url in sides if rnd % 2 == 0 else sides[::-1]:
                    rows.append(loadtest(f"perf-{shape}-{case}-{side}-{rnd}", url, ids=side == "raw",
                                         gateway_pid=gw["pid"] if side == "gateway" else None,
                                         model_dir=model, mix=mix, conc=conc, duration=secs(dur),
                                         warmup=secs(3), seed=20 + rnd,
                                         tags={"case": case, "side": side, "conc": conc, "round": rnd}))
    finally:
        stop_group(gw["pid"], 20)
    return {"knobs": {"calls": knobs[0], "wait_ms": knobs[1]}, "rows": rows,
            "comparison": lr.compare(rows), "vector_check": check}


def step_warm_start(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Stop the engines, relaunch the 4B with the same FlashInfer cache dir, time it."""
    for info in res.get("engines", {}).values():
        if not info.get("stopped"):
            stop_group(info["pid"], 60)
            info["stopped"] = True
    cache = Path(lab.FI_CACHE)
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0
    info = lab.launch_engine(shape, lab.LAB / f"engine-{shape}-warm.log")
    res["engines"][shape] = info
    t = wait_ok(f"http://127.0.0.1:{info['port']}/health", time.time() + 300)
    return {"cold_ready_s": res["steps"].get(f"ready-{shape}", {}).get("ready_after_s"),
            "warm_ready_s": t and round(t - info["launched_at"], 1), "target_s": 90,
            "flashinfer_cache_dir": str(cache), "cache_mb": round(size / 1e6, 1),
            "env": info["env"]}


# --- scale-out (issue 8 item 5) --------------------------------------------------------------------
SCALE_PLAN: list[tuple[str, str, int]] = [  # case, mix, concurrency per replica
    ("short", "uniform:16-512", 64),
    ("medium", "uniform:512-2048", 64),
]
SCALE_DEEP_PLAN = [("short", "uniform:16-512", 128)]
SCALE_EXTRA = {"EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": "1048576",
               "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "300"}


def step_scale_load(res: dict[str, Any], shape: str, budget_end: float, *, replicas: int,
                    plan: list[tuple[str, str, int]] = SCALE_PLAN, per_engine: bool = False
                    ) -> dict[str, Any]:
    """The same loads through the gateway at conc and 2 x conc in flight, or with
    ``per_engine`` at that many per engine (so both counts reach the deepest queue)."""
    url = f"http://127.0.0.1:{lab.GATEWAY_PORT}"
    model = lab.ENGINES["4b"]["model"]
    loadtest(f"scale-r{replicas}-warm", url, model_dir=model, mix="uniform:16-512", conc=64,
             duration=secs(8), tags={"case": "warm-up"})
    rows = []
    for case, mix, conc in plan:
        depth = conc * replicas if per_engine else conc
        for c in (depth, 2 * depth):
            rows.append(loadtest(f"scale-r{replicas}-{case}-{c}", url, model_dir=model, mix=mix, conc=c,
                                 gateway_pid=res["stacks"][f"r{replicas}"]["pid"],
                                 duration=secs(25), warmup=secs(5), seed=30,
                                 tags={"case": case, "replicas": replicas, "conc": c}))
    return {"rows": rows, "gpu_used_gb": gpu_used_gb()}


deep_load = partial(step_scale_load, plan=SCALE_DEEP_PLAN, per_engine=True)
# both shapes at per-engine depths, one code version: the run that settles item 5
# (short as in scale-deep, medium as in scale)
check_load = partial(step_scale_load, plan=[*SCALE_DEEP_PLAN, *SCALE_PLAN[1:]], per_engine=True)


# --- prefill CUDA graphs on/off (scale visit, one engine per GPU) ---------------------------------
# SGLang 0.5.17 captures prefill CUDA graphs for embedding models too: most of the 4-5 min
# cold start ("Capturing num tokens ... 74 sizes"). Does turning them off cost anything?
AB_FLAG = "--disable-prefill-cuda-graph"
AB_PLAN: list[tuple[str, str, str, int, float]] = [  # case, mix, inputs/request, conc, seconds
    ("low", "uniform:16-512", "1", 1, 10),
    ("short", "uniform:16-512", "1", 64, 15),
    ("seed mix", "seed", "1-16", 32, 15),
]


def step_ab_launch(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Two raw 4B engines at once, the last GPU without prefill CUDA graphs (same warm JIT cache)."""
    last_gpu = max(0, len(gpu_used_gb()) - 1)
    engines = res.setdefault("engines", {})
    engines["ab-graphs"] = lab.launch_engine("4b", lab.LAB / "engine-ab-graphs.log", port=30010, gpu=0)
    engines["ab-eager"] = lab.launch_engine("4b", lab.LAB / "engine-ab-eager.log", port=30011,
                                            gpu=last_gpu, extra_args=(AB_FLAG,))
    return {"gpus": [0, last_gpu], "eager_argv_has_flag": AB_FLAG in engines["ab-eager"]["argv"] or CPU}


def step_ab_ready(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Time to /health 200 of each (resumable: times count from each launch)."""
    out = {}
    for tag in ("ab-graphs", "ab-eager"):
        info = res["engines"][tag]
        t = wait_ok(f"http://127.0.0.1:{info['port']}/health", budget_end - 5)
        if t is None:
            raise TimeoutError(f"{tag} not ready yet")
        out[f"{tag.removeprefix('ab-')}_ready_s"] = round(t - info["launched_at"], 1)
    return out


def step_ab_load(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Token ids straight to each engine, alternating which goes first per round."""
    model = lab.ENGINES["4b"]["model"]
    sides = [(side, f"http://127.0.0.1:{res['engines']['ab-' + side]['port']}/v1/embeddings")
             for side in ("graphs", "eager")]
    for side, url in sides:  # unmeasured warm-up of each
        loadtest(f"ab-{side}-warm", url, ids=True, model_dir=model, mix="uniform:16-512", conc=64,
                 duration=secs(6), tags={"case": "warm-up", "side": side})
    rows = []
    for case, mix, inputs, conc, dur in AB_PLAN:
        for rnd in range(2):
            for side, url in sides if rnd % 2 == 0 else sides[::-1]:
                rows.append(loadtest(f"ab-{case.replace(' ', '-')}-{side}-{rnd}", url, ids=True,
                                     model_dir=model, mix=mix, inputs=inputs, conc=conc,
                                     duration=secs(dur), warmup=secs(3), seed=40 + rnd,
                                     tags={"case": case, "side": side, "conc": conc, "round": rnd}))
    return {"rows": rows, "comparison": lr.side_by_side(rows, "graphs", "eager"),
            "gpu_used_gb": gpu_used_gb()}


def scale_steps(load: Any, load_s: float) -> list[tuple[str, str, Any, float]]:
    """One gateway with 1 engine, then with 2 (one per GPU): up, ready, load, stop each."""
    steps: list[tuple[str, str, Any, float]] = []
    for n in (1, 2):
        up = partial(step_up, tag=f"r{n}", model="4b", replicas=n, extra=SCALE_EXTRA)
        steps += [(f"up-r{n}", "", up, 0),
                  (f"ready-r{n}", "", partial(step_ready, tag=f"r{n}"), 0),
                  (f"load-r{n}", "", partial(load, replicas=n), load_s),
                  (f"stop-r{n}", "", partial(step_stop, tag=f"r{n}"), 30)]
    return steps


# --- the visits ---------------------------------------------------------------------------------
Step = tuple[str, str, Any, float]
VISITS: dict[str, list[Step]] = {
    "soak": [
        ("up", "", partial(step_up, tag="soak", model="4b"), 0),
        ("ready", "", partial(step_ready, tag="soak"), 0),
        ("capacity", "", step_capacity, secs(50)),
        ("soak-start", "", step_soak_start, 5),
        ("soak-wait", "", step_soak_wait, 0),
        ("soak-summary", "", step_soak_summary, 5),
        ("stop-all", "", step_stop_all, 0),
    ],
    "perf": [
        ("ready-4b", "4b", lab.step_wait, 30),
        ("ready-0.6b", "0.6b", lab.step_wait, 30),
        ("sweep-4b", "4b", step_sweep, secs(260)),
        ("perf-4b", "4b", step_perf, secs(300)),
        ("perf-0.6b", "0.6b", step_perf, secs(300)),
        ("warm-start-4b", "4b", step_warm_start, secs(150)),
        ("stop-all", "", step_stop_all, 0),
    ],
    # a second perf visit on a fresh host: the vector diagnostics and the low-load rounds
    # again, with the gateway's defaults (since 2026-11-30 the perf visit's best knobs)
    "perf-recheck": [
        ("ready-4b", "4b", lab.step_wait, 30),
        ("ready-0.6b", "0.6b", lab.step_wait, 30),
        ("perf-0.6b", "0.6b", partial(step_perf, plan=LOW_PLAN), secs(135)),
        ("perf-4b", "4b", partial(step_perf, plan=LOW_PLAN), secs(135)),
        ("stop-all", "", step_stop_all, 0),
    ],
    "scale": [
        *scale_steps(step_scale_load, secs(160)),
        ("ab-launch", "", step_ab_launch, 10),
        ("ab-ready", "", step_ab_ready, 0),
        ("ab-load", "", step_ab_load, secs(260)),
        ("stop-all", "", step_stop_all, 0),
    ],
    # short inputs at 128 and 256 in flight per engine (the scale visit's 128 in flight over
    # two engines is only 64 each); the first scale-deep run (2026-11-30) used 128 and 256 for both
    "scale-deep": [*scale_steps(deep_load, secs(80)), ("stop-all", "", step_stop_all, 0)],
    "scale-check": [*scale_steps(check_load, secs(150)), ("stop-all", "", step_stop_all, 0)],
}


def report(res: dict[str, Any]) -> str:
    """results.md for a soak, perf or scale visit."""
    return lr.render(res, device="CPU rehearsal (tiny model, CPU engine)" if CPU else "H200")
