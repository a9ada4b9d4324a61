"""vLLM 0.26.0's pooling runner side by side with embedserve on one GPU: the same checkpoint,
the same texts, one run, sides alternating.

Four servers run at once on GPU 0, each measured alone in turn:

- ``embedserve``: `embedserve up` with the product's engine defaults;
- ``embedserve xN``: the same with ``EMBEDSERVE_ENGINE__ENGINES_PER_GPU=N`` (``--engines-per-gpu``;
  recorded as not run while the settings have no such field);
- ``vllm``: `vllm serve CKPT --runner pooling` with vLLM's defaults, except the KV pool: the
  same number of tokens as embedserve's engine (``--kv-cache-memory-bytes``), so that four
  servers fit on the GPU and memory is compared for the same pool;
- ``vllm tuned``: plus what vLLM's issues recommend for embedding throughput:
  ``--max-num-batched-tokens`` = embedserve's batch budget and ``--api-server-count`` > 1
  (request parsing, tokenisation and responses spread over processes).

vLLM comes from its own folder (``--vllm-site``, bundle ``vllm/pNN``) in front of the suite's
PYTHONPATH. ``--vllm-cmd`` replaces ``python3 -m vllm.entrypoints.cli.main`` (a stub for dry runs:
bench/fake_vllm.py). Vectors are compared first: vLLM's, SGLang's (through the gateway) and a
transformers forward pass on the same texts.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import stacks
from loadgen import Load, Target
from procs import child_env, http_post_json, log_tail
from scenarios import Case, alternate, engine_memory
from stacks import Host

HERE = Path(__file__).resolve().parent
BATCH_BUDGET = 16_384  # embedserve's engine.batch_token_budget (and its KV pool at cap 8192)
API_SERVERS = 4  # vllm tuned: --api-server-count
# per shape: (up default, up xN, vllm, vllm tuned) ports; `up` engines from port + 22000
PORTS = {"0.6b": (8600, 8601, 8700, 8701), "4b": (8620, 8621, 8720, 8721)}
UP_EXTRA = {"EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": "1048576",  # admission control off
            "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "300"}
VLLM_CASES = [
    Case("short, 64 in flight", Load("uniform:16-512", 64, seconds=15)),
    Case("short, 256 in flight", Load("uniform:16-512", 256, seconds=15)),
    Case("seed mix", Load("seed", 64, seconds=15)),
    Case("seed mix, 1-16 inputs", Load("seed", 32, inputs="1-16", seconds=15)),
    Case("medium", Load("uniform:512-2048", 64, seconds=15)),
    Case("long", Load("uniform:8000-8191", 8, seconds=15)),
    Case("one in flight", Load("uniform:16-512", 1, seconds=6, warmup=1), rounds=2),
]
VLLM_PARTS = {1: VLLM_CASES[:4], 2: VLLM_CASES[4:]}  # one step each, within 10 minutes
CROSSCHECKED = VLLM_CASES[0]  # one crosscheck.py run per side, in the last part
LOG_LINES = re.compile(r"attention backend|cudagraph|CUDA graph|Model loading took|KV cache|"
                       r"torch\.compile|Supported tasks|pooler_config", re.IGNORECASE)


def tag(side: str, shape: str) -> str:
    return f"{side.replace(' ', '-')}-{shape}"


def side_names(host: Host) -> list[str]:
    return ["embedserve", f"embedserve x{host.engines_per_gpu}", "vllm", "vllm tuned"]


def engines_per_gpu_setting() -> str | None:
    """None when the installed embedserve has ``engine.engines_per_gpu``, else why not."""
    try:
        from embedserve.config import EngineSettings
    except ImportError as exc:
        return f"embedserve's settings do not import: {exc}"
    if "engines_per_gpu" in EngineSettings.model_fields:
        return None
    return "this embedserve has no engine.engines_per_gpu setting (EMBEDSERVE_ENGINE__ENGINES_PER_GPU)"


def vllm_env(host: Host) -> dict[str, str]:
    path = os.pathsep.join(p for p in (host.vllm_site, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "CUDA_VISIBLE_DEVICES": "0"}


def vllm_missing(host: Host) -> str | None:
    """None when vLLM can start from its folder (or a stand-in is given), else why not."""
    if host.vllm_cmd:
        return None
    env = child_env(vllm_env(host))
    probe = "import vllm, vllm.entrypoints.cli.main; print(vllm.__version__)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1][:300]


def kv_pool_bytes(model_dir: str, tokens: int) -> int:
    """Bytes of a bf16 KV cache of ``tokens`` tokens for this checkpoint (K and V, every layer)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return tokens * 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2


def vllm_argv(host: Host, shape: str, port: int, tuned: bool) -> list[str]:
    """`vllm serve` for one side; flags as vLLM 0.26.0's argparse spells them."""
    base = list(host.vllm_cmd) or [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    model = host.model(shape)
    argv = [*base, "serve", model, "--runner", "pooling", "--served-model-name", Path(model).name,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(host.cap),
            "--dtype", "float32" if host.cpu else "bfloat16",
            # the same KV pool as embedserve's engine; the utilisation only gates the start-up
            # check of free memory, which four servers on one GPU would otherwise fail
            "--kv-cache-memory-bytes", str(kv_pool_bytes(model, max(BATCH_BUDGET, 2 * host.cap))),
            "--gpu-memory-utilization", "0.2"]
    if tuned:
        argv += ["--max-num-batched-tokens", str(BATCH_BUDGET), "--api-server-count", str(API_SERVERS)]
    return argv


def start_vllm(host: Host, name: str, shape: str, port: int, tuned: bool) -> dict[str, Any]:
    stacks.free_port(port)
    return host.work.start(name, vllm_argv(host, shape, port, tuned), vllm_env(host))


def vllm_log_facts(log: Path) -> dict[str, Any]:
    """What vLLM said about itself at start-up: the attention backend, the CUDA-graph mode,
    and the lines they came from."""
    text = log_tail(log, 2_000_000)
    lines = [ln.strip()[:300] for ln in text.splitlines() if LOG_LINES.search(ln)]
    backend = re.search(r"Using (\S+) attention backend", text)
    graphs = re.search(r"cudagraph_mode'?\"?\s*[:=]\s*<?(?:CUDAGraphMode\.)?([A-Z_]+)", text)
    override = re.findall(r"[Oo]verriding cudagraph_mode to ([A-Z_]+)", text)
    return {"attention_backend": backend.group(1) if backend else None,
            "cudagraph_mode": override[-1] if override else (graphs.group(1) if graphs else None),
            "log_lines": lines[:16]}


def up_target(host: Host, name: str, shape: str, port: int, engines: int) -> Target:
    pid = host.work.state["procs"][name]["pid"]
    return stacks.gateway_target(host, shape, port, [port + 22000 + i for i in range(engines)], pid)


def vllm_target(host: Host, shape: str, port: int) -> Target:
    url = f"http://127.0.0.1:{port}"
    return Target(url, host.model(shape), raw=False, engine_urls=[url], cap=host.cap)


def sides(host: Host, shape: str) -> list[tuple[str, Target]]:
    """The sides running now, in the fixed order: embedserve first."""
    out = []
    for i, (side, port) in enumerate(zip(side_names(host), PORTS[shape], strict=True)):
        if host.work.running(tag(side, shape)):
            out.append((side, up_target(host, tag(side, shape), shape, port, host.engines_per_gpu if i else 1)
                        if i < 2 else vllm_target(host, shape, port)))
    return out


def step_start(host: Host, budget_end: float, shape: str = "0.6b") -> dict[str, Any]:
    """All four servers at once on GPU 0 (starts overlap), then each one's readiness, start-up
    facts and GPU memory."""
    up, up_n, _, vl_tuned = PORTS[shape]
    names = side_names(host)
    out: dict[str, Any] = {"shape": shape, "not_run": {}, "argv": {}, "ready_s": {}}
    no_vllm = vllm_missing(host)
    no_n = engines_per_gpu_setting() if host.engines_per_gpu > 1 else "not asked for (--engines-per-gpu 1)"
    if no_vllm:
        why = f"vLLM not importable from {host.vllm_site}: {no_vllm}"
        out["not_run"]["vllm"] = out["not_run"]["vllm tuned"] = why
    if no_n:
        out["not_run"][names[1]] = no_n
    for side, port in zip(names, PORTS[shape], strict=True):
        name = tag(side, shape)
        if side in out["not_run"] or host.work.running(name):
            continue
        if port in (up, up_n):
            extra = dict(UP_EXTRA, EMBEDSERVE_ENGINE__ENGINES_PER_GPU=str(host.engines_per_gpu)) \
                if port == up_n else dict(UP_EXTRA)
            stacks.start_up(host, name, shape, port, engine_port=port + 22000,
                            extra=extra | ({} if host.cpu else {"CUDA_VISIBLE_DEVICES": "0"}))
        else:
            start_vllm(host, name, shape, port, tuned=port == vl_tuned)
    for side, port in zip(names, PORTS[shape], strict=True):
        name = tag(side, shape)
        if side in out["not_run"]:
            continue
        out["argv"][side] = host.work.state["procs"][name]["argv"]
        try:
            if port in (up, up_n):
                out["ready_s"][side] = stacks.wait_ready(host, name, "/health/ready", port, budget_end,
                                                         banner="embedserve is up")
            else:
                out["ready_s"][side] = stacks.wait_ready(host, name, "/health", port, budget_end)
                out.setdefault("vllm_facts", {})[side] = vllm_log_facts(
                    Path(host.work.state["procs"][name]["log"]))
        except RuntimeError as exc:  # a side that cannot start is a finding; the others go on
            out["not_run"][side] = str(exc)[-1500:]
            host.work.stop(name, 30)
    out["gpu_gb_idle"] = engine_memory(host, [tag(s, shape) for s in names])
    out["fi_cache_tgz_mb"] = stacks.pack_fi_cache(host)
    return out


def vector_texts(cap: int, n: int = 6, seed: int = 3) -> list[str]:
    """Texts of a few lengths, from plain words (no two alike)."""
    rng = random.Random(seed)
    words = ("the", "model", "retrieves", "passages", "that", "answer", "a", "query", "about", "memory",
             "cache", "and", "vectors")
    lengths = [k for k in (3, 20, 60, 150, 400, 900) if 4 * k < cap]  # words: at most ~2 tokens each
    return [f"text {i}: " + " ".join(rng.choice(words) for _ in range(k)) for i, k in enumerate(lengths[:n])]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(p * q for p, q in zip(a, b, strict=True))
    na, nb = sum(p * p for p in a) ** 0.5, sum(q * q for q in b) ** 0.5
    return round(dot / (na * nb), 6) if na and nb else 0.0


def server_vectors(url: str, model: str, texts: list[str]) -> tuple[list[list[float]], list[int]]:
    """Each text alone (a batch must not change a vector): vectors and usage's token counts."""
    vecs, tokens = [], []
    for text in texts:
        doc = http_post_json(url.rstrip("/") + "/v1/embeddings", {"model": model, "input": [text]})
        vecs.append(doc["data"][0]["embedding"])
        tokens.append(int((doc.get("usage") or {}).get("prompt_tokens") or 0))
    return vecs, tokens


def step_vectors(host: Host, budget_end: float, shape: str = "0.6b") -> dict[str, Any]:
    """Cosines on the same texts: vLLM against SGLang (embedserve's gateway), and each against a
    transformers forward pass (last-token pooling, L2 norm) of the same checkpoint."""
    texts = vector_texts(host.cap)
    work = host.work.root / "vectors" / shape
    work.mkdir(parents=True, exist_ok=True)
    (work / "texts.json").write_text(json.dumps(texts))
    ref = subprocess.run([sys.executable, str(HERE / "reference_vectors.py"), host.model(shape),
                          str(work / "texts.json"), "--device", host.device],
                         capture_output=True, text=True, env=child_env(), timeout=600, check=False)
    got: dict[str, tuple[list[list[float]], list[int]]] = {}
    errors: dict[str, str] = {}
    if ref.returncode == 0:
        doc = json.loads(ref.stdout.strip().splitlines()[-1])
        got["transformers"] = (doc["vectors"], doc["tokens"])
    else:
        errors["transformers"] = ref.stderr[-800:]
    for side, target in sides(host, shape):
        if side in ("embedserve", "vllm"):
            label = "sglang" if side == "embedserve" else "vllm"
            try:
                got[label] = server_vectors(target.url, Path(target.model_dir).name, texts)
            except Exception as exc:  # recorded; the throughput runs still go on
                errors[label] = repr(exc)[:300]
    pairs = []
    for a, b in (("vllm", "sglang"), ("vllm", "transformers"), ("sglang", "transformers")):
        if a in got and b in got:
            cos = [cosine(x, y) for x, y in zip(got[a][0], got[b][0], strict=True)]
            pairs.append({"pair": f"{a} vs {b}", "cosines": cos, "min": min(cos),
                          "tokens_a": got[a][1], "tokens_b": got[b][1]})
    return {"shape": shape, "texts": len(texts), "pairs": pairs, "errors": errors}


def step_load(host: Host, budget_end: float, shape: str = "0.6b", part: int = 1) -> dict[str, Any]:
    """This part's cases on every running side, same seeds (so the same texts), the sides'
    order reversed every other case and round; the last part adds one crosscheck.py run per
    side and each server's GPU memory after the runs."""
    running = sides(host, shape)
    if len(running) < 2:
        return {"skipped": f"fewer than two sides running for {shape}: {[s for s, _ in running]}"}
    warm = Case("warm-up", Load("uniform:16-512", 32, seconds=6, warmup=0))
    alternate(host, running, warm, f"vllm-warm-{shape}-{part}", 600)
    rows = []
    for i, case in enumerate(VLLM_PARTS[part]):
        order = running if i % 2 == 0 else running[::-1]
        rows += alternate(host, order, case, f"vllm-{shape}", 610 + 10 * i + 100 * part,
                          tags={"shape": shape})
    out: dict[str, Any] = {"shape": shape, "rows": rows}
    if part == max(VLLM_PARTS):
        out["crosscheck_rows"] = alternate(host, running, Case(CROSSCHECKED.name, CROSSCHECKED.load),
                                           f"vllm-cross-{shape}", 690, tags={"shape": shape},
                                           client="crosscheck")
        out["gpu_gb_after"] = engine_memory(host, [tag(s, shape) for s in side_names(host)])
    return out


def step_stop(host: Host, budget_end: float, shape: str = "0.6b") -> dict[str, Any]:
    stopped = [tag(s, shape) for s in side_names(host) if tag(s, shape) in host.work.state["procs"]]
    for name in stopped:
        host.work.stop(name, 60)
    return {"stopped": stopped}
