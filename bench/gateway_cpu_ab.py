"""Gateway CPU per request on the lab host's CPUs, A/B over gateway settings, no GPU used.

The scale visit found one gateway in front of two 4B engines at ~610 short single-input
requests/s and 86% of a core, against ~1,100 req/s at ~80% on the 2-core dev box. This asks
where the lab host's extra CPU goes: two instant engines answering 2560-dim vectors, one
gateway in front of both, closed loop at 256 in flight, short texts (16-512 tokens); each
configuration alternates over rounds. Per run: gateway CPU ms per request, and how busy its
event-loop thread was (busy near 100% = the loop is the limit) against all its other threads
(tokenizer pool, Rayon inside ``tokenizers``).

    python3 loadtest/gpu_lab/gateway_cpu_ab.py --seconds 15 --rounds 2     # writes to $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from loadtest.bench_gateway_cpu import wait_http

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_PORT, ENGINE_PORTS = 8100, (30100, 30101)
CONFIGS: dict[str, dict[str, str]] = {
    "default": {},
    "TOKENIZERS_PARALLELISM=false": {"TOKENIZERS_PARALLELISM": "false"},
    "all tokenising in threads": {"EMBEDSERVE_GATEWAY__INLINE_TOKENIZE_CHARS": "0"},
    "no Rayon + all in 4 threads": {"TOKENIZERS_PARALLELISM": "false",
                                    "EMBEDSERVE_GATEWAY__INLINE_TOKENIZE_CHARS": "0",
                                    "EMBEDSERVE_GATEWAY__TOKENIZER_THREADS": "4"},
}


def cpu_split(proc: psutil.Process) -> tuple[float, float]:
    """(event-loop thread, all other threads) CPU seconds; the main thread runs the loop."""
    main = other = 0.0
    for t in proc.threads():
        if t.id == proc.pid:
            main += t.user_time + t.system_time
        else:
            other += t.user_time + t.system_time
    return main, other


def one_run(name: str, env_extra: dict[str, str], model: Path, seconds: float, conc: int,
            work: Path) -> dict[str, Any]:
    env = dict(os.environ, **env_extra, EMBEDSERVE_LOG_LEVEL="WARNING",
               EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT="1048576")
    argv = [sys.executable, "-m", "service.cli", "up", "--model", str(model), "--model-name", "m",
            "--engine-kind", "external", "--port", str(GATEWAY_PORT)]
    for port in ENGINE_PORTS:
        argv += ["--engine-url", f"http://127.0.0.1:{port}"]
    log = open(work / "gateway.log", "ab")  # noqa: SIM115  (closed below)
    gw = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        try:
            wait_http(f"http://127.0.0.1:{GATEWAY_PORT}/health/ready", 45)
        except RuntimeError:
            print((work / "gateway.log").read_text(errors="replace")[-3000:], flush=True)
            raise
        proc = psutil.Process(gw.pid)
        out = work / f"lt-{len(list(work.glob('lt-*')))}"
        lt = [sys.executable, "-m", "loadtest.cli", f"http://127.0.0.1:{GATEWAY_PORT}",
              "--tokenizer", str(model), "--model", "m", "--mix", "uniform:16-512",
              "--concurrency", str(conc), "--duration", str(seconds), "--warmup", "3",
              "--no-progress", "--no-plots", "--out", str(out)]
        loadgen = subprocess.Popen(lt, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        time.sleep(3.5)  # past the load generator's warm-up
        m0, o0, t0 = *cpu_split(proc), time.perf_counter()
        g0 = psutil.Process(loadgen.pid).cpu_times()
        time.sleep(seconds - 1)
        m1, o1, t1 = *cpu_split(proc), time.perf_counter()
        g1 = psutil.Process(loadgen.pid).cpu_times()
        loadgen.wait(timeout=120)
        totals = json.loads((out / "results.json").read_text())["totals"]
        req_s = totals["requests_per_s"]
        wall = t1 - t0
        return {"config": name, "req_s": round(req_s, 1), "tok_s": round(totals["tokens_per_s"]),
                "p50_ms": totals["latency_ms"]["p50"], "errors": totals["errors"],
                "gw_cpu_ms_per_req": round((m1 - m0 + o1 - o0) / (req_s * wall) * 1000, 3),
                "loop_thread_pct": round((m1 - m0) / wall * 100, 1),
                "other_threads_pct": round((o1 - o0) / wall * 100, 1),
                "threads": proc.num_threads(),
                "loadgen_cpu_pct": round((g1.user + g1.system - g0.user - g0.system) / wall * 100, 1)}
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        log.close()


def to_markdown(rows: list[dict[str, Any]], ncpu: int) -> str:
    md = [f"# Gateway CPU per request on the lab host ({ncpu} CPUs), 2 instant 2560-dim engines",
          "", "Short single texts (16-512 tok), 256 in flight; medians over rounds.", "",
          "| config | req/s | gateway CPU ms/req | event-loop thread % | other threads % | "
          "load generator % | errors |", "|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        if mine:
            med = {k: statistics.median(r[k] for r in mine) for k in
                   ("req_s", "gw_cpu_ms_per_req", "loop_thread_pct", "other_threads_pct",
                    "loadgen_cpu_pct")}
            md.append(f"| {name} | {med['req_s']:,.0f} | {med['gw_cpu_ms_per_req']:.3f} | "
                      f"{med['loop_thread_pct']:.0f} | {med['other_threads_pct']:.0f} | "
                      f"{med['loadgen_cpu_pct']:.0f} | {sum(r['errors'] for r in mine)} |")
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    a = ap.parse_args(argv)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gw-cpu-ab-"))
    model = work / "model"
    subprocess.run([sys.executable, "-m", "service.synthetic", "tiny", str(model)], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)
    engines = [subprocess.Popen([sys.executable, "-m", "loadtest.instant_engine", str(p), "2560"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for p in ENGINE_PORTS]
    rows: list[dict[str, Any]] = []
    try:
        for p in ENGINE_PORTS:
            wait_http(f"http://127.0.0.1:{p}/health")
        names = [n.strip() for n in a.configs.split(",")]
        for rnd in range(a.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                row = one_run(name, CONFIGS[name], model, a.seconds, a.concurrency, work)
                rows.append(row | {"round": rnd})
                print(json.dumps(row), flush=True)
    finally:
        for e in engines:
            e.terminate()
    ncpu = psutil.cpu_count() or 0
    (out / "gateway-cpu-ab.json").write_text(json.dumps({"cpus": ncpu, "rows": rows}, indent=1))
    md = to_markdown(rows, ncpu)
    (out / "gateway-cpu-ab.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
