"""FP8 against bf16, and the prefill attention backends, each behind its own gateway on one GPU.

- ``fp8``: the 4B and the 0.6B (random weights) and, when given (``--model minilm=DIR``), the
  bundled all-MiniLM-L6-v2 (real weights), each as a bf16 and an FP8 engine
  (``engine.quantization=fp8``). The quality gate (``embedserve quality``) compares their
  vectors and retrieval on the real-text corpus (``--quality-corpus``, or one built from
  python3-doc when the host has it); then the 4B pair is measured side by side through its gateways:
  throughput at 64 in flight, latency at 1 in flight, GPU memory of each engine.
- ``attention``: the 4B on FlashInfer (the default) against the other prefill backends
  SGLang 0.5.17 has for it on this GPU: FA3 (needs sgl_kernel's ``flash_ops``: the offline
  bundle fa3/pNN) and Triton; throughput, and the quality gate against FlashInfer's vectors.
  A backend whose kernels are missing is recorded as not run, with the reason.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import stacks
from loadgen import Load, Target
from procs import child_env, embedserve_cmd, http_get
from scenarios import MAIN_KV_POOL, Case, alternate, engine_memory, ready_engine
from stacks import Host

from embedserve.engines.sglang import fa3_installed
from embedserve.loadtest.quality.corpus import DEFAULT_HTML

# shape -> (bf16 engine port, fp8 engine port); gateways listen on engine port - 22000
FP8_PORTS = {"4b": (30400, 30401), "0.6b": (30402, 30403), "minilm": (30404, 30405)}
FP8_CASES = [
    Case("seed mix", Load("seed", 64, seconds=15), rounds=2),
    Case("seed mix, 1-16 inputs", Load("seed", 32, inputs="1-16", seconds=15)),
    Case("medium", Load("uniform:512-2048", 64, seconds=15)),
    Case("long", Load("uniform:8000-8191", 8, seconds=15)),
    Case("one in flight", Load("seed", 1, seconds=6, warmup=1), rounds=4),
]
ATTENTION_CASES = [Case(c.name, c.load, rounds=3) for c in (FP8_CASES[0], FP8_CASES[2], FP8_CASES[3])]


def gateway_port(engine_port: int) -> int:
    return engine_port - 22000


def fp8_shapes(host: Host) -> list[str]:
    return ["4b", "0.6b"] + (["minilm"] if "minilm" in host.models else [])


def _max_seq_length(host: Host, shape: str) -> int:
    """The model's own cap (all-MiniLM-L6-v2: 256 tokens) where it states one."""
    conf = Path(host.model(shape)) / "sentence_bert_config.json"
    own = json.loads(conf.read_text()).get("max_seq_length") if conf.exists() else None
    return min(int(own or host.cap), host.cap)


def _start_pair(host: Host, tag: str, shape: str, port: int, extra: dict[str, str]) -> None:
    """An engine and its gateway, both at the model's own cap (SGLang refuses a context
    longer than a BERT's position table)."""
    cap = {"EMBEDSERVE_MODEL__MAX_SEQ_LEN": str(_max_seq_length(host, shape))}
    if not host.work.running(f"engine-{tag}"):
        stacks.start_engine(host, f"engine-{tag}", shape, port, kv_pool=MAIN_KV_POOL, gpu=0,
                            extra=extra | cap)
    if not host.work.running(f"gateway-{tag}"):
        stacks.start_gateway(host, f"gateway-{tag}", shape, gateway_port(port), [port], extra=cap)


def _target(host: Host, tag: str, engine_port: int) -> Target:
    """The 4B gateway of the pair ``tag``, for a measured run."""
    pid = host.work.state["procs"][f"gateway-{tag}"]["pid"]
    return stacks.gateway_target(host, "4b", gateway_port(engine_port), [engine_port], pid)


def _tags(shape: str) -> tuple[str, str]:
    return f"{shape}-bf16", f"{shape}-fp8"


def step_fp8_engines(host: Host, budget_end: float) -> dict[str, Any]:
    """bf16 and FP8 engines (and a gateway each) for every shape, started together."""
    quant = {"EMBEDSERVE_ENGINE__QUANTIZATION": "fp8"}
    for shape in fp8_shapes(host):
        bf16, fp8 = _tags(shape)
        # FlashInfer's prefill has no head_dim 32 (MiniLM's): SGLang's BERT runs on Triton
        own = {"EMBEDSERVE_ENGINE__ATTENTION_BACKEND": "triton"} if shape == "minilm" and not host.cpu else {}
        _start_pair(host, bf16, shape, FP8_PORTS[shape][0], own)
        _start_pair(host, fp8, shape, FP8_PORTS[shape][1], own | ({} if host.cpu else quant))
    out: dict[str, Any] = {"ready_s": {}, "failed": {}}
    for shape in fp8_shapes(host):
        for tag, port in zip(_tags(shape), FP8_PORTS[shape], strict=True):
            try:
                out["ready_s"][tag] = ready_engine(host, f"engine-{tag}", port, budget_end)
                stacks.wait_ready(host, f"gateway-{tag}", "/health/ready", gateway_port(port), budget_end)
            except RuntimeError as exc:  # an engine that cannot run FP8 is a finding, not a crash
                out["failed"][tag] = str(exc)[-1500:]
                host.work.stop(f"gateway-{tag}", 10)
    out["engine_gpu_gb"] = engine_memory(host, [f"engine-{t}" for s in fp8_shapes(host) for t in _tags(s)])
    return out


def quality_corpus(host: Host) -> Path | None:
    """The gate's corpus: ``--quality-corpus``, else one built once from python3-doc into the
    work folder (300 passages on ``--device cpu``), else None."""
    if host.quality_corpus:
        return Path(host.quality_corpus)
    built = host.work.root / "quality-corpus.json"
    if not built.exists() and DEFAULT_HTML.is_dir():
        small = ["--max-passages", "300"] if host.cpu else []
        subprocess.run([*embedserve_cmd(), "quality-corpus", "--out", str(built), *small],
                       env=child_env(), capture_output=True, timeout=600, check=True)
    return built if built.exists() else None


def gate(host: Host, name: str, base_port: int, cand_port: int) -> dict[str, Any]:
    """``embedserve quality`` between two gateways: its report (also in --out's quality/NAME,
    with its summary.md), or why it did not run."""
    corpus = quality_corpus(host)
    if corpus is None:
        return {"not_run": f"no corpus: pass --quality-corpus FILE (embedserve quality-corpus) or "
                           f"install python3-doc ({DEFAULT_HTML})"}
    out = (host.out or host.work.root) / "quality" / name
    argv = [*embedserve_cmd(), "quality", "--baseline", f"http://127.0.0.1:{base_port}",
            "--candidate", f"http://127.0.0.1:{cand_port}", "--corpus", str(corpus), "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=1800, check=False)
    report = out / "quality.json"
    if done.returncode in (0, 1) and report.exists():
        return dict(json.loads(report.read_text()))
    return {"error": (done.stderr or done.stdout)[-1500:]}


def step_fp8_quality(host: Host, budget_end: float) -> dict[str, Any]:
    """``embedserve quality`` per shape, FP8 against bf16: per-input cosine, top-10 overlap and
    recall@10 / nDCG@10 on the real-text corpus."""
    out: dict[str, Any] = {}
    for shape in fp8_shapes(host):
        bf16, fp8 = _tags(shape)
        if not (host.work.running(f"gateway-{bf16}") and host.work.running(f"gateway-{fp8}")):
            out[shape] = {"not_run": "an engine of the pair did not start (see fp8-engines)"}
            continue
        out[shape] = gate(host, f"fp8-{shape}", gateway_port(FP8_PORTS[shape][0]),
                          gateway_port(FP8_PORTS[shape][1]))
    return out


def step_fp8_throughput(host: Host, budget_end: float) -> dict[str, Any]:
    """The 4B's bf16 and FP8 gateways side by side, alternating, unique inputs."""
    bf16, fp8 = _tags("4b")
    if not host.work.running(f"gateway-{fp8}"):
        return {"not_run": "the FP8 engine did not start (see fp8-engines)"}
    bf16_port, fp8_port = FP8_PORTS["4b"]
    sides = [("bf16", _target(host, bf16, bf16_port)), ("fp8", _target(host, fp8, fp8_port))]
    alternate(host, sides, Case("warm-up", Load("uniform:16-512", 64, seconds=8, warmup=0)), "fp8-warm", 480)
    rows = [r for i, case in enumerate(FP8_CASES)
            for r in alternate(host, sides, case, "fp8", 500 + 10 * i, tags={"shape": "4b"})]
    return {"rows": rows, "sides": ["bf16", "fp8"],
            "engine_gpu_gb": engine_memory(host, [f"engine-{bf16}", f"engine-{fp8}"])}


def step_fp8_stop(host: Host, budget_end: float) -> dict[str, Any]:
    tags = [f"{kind}-{t}" for s in FP8_PORTS for t in _tags(s) for kind in ("gateway", "engine")]
    return {"stopped": [t for t in tags if host.work.stop(t, 60) is not None]}


def fa3_missing() -> str | None:
    """SGLang's FA3 backend imports sgl_kernel.flash_ops (1.1 GB unpacked in sglang-kernel
    0.4.5's wheel); the offline bundles bring it in six parts (fa3/pNN)."""
    if fa3_installed():
        return None
    return "sgl_kernel/flash_ops.abi3.so is not installed (1.1 GB; stage the offline bundle fa3/pNN)"


def resolved_backends(port: int) -> dict[str, Any]:
    """The attention backends SGLang settled on (its own fallbacks may override the flag)."""
    status, body = http_get(f"http://127.0.0.1:{port}/server_info", timeout=10)
    if status != 200:
        return {"error": f"HTTP {status}"}
    info = json.loads(body)
    return {k: info.get(k) for k in ("attention_backend", "prefill_attention_backend",
                                      "decode_attention_backend")}


def step_attention(host: Host, budget_end: float) -> dict[str, Any]:
    """The 4B (bf16) behind a gateway on each chosen prefill backend (``--attention-backends``),
    against FlashInfer (the bf16 pair of the fp8 scenario, or one started here), alternating."""
    out: dict[str, Any] = {"not_run": {}, "rows": [], "resolved": {}}
    base_tag, base_port = _tags("4b")[0], FP8_PORTS["4b"][0]
    _start_pair(host, base_tag, "4b", base_port, {})
    backends = {name: port for name, port in (("fa3", 30410), ("triton", 30411))
                if name in host.attention_backends}
    if host.cpu:
        out["not_run"] = {b: "no attention backends on the CPU engine" for b in backends}
        return out
    if (why := fa3_missing()) is not None:
        out["not_run"]["fa3"] = why
        backends.pop("fa3")
    for name, port in backends.items():
        _start_pair(host, f"4b-{name}", "4b", port, {"EMBEDSERVE_ENGINE__ATTENTION_BACKEND": name})
    try:
        ready_engine(host, f"engine-{base_tag}", base_port, budget_end)
        stacks.wait_ready(host, f"gateway-{base_tag}", "/health/ready", gateway_port(base_port), budget_end)
        base = ("flashinfer", _target(host, base_tag, base_port))
        out["resolved"]["flashinfer"] = resolved_backends(base_port)
        for name, port in backends.items():
            try:
                ready = ready_engine(host, f"engine-4b-{name}", port, budget_end)
                out.setdefault("ready_s", {})[name] = ready
                stacks.wait_ready(host, f"gateway-4b-{name}", "/health/ready", gateway_port(port), budget_end)
            except RuntimeError as exc:
                out["not_run"][name] = str(exc)[-1500:]
                continue
            out["resolved"][name] = resolved_backends(port)
            side = (name, _target(host, f"4b-{name}", port))
            for i, case in enumerate(ATTENTION_CASES):
                out["rows"] += alternate(host, [base, side], case, f"attn-{name}",
                                         600 + 10 * i, tags={"shape": "4b", "backend_pair": name})
            quality = gate(host, f"attention-{name}", gateway_port(base_port), gateway_port(port))
            out.setdefault("quality", {})[name] = quality
    finally:
        for name in backends:
            for kind in ("gateway", "engine"):
                host.work.stop(f"{kind}-4b-{name}", 60)
    return out
