"""The peers and embedserve's variants as entries: each peer a :class:`harness.Kind` (its
command line, readiness and embeddings routes, texts or token ids), each variant a few settings.
Adding a peer is one entry here and a side in a scenario's list (bench/README.md has TEI's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness
from harness import Host, Kind, Side
from procs import child_env, log_tail

from embedserve.engines.sizing import ModelShape

HERE = Path(__file__).resolve().parent
BATCH_BUDGET = 16_384  # embedserve's engine.batch_token_budget (and its KV pool at cap 8192)
API_SERVERS = 4  # vllm tuned: --api-server-count (vllm-project/vllm#22941)
TC_PIECEWISE = ["--cuda-graph-backend-prefill", "tc_piecewise", "--cuda-graph-tc-compiler", "inductor"]
#: embedserve's variants: settings over the defaults, SGLang flags through ``engine.extra_args``; ``+`` joins
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    **{f"x{n}": ({"EMBEDSERVE_ENGINE__ENGINES_PER_GPU": str(n)}, []) for n in (1, 2, 3)},
    "graphs": ({}, TC_PIECEWISE),
    # prefill CUDA graphs captured up to N tokens only: larger batches run unpadded, without a graph
    **{f"gcap{n}": ({"EMBEDSERVE_ENGINE__PREFILL_GRAPH_TOKENS": str(n)}, []) for n in (1024, 4096, 16384)},
    "tokenizer-workers": ({}, ["--tokenizer-worker-num", "2"]),
    "fwdtimer": ({"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}, []),  # SGLang times each pass on the GPU
    **{name: ({f"EMBEDSERVE_ENGINE__{key}": value}, []) for name, key, value in (  # docs/SGLANG.md
        ("nokv", "KV_CACHE", "none"), ("overlap", "OVERLAP_SCHEDULE", "true"), ("fp8", "QUANTIZATION", "fp8"),
        ("pooled", "POOLED_LAST_LAYER", "true"), ("vectorised", "VECTORISED_CROSS_ENCODER", "true"),
        ("strided", "STRIDED_QUERY", "true"), ("unstrided", "STRIDED_QUERY", "false"),
        ("compiledqk", "COMPILED_QK_NORM_ROPE", "true"))},
    # the former defaults, where the embedding-only forward is now the default (docs/SGLANG.md)
    "paged": ({"EMBEDSERVE_ENGINE__KV_CACHE": "paged", "EMBEDSERVE_ENGINE__OVERLAP_SCHEDULE": "false",
               "EMBEDSERVE_ENGINE__POOLED_LAST_LAYER": "false"}, [])}


def variant(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME=K=V,K=V`` (settings of its own), or names of :data:`VARIANTS` joined by ``+``:
    their settings together, SGLang's extra flags concatenated."""
    name, sep, settings = spec.partition("=")
    if sep:
        env = dict(item.split("=", 1) for item in settings.split(",") if item)
        if not all(k.startswith(("EMBEDSERVE_", "CUDA_")) for k in env):
            raise ValueError(f"{spec!r}: wants NAME=EMBEDSERVE_X=V,EMBEDSERVE_Y=W")
        return name, env
    env, extra = {}, []
    for part in spec.split("+"):
        if part not in VARIANTS:
            raise ValueError(f"unknown embedserve variant {part!r}; known: {', '.join(VARIANTS)}")
        env |= VARIANTS[part][0]
        extra += VARIANTS[part][1]
    return spec, env | ({"EMBEDSERVE_ENGINE__EXTRA_ARGS": json.dumps(extra)} if extra else {})


def importable(site: str, probe: str, what: str) -> str | None:
    """None when ``probe`` runs with ``site`` first on the path, else why ``what`` cannot start
    (its last error line)."""
    done = subprocess.run([sys.executable, "-c", probe], env=child_env(site_env(site)), capture_output=True,
                          text=True, timeout=300, check=False)
    why = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    return None if done.returncode == 0 else f"{what} not importable from {site}: {why}"


def site_env(site: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}


# -- vLLM 0.26.0's pooling runner ------------------------------------------------------------------

def kv_pool_bytes(model_dir: str, tokens: int) -> int:
    """Bytes of a bf16 KV cache of ``tokens`` tokens for this checkpoint (K and V, every layer)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return tokens * ModelShape.from_config(config).kv_bytes_per_token


def vllm_command(host: Host, side: Side) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` with vLLM's defaults but two (bench/README.md says why): the KV pool, by
    default as many tokens as embedserve's engine, and chunked prefill, off (vllm-project/vllm#47971);
    its torch profiler is enabled, idle until ``/start_profile`` (bench/kernel_profile.py).
    ``side.args`` adds flags (``vllm tuned``)."""
    profiler = {"profiler": "torch", "torch_profiler_dir": str(harness.trace_dir(host, side)),
                "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False,
                "ignore_frontend": True}
    base = list(host.vllm_cmd) or [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    model = host.model(side.shape)
    kv_tokens = host.vllm_kv_tokens or max(BATCH_BUDGET, 2 * host.cap)
    argv = [*base, "serve", model, "--runner", "pooling", "--served-model-name", host.served_name(side.shape),
            "--host", "127.0.0.1", "--port", str(side.port), "--max-model-len", str(host.cap),
            "--dtype", "float32" if host.cpu else "bfloat16",
            "--kv-cache-memory-bytes", str(kv_pool_bytes(model, kv_tokens)),
            "--gpu-memory-utilization", "0.1", "--no-enable-chunked-prefill",
            "--profiler-config", json.dumps(profiler, separators=(",", ":")), *side.args]
    return argv, site_env(host.vllm_site) | {"VLLM_NO_USAGE_STATS": "1", "CUDA_VISIBLE_DEVICES": "0"}


def vllm_missing(host: Host) -> str | None:
    return None if host.vllm_cmd else importable(host.vllm_site, "import vllm, vllm.entrypoints.cli.main",
                                                 "vLLM")


LOG_LINES = re.compile(r"attention backend|cudagraph|CUDA graph|Model loading took|KV cache|"
                       r"torch\.compile|Supported tasks|pooler_config", re.IGNORECASE)


def vllm_facts(log: Path) -> dict[str, Any]:
    """What vLLM said about itself at start-up: the attention backend, the CUDA-graph mode,
    and the lines they came from."""
    text = log_tail(log, 2_000_000)
    backend = re.search(r"Using (\S+) attention backend", text)
    graphs = re.search(r"cudagraph_mode'?\"?\s*[:=]\s*<?(?:CUDAGraphMode\.)?([A-Z_]+)", text)
    override = re.findall(r"[Oo]verriding cudagraph_mode to ([A-Z_]+)", text)
    return {"attention_backend": backend.group(1) if backend else None,
            "cudagraph_mode": override[-1] if override else (graphs.group(1) if graphs else None),
            "log_lines": [ln.strip()[:300] for ln in text.splitlines() if LOG_LINES.search(ln)][:16]}


# a request unanswered for 60 s is an error: vLLM 0.26 once stopped making progress with 64 in
# flight, and the default 300 s would hold every later run of the step
VLLM = Kind(vllm_command, ready="/health", rerank="/rerank", missing=vllm_missing, facts=vllm_facts,
            timeout_s=60.0)
VLLM_TUNED_ARGS = ("--max-num-batched-tokens", str(BATCH_BUDGET), "--api-server-count", str(API_SERVERS))


# -- Infinity 0.0.78, from a folder of its own (it breaks on transformers 5) ----------------------

def infinity_command(host: Host, side: Side) -> tuple[list[str], dict[str, str]]:
    """``side.args``: options over the defaults below (``--engine optimum``, ``--pooling-method
    mean``); given a folder with model.onnx as ``cwd``, it is started there with ``--model-id .``
    (given a path, Infinity passes the whole path as the ONNX file's name)."""
    cpu = host.cpu or "cpu" in side.args
    options = {"--engine": "torch", "--device": "cpu" if cpu else "cuda", "--dtype": "float32" if cpu else
               "bfloat16"} | dict(zip(side.args[::2], side.args[1::2], strict=True))
    model = "." if side.cwd else host.model(side.shape)
    argv = [sys.executable, "-m", "infinity_emb.cli", "v2", "--model-id", model,
            "--served-model-name", host.served_name(side.shape), "--port", str(side.port),
            *(x for kv in options.items() for x in kv)]
    return argv, site_env(host.infinity_site) | {"INFINITY_ANONYMOUS_USAGE_STATS": "0"}


def infinity_missing(host: Host) -> str | None:
    return importable(host.infinity_site, "import infinity_emb, transformers; assert "
                      "transformers.__version__.startswith('4.'), transformers.__version__", "Infinity")


INFINITY = Kind(infinity_command, ready="/health", route="/embeddings", rerank="/rerank",
                missing=infinity_missing)


# -- in process: a model in the client's own loop, no HTTP (bench/inprocess.py) -------------------

def in_process_command(host: Host, side: Side) -> tuple[list[str], dict[str, str]]:
    backend = side.args[0] if side.args else "st-torch"
    argv = [sys.executable, str(HERE / "inprocess.py"), backend, side.cwd or host.model(side.shape)]
    return [*argv, str(side.port)], {"HF_HUB_OFFLINE": "1"}


IN_PROCESS = Kind(in_process_command, ready="/health", in_process=True)
