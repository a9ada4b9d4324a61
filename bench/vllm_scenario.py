"""vllm: vLLM 0.26.0's pooling runner next to embedserve on one GPU, same checkpoint and texts
(bench/README.md, "vLLM as a peer"): every server of every shape started at once, then per
shape readiness, vectors, the variants' quality gate, a profile, two load parts, a stop."""

from __future__ import annotations

from functools import partial
from typing import Any

import harness
from gpu_scenarios import case
from harness import UNCAPPED, UP, Host, Side
from measure import Case, Load
from peers import IN_PROCESS, VLLM, VLLM_TUNED_ARGS
from runner import Step, profile, step_compare, step_quality, step_start, step_stop

VLLM_SHAPES = ("0.6b", "4b")
VLLM_CASES = [Case("short, 64 in flight", case("short").load),
              Case("short, 256 in flight", case("short", conc=256).load),
              *map(case, ("seed mix", "seed mix, 1-16 inputs", "medium", "long")), case("one in flight", 2)]


def vllm_default(shape: str, **env: str) -> Side:
    """embedserve's defaults (engines per GPU ``auto``), in the vllm scenario."""
    port = {"0.6b": 8600, "4b": 8650}[shape]
    return Side("embedserve", UP, port, shape, UNCAPPED | env, tag=f"embedserve-{shape}")


def vllm_sides(shape: str) -> Any:
    """Every side of a shape, embedserve's first: its defaults, one stack per variant
    (``--embedserve-variants``), vLLM with its defaults and tuned."""
    port = {"0.6b": 8700, "4b": 8720}[shape]

    def sides(host: Host) -> list[Side]:
        gpu0 = {} if host.cpu else {"CUDA_VISIBLE_DEVICES": "0"}
        default = vllm_default(shape, **gpu0)
        return [default, *(Side(f"embedserve {name}", UP, default.port + 10 * (k + 1), shape,
                                default.env | env, tag=harness.slug(f"embedserve-{name}-{shape}"))
                           for k, (name, env) in enumerate(host.variants)),
                *[s for s in (Side("vllm", VLLM, port, shape, tag=f"vllm-{shape}"),
                              Side("vllm tuned", VLLM, port + 1, shape, args=VLLM_TUNED_ARGS,
                                   tag=f"vllm-tuned-{shape}")) if s.name in host.vllm_sides]]
    return sides


def reference(shape: str) -> Side:
    """A transformers forward pass of the same checkpoint (last-token pooling, L2 norm)."""
    return Side("transformers", IN_PROCESS, {"0.6b": 8790, "4b": 8791}[shape], shape, args=("transformers",),
                tag=f"reference-{shape}")


def vector_sides(shape: str, host: Host) -> list[Side]:
    return [*(s for s in vllm_sides(shape)(host) if s.name in ("embedserve", "vllm")), reference(shape)]


def variant_pairs(shape: str, host: Host) -> list[tuple[str, Side, Side]]:
    """Each embedserve variant's vectors against the defaults' (the quality gate on the corpus)."""
    default, *others = vllm_sides(shape)(host)
    return [(f"{side.name}-{shape}", default, side) for side in others if side.kind is UP]


def client_sides(host: Host) -> list[Side]:
    default = vllm_default("0.6b")
    return [Side(name, UP, default.port, "0.6b", tag=default.key)
            for name in ("client one build thread", "client build processes")]


def vllm_steps(shapes: tuple[str, ...]) -> list[Step]:
    """Every shape's servers started together (their start-ups overlap), then per shape: readiness,
    vectors, the default side's profile, two load parts, its servers stopped."""
    steps = [Step("vllm-start", ("vllm",), partial(step_start, wait=False, sides=lambda host: [
        side for s in shapes for side in vllm_sides(s)(host)]), 30)]
    for shape in shapes:
        sides, title = vllm_sides(shape), f"vLLM 0.26.0 (pooling runner) vs embedserve, {shape}, same texts"
        load = partial(step_compare, sides=sides, stall=True, least=2, section=title,
                       warm=Load("uniform:16-512", 32, seconds=6, warmup=0))
        steps += [
            Step(f"vllm-ready-{shape}", ("vllm",), partial(step_start, sides=sides), 150),
            Step(f"vllm-vectors-{shape}", ("vllm",), partial(
                step_compare, sides=partial(vector_sides, shape), cases=[], vectors=True, seed=0,
                start=[reference(shape)], stop=[reference(shape)], section=title), 60),
            Step(f"vllm-quality-{shape}", ("vllm",), partial(
                step_quality, pairs=partial(variant_pairs, shape)), 120),
            profile(f"vllm-profile-{shape}", "vllm", vllm_default(shape), f"profiles-vllm/{shape}", 45),
            Step(f"vllm-load-{shape}-1", ("vllm",), partial(load, cases=VLLM_CASES[:4], seed=610), 450),
            Step(f"vllm-load-{shape}-2", ("vllm",), partial(load, cases=VLLM_CASES[4:], seed=650,
                                                             crosscheck=VLLM_CASES[:1]), 380),
        ]
        if shape == "0.6b":  # what the client alone caps: inputs built on one thread, or by processes
            steps.append(Step("vllm-client-0.6b", ("vllm",), partial(
                step_compare, sides=client_sides, cases=[Case("seed mix", VLLM_CASES[2].load, rounds=2)],
                seed=720, loads={"client one build thread": Load("seed", 64, seconds=15, build_workers=0)},
                section="The client alone: `embedserve loadtest` building inputs on one thread against its "
                        "build processes, 0.6b"), 130))
        steps.append(Step(f"vllm-stop-{shape}", ("vllm",), partial(step_stop, sides=sides), 20))
    return steps
