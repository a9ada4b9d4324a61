"""The CPU comparisons as data for the suite's runner (`python bench/suite.py --only NAME`), the bundled
all-MiniLM-L6-v2 on the CPU engine; bench/README.md says what each does."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from random import Random
from typing import Any

import httpx
from harness import GATEWAY, INSTANT, UP, Host, Kind, Side, slug
from measure import Case, Load, children_cpu
from peers import IN_PROCESS, INFINITY
from procs import child_env, embedserve_cmd
from runner import Step, lifecycle, resolve, step_compare, step_quality, step_stop, step_vectors

OPEN = {"EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": str(10**9)}  # admission never caps a run
CPU = {"EMBEDSERVE_ENGINE__KIND": "cpu", **OPEN}  # `up`'s engine (a gateway given engines starts none)
MEAN = ("--device", "cpu", "--dtype", "float32", "--pooling-method", "mean")
PEER_LOADS = [Case(name, Load(mix, conc, inputs, seconds=15, warmup=2, words=True, batches=batches), rounds=3)
              for name, mix, conc, inputs, batches in (
                  ("20-word texts, 1 per request, 16 in flight", "fixed:20", 16, "1", (1, 16)),
                  ("64-word texts x 32 per request, 4 in flight", "fixed:64", 4, "32", (32,)),
                  ("one in flight", "fixed:20", 1, "1", (1,)))]


def up(name: str, port: int, **settings: str) -> Side:
    return Side(name, UP, port, "bundled", CPU | settings, tag=slug(name))


def peer_sides(host: Host) -> list[Side]:
    onnx, hub = host.work.root / "minilm-onnx", host.work.root / "hub"
    # huggingface_hub 0.36 reads HUGGINGFACE_HUB_CACHE for the constant Infinity's optimiser uses
    caches = {k: {"HF_HUB_CACHE": str(hub / k), "HUGGINGFACE_HUB_CACHE": str(hub / k)}
              for k in ("plain", "optimised")}
    optimum = (*MEAN, "--engine", "optimum")
    return [up("embedserve torch", 8800, EMBEDSERVE_ENGINE__CPU_BACKEND="torch"), up("embedserve onnx", 8810),
            up("embedserve onnx int8", 8820, EMBEDSERVE_ENGINE__CPU_QUANTIZATION="int8"),
            Side("Infinity torch", INFINITY, 8830, "bundled", args=MEAN),
            Side("Infinity optimum", INFINITY, 8831, "bundled", caches["plain"], optimum, cwd=str(onnx)),
            Side("Infinity optimum optimised", INFINITY, 8832, "bundled", caches["optimised"], optimum,
                 cwd=str(onnx)),
            Side("ST torch in process", IN_PROCESS, 8833, "bundled", args=("st-torch",)),
            Side("ST ONNX in process", IN_PROCESS, 8834, "bundled", {"PYTHONPATH": host.infinity_site},
                 ("st-onnx",), cwd=str(onnx)),
            Side("embedserve's export in process", IN_PROCESS, 8835, "bundled", args=("ort-export",))]


PREPARE = """
import shutil, sys
from pathlib import Path
from sentence_transformers import SentenceTransformer
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTOptimizer
from optimum.onnxruntime.configuration import OptimizationConfig

source, folder, optimised = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
shutil.rmtree(folder, ignore_errors=True)
SentenceTransformer(source, device="cpu", backend="onnx", local_files_only=True).save_pretrained(str(folder))
(folder / "onnx" / "model.onnx").rename(folder / "model.onnx")
(folder / "onnx").rmdir()
model = ORTModelForFeatureExtraction.from_pretrained(str(folder), file_name="model.onnx")
# Infinity's own settings (infinity_emb/transformer/utils_optimum.py) less the argument that
# optimum-onnx 0.1.0 refuses
config = OptimizationConfig(optimization_level=99, optimize_for_gpu=False, fp16=False)
ORTOptimizer.from_pretrained(model).optimize(optimization_config=config, save_dir=str(optimised),
                                             one_external_file=True)
"""


def step_onnx(host: Host, budget_end: float) -> dict[str, Any]:
    """sentence-transformers' ONNX export in a copy of the model's folder (the bundled model
    ships none), and the graph Infinity's optimisation step would have written (optimum's
    optimiser at level 99, for CPU) in the "optimised" side's hub cache, where it looks first."""
    hub = host.work.root / "hub"
    shutil.rmtree(hub, ignore_errors=True)
    target = hub / "optimised" / "infinity_onnx" / "CPUExecutionProvider"
    (hub / "plain").mkdir(parents=True)
    argv = [sys.executable, "-c", PREPARE, host.model("bundled"), str(host.work.root / "minilm-onnx"),
            str(target)]
    env = {**os.environ, "PYTHONPATH": host.infinity_site, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    return {"skipped": f"no ONNX copy for Infinity: {done.stderr[-300:]}"} if done.returncode else {}


def step_first_export(host: Host, budget_end: float) -> dict[str, Any]:
    """What a first start adds: the export into an empty cache (fp32, then int8 from it), in the
    child process the engine runs: wall-clock seconds and the CPU seconds it used (which a busy
    machine changes less)."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for quantization in ("none", "int8"):
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDSERVE_ENGINE__CPU_EXPORT_DIR": cache,
                   "EMBEDSERVE_ENGINE__CPU_QUANTIZATION": quantization}
            t0, cpu0, load0 = time.monotonic(), children_cpu(), os.getloadavg()[0]
            subprocess.run([sys.executable, "-m", "embedserve.engines.onnx_export"], env=env, check=True,
                           capture_output=True)
            rows.append({"quantization": quantization, "seconds": round(time.monotonic() - t0, 1),
                         "cpu_seconds": round(children_cpu() - cpu0, 1),
                         "load_average": f"{load0:.1f}-{os.getloadavg()[0]:.1f}"})
    return {"tables": {"A first start's export into an empty cache": rows}}


OVERHEAD = [Side("instant engine", INSTANT, 18611, "bundled", {"DIM": "384"}, tag="instant-384"),
            Side("gateway (text)", GATEWAY, 18610, "bundled", OPEN, behind=(18611,), tag="gateway-overhead"),
            Side("gateway (ids)", GATEWAY, 18610, "bundled", ids=True, tag="gateway-overhead")]
CPU_GATEWAY = Side("gateway", GATEWAY, 8991, "bundled", OPEN, behind=(30991,), tag="gateway-cpu")
CPU_GATEWAY_ENGINE = Side("instant engine", INSTANT, 30991, "bundled", {"DIM": "384"}, tag="instant-cpu")
# request shapes (name, tokens a text, texts, encoding): loads through the gateway, and in process
REQUESTS = (("1 short text, float", 14, 1, "float"), ("1 short text, base64", 14, 1, "base64"),
            ("32 short texts, base64", 14, 32, "base64"),
            ("1 long text (256 tokens), base64", 256, 1, "base64"))
SHAPES = [Case(name, Load(f"fixed:{tokens}", 32, str(n), seconds=10, warmup=1, encoding=encoding))
          for name, tokens, n, encoding in REQUESTS]
SHORT = "How do I keep GPU memory flat when inputs vary in length?"  # 14 tokens
LONG = " ".join(["the embedding service truncates long inputs and keeps the EOS token"] * 30)


def median_us(fn: Callable[[], object], repeats: int = 7, number: int = 200) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return round(statistics.median(times) * 1e6, 1)


def stages(tok: Any, fields: dict[str, Any]) -> dict[str, float]:
    """Median µs per request of each of the gateway's CPU stages, in process, for one request shape."""
    import orjson

    from embedserve.contracts.wire import decode_response, encode_base64
    from embedserve.core.vectors import shape_vectors
    from embedserve.gateway.schemas import EmbeddingRequest
    from embedserve.loadtest.instant_engine import reply

    body = orjson.dumps({"model": "m", **fields})
    req = EmbeddingRequest.model_validate(orjson.loads(body))
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    engine_reply = reply(len(texts))
    vectors = decode_response(engine_reply, len(texts))

    def respond() -> bytes:
        shaped = shape_vectors(vectors, None, True)
        payload = encode_base64(shaped) if req.encoding_format == "base64" else list(shaped)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(payload)]
        return orjson.dumps({"object": "list", "data": data}, option=orjson.OPT_SERIALIZE_NUMPY)

    out = {"parse_validate_us": median_us(lambda: EmbeddingRequest.model_validate(orjson.loads(body))),
           "tokenize_us": median_us(lambda: tok.encode_texts(texts)),
           "engine_reply_parse_us": median_us(lambda: decode_response(engine_reply, len(texts))),
           "normalise_encode_us": median_us(respond)}
    return out | {"sum_us": round(sum(out.values()), 1)}


def step_gateway_stages(host: Host, budget_end: float) -> dict[str, Any]:
    from embedserve.core.tokenize import ModelTokenizer

    tok, rows = ModelTokenizer(Path(host.model("bundled")), 256), []
    for name, tokens, n, encoding in REQUESTS:
        text = SHORT if tokens < 256 else LONG
        rows.append({"request": name, **stages(tok, {"input": text if n == 1 else [text] * n,
                                                     "encoding_format": encoding})})
    return {"tables": {"Where the gateway's CPU time goes, in process (median µs per request)": rows}}


def rerank_sides(host: Host) -> list[Side]:
    """A cross-encoder of ms-marco-MiniLM-L-6-v2's shape with random weights (no model hub here;
    speed depends on the shape) on the CPU engine (ONNX Runtime) and on Infinity's torch engine."""
    return [up("embedserve, bundled MiniLM (cosine)", 8860),
            Side("embedserve, cross-encoder (ONNX)", UP, 8870, "cross-encoder", CPU, tag="rerank-ce"),
            Side("Infinity, cross-encoder (torch)", INFINITY, 8880, "cross-encoder", args=MEAN[:4])]


def step_cross_encoder(host: Host, budget_end: float) -> dict[str, Any]:
    from embedserve.runtime.synth_rerank import build_cross_encoder

    return {"model": str(build_cross_encoder(Path(host.model("cross-encoder")), "minilm-l6"))}


def rerank_loads(seconds: float, rounds: int) -> list[Case]:
    """rerank-gpu's loads: one 8-word query and its passages, every text unique."""
    return [Case(f"1 query x {n} passages of {words} words, {conc} in flight",
                 Load(f"fixed:{words}", conc, seconds=seconds, warmup=2, words=True, rerank=n), rounds)
            for n, words, conc in ((32, 128, 16), (100, 64, 4), (16, 64, 1))]


# rerank-gpu's loads through gateways over an engine that answers at once: what the gateway alone carries
RERANK_ENGINE = Side("instant engine", INSTANT, 30981, "bundled", tag="instant-rerank")
RERANK_GATEWAYS = [Side(f"gateway, {shape}", GATEWAY, port, shape, OPEN, behind=(30981,), tag=shape)
                   for shape, port in (("cross-encoder", 8981), ("qwen3-reranker", 8982))]


def step_rerankers(host: Host, budget_end: float) -> dict[str, Any]:
    from embedserve.runtime.synth_model import build_qwen3_reranker

    if not (Path(qwen := host.model("qwen3-reranker")) / "config.json").exists():
        build_qwen3_reranker(Path(qwen))
    return step_cross_encoder(host, budget_end) | {"qwen3_reranker": qwen}


def step_rerank_scores(host: Host, budget_end: float, sides: Any = None) -> dict[str, Any]:
    """The cross-encoder sides' relevance scores for the same 8 pairs, each side's largest difference
    from the first side's (``sides``: the first is the reference; default the CPU scenario's
    cross-encoders), and the tokens each side says it read."""
    from embedserve.loadtest.textbuild import WordBuilder

    texts = [WordBuilder(99).build(64, Random(99), i)[0] for i in range(9)]
    got, tokens = {}, {}
    for side in resolve(host, sides) if sides else rerank_sides(host)[1:]:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            r = httpx.post(f"http://127.0.0.1:{side.port}{side.kind.rerank}", timeout=120, json={
                "model": host.served_name(side.shape), "query": side.wrap[0].format(texts[0]),
                "documents": [side.wrap[1].format(x) for x in texts[1:]]})
            ranked = sorted(r.json()["results"], key=lambda x: x["index"])
            got[side.name] = [x["relevance_score"] for x in ranked]
            tokens[side.name] = (r.json().get("usage") or {}).get("total_tokens")
    first = next(iter(got.values()), [])
    diffs = {k: max(abs(a - b) for a, b in zip(first, v, strict=True)) for k, v in list(got.items())[1:]}
    return {"scores": got, "tokens": tokens, "largest_difference": diffs,
            "notes": [f"Scores of the same 8 pairs, largest difference from {next(iter(got), '?')}: {diffs}"]}


RERANK_LOADS = [Case(f"1 query x {n} passages of 64 words, {conc} in flight",
                     Load("fixed:64", conc, seconds=15, warmup=2, words=True, rerank=n), 3)
                for n, conc in ((16, 4), (64, 1))]


# tracing off and on, exporting to the test suite's OTLP receivers run as a collector (HTTP 14318, gRPC 14319)
OTLP = Kind(lambda host, side: ([sys.executable, "-m", "tests.otlp_receiver", "14318", "14319"], {}),
            ready="/")
RECEIVER = Side("OTLP receiver", OTLP, 14318, tag="otlp", cwd=str(Path(__file__).parents[1].resolve()))
TRACED = [up(f"tracing {name}", 8900 + 10 * i, **({"EMBEDSERVE_TRACING__ENDPOINT": f"http://127.0.0.1:{port}",
                                                   "EMBEDSERVE_TRACING__PROTOCOL": protocol} if port else {}))
          for i, (name, port, protocol) in enumerate(
              (("off", 0, ""), ("on, OTLP/HTTP", 14318, "http/protobuf"), ("on, OTLP/gRPC", 14319, "grpc")))]


# dense only against dense + sparse + ColBERT from one forward of a model of BGE-M3's shape (random weights),
# capped at 512 tokens: the warm-up's longest input at BGE-M3's 8,192 left the engine at 20.8 GB
HYBRID = [Side("embedserve, BGE-M3 heads", UP, 8940, "bge-m3", CPU | {"EMBEDSERVE_MODEL__MAX_SEQ_LEN": "512"},
               tag="hybrid")]
HYBRID_LOADS = [Case(f"64-word texts x 4 per request, 2 in flight, {name}", Load(
    "fixed:64", 2, "4", seconds=30, warmup=5, words=True, outputs=outputs), 3) for name, outputs in (
    ("dense", None), ("dense + sparse + colbert", "dense,sparse,colbert"))]


def step_bge_m3(host: Host, budget_end: float) -> dict[str, Any]:
    if not (Path(out := host.model("bge-m3")) / "config.json").exists():
        subprocess.run([*embedserve_cmd(), "synth-model", "bge-m3", out, "--kind", "bge-m3"], check=True,
                       env=child_env(), timeout=600)  # the real shape: a head's cost is relative to the body
    return {"model": out}


def spans_received(host: Host, budget_end: float) -> dict[str, Any]:
    return {"notes": [f"Spans received: {httpx.get('http://127.0.0.1:14318').json()['spans']:,}"]}


def quality_base(host: Host) -> list[Side]:
    return [up("baseline", 18700, **dict(host.variants).get("baseline", {}))]


def quality_pairs(host: Host) -> list[tuple[str, Side, Side]]:
    base = quality_base(host)[0]
    return [(name, base, up(name, 18710, **env)) for name, env in host.variants if name != "baseline"]


def cpu_steps() -> list[Step]:
    def step(name: str, run: Callable[..., dict[str, Any]], seconds: float, **args: Any) -> Step:
        """A step of the scenario its name starts with."""
        return Step(name, (next(s for s in SCENARIOS if name.startswith(s)),), partial(run, **args), seconds)

    peers_on, peers_off = lifecycle("cpu-peers", "cpu-peers", peer_sides, 300, one_at_a_time=True)
    quality_on, quality_off = lifecycle("quality-cpu", "quality-cpu", quality_base)
    rerank_on, rerank_off = lifecycle("rerank-cpu", "rerank-cpu", rerank_sides)
    return [
        step("cpu-peers-export", step_first_export, 60), step("cpu-peers-onnx", step_onnx, 90), peers_on,
        step("cpu-peers-vectors", step_vectors, 30, sides=peer_sides, reference="ST torch in process"),
        step("cpu-peers-load", step_compare, 1500, sides=peer_sides, cases=PEER_LOADS, seed=1000,
             section="CPU peers (all-MiniLM-L6-v2)"), peers_off,
        step("gateway-overhead", step_compare, 300, sides=OVERHEAD, start=OVERHEAD[:2], stop=OVERHEAD[:2],
             seed=0, section="The gateway over an engine that answers at once",
             cases=[Case(f"{n} in flight", Load("seed", n, seconds=10), 2) for n in (1, 8)]),
        step("gateway-cpu", step_compare, 120, sides=[CPU_GATEWAY], start=[CPU_GATEWAY_ENGINE, CPU_GATEWAY],
             stop=[CPU_GATEWAY, CPU_GATEWAY_ENGINE], cases=SHAPES, seed=3,
             section="The gateway's CPU per request (instant engine)"),
        step("gateway-cpu-stages", step_gateway_stages, 60),
        step("gateway-rerank-cpu-models", step_rerankers, 30),
        step("gateway-rerank-cpu", step_compare, 200, sides=RERANK_GATEWAYS,
             start=[RERANK_ENGINE, *RERANK_GATEWAYS], stop=[*RERANK_GATEWAYS, RERANK_ENGINE],
             cases=rerank_loads(10, 2), seed=13,
             section="Rerank through the gateway over an engine that answers at once, pairs/s"), quality_on,
        step("quality-cpu", step_quality, 900, pairs=quality_pairs, one_at_a_time=True), quality_off,
        step("rerank-cpu-model", step_cross_encoder, 30), rerank_on,
        step("rerank-cpu-scores", step_rerank_scores, 10),
        step("rerank-cpu-load", step_compare, 400, sides=rerank_sides, cases=RERANK_LOADS, seed=11,
             section="Rerank on CPU, pairs/s (inputs/s)",
             warm=Load("fixed:64", 1, seconds=2, warmup=0, words=True, rerank=4)), rerank_off,
        step("tracing-cpu", step_compare, 900, sides=TRACED, start=[RECEIVER, *TRACED], stop=TRACED, seed=21,
             cases=[PEER_LOADS[0], PEER_LOADS[2]], section="Tracing off and on: the CPU stack"),
        step("tracing-cpu-spans", spans_received, 10),
        step("tracing-cpu-stop", step_stop, 10, sides=[RECEIVER]), step("hybrid-cpu-model", step_bge_m3, 600),
        step("hybrid-cpu", step_compare, 450, sides=HYBRID, start=HYBRID, stop=HYBRID, cases=HYBRID_LOADS,
             seed=31, section="Dense only against dense + sparse + ColBERT on CPU, inputs/s")]


SCENARIOS = ("cpu-peers", "gateway-overhead", "gateway-cpu", "gateway-rerank-cpu", "quality-cpu",
             "rerank-cpu", "tracing-cpu", "hybrid-cpu")
