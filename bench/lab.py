"""The GPU lab runner: build checkpoints, launch SGLang through our launcher with our
plugin, and measure correctness, memory, throughput and cache clearing.

Runs on the offline H200 host under its ``python3`` with ``PYTHONPATH=/tmp/site:<checkout>``
(see docs/SGLANG.md, "GPU lab"). The host is held only while commands follow each other,
and one command may run 10 minutes, so the work is split into resumable sub-commands;
processes that must outlive a command are started in their own session (setsid):

    lab.py models            # random-weight 4B and 0.6B checkpoints (detached)
    lab.py launch            # SGLang engines via service.sglang_launch (detached)
    lab.py run --budget-s N  # the measurement steps not done yet, until N seconds are used
    lab.py report            # results.json -> results.md

``--visit`` picks the step list: ``engine`` (the first visits: correctness, memory, cache
clearing), or ``soak``, ``perf``, ``scale`` (labsteps.py; runbook: docs/LAB-RUNBOOK.md).
State lives in /tmp/lab (results.json, logs); each sub-command copies results and log tails
to $OUT when set. ``LAB_DEVICE=cpu`` rehearses everything on a CPU box: tiny checkpoints,
the CPU engine in SGLang's place, durations scaled by ``LAB_TIME_SCALE``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LAB = Path(os.environ.get("LAB_DIR", "/tmp/lab"))
RESULTS = LAB / "results.json"
SITE = os.environ.get("LAB_SITE", "/tmp/site")
CAP = int(os.environ.get("LAB_CAP", "8192"))  # the service cap (smaller for CPU smoke tests)
DEVICE = os.environ.get("LAB_DEVICE", "cuda")
_MODELS = LAB if DEVICE == "cpu" else Path("/tmp")  # CPU rehearsals keep everything in LAB_DIR
ENGINES: dict[str, dict[str, Any]] = {
    "4b": {"model": str(_MODELS / "m4"), "port": 30000},
    "0.6b": {"model": str(_MODELS / "m06"), "port": 30001},
}
FI_CACHE = os.environ.get("LAB_FI_CACHE", str(_MODELS / "fi-cache"))
GATEWAY_PORT = 8000
GB = 1e9


# --- bookkeeping ---------------------------------------------------------------------------
def load() -> dict[str, Any]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"steps": {}, "log": []}


def save(res: dict[str, Any]) -> None:
    LAB.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(RESULTS)


def note(res: dict[str, Any], msg: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    print(line, flush=True)
    res.setdefault("log", []).append(line)
    save(res)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{SITE}:{ROOT}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def spawn_detached(argv: list[str], log: Path, env: dict[str, str]) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log, "ab")  # noqa: SIM115  (the child owns it)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    return proc.pid


def export_out() -> None:
    """results.json/.md, log tails, and the files a visit lists under ``export``
    (name in $OUT -> path; at most 8 files come back from a device call, all told)."""
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "results.md"):
        if (LAB / name).exists():
            shutil.copy(LAB / name, Path(out) / name)
    for name, path in load().get("export", {}).items():
        if Path(path).is_file():
            shutil.copy(path, Path(out) / name)
    tails = []
    for log in sorted(LAB.glob("*.log")):
        data = log.read_bytes()[-6000:].decode(errors="replace")
        tails.append(f"===== {log.name} =====\n{data}\n")
    (Path(out) / "logs.txt").write_text("".join(tails)[-2_000_000:])


# --- models and engines --------------------------------------------------------------------
def cmd_models(a: argparse.Namespace) -> int:
    for shape, eng in ENGINES.items():
        if shape not in a.shapes:
            continue
        done = LAB / f"model-{shape}.done"
        if done.exists():
            continue
        kind = "tiny" if DEVICE == "cpu" else shape
        script = (f"{sys.executable} -m service.synthetic {kind} {eng['model']} --device {DEVICE} "
                  f"--max-seq-length {CAP} && touch {done}")
        env = child_env()
        env["PYTHONPATH"] = str(ROOT)  # the host's own transformers is fine here
        spawn_detached(["bash", "-c", script], LAB / f"model-{shape}.log", env)
    print("model builds started", flush=True)
    return 0


def engine_env(shape: str) -> dict[str, str]:
    eng = ENGINES[shape]
    return {
        "EMBEDSERVE_MODEL__PATH": eng["model"],
        "EMBEDSERVE_ENGINE__PORT": str(eng["port"]),
        "EMBEDSERVE_ENGINE__STATS_DIR": str(LAB / f"stats-{eng['port']}"),
        "EMBEDSERVE_ENGINE__STATS_INTERVAL_S": "0.5",
        "EMBEDSERVE_ENGINE__FLASHINFER_CACHE_DIR": FI_CACHE,
        "EMBEDSERVE_MODEL__MAX_SEQ_LEN": str(CAP),
    }


def launch_engine(shape: str, log: Path, *, port: int | None = None, gpu: int | None = None,
                  extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One raw engine for ``shape``, detached: SGLang through our launcher (plugin included),
    or on a CPU rehearsal the CPU engine, which speaks the same token-id protocol. ``port``,
    ``gpu`` and ``extra_args`` (appended to SGLang's argv) serve A/B launches."""
    port = port or ENGINES[shape]["port"]
    env = engine_env(shape) | {"EMBEDSERVE_ENGINE__PORT": str(port),
                               "EMBEDSERVE_ENGINE__STATS_DIR": str(LAB / f"stats-{port}")}
    os.environ.update(env)
    if DEVICE == "cpu":
        argv = [sys.executable, "-m", "service.cpu_engine", "--port", str(port)]
        extra: dict[str, str] = {"HF_HUB_OFFLINE": "1"}
        notes: list[str] = []
    else:
        from service.settings import Settings
        from service.sglang_launch import build_launch

        settings = Settings()
        settings.engine.extra_args = [*settings.engine.extra_args, *extra_args]
        spec = build_launch(settings, python=sys.executable)
        argv, extra, notes = spec.argv, dict(spec.env), spec.notes
    if gpu is not None:
        extra["CUDA_VISIBLE_DEVICES"] = str(gpu)
    pid = spawn_detached(argv, log, child_env({**env, **extra}))
    return {"pid": pid, "launched_at": time.time(), "argv": argv, "env": extra, "notes": notes,
            "port": port}


def cmd_launch(a: argparse.Namespace) -> int:
    res = load()
    deadline = time.time() + a.wait_models_s
    for shape in a.shapes:
        while not (LAB / f"model-{shape}.done").exists():
            if time.time() > deadline:
                note(res, f"model {shape} not built in time")
                export_out()
                return 1
            time.sleep(2)
        info = launch_engine(shape, LAB / f"engine-{shape}.log")
        res.setdefault("engines", {})[shape] = info
        note(res, f"launched {shape} pid {info['pid']}: {' '.join(info['argv'][3:])}")
    save(res)
    export_out()
    return 0


# --- GPU memory via NVML -------------------------------------------------------------------
def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def nvml_usage(groups: dict[str, int]) -> dict[str, Any]:
    """Device used/total, and per engine the sum over its process group's GPU processes."""
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        per: dict[str, int] = {k: 0 for k in groups}
        listed = []
        for p in procs:
            used = int(p.usedGpuMemory or 0)
            g = pgid_of(int(p.pid))
            listed.append({"pid": int(p.pid), "pgid": g, "used": used})
            for name, pg in groups.items():
                if g == pg:
                    per[name] += used
        return {"device_used": int(mem.used), "device_total": int(mem.total),
                "per_engine": per, "processes": listed}
    finally:
        pynvml.nvmlShutdown()


def engine_groups(res: dict[str, Any]) -> dict[str, int]:
    out = {}
    for shape, info in res.get("engines", {}).items():
        if info.get("stopped"):
            continue
        g = pgid_of(info["pid"])
        if g is not None:
            out[shape] = g
    return out


def read_engine_stats(port: int) -> list[dict[str, Any]]:
    folder = LAB / f"stats-{port}"
    out = []
    for p in sorted(folder.glob("engine-*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(p.read_text()))
    return out


# --- HTTP client ---------------------------------------------------------------------------
async def post_json(session: Any, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def wait_ready(port: int, wait_s: float) -> float | None:
    import aiohttp

    t0 = time.time()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        while time.time() - t0 < wait_s:
            try:
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        return time.time()
            except Exception:
                pass
            await asyncio.sleep(2)
    return None


def lengths_for(load: str, rng: random.Random) -> int:
    if load == "seed-mix":
        u = rng.random()
        if u < 0.92:
            return rng.randint(16, 512)
        if u < 0.98:
            return rng.randint(513, 1024)
        return min(rng.randint(1025, 32768), CAP)  # truncated at the cap
    lo, hi = (int(x) for x in load.split("-"))
    return rng.randint(lo, hi)


async def closed_loop(url: str, model: str, load: str, bs: int | str, conc: int, duration: float,
                      sampler: Any = None, seed: int = 0, pool_size: int = 256) -> dict[str, Any]:
    """``conc`` workers, each sending its next request when the last one answers."""
    import aiohttp

    rng = random.Random(seed)
    lat: list[float] = []
    toks = 0
    errors: dict[str, int] = {}

    def make_body() -> tuple[bytes, int]:
        n = bs if isinstance(bs, int) else rng.randint(1, 16)
        inputs = [[rng.randrange(100, 150000) for _ in range(lengths_for(load, rng))]
                  for _ in range(n)]
        return json.dumps({"model": model, "input": inputs}).encode(), sum(len(x) for x in inputs)

    # bodies built up front, so the client's own CPU time stays out of the figures
    pool: list[tuple[bytes, int]] = []
    while len(pool) < pool_size and sum(n for _, n in pool) < 1_500_000:
        pool.append(make_body())
    stop_at = time.perf_counter() + duration
    headers = {"Content-Type": "application/json"}

    async def worker(s: Any) -> None:
        nonlocal toks
        while time.perf_counter() < stop_at:
            body, n = pool[rng.randrange(len(pool))]
            t = time.perf_counter()
            try:
                async with s.post(url, data=body, headers=headers) as r:
                    status, data = r.status, await r.text()
            except Exception as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            if status != 200:
                key = re.sub(r"\d+", "N", f"{status}: {str(data)[:100]}")
                errors[key] = errors.get(key, 0) + 1
                continue
            lat.append(time.perf_counter() - t)
            toks += n

    conn = aiohttp.TCPConnector(limit=conc + 4)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(s)) for _ in range(conc)]
        samp = asyncio.create_task(sampler()) if sampler else None
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        if samp:
            samp.cancel()
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")

    return {"load": load, "bs": bs, "conc": conc, "seconds": round(elapsed, 2),
            "requests": len(lat), "tok_s": round(toks / elapsed), "req_s": round(len(lat) / elapsed, 2),
            "p50_ms": round(pct(0.5), 1), "p95_ms": round(pct(0.95), 1),
            "p99_ms": round(pct(0.99), 1), "errors": errors}


# --- correctness (a child process, so the reference model's memory goes away) ---------------
def cmd_correctness(a: argparse.Namespace) -> int:
    import numpy as np
    import requests
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    model_dir = Path(a.model)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos_id = tok.token_to_id("<|endoftext|>")
    assert eos_id is not None, "tokenizer without <|endoftext|>"
    eos: int = eos_id
    rng = random.Random(1)
    cases: list[tuple[str, list[int]]] = []
    if a.gateway:
        words = ["memory", "model", "token", "embedding", "query", "passage", "search",
                 "gpu", "cache", "batch", "数据", "café"]
        texts = {
            "short": "hello world",
            "medium": " ".join(rng.choice(words) for _ in range(300)),
            "over-cap (truncated by gateway)": " ".join(rng.choice(words) for _ in range(20000)),
        }
        for name, text in texts.items():
            ids = tok.encode(text, add_special_tokens=False).ids
            framed = [*ids[: CAP - 1], eos]  # what the gateway must send: EOS kept last
            cases.append((f"{name}: {len(ids) + 1} tok -> {len(framed)}", framed))
        body: dict[str, Any] = {"model": model_dir.name, "input": list(texts.values()),
                                "encoding_format": "float"}
        url = f"http://127.0.0.1:{a.port}/v1/embeddings"
    else:
        for n in sorted({n for n in (8, 64, 500, 2047) if n < CAP} | {CAP}):
            cases.append((f"{n} tok", [rng.randrange(0, 4000) for _ in range(n - 1)] + [eos]))
        long_ids = [rng.randrange(0, 4000) for _ in range(CAP + 3808)]
        cases.append((f"{len(long_ids) + 1} tok truncated to cap, EOS last", [*long_ids[:CAP - 1], eos]))
        body = {"model": model_dir.name, "input": [ids for _, ids in cases]}
        url = f"http://127.0.0.1:{a.port}/v1/embeddings"
    r = requests.post(url, json=body, timeout=300)
    r.raise_for_status()
    got = [np.asarray(d["embedding"], dtype=np.float64) for d in sorted(r.json()["data"],
                                                                       key=lambda d: d["index"])]
    usage = r.json().get("usage")
    out: dict[str, Any] = {"model": str(model_dir), "url": url, "usage": usage, "cases": []}
    refs: dict[str, list[np.ndarray]] = {}
    for dtype in (torch.bfloat16, torch.float32):
        m = AutoModel.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(DEVICE).eval()
        vecs = []
        with torch.inference_mode():
            for _, ids in cases:
                h = m(input_ids=torch.tensor([ids], device=DEVICE)).last_hidden_state[0, -1]
                v = h.float().cpu().numpy().astype(np.float64)
                vecs.append(v / np.linalg.norm(v))
        refs[str(dtype).split(".")[-1]] = vecs
        del m
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for i, (name, ids) in enumerate(cases):
        g = got[i] / np.linalg.norm(got[i])
        row = {"case": name, "tokens": len(ids), "eos_last": ids[-1] == eos,
               "sglang_norm": round(float(np.linalg.norm(got[i])), 5)}
        for k, vecs in refs.items():
            row[f"cos_{k}"] = round(float(g @ vecs[i]), 6)
        out["cases"].append(row)
    out["min_cos_bf16"] = min(c["cos_bfloat16"] for c in out["cases"])
    out["min_cos_fp32"] = min(c["cos_float32"] for c in out["cases"])
    out["pass"] = max(out["min_cos_bf16"], out["min_cos_fp32"]) >= 0.999
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


# --- the steps -----------------------------------------------------------------------------
def step_wait(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    info = res["engines"][shape]
    t = asyncio.run(wait_ready(info["port"], max(5.0, budget_end - time.time() - 5)))
    if t is None:
        raise TimeoutError(f"{shape} not ready yet")
    return {"ready_after_s": round(t - info["launched_at"], 1)}


def run_child(args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    subprocess.run([sys.executable, __file__, *args, "--out", str(out)], env=child_env(),
                   timeout=timeout, check=True)
    return json.loads(out.read_text())


def step_correctness(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    eng = ENGINES[shape]
    return run_child(["correctness", "--model", eng["model"], "--port", str(eng["port"])],
                     LAB / f"correct-{shape}.json", budget_end - time.time())


def step_stop(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    info = res["engines"][shape]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(info["pid"], signal.SIGTERM)
    for _ in range(30):
        if pgid_of(info["pid"]) is None:
            break
        time.sleep(1)
    info["stopped"] = True
    return {"stopped": True}


def step_gateway(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    eng = ENGINES[shape]
    env = child_env({
        "EMBEDSERVE_ENGINE__KIND": "external",
        "EMBEDSERVE_ENGINE__URLS": json.dumps([f"http://127.0.0.1:{eng['port']}"]),
        "EMBEDSERVE_MODEL__PATH": eng["model"],
        "EMBEDSERVE_ENGINE__STATS_DIR": str(LAB / f"stats-{eng['port']}"),
        "EMBEDSERVE_GATEWAY__PORT": str(GATEWAY_PORT),
    })
    pid = spawn_detached([sys.executable, "-m", "service.cli", "gateway"], LAB / "gateway.log", env)
    res.setdefault("gateway", {})["pid"] = pid
    import requests

    t0 = time.time()
    while time.time() - t0 < 90:
        try:
            if requests.get(f"http://127.0.0.1:{GATEWAY_PORT}/health/live", timeout=2).status_code:
                break
        except Exception:
            time.sleep(1)
    out = run_child(["correctness", "--model", eng["model"], "--port", str(GATEWAY_PORT),
                     "--gateway"], LAB / f"correct-gateway-{shape}.json", budget_end - time.time())
    try:
        mem = requests.get(f"http://127.0.0.1:{GATEWAY_PORT}/health/memory", timeout=10)
        out["health_memory"] = mem.json()
    except Exception as exc:
        out["health_memory_error"] = repr(exc)
    return out


def step_memory(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    return {"nvml": nvml_usage(engine_groups(res)),
            "plugin_stats": read_engine_stats(ENGINES[shape]["port"])}


LOADS: list[tuple[str, int, int, float]] = [  # gpu-lab/README.md's 4B rows
    ("16-512", 1, 64, 25.0),
    ("16-512", 32, 16, 25.0),
    ("512-2048", 1, 64, 25.0),
    ("8000-8192", 1, 8, 25.0),
]
BASELINE_DEFAULT_POOL = {("16-512", 1): 59870, ("16-512", 32): 71724,
                         ("512-2048", 1): 70366, ("8000-8192", 1): 55193}
BASELINE_CAPPED = {("16-512", 1): 30913, ("16-512", 32): 69541,
                   ("512-2048", 1): 69960, ("8000-8192", 1): 54721}


def make_nvml_sampler(res: dict[str, Any], shape: str, peaks: dict[str, int]) -> Any:
    groups = engine_groups(res)

    async def sampler() -> None:
        while True:
            try:
                u = nvml_usage(groups)
                peaks["engine"] = max(peaks.get("engine", 0), u["per_engine"].get(shape, 0))
                peaks["device"] = max(peaks.get("device", 0), u["device_used"])
            except Exception:
                pass
            await asyncio.sleep(0.5)

    return sampler


def step_throughput(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    eng = ENGINES[shape]
    url = f"http://127.0.0.1:{eng['port']}/v1/embeddings"
    name = Path(eng["model"]).name
    asyncio.run(closed_loop(url, name, "16-512", 1, 64, 8.0, seed=99))  # warm-up
    rows: list[dict[str, Any]] = []
    for load, bs, conc, dur in LOADS:
        peaks: dict[str, int] = {}
        row = asyncio.run(closed_loop(url, name, load, bs, conc, dur,
                                      make_nvml_sampler(res, shape, peaks), seed=len(rows)))
        row["engine_gpu_peak_gb"] = round(peaks.get("engine", 0) / GB, 2)
        base = BASELINE_DEFAULT_POOL.get((load, bs))
        if base:
            row["baseline_default_pool_tok_s"] = base
            row["vs_default_pool"] = round(row["tok_s"] / base, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "plugin_stats": read_engine_stats(eng["port"])}


CACHE_PHASES: list[tuple[str, dict[str, Any] | None, float]] = [
    ("warm-up (configured policy)", None, 15.0),
    ("off", {"every_n_batches": 0, "fragmentation_ratio": None, "unused_reserve_bytes": None}, 45.0),
    ("on (configured: every 64 batches + thresholds)", None, 45.0),
    ("every batch", {"every_n_batches": 1, "fragmentation_ratio": None,
                     "unused_reserve_bytes": None}, 30.0),
]


def step_cache(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    eng = ENGINES[shape]
    url = f"http://127.0.0.1:{eng['port']}/v1/embeddings"
    stats_dir = LAB / f"stats-{eng['port']}"
    override = stats_dir / "cache-clear-override.json"
    name = Path(eng["model"]).name
    phases = []
    for label, rules, dur in CACHE_PHASES:
        if rules is None:
            override.unlink(missing_ok=True)
        else:
            override.write_text(json.dumps(rules))
        time.sleep(1.2)
        before = read_engine_stats(eng["port"])
        samples: list[dict[str, Any]] = []
        peaks: dict[str, int] = {}
        nv = make_nvml_sampler(res, shape, peaks)

        async def sampler(nv: Any = nv, samples: list[dict[str, Any]] = samples) -> None:
            t = asyncio.create_task(nv())
            try:
                while True:
                    for st in read_engine_stats(eng["port"]):
                        samples.append({k: st[k] for k in (
                            "time", "allocated_bytes", "reserved_bytes", "inactive_split_bytes",
                            "cache_clears", "cache_clear_seconds_total", "batches")})
                    await asyncio.sleep(0.5)
            finally:
                t.cancel()

        row = asyncio.run(closed_loop(url, name, "seed-mix", "1-16", 32, dur, sampler, seed=7))
        time.sleep(1.0)  # let the plugin publish the phase's last figures
        after = read_engine_stats(eng["port"])
        b, e = (before[0] if before else {}), (after[0] if after else {})
        clears = e.get("cache_clears", 0) - b.get("cache_clears", 0)
        secs = e.get("cache_clear_seconds_total", 0.0) - b.get("cache_clear_seconds_total", 0.0)
        unused = [s["reserved_bytes"] - s["allocated_bytes"] for s in samples]
        row.update({
            "phase": label, "rules": rules,
            "batches": e.get("batches", 0) - b.get("batches", 0),
            "clears": clears, "clear_ms_mean": round(1000 * secs / clears, 2) if clears else None,
            "clear_ms_total": round(1000 * secs, 1),
            "end_reserved_gb": round(e.get("reserved_bytes", 0) / GB, 3),
            "end_allocated_gb": round(e.get("allocated_bytes", 0) / GB, 3),
            "end_unused_gb": round((e.get("reserved_bytes", 0) - e.get("allocated_bytes", 0)) / GB, 3),
            "end_inactive_split_gb": round(e.get("inactive_split_bytes", 0) / GB, 3),
            "max_unused_gb": round(max(unused) / GB, 3) if unused else None,
            "mean_unused_gb": round(statistics.fmean(unused) / GB, 3) if unused else None,
            "max_inactive_split_gb": round(max(s["inactive_split_bytes"] for s in samples) / GB, 3)
            if samples else None,
            "max_reserved_gb": round(max(s["reserved_bytes"] for s in samples) / GB, 3)
            if samples else None,
            "engine_gpu_peak_gb": round(peaks.get("engine", 0) / GB, 2),
            "num_alloc_retries": e.get("num_alloc_retries"), "num_ooms": e.get("num_ooms"),
        })
        phases.append(row)
        print(json.dumps(row), flush=True)
    override.unlink(missing_ok=True)
    return {"phases": phases}


# --- variants: is the launch's choice the right one? (one launch each, warm JIT ~65-80 s) --------
def launch_variant(tag: str, port: int, *, overlap: bool = False, expandable: bool = True) -> int:
    """The 4B engine as our launcher builds it, but with one choice flipped."""
    from service.settings import Settings
    from service.sglang_launch import build_launch

    os.environ.update(engine_env("4b"))
    os.environ["EMBEDSERVE_ENGINE__PORT"] = str(port)
    os.environ["EMBEDSERVE_ENGINE__STATS_DIR"] = str(LAB / f"stats-{port}")
    spec = build_launch(Settings(), python=sys.executable)
    argv = [x for x in spec.argv if not (overlap and x == "--disable-overlap-schedule")]
    env = child_env(dict(spec.env))
    if not expandable:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return spawn_detached(argv, LAB / f"engine-4b-{tag}.log", env)


def step_variants(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Cache clearing with torch's default allocator (no expandable segments), and the
    overlap scheduler on (the launcher turns it off for sglang#22518)."""
    step_stop(res, "4b", budget_end)
    pa = launch_variant("noexp", ENGINES["4b"]["port"], expandable=False)
    pb = launch_variant("overlap", 30002, overlap=True)
    t0 = time.time()
    ra = asyncio.run(wait_ready(ENGINES["4b"]["port"], 300))
    rb = asyncio.run(wait_ready(30002, 300))
    res["engines"]["4b"] = {**res["engines"]["4b"], "pid": pa, "stopped": False}
    out: dict[str, Any] = {"ready_s": [ra and ra - t0, rb and rb - t0]}
    out["cache_noexp"] = step_cache(res, "4b", budget_end)
    out["overlap_on"] = [
        asyncio.run(closed_loop("http://127.0.0.1:30002/v1/embeddings", "m4", load, bs, conc, 25.0,
                                seed=21 + i))
        for i, (load, bs, conc) in enumerate([("16-512", 1, 64), ("16-512", 1, 64), ("16-512", 32, 16)])
    ]
    out["noexp_short"] = [asyncio.run(closed_loop(
        f"http://127.0.0.1:{ENGINES['4b']['port']}/v1/embeddings", "m4", "16-512", 1, 64, 25.0, seed=31))]
    out["nvml"] = nvml_usage({"noexp": os.getpgid(pa), "overlap": os.getpgid(pb)})
    return out


def step_ab(res: dict[str, Any], shape: str, budget_end: float) -> dict[str, Any]:
    """Short single inputs are noisy: alternate the three launches, two rounds."""
    gw = res.get("gateway", {}).get("pid")
    if gw:
        with contextlib.suppress(OSError):
            os.killpg(gw, signal.SIGTERM)  # its /health polling must not add load
    launch_variant("default2", 30003)
    t0 = time.time()
    r = asyncio.run(wait_ready(30003, 300))
    out: dict[str, Any] = {"ready_s": r and r - t0, "runs": []}
    variants = ((30003, "expandable (default launch)"), (ENGINES["4b"]["port"], "no expandable_segments"),
                (30002, "expandable + overlap on"))
    for rnd in range(2):
        for port, tag in variants:
            row = asyncio.run(closed_loop(f"http://127.0.0.1:{port}/v1/embeddings", "m4", "16-512",
                                          1, 64, 20.0, seed=40 + rnd))
            out["runs"].append({**row, "variant": tag, "round": rnd})
    for port, tag in variants[:2]:
        row = asyncio.run(closed_loop(f"http://127.0.0.1:{port}/v1/embeddings", "m4", "512-2048",
                                      1, 64, 20.0, seed=50))
        out["runs"].append({**row, "variant": tag})
    return out


STEPS: list[tuple[str, str, Any, float]] = [  # name, engine, function, seconds it needs
    ("ready-4b", "4b", step_wait, 30),
    ("ready-0.6b", "0.6b", step_wait, 30),
    ("correctness-0.6b", "0.6b", step_correctness, 60),
    ("stop-0.6b", "0.6b", step_stop, 20),
    ("correctness-4b", "4b", step_correctness, 90),
    ("gateway-4b", "4b", step_gateway, 90),
    ("memory-4b-idle", "4b", step_memory, 5),
    ("throughput-4b", "4b", step_throughput, 125),
    ("cache-clearing-4b", "4b", step_cache, 150),
    ("memory-4b-after", "4b", step_memory, 5),
    ("variants-noexp-overlap", "4b", step_variants, 340),
    ("variants-ab", "4b", step_ab, 230),
]


# "engine" is this module's STEPS; the others are labsteps.VISITS (imported late: it imports us)
VISIT_NAMES = ("engine", "soak", "perf", "perf-recheck", "scale", "scale-deep", "scale-check")


def visit_steps(visit: str) -> list[tuple[str, str, Any, float]]:
    """The step list of a visit; a step's engine ("" = none) must have been launched."""
    if visit == "engine":
        return STEPS
    import labsteps

    return labsteps.VISITS[visit]


def cmd_run(a: argparse.Namespace) -> int:
    res = load()
    res["visit"] = a.visit
    for name in a.redo or []:  # e.g. the sweep again with other LAB_SWEEP knobs
        res["steps"].pop(name, None)
    t_end = time.time() + a.budget_s
    only = set(a.only or [])
    for name, shape, fn, need in visit_steps(a.visit):
        if only and name not in only:
            continue
        if name in res["steps"] and res["steps"][name].get("ok"):
            continue
        if shape and shape not in res.get("engines", {}):
            continue
        left = t_end - time.time()
        if fn is not step_wait and need > 0 and left < need:
            note(res, f"stopping before {name}: {left:.0f}s left, needs ~{need:.0f}s")
            break
        note(res, f"step {name}")
        t0 = time.time()
        try:
            data = fn(res, shape, t_end)
            res["steps"][name] = {"ok": True, "seconds": round(time.time() - t0, 1), **data}
            note(res, f"step {name} done in {time.time() - t0:.0f}s")
        except TimeoutError as exc:
            note(res, f"step {name}: {exc}")
            break
        except Exception as exc:
            res["steps"][name] = {"ok": False, "error": repr(exc)[:2000]}
            note(res, f"step {name} FAILED: {exc!r}"[:500])
        save(res)
        export_out()
    save(res)
    cmd_report(a)
    return 0


def cmd_pending(a: argparse.Namespace) -> int:
    """Steps of the visit not done yet (exit 1 if any): drives rehearse.sh's repeated calls."""
    done = {k for k, v in load().get("steps", {}).items() if v.get("ok")}
    left = [name for name, *_ in visit_steps(a.visit) if name not in done]
    print(" ".join(left) or "all done")
    return 1 if left else 0


# --- report --------------------------------------------------------------------------------
def cmd_report(_: argparse.Namespace) -> int:
    res = load()
    if res.get("visit", "engine") != "engine":
        import labsteps

        (LAB / "results.md").write_text(labsteps.report(res))
        export_out()
        return 0
    import labreport

    text = labreport.render_engine(res, CAP)
    (LAB / "results.md").write_text(text)
    print(text)
    export_out()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("models")
    p.add_argument("--shapes", nargs="+", default=list(ENGINES))
    p = sub.add_parser("launch")
    p.add_argument("--shapes", nargs="+", default=list(ENGINES))
    p.add_argument("--wait-models-s", type=float, default=240)
    p = sub.add_parser("run")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--only", nargs="*")
    p.add_argument("--redo", nargs="*", help="forget these steps' results and run them again")
    p.add_argument("--visit", default="engine", choices=VISIT_NAMES)
    sub.add_parser("report")
    p = sub.add_parser("pending")
    p.add_argument("--visit", default="engine", choices=VISIT_NAMES)
    p = sub.add_parser("correctness")
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--gateway", action="store_true")
    p.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    LAB.mkdir(parents=True, exist_ok=True)
    fn = {"models": cmd_models, "launch": cmd_launch, "run": cmd_run, "report": cmd_report,
          "pending": cmd_pending, "correctness": cmd_correctness}[a.cmd]
    return int(fn(a) or 0)


if __name__ == "__main__":
    sys.modules.setdefault("lab", sys.modules[__name__])  # labsteps shares this module's state
    raise SystemExit(main())
