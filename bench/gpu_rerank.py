"""rerank-gpu (bench/README.md): a cross-encoder on embedserve's SGLang and vLLM's ``/rerank``. Its servers
start with the vllm scenario's and are measured once that one's first are ready: no start-up shares a GPU."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from cpu_scenarios import step_rerank_scores
from harness import UNCAPPED, UP, Host, Side, slug
from measure import Case, Load
from peers import VLLM, VLLM_TUNED_ARGS
from runner import Step, step_compare, step_start, step_stop

SHAPE = "bge-reranker-v2-m3"
ENV = UNCAPPED | {"CUDA_VISIBLE_DEVICES": "0", "EMBEDSERVE_ENGINE__DTYPE": "bfloat16"}  # as vLLM (fp32 files)
SIDES = [Side("embedserve, cross-encoder (SGLang)", UP, 8960, SHAPE, ENV, tag="rerank-gpu-embedserve"),
         Side("vllm tuned, cross-encoder", VLLM, 8970, SHAPE, args=VLLM_TUNED_ARGS, tag="rerank-gpu-vllm")]


def sides(host: Host) -> list[Side]:  # an embedserve stack more per --embedserve-variants entry (vectorised)
    return [SIDES[0], *(Side(f"embedserve {n}, cross-encoder (SGLang)", UP, 8980 + 10 * k, SHAPE, ENV | env,
                             tag=slug(f"rerank-gpu-{n}")) for k, (n, env) in enumerate(host.variants)),
            SIDES[1]]
CASES = [Case(f"1 query x {n} passages of {words} words, {conc} in flight",
              Load(f"fixed:{words}", conc, seconds=15, warmup=2, words=True, rerank=n), 3)
         for n, words, conc in ((32, 128, 16), (100, 64, 4), (16, 64, 1))]


def step_model(host: Host, budget_end: float) -> dict[str, Any]:
    """The checkpoint (on a dry run without a GPU: the tiny XLM-R, under the same name)."""
    from embedserve.runtime.synth_rerank import build_cross_encoder

    out = Path(host.model(SHAPE))
    if not (out / "config.json").exists():
        build_cross_encoder(out, "tiny-xlmr" if host.cpu else SHAPE)
    return {"model": str(out)}


def start_steps() -> list[Step]:
    """Built, then started without waiting (before the vllm scenario's servers)."""
    return [Step("rerank-gpu-model", ("rerank-gpu",), step_model, 60),
            Step("rerank-gpu-start", ("rerank-gpu",), partial(step_start, sides=sides, wait=False), 30)]


def measure_steps() -> list[Step]:
    return [Step("rerank-gpu-ready", ("rerank-gpu",), partial(step_start, sides=sides), 150),
            Step("rerank-gpu-scores", ("rerank-gpu",), partial(step_rerank_scores, sides=sides), 10),
            Step("rerank-gpu-load", ("rerank-gpu",), partial(
                step_compare, sides=sides, cases=CASES, seed=13,
                section="Rerank on one GPU, pairs/s (inputs/s)",
                warm=Load("fixed:64", 8, seconds=4, warmup=0, words=True, rerank=16)), 420),
            Step("rerank-gpu-stop", ("rerank-gpu",), partial(step_stop, sides=sides), 30, always=True)]
