"""The one configuration becomes SGLang's command line and environment.

``build_launch(settings)`` is used by the supervisor (``embedserve up``) and by
``embedserve engine [--dry-run]``. One number, the service's max sequence length
(``ModelInfo.max_seq_len``, the gateway's truncation limit too), drives:

* ``--context-length`` = cap + 1 (SGLang 0.5.17 rejects an input of exactly its context
  length, so the longest input the gateway sends must be one shorter; every model runs with
  ``--is-embedding``, where none of the context is kept for output);
* ``--chunked-prefill-size`` and ``--max-prefill-tokens`` = the batch token budget, raised
  to the cap so that one capped input always fits one prefill;
* ``--max-total-tokens`` (the KV pool) = ``engine.kv_pool_tokens``, else the budget (twice
  with ``engine.overlap_schedule``) and at least 2 x cap, instead of SGLang's default of ~0.8
  of the GPU.

Every flag used here exists in SGLang 0.5.17's parser: tests check the argv against the
list extracted from it (``tests/fixtures/sglang_0.5.17_flags.json``). See docs/SGLANG.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from embedserve.config import Settings, load_settings
from embedserve.contracts.launch import LaunchSpec
from embedserve.engines.forward import LaunchConfigError, resolve_engine
from embedserve.engines.sizing import EnginesPlan, ModelShape, SizingError, plan_engines_per_gpu
from embedserve.model_info import ModelInfo
from embedserve.nvml import gpu_compute_capability, gpu_total_bytes

SGLANG_VERSION = "0.5.17"
ALLOC_CONF = "expandable_segments:True"


def default_kv_pool_tokens(cap: int, budget: int, batches: int = 1) -> int:
    """One full prefill batch per batch in the engine, and at least two capped inputs: an
    embedding server frees a sequence's KV right after its forward pass, so a larger pool only
    holds memory (for the 4B: about 14 GB in use with 16,384 tokens, against 21 GB with 65,536).
    The overlap scheduler builds the next batch while the last one still holds its slots."""
    return max(batches * budget, 2 * cap)


def batches_in_engine(settings: Settings) -> int:
    """Two with the overlap scheduler (one on the GPU, one being built), else one (``auto`` not yet
    resolved counts one: where it resolves to on, kv_cache is none and the pool holds no memory)."""
    return 2 if settings.engine.overlap_schedule is True else 1


def kv_pool_tokens(settings: Settings, cap: int) -> int:
    eng = settings.engine
    budget = max(eng.batch_token_budget, cap)
    if eng.kv_pool_tokens is not None:
        return eng.kv_pool_tokens
    return default_kv_pool_tokens(cap, budget, batches_in_engine(settings))


def plan_engines(settings: Settings, info: ModelInfo, gpu_bytes: int | None = None) -> EnginesPlan:
    """``engine.engines_per_gpu`` resolved for this model and GPU (``gpu_bytes`` overrides
    the NVML lookup). Raises ``LaunchConfigError`` when an explicit number cannot fit."""
    eng = settings.engine
    cap = info.max_seq_len
    try:
        return plan_engines_per_gpu(
            None if eng.engines_per_gpu == "auto" else eng.engines_per_gpu,
            ModelShape.read(info.config),
            kv_pool_tokens=kv_pool_tokens(settings, cap),
            batch_tokens=max(eng.batch_token_budget, cap),
            quantization=eng.quantization,
            gpu_total_bytes=gpu_bytes if gpu_bytes is not None else gpu_total_bytes(),
            mem_fraction_static=eng.mem_fraction_static,
        )
    except SizingError as exc:
        raise LaunchConfigError(str(exc)) from exc


def mem_fraction(settings: Settings, total_bytes: int | None, notes: list[str]) -> float:
    """``--mem-fraction-static``, lowered to ``gpu_memory_budget_gb`` / GPU size if set.

    In 0.5.17 the fraction bounds weights + KV pool (the pool is then cut to
    ``--max-total-tokens``); SGLang refuses to start if the weights do not fit it.
    """
    eng = settings.engine
    frac = eng.mem_fraction_static
    if eng.gpu_memory_budget_gb is None:
        return frac
    if not total_bytes:
        notes.append(
            "gpu_memory_budget_gb is set but no GPU was found (NVML): "
            f"using mem_fraction_static={frac}"
        )
        return frac
    budget_frac = eng.gpu_memory_budget_gb * 1e9 / total_bytes
    if budget_frac < frac:
        notes.append(
            f"gpu_memory_budget_gb={eng.gpu_memory_budget_gb} of {total_bytes / 1e9:.1f} GB: "
            f"mem_fraction_static {frac} -> {budget_frac:.3f}"
        )
        frac = budget_frac
    return float(f"{max(frac, 0.01):.3f}")


def fa3_installed() -> bool:
    """Whether sgl-kernel carries FA3 (``sgl_kernel/flash_ops.abi3.so``, 1.1 GB: the PyPI
    wheel has it, slimmed installs may not). Found on disk, without importing torch."""
    spec = importlib.util.find_spec("sgl_kernel")
    locations = (spec.submodule_search_locations or []) if spec else []
    return any(Path(p, "flash_ops.abi3.so").exists() for p in locations)


def engine_env(settings: Settings) -> dict[str, str]:
    """What the SGLang processes (and so our plugin in each scheduler) get on top of the
    parent's environment: this launch's settings whole (the plugin activates only where
    they say ``engine.kind`` is sglang, i.e. in engines started through this launcher)."""
    eng = settings.engine
    env = {
        "PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF,
        **settings.with_engine(kind="sglang").child_env(),
    }
    if eng.flashinfer_cache_dir:
        base = os.path.abspath(os.path.expanduser(eng.flashinfer_cache_dir))
        # flashinfer 0.6.15 jit/env.py: cache = $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer
        env["FLASHINFER_WORKSPACE_BASE"] = base
        # Triton and Inductor caches (CUDA-graph / compile warm-up) on the same volume
        env["TRITON_CACHE_DIR"] = os.path.join(base, "triton")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, "inductor")
    return env


def model_mode(info: ModelInfo) -> list[str]:
    """``--is-embedding`` for every model: embedding models, cross-encoders (their pooled logit
    comes back from ``/encode``) and Qwen3-Reranker (the plugin's score head gives its label logit
    from ``/encode`` as well: ``label_head.py``). ``LaunchConfigError`` for a cross-encoder that
    reads segment types: SGLang 0.5.17 takes token type ids only from text it tokenises itself,
    and token ids come with none; for a model without a dense vector (SPLADE:
    ``contracts/hybrid.SGLANG_OUTPUTS``)."""
    if "dense" not in info.outputs:
        raise LaunchConfigError(
            f"{info.path} gives {', '.join(info.outputs)} vectors only, which SGLang 0.5.17 does not serve "
            "(it gives a model's dense vector): serve it on the CPU engine (engine.kind=cpu)"
        )
    if info.scoring == "cross-encoder":
        config = info.config
        if int(config.get("type_vocab_size") or 1) > 1:
            raise LaunchConfigError(
                f"{info.path} is a cross-encoder that reads token type ids (type_vocab_size "
                f"{config['type_vocab_size']}), which SGLang 0.5.17 takes only from text it tokenises "
                "itself, not with token ids: serve it on the CPU engine (engine.kind=cpu), or choose one "
                "with a single segment type (the XLM-R bge-rerankers)"
            )
        if (kind := config.get("position_embedding_type")) != "absolute":  # SGLang's embeddings read it
            raise LaunchConfigError(
                f"{info.path / 'config.json'} has position_embedding_type {kind!r}; SGLang 0.5.17 serves "
                'cross-encoders with "absolute" only (transformers 5 no longer saves the key: add '
                '"position_embedding_type": "absolute" where the model\'s positions are absolute)'
            )
    return ["--is-embedding"]


def build_launch(
    settings: Settings,
    *,
    python: str | None = None,
    gpu_bytes: int | None = None,
    gpu_capability: tuple[int, int] | None = None,
    fa3: bool | None = None,
    info: ModelInfo | None = None,
) -> LaunchSpec:
    """SGLang's argv and the environment to add, from the settings with their ``auto`` values
    resolved (``resolve_engine``; the engine's environment carries them resolved, so the plugin
    sees what was launched). ``gpu_bytes`` (used only when ``engine.gpu_memory_budget_gb`` is
    set), ``gpu_capability`` and ``fa3`` override the lookups of the GPU and sgl-kernel."""
    notes: list[str] = []
    info = info or ModelInfo.load(settings.model)
    auto_backend = settings.engine.attention_backend == "auto"
    settings = resolve_engine(
        settings, info, notes, gpu_capability if gpu_capability is not None else gpu_compute_capability(),
        (fa3 if fa3 is not None else fa3_installed()) if auto_backend else False)
    model, eng = settings.model, settings.engine
    cap = info.max_seq_len
    budget = max(eng.batch_token_budget, cap)
    if budget != eng.batch_token_budget:
        notes.append(f"batch_token_budget {eng.batch_token_budget} < max_seq_len {cap}: using {cap}")
    kv = kv_pool_tokens(settings, cap)
    if kv < budget:
        raise LaunchConfigError(
            f"engine.kv_pool_tokens={kv} cannot hold one prefill batch of {budget} tokens "
            f"(max_seq_len {cap}, batch_token_budget {eng.batch_token_budget})"
        )
    if eng.gpu_memory_budget_gb is not None and gpu_bytes is None:
        gpu_bytes = gpu_total_bytes()
    frac = mem_fraction(settings, gpu_bytes, notes)
    backend, kv_cache = eng.attention_backend, eng.kv_cache

    argv = [
        python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(info.path),
        "--served-model-name", model.served_name,
        "--host", eng.host,
        "--port", str(eng.port),
        *model_mode(info),
        "--skip-tokenizer-init",
        "--attention-backend", backend,
        "--dtype", eng.dtype,
        "--context-length", str(cap + 1),
        # no KV cache: each request in one forward, so K/V never outlives it
        "--chunked-prefill-size", str(budget) if kv_cache == "paged" else "-1",
        "--max-prefill-tokens", str(budget),
        "--max-total-tokens", str(kv),
        "--max-running-requests", str(eng.max_running_requests * batches_in_engine(settings)),
        "--mem-fraction-static", repr(frac),
        "--enable-metrics",  # the prefix-cache counters the gateway re-exports
        # on with the embedding-only forward; off, each batch waits for the last one's results
        *([] if eng.overlap_schedule else ["--disable-overlap-schedule"]),
        # an idle scheduler otherwise spins a CPU core at 100%: with several engines per GPU
        # that is CPU taken from the busy engines, and under a CPU limit from the gateway
        "--sleep-on-idle",
        "--log-level", settings.log_level.lower(),
    ]
    if not eng.prefix_cache:
        argv.append("--disable-radix-cache")
    if kv_cache == "none":
        # SGLang sizes its prefill CUDA graphs from --chunked-prefill-size, which is -1 here: without
        # a size it captured none, and small batches ran eagerly (engine.prefill_graph_tokens)
        argv.append("--prefill-only-disable-kv-cache")
    if eng.prefill_graph_tokens != "auto":  # resolved to a number wherever kv_cache is none
        argv += ["--cuda-graph-max-bs-prefill", str(eng.prefill_graph_tokens)]
    if eng.quantization != "none":
        argv += ["--quantization", eng.quantization]
    if model.matryoshka_dimensions:
        override = {"matryoshka_dimensions": sorted(set(model.matryoshka_dimensions))}
        argv += ["--json-model-override-args", json.dumps(override, separators=(",", ":"))]
    argv += list(eng.extra_args)
    return LaunchSpec(argv=argv, env=engine_env(settings), notes=notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="embedserve engine",
        description="Run SGLang as configured by EMBEDSERVE_* (see docs/SGLANG.md).",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the command and environment")
    ap.add_argument("--json", action="store_true", help="with --dry-run: as JSON")
    args = ap.parse_args(argv)
    try:
        spec = build_launch(load_settings())
    except LaunchConfigError as exc:
        print(f"embedserve engine: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        if args.json:
            print(json.dumps({"argv": spec.argv, "env": spec.env, "notes": spec.notes}, indent=2))
            return 0
        for note in spec.notes:
            print(f"# note: {note}")
        print("# environment added to the parent's:")
        for line in spec.env_lines():
            print(line)
        print("# command:")
        print(spec.command_line())
        return 0
    for note in spec.notes:
        print(f"embedserve engine: {note}", file=sys.stderr)
    os.execvpe(spec.argv[0], spec.argv, {**os.environ, **spec.env})
    return 127  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
