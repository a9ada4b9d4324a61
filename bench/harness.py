"""What a comparison starts and measures, as data: a :class:`Side` (port, model, settings) of a
:class:`Kind` (how it starts, where it answers, texts or token ids); embedserve's own kinds here,
the peers' in bench/peers.py. Everything starts through its own command line, settings as
EMBEDSERVE_* variables as an operator would set them."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from gpu import once
from procs import WorkDir, alive, child_env, embedserve_cmd, http_get, log_tail, port_busy

from embedserve.config import BUNDLED_MODEL, resolve_model_path

SHAPES_ON_CPU = "tiny"  # the CPU dry run builds this shape for every model
UP_ENGINE_OFFSET = 22000  # `up` on port P starts its engines on P + 22000, + 1, ...
MAX_ENGINES = 4  # engines an `up` stack may run (engines per GPU "auto" decides)


@dataclass
class Host:
    """The machine and the run's choices: device, cap, durations, where models and caches live."""

    work: WorkDir
    device: str = "cuda"  # "cpu": tiny checkpoints, the CPU engine in SGLang's place
    cap: int = 8192  # the service's max sequence length (engine context length = cap + 1)
    time_scale: float = 1.0
    rounds: int | None = None  # replaces every case's round count
    fi_cache: str = "/tmp/fi-cache"
    infinity_site: str = "/tmp/site-infinity"
    models: dict[str, str] = field(default_factory=dict)  # shape -> checkpoint folder
    out: Path | None = None  # where results go (and the packed FlashInfer JIT cache)
    drill_rate: str | None = None
    quality_corpus: str | None = None
    vllm_site: str = "/tmp/site-vllm"
    vllm_cmd: tuple[str, ...] = ()  # replaces `python3 -m vllm.entrypoints.cli.main` (a stub)
    vllm_kv_tokens: int | None = None
    variants: tuple[tuple[str, dict[str, str]], ...] = ()  # embedserve sides beyond the defaults
    vllm_sides: tuple[str, ...] = ("vllm", "vllm tuned")  # the vllm scenario's vLLM sides
    rerank_sides: tuple[str, ...] = ("sglang", "torch")  # rerank-gpu's embedserve engines, per shape
    cases: tuple[str, ...] = ()  # load steps measure only these cases, in this order (--cases)

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def model(self, shape: str) -> str:
        if shape == "bundled" and shape not in self.models:
            return str(resolve_model_path(BUNDLED_MODEL))
        return self.models.get(shape) or str(self.work.root / "models" / shape)

    def served_name(self, shape: str) -> str:
        return "all-MiniLM-L6-v2" if shape == "bundled" else Path(self.model(shape)).name

    def cap_of(self, shape: str) -> int:
        """The run's cap, or the model's own where it states a lower one (MiniLM: 256, a BERT: 512)."""
        caps = [self.cap]
        for name, key in (("sentence_bert_config.json", "max_seq_length"),
                          ("config.json", "max_position_embeddings")):
            if (conf := Path(self.model(shape)) / name).exists():
                caps.append(int(json.loads(conf.read_text()).get(key) or self.cap))
        return min(caps)


@dataclass(frozen=True)
class Kind:
    """How a kind of server starts and is spoken to. ``command`` gives its argv and variables;
    ``missing`` says why it cannot start here (None when it can); ``facts`` reads what it said
    about itself from its log."""

    command: Callable[[Host, Side], tuple[list[str], dict[str, str]]]
    ready: str = "/health/ready"
    route: str = "/v1/embeddings"
    rerank: str | None = None  # its rerank route, where it has one
    ids: bool = False  # sent token ids (a raw engine), else texts
    banner: str | None = None  # printed once every engine is ready (`up`)
    front: bool = False  # its own process is embedserve's gateway (CPU per request)
    in_process: bool = False  # runs the load itself (bench/inprocess.py), not sent requests
    timeout_s: float = 300.0  # a request unanswered this long counts as an error
    missing: Callable[[Host], str | None] = lambda host: None
    facts: Callable[[Path], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Side:
    """One side of a comparison."""

    name: str
    kind: Kind
    port: int
    shape: str = "4b"
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    behind: tuple[int, ...] = ()  # a gateway's engine ports
    tag: str = ""  # the process's name in the work dir (default: name and shape)
    ids: bool | None = None  # sent token ids or texts (default: the kind's)
    cwd: str | None = None
    wrap: tuple[str, str] = ("{}", "{}")  # a rerank query's and passage's text as sent (a prompt's frame)

    @property
    def key(self) -> str:
        return self.tag or slug(f"{self.name}-{self.shape}")

    @property
    def takes_ids(self) -> bool:
        return self.kind.ids if self.ids is None else self.ids

    def engine_ports(self) -> list[int]:
        """The engines whose counters and memory belong to this side."""
        if self.behind:
            return list(self.behind)
        if self.kind is UP:
            first = self.port + UP_ENGINE_OFFSET
            return [p for p in range(first, first + MAX_ENGINES) if port_busy(p)] or [first]
        return [self.port] if self.kind.ids else []


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def trace_dir(host: Host, side: Side) -> Path:
    """Where a side's torch profiler writes (bench/kernel_profile.py)."""
    return host.work.root / "traces" / side.key


def base_env(host: Host, side: Side) -> dict[str, str]:
    cap = host.cap_of(side.shape)
    return {"EMBEDSERVE_MODEL__PATH": host.model(side.shape), "EMBEDSERVE_MODEL__MAX_SEQ_LEN": str(cap),
            "EMBEDSERVE_MODEL__NAME": host.served_name(side.shape),
            "EMBEDSERVE_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
            "EMBEDSERVE_ENGINE__FLASHINFER_CACHE_DIR": host.fi_cache}


def engine_command(host: Host, side: Side) -> tuple[list[str], dict[str, str]]:
    """SGLang as our launcher builds it (plugin included), or the CPU engine, which speaks the
    same token-id protocol."""
    cmd = [*embedserve_cmd(), *(["cpu-engine", "--port", str(side.port)] if host.cpu else ["engine"])]
    return cmd, base_env(host, side) | {"EMBEDSERVE_ENGINE__PORT": str(side.port)}


def gateway_command(host: Host, side: Side) -> tuple[list[str], dict[str, str]]:
    urls = [a for p in side.behind for a in ("--engine-url", f"http://127.0.0.1:{p}")]
    # the vector checks send the model's own token ids through the gateway
    return ([*embedserve_cmd(), "gateway", "--port", str(side.port), *urls],
            base_env(host, side) | {"EMBEDSERVE_GATEWAY__ACCEPT_TOKEN_IDS": "true"})


def up_command(host: Host, side: Side) -> tuple[list[str], dict[str, str]]:
    """`embedserve up`: never engine kind "auto" (a stack that quietly fell back to the CPU
    engine would mislead)."""
    return [*embedserve_cmd(), "up", *side.args], base_env(host, side) | {
        "EMBEDSERVE_GATEWAY__PORT": str(side.port),
        "EMBEDSERVE_ENGINE__PORT": str(side.port + UP_ENGINE_OFFSET),
        "EMBEDSERVE_ENGINE__KIND": "cpu" if host.cpu else "sglang",
        "EMBEDSERVE_ENGINE__PROFILE_DIR": str(trace_dir(host, side))}  # the torch engine's profiler


def instant_command(host: Host, side: Side) -> tuple[list[str], dict[str, str]]:
    dim = side.env.get("DIM", "1024")
    return [sys.executable, "-m", "embedserve.loadtest.instant_engine", str(side.port), dim], {}


ENGINE = Kind(engine_command, ready="/health", ids=True)
GATEWAY = Kind(gateway_command, rerank="/v1/rerank", front=True)
UP = Kind(up_command, rerank="/v1/rerank", banner="embedserve is up", front=True)
INSTANT = Kind(instant_command, ready="/health", ids=True)  # answers at once: the gateway alone
# admission control and deadlines must not cap what is measured; no replacement mid-run
UNCAPPED = {"EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": "1048576",
            "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "300", "EMBEDSERVE_HEALTH__REPLACE_ENGINES": "false"}


def running(host: Host, side: Side) -> bool:
    return host.work.running(side.key)


def start(host: Host, side: Side) -> dict[str, Any] | None:
    """Start ``side`` unless it runs; its ports must be free."""
    if running(host, side):
        return None
    for port in [side.port, *(side.engine_ports() if side.kind is UP else [])]:
        if port_busy(port):
            raise RuntimeError(f"port {port} is taken (an earlier run still holds it?)")
    argv, env = side.kind.command(host, side)
    return host.work.start(side.key, argv, env | side.env, cwd=side.cwd)


def wait_ready(host: Host, side: Side, budget_end: float, limit_s: float = 900.0) -> float:
    """Seconds from start until the side's readiness route answers 200 (and its banner is in
    the log: `up` prints it once every engine is ready, its gateway passes with one)."""
    info = host.work.state["procs"][side.key]
    log = Path(info["log"])
    give_up = info["started_at"] + limit_s
    while True:
        if not alive(info["pid"]):
            raise RuntimeError(f"{side.key} exited:\n{log_tail(log, 2500)}")
        if time.time() > give_up:
            raise RuntimeError(f"{side.key} not ready {limit_s:.0f} s after its start:\n"
                               f"{log_tail(log, 2500)}")
        if time.time() > budget_end:
            raise TimeoutError(f"{side.key} not ready yet")
        banner = side.kind.banner is None or side.kind.banner in log_tail(log, 200_000)
        if banner and http_get(f"http://127.0.0.1:{side.port}{side.kind.ready}")[0] == 200:
            return round(time.time() - info["started_at"], 1)
        time.sleep(1)


def describe(host: Host, gpu_run: bool = True, command: str = "") -> dict[str, Any]:
    """How the figures were produced: the command, hardware, versions, the engine's command line."""
    gpus: list[str] = once("describe")
    versions = {}
    for dist in ("embedserve", "sglang", "flashinfer-python", "torch", "transformers", "tokenizers",
                 "onnxruntime"):
        with contextlib.suppress(PackageNotFoundError):
            versions[dist] = version(dist)
    names = sorted({g.split(",")[0] for g in gpus})
    info: dict[str, Any] = {
        "command": command, "hardware": f"{len(gpus)} x {', '.join(names)}" if gpus else
        f"CPU only, {os.cpu_count()} cores", "gpus": gpus or None, "cpus": os.cpu_count(),
        "python": platform.python_version(), "versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "device": host.device, "time_scale": host.time_scale, "cap": host.cap,
        "dry_run": gpu_run and host.cpu}
    if gpu_run and not host.cpu and (Path(host.model("4b")) / "config.json").exists():
        kv = {"EMBEDSERVE_ENGINE__KV_POOL_TOKENS": "16384"}
        argv, env = engine_command(host, Side("engine", ENGINE, 30000, "4b", kv))
        done = subprocess.run([*argv, "--dry-run", "--json"], env=child_env(env | kv), capture_output=True,
                              text=True, timeout=120, check=False)
        if done.returncode == 0:
            info["engine_argv"] = json.loads(done.stdout)["argv"][1:]
    return info


def pack_fi_cache(host: Host) -> float | None:
    """The FlashInfer JIT cache as ``fi-cache.tgz`` next to the results (MiB), so the next fresh
    host starts warm (bench/offline/stage.sh); left out over 48 MiB (one transfer)."""
    cache = Path(host.fi_cache)
    if host.out is None or host.cpu or not cache.is_dir():
        return None
    host.out.mkdir(parents=True, exist_ok=True)
    tgz = host.out / "fi-cache.tgz"
    subprocess.run(["tar", "czf", str(tgz), "-C", str(cache), "."], check=True)
    size_mb = round(tgz.stat().st_size / 2**20, 1)
    if size_mb > 48:
        tgz.unlink()
    return size_mb
