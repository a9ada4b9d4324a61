"""The 0.6B through `embedserve up` on one GPU: the ``small-model`` scenario.

The 0.6B is the shape whose request rate the gateway's one event loop could cap, so this
scenario measures what moves that loop, side by side in one run, and the 0.6B in FP8:

- ``matrix``: raw SGLang (the first engine of the default stack, sent token ids), the default
  stack (two engines), and FP8 stacks with one and two engines; short, seed mix with 1 and 1-16
  inputs, medium, long, one in flight;
- ``gateway``: the default stack against the same stack with the earlier settings
  (``gateway.inline_tokenize_chars`` 2,048: texts tokenised on the loop), with uvloop
  (``gateway.event_loop``), and with three engines; two rounds, the order turned each round;
- the profile of the default stack (py-spy over the gateway and SGLang's processes, SGLang's
  torch profile of the first engine), and the seed mix cross-checked by a second client.

Every stack starts at once (about 68 GB of GPU memory together) and idles while another is
measured; rows carry the stack's GPU memory, the GPU's busy share and the cache hit rate.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import profile_engine
import stacks
from loadgen import Load, Target
from overlap import CASES, Config, measure_busy, stack_memory, start, wait
from scenarios import Case, runs_dir
from stacks import Host

DEFAULT = Config("0.6b", 2, 8500)
CONFIGS = {
    "x2": DEFAULT,
    "x2, inline 2048": Config("0.6b", 2, 8510, variant="-inline"),
    "x2, uvloop": Config("0.6b", 2, 8520, variant="-uvloop"),
    "x3": Config("0.6b", 3, 8530),
    "fp8 x1": Config("0.6b", 1, 8540, "fp8"),
    "fp8 x2": Config("0.6b", 2, 8550, "fp8"),
}
MATRIX_SIDES = ("raw SGLang", "x2", "fp8 x1", "fp8 x2")
GATEWAY_SIDES = ("x2", "x2, inline 2048", "x2, uvloop", "x3")
GATEWAY_CASES = ("short", "seed mix", "one in flight")
CROSSCHECK = ("x2", "fp8 x1")  # the seed mix, repeated by bench/crosscheck.py


def side_target(host: Host, side: str) -> Target:
    if side == "raw SGLang":
        return stacks.raw_target(host, DEFAULT.shape, DEFAULT.engine_port)
    c = CONFIGS[side]
    pid = host.work.state["procs"][c.tag]["pid"]
    return stacks.gateway_target(host, c.shape, c.port, c.engine_ports, pid)


def one_row(host: Host, name: str, side: str, load: Load, seed: int, tags: dict[str, Any],
            client: str = "loadtest") -> dict[str, Any]:
    """One measured run with the GPU's busy share and its stack's GPU memory (raw SGLang's:
    the default stack's)."""
    row = measure_busy(name, side_target(host, side), load, runs_dir(host), seed=seed, client=client,
                       tags={"group": "0.6b", "side": side, **tags})
    memory = stack_memory(CONFIGS[side if side in CONFIGS else "x2"])
    row["stack_gpu_gb"] = memory["stack_gb"]
    row["engine_gpu_gb"] = memory["engine_gb"]
    return row


def slug(*parts: str) -> str:
    return "-".join(parts).replace(", ", "-").replace(" ", "-")


def step_start(host: Host, budget_end: float) -> dict[str, Any]:
    configs = list(CONFIGS.values())
    start(host, configs)
    out = wait(host, configs, budget_end)
    out["fi_cache_tgz_mb"] = stacks.pack_fi_cache(host)
    out["uvloop_installed"] = importlib.util.find_spec("uvloop") is not None  # else "x2, uvloop" is asyncio
    return out


def step_profile(host: Host, budget_end: float) -> dict[str, Any]:
    """The default stack under the seed mix at 64 in flight: py-spy over the gateway (`up`'s
    process) and the first engine's processes, then that engine's torch profile."""
    return profile_engine.profile_under_load(
        side_target(host, "x2"), Load("seed", 64, seconds=24, warmup=2),
        host.work.root / "profiles" / "small-model", gateway_port=DEFAULT.port,
        engine_port=DEFAULT.engine_port, runs=runs_dir(host))


def step_matrix(host: Host, budget_end: float, part: int = 1) -> dict[str, Any]:
    """Each case on every matrix side, back to back (part 1: the first three cases)."""
    cases = CASES[:3] if part == 1 else CASES[3:]
    rows = [one_row(host, slug("matrix", case.name, side), side, case.load.scaled(host.time_scale), 80,
                    {"case": case.name})
            for case in cases for side in MATRIX_SIDES]
    return {"rows": rows}


def step_gateway(host: Host, budget_end: float, rnd: int = 0) -> dict[str, Any]:
    """The default stack against its variants; round 1 runs the sides in reverse order."""
    cases: list[Case] = [c for c in CASES if c.name in GATEWAY_CASES]
    order = GATEWAY_SIDES if rnd % 2 == 0 else GATEWAY_SIDES[::-1]
    rows = [one_row(host, slug("gateway", case.name, side, str(rnd)), side,
                    case.load.scaled(host.time_scale), 90 + rnd, {"case": case.name, "round": rnd})
            for case in cases for side in order]
    return {"rows": rows}


def step_crosscheck(host: Host, budget_end: float) -> dict[str, Any]:
    """The seed mix at 64 in flight by `embedserve loadtest` and by bench/crosscheck.py."""
    load = next(c for c in CASES if c.name == "seed mix").load.scaled(host.time_scale)
    rows = [one_row(host, slug("crosscheck", side, client), side, load, 95, {"case": "seed mix"}, client)
            for side in CROSSCHECK for client in ("loadtest", "crosscheck")]
    return {"rows": rows}


def step_stop(host: Host, budget_end: float) -> dict[str, Any]:
    return {"stopped": [c.tag for c in CONFIGS.values() if host.work.stop(c.tag, 60) is not None]}
