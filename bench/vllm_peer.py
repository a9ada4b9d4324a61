"""vLLM 0.26.0's pooling runner side by side with embedserve on one GPU: the same checkpoint,
the same texts, one run, sides alternating.

Every server of every shape starts at once on GPU 0 (their start-ups overlap, and with
``--until vllm-start`` they start while later bundles are still being staged), and each is
measured alone in turn:

- ``embedserve``: `embedserve up` with the product's defaults (engines per GPU ``auto``);
- ``embedserve VARIANT``: the same with one of :data:`VARIANTS` (``--embedserve-variants``):
  more or fewer engines per GPU, SGLang's ``tc_piecewise`` prefill graphs compiled by inductor,
  more tokenizer-manager workers;
- ``vllm``: `vllm serve CKPT --runner pooling` with vLLM's defaults, except the KV pool
  (``--kv-cache-memory-bytes``), so that all servers fit on the GPU: by default the same number
  of tokens as embedserve's engine, so that memory is compared for the same pool
  (``--vllm-kv-tokens`` gives it more); and chunked prefill off, the workaround vLLM's issue
  tracker gives for Qwen3-Embedding hanging with it on (it hung here too);
- ``vllm tuned``: plus what vLLM's issues recommend for embedding throughput:
  ``--max-num-batched-tokens`` = embedserve's batch budget and ``--api-server-count`` > 1
  (request parsing, tokenisation and responses spread over processes).

vLLM comes from its own folder (``--vllm-site``, bundle ``vllm/pNN``) in front of the suite's
PYTHONPATH. ``--vllm-cmd`` replaces ``python3 -m vllm.entrypoints.cli.main`` (a stub for dry runs:
bench/fake_vllm.py). Vectors are compared first: vLLM's, SGLang's (through the gateway) and a
transformers forward pass on the same texts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import profile_engine
import stacks
from loadgen import Load, Target
from procs import child_env, http_post_json, log_tail, port_busy
from scenarios import Case, alternate, engine_memory, runs_dir
from stacks import Host

HERE = Path(__file__).resolve().parent
BATCH_BUDGET = 16_384  # embedserve's engine.batch_token_budget (and its KV pool at cap 8192)
API_SERVERS = 4  # vllm tuned: --api-server-count
NO_CHUNKED_PREFILL = ["--no-enable-chunked-prefill"]  # both vLLM sides: see vllm_argv
SHAPES = ("0.6b", "4b")
# per shape: embedserve sides on BASE + 10 k (its engines on that + 22000, + 1, ...), vLLM on VLLM_BASE + 0/1
UP_BASE = {"0.6b": 8600, "4b": 8650}
VLLM_BASE = {"0.6b": 8700, "4b": 8720}
MAX_ENGINES_PER_SIDE = 4
# a request unanswered this long is an error: vLLM 0.26 once stopped making progress with 64
# requests in flight, and the default 300 s would hold every later run of the step
REQUEST_TIMEOUT_S = 60.0
TC_PIECEWISE = ["--cuda-graph-backend-prefill", "tc_piecewise", "--cuda-graph-tc-compiler", "inductor"]
#: embedserve's variants, as an operator sets them: settings on top of the defaults, and
#: SGLang flags appended through ``engine.extra_args``
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "x1": ({"EMBEDSERVE_ENGINE__ENGINES_PER_GPU": "1"}, []),
    "x2": ({"EMBEDSERVE_ENGINE__ENGINES_PER_GPU": "2"}, []),
    "x3": ({"EMBEDSERVE_ENGINE__ENGINES_PER_GPU": "3"}, []),
    "graphs": ({}, TC_PIECEWISE),
    "tokenizer-workers": ({}, ["--tokenizer-worker-num", "2"]),
    "nokv": ({"EMBEDSERVE_ENGINE__KV_CACHE": "none"}, []),
}
UP_EXTRA = {"EMBEDSERVE_GATEWAY__MAX_TOKENS_IN_FLIGHT": "1048576",  # admission control off
            "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "300",
            # a dozen servers share the GPU: no replacement on the forecast mid-run
            "EMBEDSERVE_HEALTH__REPLACE_ENGINES": "false"}
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


def variant_env(variant: str) -> dict[str, str]:
    """One variant, or several joined by ``+`` (``x2+graphs``): their settings together, SGLang's
    extra flags concatenated."""
    env: dict[str, str] = {}
    extra: list[str] = []
    for part in variant.split("+"):
        if part not in VARIANTS:
            raise ValueError(f"unknown embedserve variant {part!r}; known: {', '.join(VARIANTS)}")
        settings, flags = VARIANTS[part]
        env |= settings
        extra += flags
    if extra:
        env["EMBEDSERVE_ENGINE__EXTRA_ARGS"] = json.dumps(extra)
    return env


def side_ports(host: Host, shape: str) -> dict[str, int]:
    """Every side of a shape and its port: embedserve's first, then vLLM's."""
    ups = ["embedserve", *(f"embedserve {v}" for v in host.embedserve_variants)]
    out = {side: UP_BASE[shape] + 10 * k for k, side in enumerate(ups)}
    vllm = {"vllm": VLLM_BASE[shape], "vllm tuned": VLLM_BASE[shape] + 1}
    return out | {side: port for side, port in vllm.items() if side in host.vllm_sides}


def is_vllm(side: str) -> bool:
    return side.startswith("vllm")


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
    kv_tokens = host.vllm_kv_tokens or max(BATCH_BUDGET, 2 * host.cap)
    argv = [*base, "serve", model, "--runner", "pooling", "--served-model-name", Path(model).name,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(host.cap),
            "--dtype", "float32" if host.cpu else "bfloat16",
            # the same KV pool as embedserve's engine; the utilisation only gates the start-up
            # check of free memory, which a dozen servers on one GPU would otherwise fail
            "--kv-cache-memory-bytes", str(kv_pool_bytes(model, kv_tokens)),
            "--gpu-memory-utilization", "0.1",
            # chunked prefill (vLLM's default) hangs Qwen3-Embedding under mixed lengths
            # (vllm-project/vllm#47971; here: 1 request running, 63 waiting, 0 tokens/s)
            *NO_CHUNKED_PREFILL]
    if tuned:
        argv += ["--max-num-batched-tokens", str(BATCH_BUDGET), "--api-server-count", str(API_SERVERS)]
    return argv


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


def up_engine_ports(port: int) -> list[int]:
    """The engines an `up` stack listens on (port + 22000, + 1, ...): engines per GPU ``auto``
    decides how many."""
    found = [p for p in range(port + 22000, port + 22000 + MAX_ENGINES_PER_SIDE) if port_busy(p)]
    return found or [port + 22000]


def target_of(host: Host, side: str, shape: str, port: int) -> Target:
    if is_vllm(side):
        url = f"http://127.0.0.1:{port}"
        return Target(url, host.model(shape), raw=False, engine_urls=[url], cap=host.cap,
                      timeout_s=REQUEST_TIMEOUT_S)
    pid = host.work.state["procs"][tag(side, shape)]["pid"]
    return stacks.gateway_target(host, shape, port, up_engine_ports(port), pid)


def sides(host: Host, shape: str) -> list[tuple[str, Target]]:
    """The sides running now, in the fixed order: embedserve first."""
    return [(side, target_of(host, side, shape, port)) for side, port in side_ports(host, shape).items()
            if host.work.running(tag(side, shape))]


def step_start(host: Host, budget_end: float, shapes: tuple[str, ...] = SHAPES) -> dict[str, Any]:
    """Every side of every shape at once on GPU 0, without waiting (``vllm-ready-SHAPE`` waits):
    what is running already stays, a side that failed before is not tried again, and vLLM's
    sides wait for a later pass (``--redo vllm-start``) while vLLM does not import."""
    st = host.work.state
    failed = st.setdefault("vllm_failed_sides", [])
    out: dict[str, Any] = {"started": [], "running": [], "not_run": {}, "settings": {}}
    no_vllm = vllm_missing(host)
    for shape in shapes:
        for side, port in side_ports(host, shape).items():
            name = tag(side, shape)
            if host.work.running(name):
                out["running"].append(name)
                continue
            if name in failed:
                out["not_run"][name] = "failed to start earlier in this run"
                continue
            if is_vllm(side):
                if no_vllm:
                    out["not_run"][name] = f"vLLM not importable from {host.vllm_site}: {no_vllm}"
                    continue
                stacks.free_port(port)
                argv = vllm_argv(host, shape, port, tuned=side == "vllm tuned")
                host.work.start(name, argv, vllm_env(host))
            else:
                variant = side.removeprefix("embedserve").strip()
                extra = UP_EXTRA | (variant_env(variant) if variant else {})
                stacks.start_up(host, name, shape, port, engine_port=port + 22000,
                                extra=extra | ({} if host.cpu else {"CUDA_VISIBLE_DEVICES": "0"}))
                out["settings"][name] = extra  # beyond the model, its cap and ports
            out["started"].append(name)
    return out


def step_ready(host: Host, budget_end: float, shape: str = "0.6b") -> dict[str, Any]:
    """This shape's sides waited on at once (each its own ready time); then each one's command
    line, start-up facts and GPU memory. A side that cannot start is a finding; the others go on."""
    ports = side_ports(host, shape)
    out: dict[str, Any] = {"shape": shape, "not_run": {}, "argv": {}, "ready_s": {}, "settings": {}}
    start = host.work.state["steps"].get("vllm-start", {})
    for side in ports:
        name = tag(side, shape)
        if name in (start.get("not_run") or {}) and not host.work.running(name):
            out["not_run"][side] = start["not_run"][name]
        if name in (start.get("settings") or {}):
            out["settings"][side] = start["settings"][name]

    def ready(side: str, port: int) -> float:
        up_side = not is_vllm(side)
        return stacks.wait_ready(host, tag(side, shape), "/health/ready" if up_side else "/health", port,
                                 budget_end, banner="embedserve is up" if up_side else None)

    started = [(s, p) for s, p in ports.items() if host.work.running(tag(s, shape))]
    with ThreadPoolExecutor(len(started) or 1) as pool:
        waits = {side: pool.submit(ready, side, port) for side, port in started}
    for side, _ in started:
        name = tag(side, shape)
        out["argv"][side] = host.work.state["procs"][name]["argv"]
        try:
            out["ready_s"][side] = waits[side].result()  # TimeoutError: the next slice goes on
        except RuntimeError as exc:
            out["not_run"][side] = str(exc)[-1500:]
            host.work.state.setdefault("vllm_failed_sides", []).append(name)
            host.work.stop(name, 30)
            continue
        if is_vllm(side):
            log = Path(host.work.state["procs"][name]["log"])
            out.setdefault("vllm_facts", {})[side] = vllm_log_facts(log)
        else:
            out.setdefault("engines", {})[side] = len(up_engine_ports(ports[side]))
    out["gpu_gb_idle"] = engine_memory(host, [tag(s, shape) for s in ports])
    out["fi_cache_tgz_mb"] = stacks.pack_fi_cache(host)
    return out


def step_profile(host: Host, budget_end: float, shape: str = "0.6b") -> dict[str, Any]:
    """Where the time goes on embedserve's default side: its first engine's torch profile (GPU
    kernels by kind, gaps between them) and py-spy over the gateway and that engine's SGLang
    processes, under the seed mix at 64 in flight."""
    side, port = "embedserve", side_ports(host, shape)["embedserve"]
    if not host.work.running(tag(side, shape)):
        return {"skipped": f"{tag(side, shape)} is not running"}
    target = target_of(host, side, shape, port)
    return profile_engine.profile_under_load(
        target, Load("seed", 64, seconds=24, warmup=2), host.work.root / "profiles-vllm" / shape,
        gateway_port=port, engine_port=port + 22000, runs=runs_dir(host))


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
    order reversed every other case and round; a side that answers nothing in a case has
    stalled and is stopped, so it does not hold up the rest. The last part adds one
    crosscheck.py run per side and each server's GPU memory after the runs; on the 0.6B,
    part 1 also measures the client itself (loadtest building inputs on one thread)."""
    running = sides(host, shape)
    if len(running) < 2:
        return {"skipped": f"fewer than two sides running for {shape}: {[s for s, _ in running]}"}
    warm = Case("warm-up", Load("uniform:16-512", 32, seconds=6, warmup=0))
    alternate(host, running, warm, f"vllm-warm-{shape}-{part}", 600)
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"shape": shape, "rows": rows, "stalled": {}}
    for i, case in enumerate(VLLM_PARTS[part]):
        order = running if i % 2 == 0 else running[::-1]
        case_rows = alternate(host, order, case, f"vllm-{shape}", 610 + 10 * i + 100 * part,
                              tags={"shape": shape})
        rows += case_rows
        for side in stalled_sides(case_rows):
            out["stalled"][side] = f"no answer in {case.name!r}: stopped"
            host.work.stop(tag(side, shape), 30)
            host.work.state.setdefault("vllm_failed_sides", []).append(tag(side, shape))
        running = [(s, t) for s, t in running if s not in out["stalled"]]
    if part == 1 and shape == "0.6b":
        out["client_rows"] = client_check(host, dict(running).get("embedserve"))
    if part == max(VLLM_PARTS) and running:
        out["crosscheck_rows"] = alternate(host, running, Case(CROSSCHECKED.name, CROSSCHECKED.load),
                                           f"vllm-cross-{shape}", 690, tags={"shape": shape},
                                           client="crosscheck")
        out["gpu_gb_after"] = engine_memory(host, [tag(s, shape) for s in side_ports(host, shape)])
    return out


def stalled_sides(rows: list[dict[str, Any]]) -> list[str]:
    """Sides with no answered request in any round of a case."""
    answered: dict[str, int] = {}
    for r in rows:
        answered[r["side"]] = answered.get(r["side"], 0) + (r.get("requests") or 0)
    return [side for side, n in answered.items() if n == 0]


def client_check(host: Host, target: Target | None) -> list[dict[str, Any]]:
    """The seed mix on embedserve's defaults with loadtest building inputs on one thread and
    with its default build processes, alternating: what the client alone caps."""
    if target is None:
        return []
    seed_mix = VLLM_CASES[2].load
    return alternate(host, [("client one build thread", target), ("client build processes", target)],
                     Case(VLLM_CASES[2].name, seed_mix, rounds=2), "vllm-client", 720,
                     tags={"shape": "0.6b"},
                     loads={"client one build thread": dataclasses.replace(seed_mix, build_workers=0)})


def step_stop(host: Host, budget_end: float, shape: str = "0.6b") -> dict[str, Any]:
    stopped = [tag(s, shape) for s in side_ports(host, shape) if tag(s, shape) in host.work.state["procs"]]
    for name in stopped:
        host.work.stop(name, 60)
    return {"stopped": stopped}
