"""`embedserve up` as an operator runs it: one gateway with one, then two 4B engines (one GPU
each, `EMBEDSERVE_ENGINE__REPLICAS=2`), and the closed-loop capacity the soak is sized by."""

from __future__ import annotations

from typing import Any

import stacks
from gpu_memory import gpu_used_gb
from loadgen import Load, measure
from stacks import Host

UP_PORT, UP_ENGINE_PORT = 8100, 30100
# admission control must not cap the two-engine run
UP_EXTRA = {"EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": "1048576",
            "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "300"}
SCALE_LOADS = [("short", "uniform:16-512", 128), ("medium", "uniform:512-2048", 64)]
CAPACITY_LOAD = Load("seed", 32, inputs="1-16", seconds=30, warmup=5)


def gpus() -> int:
    return len(gpu_used_gb() or [])


def step_up(host: Host, budget_end: float, replicas: int = 1) -> dict[str, Any]:
    if replicas > 1 and not host.cpu and gpus() < replicas:
        return {"skipped": f"{replicas} engines need {replicas} GPUs; this host has {gpus()}"}
    tag = f"up-{replicas}"
    if not host.work.running(tag):
        stacks.start_up(host, tag, "4b", UP_PORT, replicas=replicas, engine_port=UP_ENGINE_PORT,
                        extra=UP_EXTRA)
    ready = stacks.wait_ready(host, tag, "/health/ready", UP_PORT, budget_end, banner="embedserve is up")
    return {"ready_s": ready, "replicas": replicas, "gpu_used_gb": gpu_used_gb(),
            "fi_cache_tgz_mb": stacks.pack_fi_cache(host)}  # now: a later slice may never come


def target(host: Host, replicas: int) -> Any:
    pid = host.work.state["procs"][f"up-{replicas}"]["pid"]
    return stacks.gateway_target(host, "4b", UP_PORT, [UP_ENGINE_PORT + i for i in range(replicas)], pid)


def step_capacity(host: Host, budget_end: float) -> dict[str, Any]:
    """Closed-loop capacity through `up`'s gateway: seed length mix, 1-16 inputs per request.
    A soak is then run open loop at ~85% of its req/s (`embedserve loadtest --rate`)."""
    row = measure("soak-capacity", target(host, 1), CAPACITY_LOAD.scaled(host.time_scale),
                  host.work.root / "runs", seed=11, tags={"case": "seed mix, 1-16 inputs"})
    return {"row": row, "soak_rate_req_s": round(0.85 * row["req_s"], 2)}


def step_scale_load(host: Host, budget_end: float, replicas: int = 1) -> dict[str, Any]:
    """Each load at its in-flight count per engine (so two engines get twice as many)."""
    if not host.work.running(f"up-{replicas}"):
        return {"skipped": f"no stack with {replicas} engine(s)"}
    t = target(host, replicas)
    measure(f"scale-{replicas}-warm", t, Load("uniform:16-512", 64, seconds=8, warmup=0).scaled(
        host.time_scale), host.work.root / "runs", seed=5)
    rows = [measure(f"scale-{replicas}-{case}", t,
                    Load(mix, conc * replicas, seconds=20, warmup=5).scaled(host.time_scale),
                    host.work.root / "runs", seed=30,
                    tags={"case": case, "replicas": replicas})
            for case, mix, conc in SCALE_LOADS]
    return {"rows": rows, "gpu_used_gb": gpu_used_gb()}


def step_down(host: Host, budget_end: float, replicas: int = 1) -> dict[str, Any]:
    return {"clean": host.work.stop(f"up-{replicas}", 120)}

