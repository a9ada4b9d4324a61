"""Other embedding servers on the same GPU, sent the same texts as embedserve's gateway:
Infinity 0.0.78 (torch engine, bf16). vLLM has a scenario of its own (bench/vllm_peer.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import stacks
from loadgen import Load, Target
from scenarios import ENGINE_PORTS, Case, alternate, engine_memory
from stacks import Host

INFINITY_PORT, GATEWAY_PORT = 7997, 8004
PEER_CASES = [
    Case("short, 1 input/request", Load("uniform:16-512", 64, seconds=15), rounds=2),
    Case("short, 32 inputs/request", Load("uniform:16-512", 4, inputs="32", seconds=15), rounds=2),
    Case("~1,000 words", Load("uniform:1200-1400", 16, seconds=15), rounds=2),
    Case("one in flight", Load("uniform:16-512", 1, seconds=6, warmup=1), rounds=4),
]


def infinity_importable(host: Host) -> str | None:
    """None when Infinity can start from its folder, else why not."""
    probe = ("import infinity_emb, transformers; "
             "assert transformers.__version__.startswith('4.'), transformers.__version__")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (host.infinity_site, env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1][:300]


PEER_PARTS = {1: ("short, 1 input/request", "short, 32 inputs/request"),
              2: ("~1,000 words", "one in flight")}  # one step each; Infinity stays up between


def step_infinity(host: Host, budget_end: float, shape: str = "4b", part: int = 1) -> dict[str, Any]:
    """Infinity and embedserve's gateway (in front of the main raw engine), alternating, same
    seeds so the same texts; the load generator counts tokens with the model's tokenizer for
    both."""
    why = infinity_importable(host)
    if why:
        return {"skipped": f"Infinity not importable from {host.infinity_site}: {why}"}
    gw = stacks.start_gateway(host, "gateway-peers", shape, GATEWAY_PORT, [ENGINE_PORTS[shape]])
    if not host.work.running("infinity"):
        stacks.start_infinity(host, "infinity", shape, INFINITY_PORT)
    last = part == max(PEER_PARTS)
    out: dict[str, Any] = {}
    try:
        stacks.wait_ready(host, "gateway-peers", "/health/ready", GATEWAY_PORT, budget_end)
        out["ready_s"] = stacks.wait_ready(host, "infinity", "/health", INFINITY_PORT, budget_end)
        out["gpu_gb_idle"] = engine_memory(host, [f"engine-{shape}", "infinity"])
        sides = [("embedserve", stacks.gateway_target(host, shape, GATEWAY_PORT, [ENGINE_PORTS[shape]],
                                                      gw["pid"])),
                 ("infinity", Target(f"http://127.0.0.1:{INFINITY_PORT}/embeddings", host.model(shape),
                                     raw=False, cap=host.cap))]
        warm = Case("warm-up", Load("uniform:16-512", 32, seconds=8, warmup=0))
        alternate(host, sides, warm, f"peers-warm-{part}", 400)
        out["rows"] = []
        for i, case in enumerate(PEER_CASES):
            if case.name in PEER_PARTS[part]:
                out["rows"] += alternate(host, sides, case, "peers", 410 + 10 * i, tags={"shape": shape})
        out["gpu_gb_after"] = engine_memory(host, [f"engine-{shape}", "infinity"])
    finally:
        host.work.stop("gateway-peers", 30)
        if last:
            host.work.stop("infinity", 60)
    return out
