"""Which forward SGLang runs, and why: every ``auto`` of the engine's forward resolved from the GPU,
sgl-kernel and the model (docs/SGLANG.md, "The embedding-only forward"). On Hopper, for an
unquantised Qwen3 embedding model or Qwen3-Reranker with the prefix cache off, that is no KV pool
(``kv_cache=none``), the overlap scheduler, the pooled last layer, the queries read in place and
prefill graphs sized by the model's width; elsewhere the paged path."""

from __future__ import annotations

from embedserve.config import Settings
from embedserve.model_info import ModelInfo


class LaunchConfigError(ValueError):
    """The settings cannot make a working SGLang launch."""


def compiles_prefill(extra_args: list[str]) -> bool:
    """Whether SGLang's tc_piecewise prefill graphs are asked for: they compile the forward the
    pooled last layer hooks."""
    return any("tc_piecewise" in arg for arg in extra_args)


def refuse_beside_compiled_prefill(setting: str, extra_args: list[str]) -> None:
    """A setting that hooks the forward cannot run where SGLang's tc_piecewise graphs compile it."""
    if compiles_prefill(extra_args):
        raise LaunchConfigError(f"{setting} does not go with SGLang's tc_piecewise prefill graphs "
                                "(engine.extra_args), which compile the forward it hooks: drop one")


def last_token_qwen3(info: ModelInfo) -> bool:
    """A Qwen3 model whose output is read from each sequence's last token: Qwen3-Embedding's
    vector, or Qwen3-Reranker's label logit (``label_head.py``)."""
    return info.is_qwen3 and info.scoring in ("cosine", "qwen3-reranker")


def check_pooled_last_layer(info: ModelInfo, extra_args: list[str]) -> None:
    """``engine.pooled_last_layer`` needs what its hooks assume (embedserve/engines/pooled_layer.py)."""
    if not last_token_qwen3(info):
        what = "not a Qwen3 model" if not info.is_qwen3 else "a cross-encoder"
        raise LaunchConfigError(f"engine.pooled_last_layer needs a Qwen3 embedding model or Qwen3-Reranker "
                                f"(last-token pooling), but {info.path} is {what}: turn it off")
    refuse_beside_compiled_prefill("engine.pooled_last_layer", extra_args)


def check_compiled_qk_norm_rope(info: ModelInfo, extra_args: list[str]) -> None:
    """``engine.compiled_qk_norm_rope`` hooks the Qwen3 attention (embedserve/engines/compiled_qk.py)."""
    if info.model_type != "qwen3":  # Qwen3-MoE's attention is another class
        raise LaunchConfigError(f"engine.compiled_qk_norm_rope needs a dense Qwen3 model, but {info.path} is "
                                f"{info.model_type!r}: turn it off")
    refuse_beside_compiled_prefill("engine.compiled_qk_norm_rope", extra_args)


def check_vectorised_cross_encoder(settings: Settings, info: ModelInfo) -> None:
    """``engine.vectorised_cross_encoder`` needs what its hooks assume (embedserve/engines/cross_encoder.py):
    SGLang's XLM-R cross-encoder, whose sequences all start at position 0 (no prefix cache)."""
    if "XLMRobertaForSequenceClassification" not in (info.config.get("architectures") or []):
        raise LaunchConfigError(f"engine.vectorised_cross_encoder needs an XLM-R cross-encoder (XLMRoberta"
                                f"ForSequenceClassification), but {info.path} is not one: turn it off")
    if settings.engine.prefix_cache:
        raise LaunchConfigError("engine.vectorised_cross_encoder needs engine.prefix_cache off (each "
                                "sequence's positions count from 0): turn one off")


def describe_gpu(capability: tuple[int, int] | None) -> str:
    return "no GPU was found (NVML)" if capability is None else \
        f"the GPU has compute capability {capability[0]}.{capability[1]}"


def auto_attention_backend(capability: tuple[int, int] | None, fa3: bool, notes: list[str]) -> str:
    """FA3 on Hopper (compute capability 9.x) when its kernels are installed, else FlashInfer.
    On an H200 both run the same FA3 arithmetic for an embedding batch (FlashInfer picks its
    own sm90 kernels), and SGLang's fa3 backend was 0-3% faster; other GPUs were not
    measured, so they keep FlashInfer."""
    if capability is not None and capability[0] == 9:
        if fa3:
            notes.append(f"attention_backend auto: fa3, because {describe_gpu(capability)} and "
                         "sgl-kernel has its FA3 kernels")
            return "fa3"
        notes.append("attention_backend auto: Hopper GPU but sgl-kernel has no FA3 kernels "
                     "(flash_ops.abi3.so): using flashinfer")
        return "flashinfer"
    notes.append(f"attention_backend auto: flashinfer, because {describe_gpu(capability)}, not 9.x"
                 if capability else f"attention_backend auto: flashinfer, because {describe_gpu(capability)}")
    return "flashinfer"


#: SGLang's prefill backends that attend over a batch's raw K/V (its fa_skip_kv_cache path)
RAW_KV_BACKENDS = ("fa3", "fa4")


def embedding_only_blocker(
    settings: Settings, info: ModelInfo, backend: str, capability: tuple[int, int] | None
) -> str | None:
    """Why the embedding-only forward (no KV pool, overlap scheduler, pooled last layer) is not the
    default here, or None where it is: where SGLang 0.5.17 allows no KV pool (an FA prefill backend,
    no radix cache) and where it was measured (Qwen3 embedding models and Qwen3-Reranker in bf16 on
    Hopper)."""
    eng = settings.engine
    if backend not in RAW_KV_BACKENDS:
        return f"attention backend {backend!r} is not fa3 or fa4"
    if eng.prefix_cache:
        return "engine.prefix_cache is on"
    if capability is None or capability[0] != 9:
        return f"{describe_gpu(capability)}, not 9.x (measured on Hopper only)"
    if not last_token_qwen3(info):
        return f"{info.path.name} is not a Qwen3 embedding model or Qwen3-Reranker (measured on those only)"
    if eng.quantization != "none":
        return (f"engine.quantization is {eng.quantization} (its vectors were not compared with the "
                "embedding-only forward's yet)")
    return None


def resolve_kv_cache(settings: Settings, info: ModelInfo, backend: str,
                     capability: tuple[int, int] | None, notes: list[str]) -> str:
    """``engine.kv_cache`` as launched: ``paged`` or ``none``; ``none`` only where SGLang 0.5.17
    allows it (server_args.py: an FA prefill backend, no radix cache)."""
    eng = settings.engine
    if eng.kv_cache == "none" and (backend not in RAW_KV_BACKENDS or eng.prefix_cache):
        why_not = embedding_only_blocker(settings, info, backend, capability)
        raise LaunchConfigError(f"engine.kv_cache=none needs the fa3 or fa4 attention backend and "
                                f"engine.prefix_cache off, but {why_not}")
    if eng.kv_cache != "auto":
        return eng.kv_cache
    if why_not := embedding_only_blocker(settings, info, backend, capability):
        notes.append(f"kv_cache auto: paged, because {why_not}")
        return "paged"
    notes.append(f"kv_cache auto: none (no KV pool), because {describe_gpu(capability)}, the attention "
                 f"backend is {backend}, engine.prefix_cache is off and {info.path.name} is a Qwen3 "
                 "embedding model or Qwen3-Reranker, unquantised")
    return "none"


def resolve_overlap_schedule(asked: bool | str, kv_cache: str, notes: list[str]) -> bool:
    """``auto``: on with no KV pool (two batches in the engine cost no KV memory); off with the
    paged pool, where it measured 0.95-1.02x the defaults and doubled the pool (docs/PERFORMANCE.md)."""
    if asked != "auto":
        return bool(asked)
    if kv_cache == "none":
        notes.append("overlap_schedule auto: on, because kv_cache is none (the next batch is built "
                     "while the GPU runs the current one, at no KV memory)")
        return True
    notes.append("overlap_schedule auto: off, because kv_cache is paged (it would double the KV pool)")
    return False


def resolve_pooled_last_layer(asked: bool | str, kv_cache: str, info: ModelInfo,
                              extra_args: list[str], notes: list[str]) -> bool:
    """``auto``: on with the embedding-only forward (kv_cache none on a Qwen3 embedding model),
    where nothing asks for the compiled prefill graphs it cannot go with; ``True`` is checked."""
    if asked is True:
        check_pooled_last_layer(info, extra_args)
    if asked != "auto":
        return bool(asked)
    why_not = (f"{info.path.name} is not a Qwen3 embedding model or Qwen3-Reranker"
               if not last_token_qwen3(info)
               else "engine.extra_args asks for tc_piecewise prefill graphs" if compiles_prefill(extra_args)
               else "kv_cache is paged" if kv_cache != "none" else None)
    notes.append(f"pooled_last_layer auto: off, because {why_not}" if why_not else
                 "pooled_last_layer auto: on, because kv_cache is none on a last-token Qwen3 model")
    return why_not is None


def resolve_strided_query(asked: bool | str, kv_cache: str, backend: str, extra_args: list[str],
                          notes: list[str]) -> bool:
    """``auto``: on with the embedding-only forward on FA3, the only branch its hook stands in for
    (embedserve/engines/strided_query.py), unless SGLang's compiled prefill graphs are asked for
    (not measured together); ``True`` where it cannot run is refused."""
    fits = kv_cache == "none" and backend == "fa3"
    if asked is True and not fits:
        raise LaunchConfigError(f"engine.strided_query needs the embedding-only forward on FA3 (kv_cache "
                                f"none, attention_backend fa3), but kv_cache is {kv_cache} and the "
                                f"attention backend {backend}: turn it off")
    if asked != "auto":
        notes.append(f"strided_query: {'on' if asked else 'off'}, as asked")
        return bool(asked)
    why_not = (f"kv_cache is {kv_cache} and the attention backend {backend}" if not fits
               else "engine.extra_args asks for tc_piecewise prefill graphs" if compiles_prefill(extra_args)
               else None)
    notes.append(f"strided_query auto: off, because {why_not}" if why_not else "strided_query auto: on, "
                 "because kv_cache is none on FA3 (FA3 reads each layer's queries in place)")
    return why_not is None


#: prefill CUDA graphs up to this many tokens for models at least LARGE_HIDDEN wide (docs/PERFORMANCE.md)
GRAPH_TOKENS_LARGE, LARGE_HIDDEN = 4096, 2560


def resolve_prefill_graph_tokens(settings: Settings, kv_cache: str, info: ModelInfo,
                                 notes: list[str]) -> int | str:
    """``auto``: 4,096 tokens for a model of the 4B's width or wider (larger batches unpadded, where
    cuBLAS tiles them better and a forward outlasts its launches), else the batch budget; ``auto``
    stays for the paged path, where SGLang sizes its graphs from the chunked-prefill size."""
    asked = settings.engine.prefill_graph_tokens
    budget = max(settings.engine.batch_token_budget, info.max_seq_len)
    if asked != "auto":
        if int(asked) > budget:
            raise LaunchConfigError(f"engine.prefill_graph_tokens={asked} is over the engine's batch "
                                    f"budget of {budget} tokens, which no batch exceeds: give at most "
                                    f"{budget}, or auto")
        notes.append(f"prefill_graph_tokens: {asked}, as asked")
        return asked
    if kv_cache != "none":
        return asked
    if compiles_prefill(list(settings.engine.extra_args)):
        notes.append(f"prefill_graph_tokens auto: {budget} (the batch budget), because engine.extra_args "
                     "asks for tc_piecewise prefill graphs")
        return budget
    hidden = int(info.config.get("hidden_size") or 0)
    if hidden >= LARGE_HIDDEN:
        notes.append(f"prefill_graph_tokens auto: {min(GRAPH_TOKENS_LARGE, budget)}, because the hidden "
                     f"size is {hidden} (larger batches run unpadded, without a graph)")
        return min(GRAPH_TOKENS_LARGE, budget)
    notes.append(f"prefill_graph_tokens auto: {budget} (the batch budget), because the hidden size "
                 f"({hidden or 'unknown'}) is under {LARGE_HIDDEN}")
    return budget


def resolve_engine(settings: Settings, info: ModelInfo, notes: list[str],
                   capability: tuple[int, int] | None, fa3: bool) -> Settings:
    """The settings with every ``auto`` of the forward resolved from the GPU's compute capability
    (None: no GPU), whether sgl-kernel has its FA3 kernels and the model, each with its reason in
    ``notes``: attention backend, kv_cache, overlap_schedule, pooled_last_layer, strided_query,
    prefill_graph_tokens."""
    eng = settings.engine
    backend = eng.attention_backend
    if backend == "auto":
        backend = auto_attention_backend(capability, fa3, notes)
    kv_cache = resolve_kv_cache(settings, info, backend, capability, notes)
    if eng.vectorised_cross_encoder:
        check_vectorised_cross_encoder(settings, info)
    if eng.compiled_qk_norm_rope:
        check_compiled_qk_norm_rope(info, list(eng.extra_args))
        notes.append("compiled_qk_norm_rope: on, as asked (inductor compiles each attention's QK-norm + RoPE "
                     "at the first forward; not yet measured in a server)")
    return settings.with_engine(
        attention_backend=backend,
        kv_cache=kv_cache,
        overlap_schedule=resolve_overlap_schedule(eng.overlap_schedule, kv_cache, notes),
        pooled_last_layer=resolve_pooled_last_layer(
            eng.pooled_last_layer, kv_cache, info, list(eng.extra_args), notes),
        strided_query=resolve_strided_query(
            eng.strided_query, kv_cache, backend, list(eng.extra_args), notes),
        prefill_graph_tokens=resolve_prefill_graph_tokens(settings, kv_cache, info, notes),
    )
