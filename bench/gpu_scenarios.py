"""The GPU suite's scenarios as data: sides, cases and the runner's steps (bench/README.md says
what each measures). Ports: raw engines 30000-30405, gateways and stacks 7997-8791, `up`'s
engines on its port + 22000."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import drill
import harness
import kernel_profile
from gpu import gpu_used_gb
from harness import ENGINE, GATEWAY, UNCAPPED, UP, Host, Side
from measure import Case, Load
from peers import IN_PROCESS, INFINITY, VLLM, VLLM_TUNED_ARGS
from runner import Step, step_compare, step_profile, step_quality, step_start, step_stop

MAIN_KV_POOL = 16_384  # the product's default for the 4B: one prefill batch (engine.batch_token_budget)
WARM = Load("uniform:16-512", 64, seconds=8, warmup=0)
FP8 = {"EMBEDSERVE_ENGINE__QUANTIZATION": "fp8"}
LOADS = {"short": Load("uniform:16-512", 64), "seed mix": Load("seed", 64),
         "seed mix, 1-16 inputs": Load("seed", 32, inputs="1-16"), "medium": Load("uniform:512-2048", 64),
         "long": Load("uniform:8000-8191", 8),
         "one in flight": Load("uniform:16-512", 1, seconds=6, warmup=1)}


def case(name: str, rounds: int = 1, **load: Any) -> Case:
    """One of the named loads, 15 s after a 3 s warm-up unless ``load`` says otherwise (one in
    flight: 6 s after 1 s)."""
    timing = {} if name == "one in flight" else {"seconds": 15.0, "warmup": 3.0}
    return Case(name, dataclasses.replace(LOADS[name], **timing | load), rounds)


def kv(tokens: int = MAIN_KV_POOL, **extra: str) -> dict[str, str]:
    return {"EMBEDSERVE_ENGINE__KV_POOL_TOKENS": str(tokens), "CUDA_VISIBLE_DEVICES": "0", **extra}


def raw(shape: str, name: str = "raw") -> Side:
    """The raw engines the first scenarios share, on GPU 0."""
    return Side(name, ENGINE, {"4b": 30000, "0.6b": 30001}[shape], shape, kv(), tag=f"engine-{shape}")


def gateway(name: str, port: int, engine: Side, tag: str) -> Side:
    return Side(name, GATEWAY, port, engine.shape, behind=(engine.port,), tag=tag)


# -- raw SGLang against the gateway, Infinity --------------------------

RAW_VS_GATEWAY = [case("short", 2), *map(case, ("seed mix", "seed mix, 1-16 inputs", "medium", "long")),
                  case("one in flight", 6)]
PARTS = {1: RAW_VS_GATEWAY[:2], 2: RAW_VS_GATEWAY[2:5], 3: RAW_VS_GATEWAY[5:]}  # each fits a 10-minute slice
CROSSCHECKED = [Case(c.name, c.load) for c in RAW_VS_GATEWAY if c.name in ("short", "medium")]


def raw_vs_gateway(shape: str) -> list[Step]:
    """Raw SGLang (token ids) against a gateway in front of it (texts of the same token counts);
    part 1 first checks that the gateway's hop leaves vectors alone, part 3 on the 4B repeats
    the headline cases with crosscheck.py."""
    engine = raw(shape)
    gw = gateway("gateway", {"4b": 8000, "0.6b": 8010}[shape], engine, f"gateway-{shape}")
    seconds = {1: 200, 2: 190, 3: 230 if shape == "4b" else 150}
    return [Step(f"raw-vs-gateway-{shape}-{part}", ("raw-vs-gateway",), partial(
        step_compare, sides=[engine, gw], cases=cases, start=[gw], stop=[gw], warm=WARM, seed=20 + 30 * part,
        section=f"Raw SGLang (token ids) vs the gateway (texts), {shape}", vectors=part == 1,
        crosscheck=CROSSCHECKED if shape == "4b" and part == 3 else ()), seconds[part])
        for part, cases in PARTS.items()]


PEER_GATEWAY = gateway("embedserve", 8004, raw("4b"), "gateway-peers")
PEER_INFINITY = Side("infinity", INFINITY, 7997, "4b", tag="infinity")
PEER_SIDES = [PEER_GATEWAY, PEER_INFINITY]
PEER_CASES = [Case("short, 1 input/request", case("short").load, 2),
              Case("short, 32 inputs/request", case("short", conc=4, inputs="32").load, 2),
              Case("~1,000 words", case("short", mix="uniform:1200-1400", conc=16).load, 2),
              case("one in flight", 4)]

def raw_engine_steps(shapes: tuple[str, ...]) -> list[Step]:
    peers = partial(step_compare, sides=PEER_SIDES, start=PEER_SIDES, warm=WARM,
                    section="Peers on the same GPU: embedserve vs Infinity 0.0.78 (same texts)")
    return [
        Step("engines", SHARED_ENGINES, partial(step_start, sides=[raw(s) for s in shapes]), 150,
             holds=tuple(raw(s).key for s in shapes)),
        *raw_vs_gateway("4b"),  # the 4B's rows and its peer first, where time is short
        Step("peers-infinity-1", ("peers",), partial(peers, cases=PEER_CASES[:2], stop=[PEER_GATEWAY],
                                                     seed=410), 300),
        Step("peers-infinity-2", ("peers",), partial(peers, cases=PEER_CASES[2:], seed=430, stop=PEER_SIDES),
             230),
        *(step for shape in shapes if shape != "4b" for step in raw_vs_gateway(shape)),
        Step("stop-engines", SHARED_ENGINES, partial(step_stop, sides=[raw(s) for s in shapes]), 20,
             always=True)]


SHARED_ENGINES = ("raw-vs-gateway", "peers")

# -- `embedserve up`: soak capacity, one and two engines ----------------------------------------------

UPS = {n: Side(f"{n} engine{'s' if n > 1 else ''}", UP, 8090 + 10 * n, "4b",
               UNCAPPED | {"EMBEDSERVE_ENGINE__REPLICAS": str(n)}, tag=f"up-{n}") for n in (1, 2)}
CAPACITY = case("seed mix, 1-16 inputs", seconds=30, warmup=5)


def step_up(host: Host, budget_end: float, replicas: int = 1) -> dict[str, Any]:
    if replicas > 1 and not host.cpu and len(gpu_used_gb() or []) < replicas:
        return {"skipped": f"{replicas} engines need {replicas} GPUs; this host has "
                           f"{len(gpu_used_gb() or [])}"}
    return step_start(host, budget_end, [UPS[replicas]]) | {"gpu_used_gb": gpu_used_gb()}


def step_capacity(host: Host, budget_end: float) -> dict[str, Any]:
    """Closed-loop capacity through `up`'s gateway; a soak is then run open loop at 85% of it."""
    out = step_compare(host, budget_end, [UPS[1]], [CAPACITY], seed=11,
                       section="Soak capacity (`embedserve up`, closed loop)")
    rate = round(0.85 * out["rows"][0]["req_s"], 2) if out.get("rows") else None
    return out | {"soak_rate_req_s": rate,
                  "notes": [f"A soak at 85% of it: `embedserve loadtest --rate {rate}`."]}


def step_scale(host: Host, budget_end: float, replicas: int = 1) -> dict[str, Any]:
    """Each load at its in-flight count per engine (so two engines get twice as many)."""
    cases = [case(name, seconds=20, warmup=5, conc=conc * replicas)
             for name, conc in (("short", 128), ("medium", 64))]
    return step_compare(host, budget_end, [UPS[replicas]], cases, seed=30, warm=WARM,
                        section="Scale-out: one gateway, one then two 4B engines (one GPU each, "
                                "in flight per engine the same)")


UP_STEPS = [  # `embedserve up` first: what operators run, and the 2-GPU part where GPUs are scarce
    Step("up-1", ("soak-capacity", "scale"), step_up, 150, holds=("up-1",)),
    Step("soak-capacity", ("soak-capacity",), step_capacity, 45),
    Step("scale-load-1", ("scale",), step_scale, 85),
    Step("down-1", ("soak-capacity", "scale"), partial(step_stop, sides=[UPS[1]]), 30, always=True),
    Step("up-2", ("scale",), partial(step_up, replicas=2), 100, holds=("up-2",)),
    Step("scale-load-2", ("scale",), partial(step_scale, replicas=2), 85),
    Step("down-2", ("scale",), partial(step_stop, sides=[UPS[2]]), 30, always=True),
    # a stack of its own (ports 8300, 30300-30302), started and stopped within the step
    Step("drill", ("drill",), drill.step_drill, 640)]

# -- FP8 against bf16 -------------------------------------------

FP8_PORTS = {"4b": (30400, 30401), "0.6b": (30402, 30403), "minilm": (30404, 30405)}  # gateways on - 22000
FP8_CASES = [case("seed mix", 2), case("seed mix, 1-16 inputs"), case("medium"), case("long"),
             case("one in flight", 4, mix="seed")]


def pair(host: Host, shape: str, name: str, port: int, extra: dict[str, str]) -> tuple[Side, Side]:
    """An engine and a gateway in front of it, both at the model's own cap; FlashInfer's
    prefill has no head_dim 32 (MiniLM's): SGLang's BERT runs on Triton."""
    own = {"EMBEDSERVE_ENGINE__ATTENTION_BACKEND": "triton"} if shape == "minilm" and not host.cpu else {}
    engine = Side(f"{name} engine", ENGINE, port, shape, kv() | own | ({} if host.cpu else extra),
                  tag=f"engine-{shape}-{name}")
    return engine, gateway(name, port - 22000, engine, f"gateway-{shape}-{name}")


def fp8_pairs(host: Host) -> dict[str, tuple[tuple[Side, Side], tuple[Side, Side]]]:
    shapes = ["4b", "0.6b"] + (["minilm"] if "minilm" in host.models else [])
    return {s: (pair(host, s, "bf16", FP8_PORTS[s][0], {}), pair(host, s, "fp8", FP8_PORTS[s][1], FP8))
            for s in shapes}


def fp8_sides(host: Host) -> list[Side]:
    return [side for pairs in fp8_pairs(host).values() for p in pairs for side in p]


FP8_STEPS = [
    Step("fp8-engines", ("fp8",), partial(step_start, sides=fp8_sides), 150),
    Step("fp8-quality", ("fp8",), partial(step_quality, pairs=lambda host: [
        (f"fp8-{s}", p[0][1], p[1][1]) for s, p in fp8_pairs(host).items()]), 240),
    Step("fp8-throughput", ("fp8",), partial(
        step_compare, sides=lambda host: [p[1] for p in fp8_pairs(host)["4b"]], cases=FP8_CASES, warm=WARM,
        seed=500, least=2, section="FP8 vs bf16 (4B, through the gateway)"), 330),
    Step("fp8-stop", ("fp8",), partial(step_stop, sides=fp8_sides), 30, always=True)]

# -- vllm: vLLM 0.26.0's pooling runner beside embedserve, same GPU, checkpoint and texts (README) -------

VLLM_SHAPES = ("0.6b", "4b")
VLLM_CASES = [Case("short, 64 in flight", case("short").load),
              Case("short, 256 in flight", case("short", conc=256).load),
              *map(case, ("seed mix", "seed mix, 1-16 inputs", "medium", "long")), case("one in flight", 2)]


def vllm_default(shape: str, **env: str) -> Side:
    """embedserve's defaults (engines per GPU ``auto``), in the vllm scenario."""
    port = {"0.6b": 8600, "4b": 8650}[shape]
    return Side("embedserve", UP, port, shape, UNCAPPED | env, tag=f"embedserve-{shape}")


VLLM_SIDES = {"vllm": (), "vllm tuned": VLLM_TUNED_ARGS,  # --vllm-sides picks; fp8 beside the variant fp8
              "vllm tuned fp8": (*VLLM_TUNED_ARGS, "--quantization", "fp8")}


def vllm_sides(shape: str) -> Any:
    """Every side of a shape: embedserve's defaults, a stack per ``--embedserve-variants``, vLLM's sides."""
    port = {"0.6b": 8700, "4b": 8720}[shape]

    def sides(host: Host) -> list[Side]:
        gpu0 = {} if host.cpu else {"CUDA_VISIBLE_DEVICES": "0"}
        default = vllm_default(shape, **gpu0)
        return [default, *(Side(f"embedserve {name}", UP, default.port + 10 * (k + 1), shape,
                                default.env | env, tag=harness.slug(f"embedserve-{name}-{shape}"))
                           for k, (name, env) in enumerate(host.variants)),
                *[Side(name, VLLM, port + k, shape, args=args, tag=harness.slug(f"{name}-{shape}"))
                  for k, (name, args) in enumerate(VLLM_SIDES.items()) if name in host.vllm_sides]]
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


def vllm_steps(shapes: tuple[str, ...]) -> list[Step]:
    """Every shape's servers started together (their start-ups overlap), then per shape: readiness,
    vectors, the variants' quality gate, a profile, two load parts, its servers stopped."""
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
            Step(f"vllm-profile-{shape}", ("vllm",), partial(
                step_profile, side=vllm_default(shape), folder=f"profiles-vllm/{shape}"), 45),
            *[Step(f"vllm-kernels{tag}-{shape}", ("vllm",), partial(  # the seed mix, then short inputs alone
                kernel_profile.step_kernels, sides=sides, load=Load(mix, 64), requests=800, seed=770), 150)
              for tag, mix in (("", "seed"), ("-short", "uniform:16-512"))],
            Step(f"vllm-load-{shape}-1", ("vllm",), partial(load, cases=VLLM_CASES[:4], seed=610), 450,
                 least_s=150),
            Step(f"vllm-load-{shape}-2", ("vllm",), partial(load, cases=VLLM_CASES[4:], seed=650,
                                                             crosscheck=VLLM_CASES[:1]), 380, least_s=150)]
        steps.append(Step(f"vllm-stop-{shape}", ("vllm",), partial(step_stop, sides=sides), 20))
    return steps
