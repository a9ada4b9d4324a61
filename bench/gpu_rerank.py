"""rerank-gpu (bench/README.md): a cross-encoder and Qwen3-Reranker on embedserve (SGLang, and its own
torch engine) and vLLM's ``/rerank``, each side's scores against a transformers forward in fp32. Its
servers start with the vllm scenario's and are measured once that one's first are ready: no start-up
shares a GPU."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import kernel_profile
from cpu_scenarios import rerank_loads, step_rerank_scores
from harness import UNCAPPED, UP, Host, Side, slug
from measure import Load
from peers import VLLM, VLLM_TUNED_ARGS
from runner import Step, step_compare, step_start, step_stop

from embedserve.core.pairs import QWEN3_RERANK_PREFIX, QWEN3_RERANK_SUFFIX, QWEN3_RERANK_TASK

CROSS_ENCODER, QWEN3 = "bge-reranker-v2-m3", "qwen3-reranker-0.6b"
ENV = UNCAPPED | {"CUDA_VISIBLE_DEVICES": "0", "EMBEDSERVE_ENGINE__DTYPE": "bfloat16"}  # as vLLM (fp32 files)
TORCH = ENV | {"EMBEDSERVE_ENGINE__KIND": "torch"}
# vLLM reads Qwen3-Reranker as a one-label classifier from the lm_head's "no" and "yes" rows; the client
# frames the prompt (its docs' example), as embedserve's gateway does from the same model card
QWEN3_VLLM = ("--hf-overrides", json.dumps({"architectures": ["Qwen3ForSequenceClassification"],
                                            "classifier_from_token": ["no", "yes"],
                                            "is_original_qwen3_reranker": True}))
QWEN3_WRAP = (f"{QWEN3_RERANK_PREFIX}<Instruct>: {QWEN3_RERANK_TASK}\n<Query>: {{}}\n",
              f"<Document>: {{}}{QWEN3_RERANK_SUFFIX}")


def engines_of(host: Host, shape: str) -> list[str]:
    """The embedserve engines --rerank-sides names for ``shape``; none: its servers never start."""
    return [k.split(":")[-1] for k in host.rerank_sides if ":" not in k or k.startswith(f"{shape}:")]


def reference(shape: str, port: int) -> Side:
    """transformers' forward of the same checkpoint in fp32 behind the same gateway: scores only."""
    fp32 = TORCH | {"EMBEDSERVE_ENGINE__DTYPE": "float32"}
    return Side("reference: transformers fp32", UP, port, shape, fp32, tag=slug(f"rerank-gpu-{shape}-fp32"))


def load_sides(host: Host, shape: str, port: int) -> list[Side]:
    """embedserve on SGLang and one more stack on SGLang per --embedserve-variants entry, its torch
    engine and one more per entry (up to three), vLLM tuned (each where --rerank-sides asks for the
    engine)."""
    qwen3 = shape == QWEN3
    if not (kinds := engines_of(host, shape)):
        return []
    sglang = ENV | {"EMBEDSERVE_ENGINE__KIND": "cpu" if host.cpu else "sglang"}  # auto gives a reranker torch
    return [*[Side("embedserve (SGLang)", UP, port, shape, sglang, tag=slug(f"rerank-gpu-{shape}-sglang"))
              ] * ("sglang" in kinds),
            *(Side(f"embedserve {n}", UP, port + 10 * (k + 1), shape, sglang | env,
                   tag=slug(f"rerank-gpu-{shape}-{n}")) for k, (n, env) in enumerate(host.variants)
              if "sglang" in kinds),
            *[Side("embedserve (torch engine)", UP, port + 40, shape, TORCH,
                   tag=slug(f"rerank-gpu-{shape}-torch"))] * ("torch" in kinds),
            *(Side(f"embedserve torch {n}", UP, port + 70 + 4 * k, shape, TORCH | env,
                   tag=slug(f"rerank-gpu-{shape}-torch-{n}")) for k, (n, env) in enumerate(host.variants[:3])
              if "torch" in kinds),
            Side("vllm tuned", VLLM, port + 50, shape, args=VLLM_TUNED_ARGS + (QWEN3_VLLM if qwen3 else ()),
                 tag=slug(f"rerank-gpu-{shape}-vllm"), wrap=QWEN3_WRAP if qwen3 else ("{}", "{}"))]


PORTS = {CROSS_ENCODER: 8960, QWEN3: 9060}


def every_side(host: Host) -> list[Side]:
    return [s for shape, port in PORTS.items() if engines_of(host, shape)
            for s in (reference(shape, port + 60), *load_sides(host, shape, port))]


CASES = rerank_loads(15, 3)


def step_model(host: Host, budget_end: float) -> dict[str, Any]:
    """The checkpoints (on a dry run without a GPU: tiny ones, under the same names)."""
    from embedserve.runtime.synth_model import build_qwen3_reranker
    from embedserve.runtime.synth_rerank import build_cross_encoder

    for shape in PORTS:
        if ((out := Path(host.model(shape))) / "config.json").exists():
            continue
        if shape == QWEN3:
            build_qwen3_reranker(out, "tiny" if host.cpu else "0.6b", device=host.device)
        else:
            build_cross_encoder(out, "tiny-xlmr" if host.cpu else shape)
    return {"models": {shape: host.model(shape) for shape in PORTS}}


def start_steps() -> list[Step]:
    """Built, then started without waiting (before the vllm scenario's servers)."""
    return [Step("rerank-gpu-model", ("rerank-gpu",), step_model, 90),
            Step("rerank-gpu-start", ("rerank-gpu",), partial(step_start, sides=every_side, wait=False), 30)]


def shape_steps(shape: str, seed: int) -> list[Step]:
    port = PORTS[shape]
    sides = partial(load_sides, shape=shape, port=port)

    def scored(host: Host) -> list[Side]:
        return [reference(shape, port + 60), *sides(host)]

    return [Step(f"rerank-gpu-scores-{shape}", ("rerank-gpu",),
                 partial(step_rerank_scores, sides=scored), 20),
            # the kernel step on the first load: GPU ms per 1,000 passage words, the same requests each
            Step(f"rerank-gpu-kernels-{shape}", ("rerank-gpu",), partial(
                kernel_profile.step_kernels, sides=sides, load=CASES[0].load, requests=120, seed=seed + 5),
                 90),
            Step(f"rerank-gpu-load-{shape}", ("rerank-gpu",), partial(
                step_compare, sides=sides, cases=CASES, seed=seed, crosscheck=CASES[:1],
                section=f"Rerank on one GPU, {shape}, pairs/s (inputs/s)",
                warm=Load("fixed:64", 8, seconds=4, warmup=0, words=True, rerank=16)), 420, least_s=150)]


def measure_steps() -> list[Step]:
    return [Step("rerank-gpu-ready", ("rerank-gpu",), partial(step_start, sides=every_side), 200),
            *shape_steps(CROSS_ENCODER, 13), *shape_steps(QWEN3, 17),
            Step("rerank-gpu-stop", ("rerank-gpu",), partial(step_stop, sides=every_side), 30, always=True)]
