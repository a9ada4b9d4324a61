"""Several engines per GPU (``engine.engines_per_gpu``) against one, through `embedserve up`,
side by side with raw SGLang, on one GPU: the ``engines-per-gpu`` scenario.

Every stack starts at once in the first step (the FlashInfer JIT cache is compiled once for
all): the 0.6B with 1, 2 and 3 engines, the 4B with 1 and 2, the FP8 4B with 1 and 2: about
106 GB of GPU memory together, idle while another stack is measured. Each case runs its
configurations back to back (raw SGLang is the one-engine stack's own engine, sent token ids),
so every configuration meets the same machine state; rows carry GPU memory (NVML, the stack's
processes), the GPU's busy fraction (NVML utilisation, sampled every 0.5 s) and the prefix-cache
hit rate. The profile step (bench/profile_engine.py) runs against the one-engine stacks.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import profile_engine
import stacks
from gpu_memory import tree_used_gb
from loadgen import Load, Target, measure
from profile_engine import listener_pid
from scenarios import Case, runs_dir
from stacks import Host


@dataclass(frozen=True)
class Config:
    """One `embedserve up` stack: model shape, engines per GPU, quantization."""

    shape: str
    engines: int
    port: int  # the gateway's; its engines listen on port + 22000, + 1, ...
    quantization: str = "none"
    variant: str = ""  # a settings variant's name (KNOB_EXTRA)

    @property
    def tag(self) -> str:
        q = "-fp8" if self.quantization == "fp8" else ""
        return f"up-{self.shape}{q}-x{self.engines}{self.variant}"

    @property
    def engine_port(self) -> int:
        return self.port + 22000

    @property
    def engine_ports(self) -> list[int]:
        return [self.engine_port + i for i in range(self.engines)]


CONFIGS = {
    "0.6b": [Config("0.6b", 1, 8400), Config("0.6b", 2, 8410), Config("0.6b", 3, 8420)],
    "4b": [Config("4b", 1, 8430), Config("4b", 2, 8440)],
    "4b-fp8": [Config("4b", 1, 8450, "fp8"), Config("4b", 2, 8460, "fp8")],
}
# admission and deadlines must not cap what is measured
UP_EXTRA = {"EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": "1048576",
            "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "300",
            "EMBEDSERVE_HEALTH__REPLACE_ENGINES": "false"}
KNOB_EXTRA = {"-b32k": {"EMBEDSERVE_ENGINE__BATCH_TOKEN_BUDGET": "32768",
                        "EMBEDSERVE_GATEWAY__MAX_TOKENS_PER_ENGINE_CALL": "32768"},
              "-inline": {"EMBEDSERVE_GATEWAY__INLINE_TOKENIZE_CHARS": "2048"},
              "-uvloop": {"EMBEDSERVE_GATEWAY__EVENT_LOOP": "uvloop"}}
CASES = [
    Case("short", Load("uniform:16-512", 64, seconds=10, warmup=2)),
    Case("seed mix", Load("seed", 64, seconds=10, warmup=2)),
    Case("seed mix, 1-16 inputs", Load("seed", 32, inputs="1-16", seconds=10, warmup=2)),
    Case("medium", Load("uniform:512-2048", 64, seconds=10, warmup=2)),
    Case("long", Load("uniform:8000-8191", 8, seconds=10, warmup=2)),
    Case("one in flight", Load("seed", 1, seconds=6, warmup=1)),
]
FP8_CASES = ("seed mix", "seed mix, 1-16 inputs", "medium", "one in flight")
CROSSCHECK = {"0.6b": "x2", "4b": "x2"}  # the headline rows, repeated by bench/crosscheck.py


def start(host: Host, configs: list[Config]) -> None:
    for c in configs:
        if host.work.running(c.tag):
            continue
        extra = {**UP_EXTRA, **KNOB_EXTRA.get(c.variant, {}),
                 "EMBEDSERVE_ENGINE__ENGINES_PER_GPU": str(c.engines)}
        if c.quantization != "none":
            extra["EMBEDSERVE_ENGINE__QUANTIZATION"] = c.quantization
        stacks.start_up(host, c.tag, c.shape, c.port, engine_port=c.engine_port, extra=extra)


def wait(host: Host, configs: list[Config], budget_end: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in configs:
        out[f"ready_s_{c.tag}"] = stacks.wait_ready(host, c.tag, "/health/ready", c.port, budget_end,
                                                    banner="embedserve is up")
    out["memory"] = {c.tag: stack_memory(c) for c in configs}
    return out


def stack_memory(c: Config) -> dict[str, Any]:
    """GPU memory (NVML) of the whole stack (`up` and everything under it) and of each engine."""
    up = listener_pid(c.port)
    engines = {str(p): listener_pid(p) for p in c.engine_ports}
    found = tree_used_gb({"stack": [up] if up else [], **{k: [v] for k, v in engines.items() if v}})
    return {"stack_gb": found.get("stack"), "engine_gb": [found.get(k) for k in engines]}


def step_start(host: Host, budget_end: float) -> dict[str, Any]:
    """Every stack at once (about 106 GB of GPU memory together); returns when all are ready."""
    configs = [c for group in CONFIGS.values() for c in group]
    start(host, configs)
    out = wait(host, configs, budget_end)
    out["fi_cache_tgz_mb"] = stacks.pack_fi_cache(host)  # now: a later slice may never come
    return out


class BusySampler:
    """NVML's utilisation of GPU 0 (the share of time a kernel ran), every 0.5 s, with the
    time of each sample: a run's figure is taken over its last ``seconds`` (``median_last``),
    the measured window, not over the load generator's start-up."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            return
        while not self._stop.wait(0.5):
            with contextlib.suppress(Exception):
                busy = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                self.samples.append((time.monotonic(), busy))

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def median_last(self, seconds: float) -> float | None:
        """The median of the samples in the last ``seconds`` before the sampler stopped."""
        if not self.samples:
            return None
        end = self.samples[-1][0]
        window = [busy for t, busy in self.samples if t >= end - seconds]
        return statistics.median(window)


def measure_busy(name: str, target: Target, load: Load, runs: Any, *, seed: int, tags: dict[str, Any],
                 client: str = "loadtest") -> dict[str, Any]:
    """One run (loadgen's ``measure``) with the GPU's busy share over its measured window."""
    with BusySampler() as busy:
        row = measure(name, target, load, runs, seed=seed, client=client, tags=tags)
    row["gpu_busy_pct"] = busy.median_last(load.seconds)
    return row


def targets(host: Host, group: str) -> list[tuple[str, Target]]:
    """raw SGLang (the one-engine stack's engine) first, then each stack's gateway."""
    procs = host.work.state["procs"]
    configs = [c for c in CONFIGS[group] if c.tag in procs]
    sides: list[tuple[str, Target]] = []
    one = next((c for c in configs if c.engines == 1 and c.quantization == "none"), None)
    if one is not None:
        sides.append(("raw SGLang", stacks.raw_target(host, one.shape, one.engine_port)))
    for c in configs:
        sides.append((f"x{c.engines}", stacks.gateway_target(host, c.shape, c.port, c.engine_ports,
                                                            procs[c.tag]["pid"])))
    return sides


def step_measure(host: Host, budget_end: float, group: str = "0.6b") -> dict[str, Any]:
    procs = host.work.state["procs"]
    configs = {f"x{c.engines}": c for c in CONFIGS[group] if c.tag in procs}
    sides = targets(host, group)
    if group.endswith("fp8"):
        sides = [s for s in sides if s[0] != "raw SGLang"]
    cases = [c for c in CASES if not group.endswith("fp8") or c.name in FP8_CASES]
    rows = []
    for case in cases:
        load = case.load.scaled(host.time_scale)
        for side, target in sides:
            name = f"{group}-{case.name}-{side}".replace(" ", "-").replace(",", "")
            row = measure_busy(name, target, load, runs_dir(host), seed=40,
                               tags={"group": group, "case": case.name, "side": side})
            if side in configs:
                row["stack_gpu_gb"] = stack_memory(configs[side])["stack_gb"]
            rows.append(row)
    check = CROSSCHECK.get(group)
    crosschecked = []
    if check and check in configs:
        target = dict(sides)[check]
        seed_case = next(c for c in CASES if c.name == "short")
        for client in ("loadtest", "crosscheck"):
            crosschecked.append(measure(f"{group}-short-{check}-{client}", target,
                                        seed_case.load.scaled(host.time_scale), runs_dir(host), seed=41,
                                        client=client, tags={"group": group, "case": "short", "side": check}))
    return {"rows": rows, "crosscheck": crosschecked}


def step_profile(host: Host, budget_end: float, group: str = "0.6b") -> dict[str, Any]:
    """Where the time goes with one engine: the engine's torch profile, py-spy over the gateway
    and SGLang's processes, under the seed mix at 64 in flight through the gateway."""
    c = next(c for c in CONFIGS[group] if c.engines == 1)
    procs = host.work.state["procs"]
    if c.tag not in procs:
        return {"skipped": f"{c.tag} is not running"}
    target = stacks.gateway_target(host, c.shape, c.port, c.engine_ports, procs[c.tag]["pid"])
    return profile_engine.profile_under_load(
        target, Load("seed", 64, seconds=24, warmup=2), host.work.root / "profiles" / group,
        gateway_port=c.port, engine_port=c.engine_port, runs=runs_dir(host))


def step_stop(host: Host, budget_end: float) -> dict[str, Any]:
    stopped = [c.tag for group in CONFIGS.values() for c in group if host.work.stop(c.tag, 60) is not None]
    return {"stopped": stopped}


# -- the detail run: memory per engine, profiles, latency at one in flight, SGLang's knobs ------

DETAIL = {
    "0.6b": CONFIGS["0.6b"] + [Config("0.6b", 2, 8470, variant="-b32k")],
    "4b": CONFIGS["4b"],
    "4b-fp8": CONFIGS["4b-fp8"],
}
def step_detail_start(host: Host, budget_end: float) -> dict[str, Any]:
    configs = [c for group in DETAIL.values() for c in group]
    start(host, configs)
    return wait(host, configs, budget_end)


def detail_target(host: Host, c: Config) -> Target:
    pid = host.work.state["procs"][c.tag]["pid"]
    return stacks.gateway_target(host, c.shape, c.port, c.engine_ports, pid)


def step_detail_profile(host: Host, budget_end: float, group: str = "0.6b") -> dict[str, Any]:
    c = DETAIL[group][0]
    return profile_engine.profile_under_load(
        detail_target(host, c), Load("seed", 64, seconds=24, warmup=2),
        host.work.root / "profiles-detail" / group, gateway_port=c.port, engine_port=c.engine_port,
        runs=runs_dir(host))


def step_detail_latency(host: Host, budget_end: float) -> dict[str, Any]:
    """One request in flight, three rounds, the sides' order turned each round."""
    rows = []
    load = Load("seed", 1, seconds=8, warmup=1).scaled(host.time_scale)
    for group in ("0.6b", "4b"):
        one, two = DETAIL[group][0], DETAIL[group][1]
        sides = [("raw SGLang", stacks.raw_target(host, one.shape, one.engine_port)),
                 ("x1", detail_target(host, one)), ("x2", detail_target(host, two))]
        for rnd in range(3):
            for side, target in sides if rnd % 2 == 0 else sides[::-1]:
                tags = {"group": group, "case": "one in flight", "side": side, "round": rnd}
                rows.append(measure(f"latency-{group}-{side.replace(' ', '-')}-{rnd}", target, load,
                                    runs_dir(host), seed=60 + rnd, tags=tags))
    return {"rows": rows}


def step_detail_knobs(host: Host, budget_end: float) -> dict[str, Any]:
    """The 0.6B with two engines: the default 16,384-token batch budget against 32,768."""
    base, big = DETAIL["0.6b"][1], DETAIL["0.6b"][3]
    rows = []
    for case in (CASES[1], CASES[2], CASES[0]):  # seed mix, 1-16 inputs, short
        load = case.load.scaled(host.time_scale)
        for rnd in range(2):
            for side, c in [("x2", base), ("x2, budget 32768", big)][:: 1 if rnd % 2 == 0 else -1]:
                rows.append(measure_busy(
                    f"knob-{case.name}-{side}-{rnd}".replace(" ", "-").replace(",", ""),
                    detail_target(host, c), load, runs_dir(host), seed=70 + rnd,
                    tags={"group": "0.6b", "case": case.name, "side": side, "round": rnd}))
    return {"rows": rows}


def step_detail_stop(host: Host, budget_end: float) -> dict[str, Any]:
    tags = [c.tag for group in DETAIL.values() for c in group]
    return {"stopped": [t for t in tags if host.work.stop(t, 60) is not None]}
