"""The leak drill, measured (bench/README.md, "The leak drill"): `embedserve up --drill-leak RATE` under an
open-loop load, sampled every second (/health/memory, /metrics, the engines under `up`, `up`'s log), into
``drill.json`` (bench/drill_report.py: the arithmetic, the report, the plots)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import drill_report
import harness
import psutil
from gpu import Nvml
from harness import UP, Host, Side
from procs import alive, child_env, embedserve_cmd, http_get

from embedserve.config import CHILD_SETTINGS_ENV
from embedserve.contracts.memory import MemoryReport, ProcessMemory
from embedserve.engines.drill import parse_rate
from embedserve.health.sources.processes import read_processes
from embedserve.loadtest.cachehits import counters

TAG = "drill"
DRILL_PORT = 8300  # its engines on 30300, the replacement's on 30302
STOP_RESERVE_S = 45.0  # stopping the load and the stack, and writing the results
CAPACITY_4B_REQ_S = 16.0  # seed mix, 1-16 inputs per request, one H200 (results/gpu-perf)
CAPACITY_CPU_REQ_S = 3.0  # the tiny checkpoint on a 2-core VM shared with other work
# `up`'s log lines worth a time: the leak, the replacement, the banner, failures
LOG_KEYS = re.compile(r"leak|replac|embedserve is up|did not start|exited|Traceback", re.IGNORECASE)


@dataclass(frozen=True)
class DrillConfig:
    """What the drill runs with; ``health`` becomes EMBEDSERVE_HEALTH__* variables."""

    rate: str  # `up --drill-leak`
    resource: str  # the forecast resource the leak fills: gpu:0 or host
    limit_bytes: int
    base_bytes: float  # what the resource holds before the leak (an estimate: it sets the limit)
    replace_after_s: float  # the replacement should start this long into the leak
    load_rate: float  # open-loop requests per second
    after_s: float  # how long to go on after the old engine stopped
    limit_s: float  # the whole step: start, drill and stop
    mix: str = "seed"
    inputs: str = "1-16"
    health: dict[str, float] = field(default_factory=dict)

    @property
    def rate_bytes_per_s(self) -> float:
        return parse_rate(self.rate)

    def env(self) -> dict[str, str]:
        return {f"EMBEDSERVE_HEALTH__{k.upper()}": f"{v:g}" if isinstance(v, float) else str(v)
                for k, v in self.health.items()}


def config_for(host: Host, rate: str | None = None) -> DrillConfig:
    """GPU: 4 GiB/min into a limit of 56 GB with the 4B's ~14.5 GB in use: ~9.7 min to the limit, the
    replacement due ~2 min in, which leaves room for a second engine (~14.5 GB) and the leak while both
    run. CPU: 20 MiB/s into a limit 3 GB above the stack's ~0.6 GB, the replacement due ~1 min in."""
    rows = host.work.state.get("steps", {}).get("soak-capacity", {}).get("rows") or [{}]
    cpu, capacity = host.cpu, rows[0].get("req_s")
    rate = rate or ("20MiB/s" if cpu else "4GiB/min")
    # bytes in use before the leak and up to the limit; the replacement due this long into the leak
    base, headroom, after_leak, span = (0.6e9, 3.0e9, 60.0, 20.0) if cpu else (14.5e9, 41.5e9, 120.0, 60.0)
    health: dict[str, float] = {"sample_interval_s": 1.0, "warmup_s": 5.0 if cpu else 10.0,
                                "min_span_s": span, **({"min_samples": 15} if cpu else {})}
    per_s, limit = parse_rate(rate), int(base + headroom)
    # due when the forecast says this much time is left: `after_leak` seconds into the leak,
    # but never before the forecast has had its minimum span
    due_s = max(headroom / per_s - max(after_leak, span + 15.0), 30.0)
    health |= {
        ("host_memory_limit_bytes" if cpu else "gpu_memory_limit_bytes"): limit,
        "replace_below_hours": round(due_s / 3600, 4),
        "warning_hours": round(1.25 * due_s / 3600, 4),
        "critical_hours": round(0.4 * due_s / 3600, 4),
        "replace_min_age_s": 30,
        "replace_cooldown_s": 600,  # one replacement per drill
    }
    load = 0.5 * (capacity or (CAPACITY_CPU_REQ_S if cpu else CAPACITY_4B_REQ_S))
    return DrillConfig(rate=rate, resource="host" if cpu else "gpu:0", limit_bytes=limit, base_bytes=base,
                       replace_after_s=after_leak, load_rate=round(load, 2), after_s=30.0 if cpu else 60.0,
                       limit_s=300.0 if cpu else 530.0, health=health)


# -- reading the stack ---------------------------------------------------------------------
def engine_port(proc: psutil.Process) -> int | None:
    """An engine's port: SGLang's --port, else the settings `up` handed the CPU engine."""
    with contextlib.suppress(psutil.Error, ValueError, KeyError, TypeError):
        argv = proc.cmdline()
        if "--port" in argv and argv.index("--port") + 1 < len(argv):
            return int(argv[argv.index("--port") + 1])
        env = proc.environ()
        if CHILD_SETTINGS_ENV in env:
            return int(json.loads(env[CHILD_SETTINGS_ENV])["engine"]["port"])
        return int(env["EMBEDSERVE_ENGINE__PORT"])
    return None


def engines_under(up_pid: int) -> dict[int, ProcessMemory]:
    """`up`'s children that are engines, each with its family's pids and RSS as health reads them."""
    pids: dict[str, int] = {}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(up_pid).children():
            with contextlib.suppress(psutil.Error):
                argv = " ".join(child.cmdline())
                if "sglang" in argv or "embedserve.engines" in argv:
                    pids[str(child.pid)] = child.pid
    found, _ = read_processes(pids)
    return {mem.pid: mem for mem in found.values()}


def health_figures(doc: MemoryReport, resource: str) -> dict[str, Any]:
    """What one /health/memory answer says about the drill's resource, and the verdict."""
    res = doc.resource(resource)
    return {"status": doc.status, "recommends_restart": doc.recommends_restart,
            "binding": doc.binding_resource, "hours": doc.estimated_hours_until_oom,
            "res_hours": res and res.estimated_hours_until_oom, "res_low": res and res.hours_lower,
            "res_high": res and res.hours_upper, "res_status": res and res.status,
            "used": res and res.used_bytes, "limit": res and res.limit_bytes, "measure": res and res.measure,
            "replacements": doc.replacements, "ready": {e.url: e.ready for e in doc.engines}}


def exit_status(pid: int) -> str | None:
    """How our child ``pid`` ended ("exit 0", "signal 9"), reaping it; None while it runs."""
    with contextlib.suppress(ChildProcessError):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return f"signal {-code}" if code < 0 else f"exit {code}"
    return None


def log_time(line: str, seen: float) -> tuple[float, str]:
    """(time, message) of one log line: a JSON line's ``ts``, else when it was read."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        doc = json.loads(line)
        return float(doc["ts"]), str(doc.get("msg", line))
    return seen, line.strip()


class Sampler(threading.Thread):
    """Every ``interval_s``: /health/memory, /metrics, the engines under `up` and `up`'s new log lines."""

    def __init__(self, url: str, up_pid: int, log: Path, resource: str, interval_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.up_pid, self.log, self.resource = url, up_pid, log, resource
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self.lines: list[dict[str, Any]] = []
        self.engine_seen: dict[int, dict[str, Any]] = {}  # pid -> port, first and last seen
        self._offset = 0  # read up to here (the step moves an earlier run's log aside)
        self._halt = threading.Event()
        self._gpu = Nvml()

    def first_line(self, pattern: str) -> float | None:
        return next((x["t"] for x in self.lines if re.search(pattern, x["msg"], re.IGNORECASE)), None)

    def read_log(self) -> None:
        try:
            with open(self.log, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except OSError:
            return
        cut = chunk.rfind(b"\n") + 1  # whole lines only
        self._offset += cut
        seen = time.time()
        for raw in chunk[:cut].decode(errors="replace").splitlines():
            if LOG_KEYS.search(raw):
                t, msg = log_time(raw, seen)
                self.lines.append({"t": round(t, 3), "msg": msg[:300], "line": raw[:600]})

    def sample(self) -> None:
        t = time.time()
        row: dict[str, Any] = {"t": round(t, 3)}
        code, body = http_get(self.url + "/health/memory", timeout=3)
        if code in (200, 503) and body:
            with contextlib.suppress(ValueError):  # pydantic's ValidationError included
                row |= health_figures(MemoryReport.model_validate_json(body), self.resource)
        code, body = http_get(self.url + "/metrics", timeout=3)
        if code == 200:
            row["replacements_metric"] = counters(body).get("embedserve_engine_replacements_total")
        gpu = self._gpu.read()
        engines: dict[str, dict[str, Any]] = {}
        for pid, mem in engines_under(self.up_pid).items():
            if pid not in self.engine_seen:
                with contextlib.suppress(psutil.Error):
                    self.engine_seen[pid] = {"pid": pid, "port": engine_port(psutil.Process(pid)),
                                             "first": round(t, 3)}
            if (seen := self.engine_seen.get(pid)) is not None:
                seen["last"] = round(t, 3)
                engines[str(seen["port"] or pid)] = {"pid": pid, "rss": mem.rss_bytes} | (
                    {} if gpu is None else {"gpu": sum(gpu[0].get(p, 0) for p in mem.pids)})
        row["engines"] = engines
        if gpu is not None:
            row["device_used"] = gpu[1]
        self.samples.append(row)

    def run(self) -> None:
        while not self._halt.is_set():
            began = time.time()
            try:
                self.read_log()
                self.sample()
            except Exception as exc:  # one bad tick must not end the series
                self.samples.append({"t": round(began, 3), "error": repr(exc)[:300]})
            self._halt.wait(max(0.0, self.interval_s - (time.time() - began)))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=15)
        self.read_log()
        self._gpu.close()


# -- the load ------------------------------------------------------------------------------
def loadtest_argv(host: Host, cfg: DrillConfig, url: str, out: Path, seconds: float) -> list[str]:
    """`embedserve loadtest` open loop: unique inputs, the memory report every second, 5 s windows."""
    return [*embedserve_cmd(), "loadtest", url, "--tokenizer", host.model("4b"), "--model",
            host.served_name("4b"), "--mix", cfg.mix, "--inputs", cfg.inputs, "--rate", f"{cfg.load_rate:g}",
            "--duration", f"{seconds:.0f}", "--warmup", "0", "--seed", "23", "--out", str(out),
            "--no-progress", "--no-plots", "--health-url", "/health/memory", "--sample-interval", "1",
            "--window", "5", "--timeout", "300", "--max-tokens", str(host.cap), "--metrics-url", "none",
            "--retries-429", "0"]  # one attempt per request: a 429 is counted, not sent again


def load_series(results: dict[str, Any]) -> dict[str, Any]:
    """The load's totals and its per-window statuses, in wall-clock time."""
    t0 = float(results["meta"].get("started_at") or 0.0)
    wins = [{"t0": round(t0 + w["t_start"], 3), "t1": round(t0 + w["t_end"], 3),
             "by_status": w.get("by_status", {}), "ok": w.get("ok", 0),
             "p50_ms": (w.get("latency_ms") or {}).get("p50"),
             "p95_ms": (w.get("latency_ms") or {}).get("p95")}
            for w in results.get("windows", [])]
    tot = results.get("totals", {})
    return {"started_at": t0, "stop_reason": results["meta"].get("stop_reason"),
            "traffic": results["meta"].get("traffic"), "attempts": tot.get("attempts", 0),
            "by_status": tot.get("by_status", {}), "latency_ms": tot.get("latency_ms"),
            "requests_per_s": tot.get("requests_per_s"), "tokens_per_s": tot.get("tokens_per_s"),
            "dropped_arrivals": (results.get("client") or {}).get("dropped_arrivals", 0),
            "error_samples": results.get("error_samples", {}), "windows": wins}


# -- the step ------------------------------------------------------------------------------
def step_drill(host: Host, budget_end: float, rate: str | None = None) -> dict[str, Any]:
    cfg = config_for(host, rate or host.drill_rate)
    out = (host.out or host.work.root) / "drill"
    out.mkdir(parents=True, exist_ok=True)
    deadline = min(time.time() + cfg.limit_s, budget_end) - STOP_RESERVE_S
    log = host.work.root / "logs" / f"{TAG}.log"
    if log.exists():  # an earlier run's banner must not pass for this one's
        log.replace(log.with_suffix(".log.1"))
    args = ("--drill-leak", cfg.rate)
    side = Side(TAG, UP, DRILL_PORT, "4b", {"EMBEDSERVE_LOG_LEVEL": "WARNING", **cfg.env()}, args, tag=TAG)
    env = UP.command(host, side)[1] | side.env
    info = harness.start(host, side)  # its ports free: the engine's, its replacement's
    assert info is not None
    url = f"http://127.0.0.1:{DRILL_PORT}"
    sampler = Sampler(url, info["pid"], Path(info["log"]), cfg.resource)
    sampler.start()
    load: subprocess.Popen[bytes] | None = None
    events: dict[str, Any] = {"stack_start": info["started_at"]}
    runs = host.work.root / "runs" / "drill"
    load_argv: list[str] = []
    ended = "time limit"
    try:
        harness.wait_ready(host, side, min(deadline, budget_end))
        events["ready"] = time.time()
        runs.mkdir(parents=True, exist_ok=True)
        load_argv = loadtest_argv(host, cfg, url, runs, deadline - time.time() + 30)
        with open(runs / "client.log", "ab") as fh:
            load = subprocess.Popen(load_argv, env=child_env(), stdout=fh, stderr=subprocess.STDOUT)
        events["load_start"] = time.time()
        while time.time() < deadline:
            status = exit_status(info["pid"])
            if status or not alive(info["pid"]):
                ended = f"the stack exited ({status or 'its process group is gone'})"
                break
            done = sampler.first_line(r"engine replaced")
            if done is not None and time.time() >= done + cfg.after_s:
                ended = f"{cfg.after_s:g} s after the replacement"
                break
            time.sleep(0.5)
    finally:
        if load is not None and load.poll() is None:
            load.send_signal(signal.SIGINT)  # stops sending, waits for the answers, writes results
            try:
                load.wait(timeout=60)
            except subprocess.TimeoutExpired:
                load.kill()
        events["load_end"] = time.time()
        sampler.stop()
        events["stop"] = time.time()
        clean = host.work.stop(TAG, 60)
        events["stopped"] = time.time()
        sampler.read_log()
    results_path = runs / "results.json"
    load_doc = load_series(json.loads(results_path.read_text())) if results_path.exists() else None
    events |= {"leak_start": sampler.first_line(r"leak"),
               "replace_start": sampler.first_line(r"replacing an engine"),
               "replace_done": sampler.first_line(r"engine replaced"),
               "replace_failed": sampler.first_line(r"replacement failed")}
    doc = {
        "meta": {**harness.describe(host, command="python bench/suite.py --only drill"),
                 "model": host.model("4b"), "cap": host.cap, "rate": cfg.rate,
                 "rate_bytes_per_s": cfg.rate_bytes_per_s, "resource": cfg.resource,
                 "limit_bytes": cfg.limit_bytes, "config": asdict(cfg), "health": cfg.health,
                 "ended": ended, "stopped_clean": clean,
                 "commands": {"up": ["embedserve", "up", *args], "up_env": {
                     k: v for k, v in env.items() if k.startswith(("EMBEDSERVE_", "CUDA_"))},
                     "loadtest": ["embedserve", *load_argv[len(embedserve_cmd()):]] if load_argv else None}},
        "events": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in events.items()},
        "engines": list(sampler.engine_seen.values()), "log": sampler.lines, "samples": sampler.samples,
        "load": load_doc}
    doc["summary"] = drill_report.summarize(doc)
    path = out / "drill.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    rendered = None
    try:
        rendered = str(drill_report.write_report(doc, out))
    except ImportError as exc:  # no matplotlib here: render later with bench/drill_report.py
        host.work.note(f"drill report not rendered here ({exc}); run bench/drill_report.py {path} DIR")
    return {"drill_json": str(path), "report": rendered, "summary": doc["summary"]}
