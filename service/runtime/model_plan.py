"""What ``embedserve up`` starts, model by model, decided before anything starts: each model's
engine kind and engines (``service/catalog.py``), and whether the SGLang engines of all the models
fit their GPUs together (on one GPU by default), else one sentence and exit 2.

One model keeps the single-model rules (``engine.engines_per_gpu`` ``auto`` sized to the GPU);
several get one engine per GPU each unless an entry names ``engines_per_gpu``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import defaultdict
from dataclasses import dataclass, replace

from embedserve.catalog import VARIABLE, served_models
from embedserve.config import Settings
from embedserve.engines.sglang import LaunchConfigError, kv_pool_tokens, plan_engines
from embedserve.engines.sizing import ModelShape, engine_memory
from embedserve.model_info import ModelInfo
from embedserve.nvml import gpu_count, gpu_total_bytes
from embedserve.runtime.preflight import check_engine_kind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedModel:
    settings: Settings  # the model's own model and engine sections
    info: ModelInfo
    kind: str  # its engines': cpu, sglang or external

    @property
    def local(self) -> bool:
        return self.kind != "external"

    def ports(self) -> list[int]:
        e = self.settings.engine
        return [e.port + i for i in range(self.settings.local_engine_count())] if self.local else []

    def with_settings(self, settings: Settings) -> PlannedModel:
        return replace(self, settings=settings)


def resolve_engine_kind(settings: Settings, info: ModelInfo | None = None) -> str:
    """``auto``: on an NVIDIA GPU, embedserve's torch engine for a cross-encoder (``info``; on one
    H100 it scored pairs 1.1-2.1x faster than SGLang: docs/RERANK.md), SGLang for the rest; the CPU
    engine without a GPU."""
    kind = settings.engine.kind
    if kind != "auto":
        return kind
    if settings.engine.urls:
        return "external"
    if gpu_count() == 0:
        return "cpu"
    if info is not None and info.scoring == "cross-encoder" and importlib.util.find_spec("torch"):
        return "torch"
    return "sglang" if importlib.util.find_spec("sglang") else "cpu"


#: the torch engine's ``engines_per_gpu`` for ``auto``: on one H100 two engines of a cross-encoder of
#: bge-reranker-v2-m3's shape scored 1.0-1.13x one engine's pairs/s in every case, in 5.2 GB against
#: 2.7-2.9 GB under load (docs/RERANK.md): one engine's own CPU work leaves the GPU idle between batches
TORCH_ENGINES_PER_GPU = 2


def resolve_engines_per_gpu(settings: Settings, info: ModelInfo, kind: str) -> Settings:
    """``engine.engines_per_gpu`` as a number: SGLang's from the model and the GPU (fewer than
    asked for by ``auto`` when they would not fit, with the reason logged); the torch engine's as
    asked (``auto``: ``TORCH_ENGINES_PER_GPU``); one otherwise."""
    if kind == "torch":
        n = settings.engine.engines_per_gpu
        return settings.with_engine(engines_per_gpu=n if isinstance(n, int) else TORCH_ENGINES_PER_GPU)
    if kind != "sglang":
        if settings.engine.engines_per_gpu not in ("auto", 1):
            log.warning("engines_per_gpu applies to GPU engines only: starting one",
                        extra={"engine_kind": kind})
        return settings.with_engine(engines_per_gpu=1)
    plan = plan_engines(settings, info)
    for note in plan.notes:
        log.warning(note)
    memory = plan.engine
    log.info("engines per GPU", extra={
        "engines_per_gpu": plan.per_gpu,
        "engine_gb": round(memory.total / 1e9, 1) if memory else None,
        "all_engines_gb": round(plan.per_gpu * memory.total / 1e9, 1) if memory else None,
        "usable_gb": round(plan.usable_bytes / 1e9, 1) if plan.usable_bytes else None,
    })
    return settings.with_engine(engines_per_gpu=plan.per_gpu)


def plan_models(settings: Settings, gpu_bytes: int | None = None) -> tuple[Settings, list[PlannedModel]]:
    """The settings to serve with and each model's plan; ``gpu_bytes`` overrides NVML's figure."""
    if not settings.served.models:
        info = ModelInfo.load(settings.model)
        kind = resolve_engine_kind(settings, info)
        check_engine_kind(settings, kind)
        settings = resolve_engines_per_gpu(settings, info, kind)
        return settings, [PlannedModel(settings, info, kind)]
    planned = []
    for entry in served_models(settings):
        info = entry.load_info()
        entry.check_kind(info)
        kind = resolve_engine_kind(entry.settings, info)
        check_engine_kind(entry.settings, kind)
        planned.append(PlannedModel(entry.settings, info, kind))
    check_shared_gpus(planned, gpu_bytes if gpu_bytes is not None else gpu_total_bytes())
    return settings, planned


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_shared_gpus(planned: list[PlannedModel], gpu_bytes: int | None) -> None:
    """The SGLang engines of all the models, GPU by GPU, within ``mem_fraction_static`` of it
    (``engines/sizing.py``'s arithmetic per engine); ``LaunchConfigError`` naming what each needs."""
    need: dict[int, list[tuple[str, int]]] = defaultdict(list)
    fractions = {}
    for p in planned:
        shape = ModelShape.read(p.info.config)
        if p.kind != "sglang" or shape is None:
            continue
        eng, cap = p.settings.engine, p.info.max_seq_len
        memory = engine_memory(shape, kv_pool_tokens(p.settings, cap), max(eng.batch_token_budget, cap),
                               eng.quantization).total
        for index in range(p.settings.local_engine_count()):
            need[p.settings.engine_gpu(index)].append((p.info.name, memory))
        fractions[p.info.name] = eng.mem_fraction_static
    if not need or not gpu_bytes:
        return
    fraction = min(fractions.values())
    usable = int(gpu_bytes * fraction)
    for gpu, engines in sorted(need.items()):
        total = sum(m for _, m in engines)
        log.info("models on one GPU", extra={"gpu": gpu, "engines_gb": round(total / 1e9, 1),
                                             "usable_gb": round(usable / 1e9, 1)})
        if total > usable:
            parts = ", ".join(f"{name} {_gb(m)}" for name, m in engines)
            raise LaunchConfigError(
                f"{VARIABLE}: the models' SGLang engines need {_gb(total)} on GPU {gpu} ({parts}), more "
                f"than mem_fraction_static {fraction} of its {_gb(gpu_bytes)} ({_gb(usable)}); shrink a "
                "model's engine.kv_pool_tokens or engine.batch_token_budget, or serve one from engines "
                "elsewhere (engine.urls)"
            )
