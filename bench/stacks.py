"""What the scenarios start, all through the product's own commands: a raw engine
(`embedserve engine`, or `embedserve cpu-engine` on a machine without a GPU), a gateway in front
of engines (`embedserve gateway --engine-url`), the whole stack (`embedserve up`), and the
Infinity peer. Settings travel as EMBEDSERVE_* variables, as an operator would set them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadgen import Target
from procs import WorkDir, alive, embedserve_cmd, log_tail, port_busy, wait_ok

SHAPES_ON_CPU = "tiny"  # the CPU dry run builds this shape for every model


@dataclass
class Host:
    """The machine and the run's choices: device, cap, where models and caches live."""

    work: WorkDir
    device: str = "cuda"  # "cpu": tiny checkpoints, the CPU engine in SGLang's place
    cap: int = 8192  # the service's max sequence length (engine context length = cap + 1)
    time_scale: float = 1.0
    fi_cache: str = "/tmp/fi-cache"
    infinity_site: str = "/tmp/site-infinity"
    models: dict[str, str] = field(default_factory=dict)  # shape -> checkpoint folder
    out: Path | None = None  # where results go (and the packed FlashInfer JIT cache)
    drill_rate: str | None = None  # the leak drill's `--drill-leak` (default per device: bench/drill.py)
    attention_backends: tuple[str, ...] = ("fa3", "triton")  # measured against FlashInfer
    quality_corpus: str | None = None  # the quality gate's corpus (embedserve quality-corpus)
    vllm_site: str = "/tmp/site-vllm"  # vLLM 0.26.0's own folder (bundle vllm/pNN)
    vllm_cmd: tuple[str, ...] = ()  # replaces `python3 -m vllm.entrypoints.cli.main` (a stub)
    vllm_kv_tokens: int | None = None  # vLLM's KV pool; default: embedserve's engine's
    embedserve_variants: tuple[str, ...] = ()  # the vllm scenario's sides beyond the defaults
    vllm_sides: tuple[str, ...] = ("vllm", "vllm tuned")  # the vllm scenario's vLLM sides

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def model(self, shape: str) -> str:
        return self.models.get(shape) or str(self.work.root / "models" / shape)

    def secs(self, x: float) -> float:
        return max(2.0, round(x * self.time_scale, 1))


def engine_env(host: Host, shape: str, port: int, *, kv_pool: int | None = None,
               prefix_cache: bool = False, gpu: int | None = None,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {"EMBEDSERVE_MODEL__PATH": host.model(shape), "EMBEDSERVE_ENGINE__PORT": str(port),
           "EMBEDSERVE_MODEL__MAX_SEQ_LEN": str(host.cap), "EMBEDSERVE_LOG_LEVEL": "WARNING",
           "EMBEDSERVE_ENGINE__FLASHINFER_CACHE_DIR": host.fi_cache, "HF_HUB_OFFLINE": "1"}
    if kv_pool:
        env["EMBEDSERVE_ENGINE__KV_POOL_TOKENS"] = str(kv_pool)
    if prefix_cache:
        env["EMBEDSERVE_ENGINE__PREFIX_CACHE"] = "true"
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env | (extra or {})


def free_port(port: int) -> None:
    if port_busy(port):
        raise RuntimeError(f"port {port} is taken (an earlier run still holds it?)")


def start_engine(host: Host, tag: str, shape: str, port: int, **kw: Any) -> dict[str, Any]:
    """A raw engine: SGLang as our launcher builds it (plugin included), or the CPU engine,
    which speaks the same token-id protocol."""
    free_port(port)
    argv = [*embedserve_cmd(), "cpu-engine", "--port", str(port)] if host.cpu else \
        [*embedserve_cmd(), "engine"]
    if host.cpu:
        kw.pop("prefix_cache", None)
    return host.work.start(tag, argv, engine_env(host, shape, port, **kw))


def start_gateway(host: Host, tag: str, shape: str, port: int, engine_ports: list[int],
                  extra: dict[str, str] | None = None) -> dict[str, Any]:
    free_port(port)
    argv = [*embedserve_cmd(), "gateway", "--port", str(port)]
    for p in engine_ports:
        argv += ["--engine-url", f"http://127.0.0.1:{p}"]
    env = {"EMBEDSERVE_MODEL__PATH": host.model(shape), "EMBEDSERVE_MODEL__MAX_SEQ_LEN": str(host.cap),
           "EMBEDSERVE_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
           # the vector check sends the model's own token ids through the gateway
           "EMBEDSERVE_GATEWAY__ACCEPT_TOKEN_IDS": "true"}
    return host.work.start(tag, argv, env | (extra or {}))


def up_env(host: Host, shape: str, port: int, *, replicas: int = 1, engine_port: int = 30000,
           extra: dict[str, str] | None = None) -> dict[str, str]:
    """The variables `embedserve up` gets: never engine kind "auto" (a stack that quietly
    fell back to the CPU engine would mislead)."""
    return engine_env(host, shape, engine_port) | {
        "EMBEDSERVE_GATEWAY__PORT": str(port), "EMBEDSERVE_ENGINE__REPLICAS": str(replicas),
        "EMBEDSERVE_ENGINE__KIND": "cpu" if host.cpu else "sglang", **(extra or {})}


def start_up(host: Host, tag: str, shape: str, port: int, *, replicas: int = 1, engine_port: int = 30000,
             extra: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> dict[str, Any]:
    """`embedserve up [ARGS]`: engine(s) and gateway."""
    free_port(port)
    env = up_env(host, shape, port, replicas=replicas, engine_port=engine_port, extra=extra)
    return host.work.start(tag, [*embedserve_cmd(), "up", *args], env)


def start_infinity(host: Host, tag: str, shape: str, port: int) -> dict[str, Any]:
    """Infinity 0.0.78 on the same GPU, from its own folder (transformers 4.57: it breaks on 5.x)."""
    free_port(port)
    path = os.pathsep.join(p for p in (host.infinity_site, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "infinity_emb.cli", "v2", "--model-id", host.model(shape),
            "--served-model-name", Path(host.model(shape)).name, "--engine", "torch",
            "--device", "cpu" if host.cpu else "cuda", "--dtype", "float32" if host.cpu else "bfloat16",
            "--port", str(port)]
    return host.work.start(tag, argv, env)


def wait_ready(host: Host, tag: str, path: str, port: int, budget_end: float,
               banner: str | None = None, limit_s: float = 900.0) -> float:
    """Seconds from start until ``path`` answers 200 (and ``banner`` is in the log: `up` prints
    it once every engine is ready; its gateway's readiness passes with one of several)."""
    info = host.work.state["procs"][tag]
    log = Path(info["log"])
    give_up = info["started_at"] + limit_s
    while True:
        if not alive(info["pid"]):
            raise RuntimeError(f"{tag} exited:\n{log_tail(log, 2500)}")
        if time.time() > give_up:
            raise RuntimeError(f"{tag} not ready {limit_s:.0f} s after its start:\n{log_tail(log, 2500)}")
        if time.time() > budget_end:
            raise TimeoutError(f"{tag} not ready yet")
        ok = banner is None or banner in log_tail(log, 200_000)
        if ok and wait_ok(f"http://127.0.0.1:{port}{path}", time.time() + 2, info["pid"]):
            return round(time.time() - info["started_at"], 1)
        time.sleep(1)


def raw_target(host: Host, shape: str, port: int) -> Target:
    url = f"http://127.0.0.1:{port}"
    return Target(url, host.model(shape), raw=True, engine_urls=[url], cap=host.cap)


def gateway_target(host: Host, shape: str, port: int, engine_ports: list[int],
                   pid: int | None = None) -> Target:
    return Target(f"http://127.0.0.1:{port}", host.model(shape), raw=False,
                  engine_urls=[f"http://127.0.0.1:{p}" for p in engine_ports], cap=host.cap,
                  gateway_pid=pid)


def pack_fi_cache(host: Host) -> float | None:
    """The FlashInfer JIT cache as ``fi-cache.tgz`` next to the results (MiB), so the next
    fresh host starts warm: put it in a bundle folder staged after b1 (bench/offline/stage.sh).
    Left out when over 48 MiB: it must fit one transfer with a bundle."""
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
