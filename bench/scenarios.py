"""The measurements on raw engines and gateways: raw SGLang against the gateway in front of it,
the KV pool size, the radix (prefix) cache. Each step takes the run's :class:`Host` and the
time it must end by, starts and stops what it needs, and returns its rows."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

import stacks
from gpu_memory import tree_used_gb
from loadgen import INPUT_TYPE_FLAGS, Load, Target, measure, supported
from procs import http_post_json
from stacks import Host

ENGINE_PORTS = {"4b": 30000, "0.6b": 30001}
GATEWAY_PORTS = {"4b": 8000, "0.6b": 8010}
MAIN_KV_POOL = 16_384  # the product's default for the 4B: one prefill batch (engine.batch_token_budget)
LARGE_KV_POOL = 65_536  # the earlier default, compared in step_kv_pool


@dataclass(frozen=True)
class Case:
    """One row of the raw-vs-gateway table: ``rounds`` alternating runs per side."""

    name: str
    load: Load
    rounds: int = 1


RAW_VS_GATEWAY = [
    Case("short", Load("uniform:16-512", 64, seconds=15), rounds=2),
    Case("seed mix", Load("seed", 64, seconds=15)),
    Case("seed mix, 1-16 inputs", Load("seed", 32, inputs="1-16", seconds=15)),
    Case("medium", Load("uniform:512-2048", 64, seconds=15)),
    Case("long", Load("uniform:8000-8191", 8, seconds=15)),
    Case("one in flight", Load("uniform:16-512", 1, seconds=6, warmup=1), rounds=6),
]
CROSSCHECKED = ("short", "medium")  # 4B rows repeated with bench/crosscheck.py, both sides


def runs_dir(host: Host) -> Any:
    return host.work.root / "runs"


def ready_engine(host: Host, tag: str, port: int, budget_end: float) -> float:
    return stacks.wait_ready(host, tag, "/health", port, budget_end)


def step_engines(host: Host, budget_end: float, shapes: tuple[str, ...] = ("4b", "0.6b")) -> dict[str, Any]:
    """The raw engines the scenarios share, on GPU 0, KV pool capped at MAIN_KV_POOL."""
    out: dict[str, Any] = {}
    for shape in shapes:
        tag = f"engine-{shape}"
        if not host.work.running(tag):
            stacks.start_engine(host, tag, shape, ENGINE_PORTS[shape], kv_pool=MAIN_KV_POOL, gpu=0)
    for shape in shapes:
        tag = f"engine-{shape}"
        out[f"ready_s_{shape}"] = ready_engine(host, tag, ENGINE_PORTS[shape], budget_end)
    out["engine_gpu_gb"] = engine_memory(host, [f"engine-{s}" for s in shapes])
    out["fi_cache_tgz_mb"] = stacks.pack_fi_cache(host)  # now: a later slice may never come
    return out


def engine_memory(host: Host, tags: list[str]) -> dict[str, float]:
    """GPU memory (NVML) of each started process and all its descendants: an `up` stack starts
    its engines in sessions of their own, which its process group would miss."""
    procs = host.work.state["procs"]
    return tree_used_gb({t: [procs[t]["pid"]] for t in tags if t in procs})


def vector_check(raw: Target, gateway: Target) -> dict[str, Any]:
    """The same token ids, each alone, straight to the engine and through the gateway: the
    gateway's hop must not change the vector (cosine >= 0.9999)."""
    rng = random.Random(7)
    model = raw.model_dir.rsplit("/", 1)[-1]
    ids = [[rng.randrange(1000, 3000) for _ in range(min(n, raw.cap - 1))] for n in (8, 300, 2000)]

    def vec(url: str, x: list[int]) -> list[float]:
        return http_post_json(url + "/v1/embeddings", {"model": model, "input": [x]})["data"][0]["embedding"]

    def cos(a: list[float], b: list[float]) -> float:
        dot = sum(p * q for p, q in zip(a, b, strict=True))
        return round(dot / math.sqrt(sum(p * p for p in a) * sum(q * q for q in b)), 6)

    try:
        cosines = [cos(vec(raw.url, x), vec(gateway.url, x)) for x in ids]
    except Exception as exc:  # recorded, the throughput runs still go on
        return {"ok": False, "error": repr(exc)[:300], "tokens": [len(x) for x in ids]}
    return {"ok": min(cosines) >= 0.9999, "cosines": cosines, "tokens": [len(x) for x in ids]}


def alternate(host: Host, sides: list[tuple[str, Target]], case: Case, prefix: str, seed: int,
              tags: dict[str, Any] | None = None, client: str = "loadtest",
              loads: dict[str, Load] | None = None) -> list[dict[str, Any]]:
    """``case.rounds`` rounds, the sides' order flipped every round; same seed per round on
    each side, so both get inputs of the same token counts. ``loads`` replaces the case's load
    for the sides it names (one target measured with two client settings)."""
    rows = []
    for rnd in range(case.rounds):
        order = sides if rnd % 2 == 0 else sides[::-1]
        for side, target in order:
            load = (loads or {}).get(side, case.load).scaled(host.time_scale)
            slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{prefix}-{case.name}-{side}-{rnd}")
            rows.append(measure(slug, target, load, runs_dir(host), seed=seed + rnd, client=client,
                                tags={"case": case.name, "side": side, "round": rnd, **(tags or {})}))
    return rows


RAW_VS_GATEWAY_PARTS = {1: ("short", "seed mix"), 2: ("seed mix, 1-16 inputs", "medium", "long"),
                        3: ("one in flight",)}  # one step each, so each fits a 10-minute slice


def step_raw_vs_gateway(host: Host, budget_end: float, shape: str = "4b", part: int = 1) -> dict[str, Any]:
    """Raw SGLang (token ids) against a gateway in front of it (texts of the same token
    counts), alternating, for this part's cases. Part 1 first checks that the gateway's hop
    leaves vectors alone; part 3 on the 4B repeats the headline cases with crosscheck.py."""
    port, gw_port = ENGINE_PORTS[shape], GATEWAY_PORTS[shape]
    tag = f"gateway-{shape}"
    info = stacks.start_gateway(host, tag, shape, gw_port, [port])
    out: dict[str, Any] = {"shape": shape}
    try:
        stacks.wait_ready(host, tag, "/health/ready", gw_port, budget_end)
        raw = stacks.raw_target(host, shape, port)
        gateway = stacks.gateway_target(host, shape, gw_port, [port], info["pid"])
        sides = [("raw", raw), ("gateway", gateway)]
        if part == 1:
            out["vector_check"] = vector_check(raw, gateway)
            host.work.note(f"vectors {shape}, gateway vs raw: {out['vector_check']}")
        warm = Case("warm-up", Load("uniform:16-512", 64, seconds=8, warmup=0))
        alternate(host, sides, warm, f"warm-{shape}-{part}", 90)
        out["rows"] = []
        for i, case in enumerate(RAW_VS_GATEWAY):
            if case.name in RAW_VS_GATEWAY_PARTS[part]:
                out["rows"] += alternate(host, sides, case, shape, 20 + 10 * i, tags={"shape": shape})
        if shape == "4b" and part == max(RAW_VS_GATEWAY_PARTS):
            out["crosscheck_rows"] = [
                r for case in RAW_VS_GATEWAY if case.name in CROSSCHECKED
                for r in alternate(host, sides, Case(case.name, case.load), f"cross-{shape}", 70,
                                   tags={"shape": shape}, client="crosscheck")]
    finally:
        host.work.stop(tag, 30)
    return out


def step_kv_pool(host: Host, budget_end: float) -> dict[str, Any]:
    """The 4B with a 65,536-token KV pool next to the main engine's default 16,384 (raw token
    ids, alternating): GPU memory of each engine's processes, and throughput."""
    small_port = 30003
    stacks.start_engine(host, "engine-4b-kv16k", "4b", small_port, kv_pool=LARGE_KV_POOL, gpu=0)
    try:
        ready = ready_engine(host, "engine-4b-kv16k", small_port, budget_end)
        idle = engine_memory(host, ["engine-4b", "engine-4b-kv16k"])
        sides = [(f"{MAIN_KV_POOL} tokens", stacks.raw_target(host, "4b", ENGINE_PORTS["4b"])),
                 (f"{LARGE_KV_POOL} tokens", stacks.raw_target(host, "4b", small_port))]
        rows = []
        for i, case in enumerate([RAW_VS_GATEWAY[0], RAW_VS_GATEWAY[2], RAW_VS_GATEWAY[4]]):
            rows += alternate(host, sides, Case(case.name, case.load, rounds=2), "kv", 200 + 10 * i)
        after = engine_memory(host, ["engine-4b", "engine-4b-kv16k"])
    finally:
        host.work.stop("engine-4b-kv16k", 60)
    return {"ready_s": ready, "engine_gpu_gb_idle": idle, "engine_gpu_gb_after": after, "rows": rows,
            "sides": [sides[0][0], sides[1][0]]}


def step_radix(host: Host, budget_end: float) -> dict[str, Any]:
    """Radix (prefix) cache on (`engine.prefix_cache`) against off (the main engine, the
    default), both behind a gateway: unique texts, and queries, which carry the Qwen3
    instruction prefix that the cache can serve. Hit rates come from SGLang's counters."""
    on_port, gw_on, gw_off = 30002, 8002, 8003
    stacks.start_engine(host, "engine-4b-radix", "4b", on_port, kv_pool=MAIN_KV_POOL, gpu=0,
                        prefix_cache=True)
    client = "loadtest" if supported(INPUT_TYPE_FLAGS) else "crosscheck"
    try:
        ready = ready_engine(host, "engine-4b-radix", on_port, budget_end)
        on = stacks.start_gateway(host, "gateway-radix-on", "4b", gw_on, [on_port])
        off = stacks.start_gateway(host, "gateway-radix-off", "4b", gw_off, [ENGINE_PORTS["4b"]])
        for tag, port in (("gateway-radix-on", gw_on), ("gateway-radix-off", gw_off)):
            stacks.wait_ready(host, tag, "/health/ready", port, budget_end)
        sides = [("cache on", stacks.gateway_target(host, "4b", gw_on, [on_port], on["pid"])),
                 ("cache off", stacks.gateway_target(host, "4b", gw_off, [ENGINE_PORTS["4b"]], off["pid"]))]
        rows = []
        for i, input_type in enumerate((None, "query")):
            load = Load("uniform:16-512", 64, seconds=15, input_type=input_type)
            case = Case("queries (instruction prefix)" if input_type else "unique texts", load, rounds=2)
            rows += alternate(host, sides, case, "radix", 300 + 10 * i, client=client)
    finally:
        for tag in ("gateway-radix-on", "gateway-radix-off", "engine-4b-radix"):
            host.work.stop(tag, 60)
    return {"ready_s": ready, "client": client, "rows": rows, "sides": ["cache on", "cache off"]}


def step_stop_engines(host: Host, budget_end: float) -> dict[str, Any]:
    stopped = [t for t in list(host.work.state["procs"]) if t.startswith(("engine-", "gateway-", "infinity"))]
    for tag in stopped:
        host.work.stop(tag, 60)
    return {"stopped": stopped}
