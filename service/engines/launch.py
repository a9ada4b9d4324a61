"""How to start a local engine: its command line and the environment it adds."""

from __future__ import annotations

import os
import sys

from embedserve.config import Settings
from embedserve.contracts.launch import LaunchSpec
from embedserve.engines.drill import LEAK_ENV
from embedserve.engines.sglang import build_launch

#: Engines' progress bars would interleave with the stack's log lines.
QUIET = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def engine_launch(
    settings: Settings, kind: str, index: int, port: int | None = None, drill_leak: float | None = None
) -> LaunchSpec:
    """Local engine ``index`` listens on ``engine.port + index`` (or ``port``: a replacement);
    a GPU engine ``index`` (sglang, torch) runs on GPU ``index // engines_per_gpu``.
    ``drill_leak``: bytes/s the engine grows on purpose (host memory for the CPU engine, GPU
    memory for SGLang)."""
    own = settings.for_replica(index).with_engine(kind=kind)
    if port is not None:
        own = own.with_engine(port=port)
    several = settings.engine.replicas > 1
    gpu = {"CUDA_VISIBLE_DEVICES": visible_gpu(settings.engine_gpu(index))} if several else {}
    if kind in ("cpu", "torch"):  # embedserve's own engine; torch: on a GPU
        env = {"HF_HUB_OFFLINE": "1", **QUIET, **own.child_env(), **(gpu if kind == "torch" else {})}
        drill = ["--drill-leak", repr(drill_leak)] if drill_leak else []
        return LaunchSpec([sys.executable, "-m", "embedserve.engines.cpu", *drill], env)
    spec = build_launch(own)
    env = dict(spec.env) | gpu
    if drill_leak:
        env[LEAK_ENV] = repr(drill_leak)
    return LaunchSpec(spec.argv, env, spec.notes)


def visible_gpu(position: int) -> str:
    """The device id of the ``position``-th GPU this process may use (``CUDA_VISIBLE_DEVICES``
    is kept: a stack given GPUs 2,3 starts its engines on 2 and 3)."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[position] if position < len(visible) else str(position)
