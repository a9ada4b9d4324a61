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
from dataclasses import dataclass
from typing import Any

import profile_engine
import stacks
from gpu_memory import group_used_gb
from loadgen import Load, Target, measure
from scenarios import Case, runs_dir
from stacks import Host


@dataclass(frozen=True)
class Config:
    """One `embedserve up` stack: model shape, engines per GPU, quantization."""

    shape: str
    engines: int
    port: int  # the gateway's; its engines listen on port + 22000, + 1, ...
    quantization: str = "none"

    @property
    def tag(self) -> str:
        q = "-fp8" if self.quantization == "fp8" else ""
        return f"up-{self.shape}{q}-x{self.engines}"

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
        extra = {**UP_EXTRA, "EMBEDSERVE_ENGINE__ENGINES_PER_GPU": str(c.engines)}
        if c.quantization != "none":
            extra["EMBEDSERVE_ENGINE__QUANTIZATION"] = c.quantization
        stacks.start_up(host, c.tag, c.shape, c.port, engine_port=c.engine_port, extra=extra)


def wait(host: Host, configs: list[Config], budget_end: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in configs:
        out[f"ready_s_{c.tag}"] = stacks.wait_ready(host, c.tag, "/health/ready", c.port, budget_end,
                                                    banner="embedserve is up")
    procs = host.work.state["procs"]
    out["stack_gpu_gb"] = group_used_gb({c.tag: procs[c.tag]["pid"] for c in configs if c.tag in procs})
    return out


def step_start(host: Host, budget_end: float) -> dict[str, Any]:
    """Every stack at once (about 106 GB of GPU memory together); returns when all are ready."""
    configs = [c for group in CONFIGS.values() for c in group]
    start(host, configs)
    out = wait(host, configs, budget_end)
    out["fi_cache_tgz_mb"] = stacks.pack_fi_cache(host)  # now: a later slice may never come
    return out


class BusySampler:
    """NVML's utilisation of GPU 0 (the share of time a kernel ran), every 0.5 s."""

    def __init__(self) -> None:
        self.samples: list[int] = []
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
                self.samples.append(int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


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
            with BusySampler() as busy:
                row = measure(name, target, load, runs_dir(host), seed=40,
                              tags={"group": group, "case": case.name, "side": side})
            row["gpu_busy_pct"] = busy.median
            if side in configs:
                row["stack_gpu_gb"] = group_used_gb({side: procs[configs[side].tag]["pid"]}).get(side)
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
        target, Load("seed", 64, seconds=14, warmup=2), host.work.root / "profiles" / group,
        gateway_port=c.port, engine_port=c.engine_port, runs=runs_dir(host))


def step_stop(host: Host, budget_end: float) -> dict[str, Any]:
    stopped = [c.tag for group in CONFIGS.values() for c in group if host.work.stop(c.tag, 60) is not None]
    return {"stopped": stopped}
