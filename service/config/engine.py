"""The engine processes: ``EMBEDSERVE_ENGINE__<FIELD>``, the CUDA cache rules among them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class CacheClearSettings(BaseModel):
    """When the SGLang plugin empties the CUDA caching allocator (all rules OR-ed)."""

    model_config = ConfigDict(extra="forbid")

    every_n_batches: int = Field(
        64, ge=0, description="clear after every N-th batch; 1 = every batch, 0 = never"
    )
    fragmentation_ratio: float | None = Field(
        0.25, gt=0, le=1, description="clear when inactive-split / reserved exceeds this"
    )
    unused_reserve_bytes: int | None = Field(
        4 << 30,
        gt=0,
        description="clear when the memory empty_cache() can return (reserved - allocated - "
        "inactive split) exceeds this",
    )
    min_interval_s: float = Field(
        1.0, ge=0, description="never clear more often than this (threshold rules only)"
    )


class EngineSettings(BaseModel):
    """The engine process(es) the gateway sends token ids to."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["auto", "cpu", "sglang", "torch", "external"] = Field(
        "auto",
        description="auto: on a GPU, torch for a cross-encoder and sglang for other models; else cpu. "
        "torch: embedserve's own "
        "engine (the CPU engine's server) running the model on a GPU with torch and transformers "
        "(dtype auto = bfloat16, PyTorch's SDPA attention), for rerankers (docs/RERANK.md)",
    )
    urls: list[str] = Field(
        default_factory=list, description="engines to use instead of starting one (external)"
    )
    external_kind: Literal["ask", "cpu", "sglang", "torch"] = Field(
        "ask",
        description="what the engines at urls are, which sets the gateway's defaults as for engines "
        "`up` starts (engine calls, tokens per call, tokens in flight, inline tokenising). ask: "
        "the gateway asks them (GET /get_model_info) before it serves, waiting up to "
        "startup_timeout_s; cpu or sglang: it does not ask (a gateway that must listen while its "
        "engine still starts)",
    )
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    replicas: int = Field(
        1, ge=1, description="GPUs to use: SGLang engines are started on GPU 0 .. replicas-1"
    )
    engines_per_gpu: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="GPU engines on each GPU (ports port, port+1, ...), so one engine's CPU "
        "work overlaps another's forward passes. auto: SGLang's by model size (docs/PERFORMANCE.md), "
        "lowered to what fits the GPU's memory, a number that does not fit refused at start; "
        "the torch engine's two (docs/RERANK.md)",
    )
    batch_token_budget: int = Field(
        16384, ge=64, description="tokens per engine batch (prefill chunk, prefill budget)"
    )
    max_running_requests: int = Field(
        128, ge=1, description="requests (inputs) in one engine batch; SGLang's --max-running-requests, "
        "twice this with overlap_schedule, where two batches are in the engine at once"
    )
    kv_pool_tokens: int | None = Field(
        None, description="SGLang --max-total-tokens; default: the batch budget (two with "
        "overlap_schedule), at least 2 x max seq"
    )
    overlap_schedule: bool | Literal["auto"] = Field(
        "auto",
        description="SGLang's overlap scheduler: the next batch is built and the last one's vectors "
        "are sent while the GPU runs the current one, instead of the GPU waiting for both. "
        "The engine then holds two batches at once, so the KV pool's default and "
        "--max-running-requests are doubled (with kv_cache=none the pool holds no memory). "
        "auto: on where kv_cache resolves to none (docs/SGLANG.md), else off",
    )
    pooled_last_layer: bool | Literal["auto"] = Field(
        "auto",
        description="Qwen3 embedding models on SGLang: the last decoder layer's output projection, "
        "norm and MLP computed for each sequence's pooled (last) row only, its attention for every "
        "row: 2.3% of the 4B's linear-layer work saved. auto: on where kv_cache resolves to none "
        "(docs/SGLANG.md), else off",
    )
    strided_query: bool | Literal["auto"] = Field(
        "auto",
        description="Qwen3 on SGLang with kv_cache none and FA3: attention reads each layer's queries "
        "where the QKV projection wrote them, instead of SGLang's contiguous copy of them (on one H100 "
        "the 4B's plain copies fell from 0.49 to 0.05 GPU ms per 1,000 tokens, vectors identical: "
        "docs/PERFORMANCE.md). auto: on where kv_cache resolves to none with FA3, else off",
    )
    compiled_qk_norm_rope: bool = Field(
        False,
        description="dense Qwen3 models on SGLang: each attention's q and k normalised and rotated by one "
        "function torch inductor compiles at the first forward, instead of SGLang's two kernels; the "
        "same arithmetic. Off: not yet measured in a server (docs/SGLANG.md)",
    )
    prefill_graph_tokens: Annotated[int, Field(ge=4)] | Literal["auto"] = Field(
        "auto",
        description="The largest batch, in tokens, that runs as one of SGLang's prefill CUDA graphs "
        "(--cuda-graph-max-bs-prefill). A graph's batch is padded to its captured size (steps of 512 "
        "tokens above 4,096), for which cuBLAS picks slower GEMM tiles; a larger batch runs without "
        "a graph at its own size. auto, with kv_cache none: 4096 for a model of hidden size 2,560 or "
        "more (on one H100 the 4B's GEMM time per 1,000 tokens fell from 10.43 to 9.90 ms: "
        "docs/SGLANG.md), else the batch budget; on the paged path SGLang's own sizing. A number is "
        "at most the batch budget",
    )
    vectorised_cross_encoder: bool = Field(
        False,
        description="XLM-R cross-encoders (bge-reranker) on SGLang: position ids built and the "
        "classifier head run once per batch instead of in SGLang's loops over its sequences, which "
        "wait on the GPU for each: 1.1-2.3x the pairs/s on one H100 (docs/SGLANG.md); needs prefix_cache off",
    )
    mem_fraction_static: float = Field(0.85, gt=0, lt=1)
    gpu_memory_budget_gb: float | None = Field(
        None, gt=0, description="cap the engine's static GPU memory at this many GB"
    )
    attention_backend: str = Field(
        "auto",
        description="SGLang's prefill attention. auto: FA3 on Hopper when sgl-kernel carries "
        "its FA3 kernels, else FlashInfer (on one H200 FA3 gave the 4B identical vectors at "
        "0.99-1.02x FlashInfer's throughput: docs/PERFORMANCE.md); or any --attention-backend value "
        "of SGLang",
    )
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="fp8: SGLang quantizes the bf16 checkpoint's linear layers to FP8 at load "
        "(weights and activations, dynamic scales): half the weight memory and Hopper's FP8 "
        "tensor cores. Check what it costs in quality with `embedserve quality` first",
    )
    prefix_cache: bool = Field(
        False,
        description="SGLang's radix (prefix) cache. Off: on one H200 the 4B embedded unique texts "
        "3.6% faster without it, and a vector never depends on what an earlier request left in "
        "the cache; queries with Qwen3's instruction prefix ran 6.6% faster with it (12.6% of "
        "their tokens came from the cache): turn it on for query-heavy traffic",
    )
    kv_cache: Literal["auto", "paged", "none"] = Field(
        "auto",
        description="paged: SGLang's paged KV cache (every layer writes its K/V to a pool of "
        "kv_pool_tokens). none: SGLang's embedding-only prefill (--prefill-only-disable-kv-cache, "
        "--chunked-prefill-size -1): attention reads the batch's own K/V, nothing is written and "
        "no pool is allocated; needs the fa3 or fa4 attention backend and prefix_cache off "
        "(on one H200 the 4B engine held 11.4 GB instead of 13.9: docs/PERFORMANCE.md). "
        "auto: none for an unquantised Qwen3 embedding model on a Hopper GPU (compute capability 9.x) "
        "with the fa3 or fa4 backend and prefix_cache off, where it was measured; else paged",
    )
    dtype: str = "auto"
    flashinfer_cache_dir: str | None = Field(
        None, description="FlashInfer JIT cache; put it on a volume (cold start 250-290 s)"
    )
    cache_clear: CacheClearSettings = Field(default_factory=CacheClearSettings)
    stats_dir: str | None = Field(
        None,
        description="where engines publish allocator statistics for the health sampler; default: "
        "a private folder per stack that `up` makes. Set it when engines run in another "
        "container (both must mount it)",
    )
    stats_interval_s: float = Field(1.0, gt=0)
    profile_dir: str | None = Field(
        None,
        description="embedserve's own engine with the torch backend (engine.kind torch): serve "
        "SGLang's POST /start_profile and /stop_profile, writing torch.profiler traces under this "
        "folder only (bench/README.md, Kernels); unset: no such routes",
    )
    startup_timeout_s: float = Field(900.0, gt=0)
    health_check_interval_s: float = Field(2.0, gt=0, description="how often the gateway checks each engine")
    health_check_timeout_s: float = Field(
        10.0, gt=0, description="SGLang's health check runs a forward pass: slow under load"
    )
    unreachable_after_failures: int = Field(
        5, ge=1, description="liveness fails once every engine failed this many checks in a row"
    )
    restart_backoff_s: float = Field(2.0, gt=0)
    restart_backoff_max_s: float = Field(60.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="appended to SGLang argv")
    base64_vectors: bool = Field(
        True,
        description="ask engines for base64 float32 vectors (no float text on either side); "
        "turn off for an engine that rejects encoding_format",
    )
    # The CPU engine (kind cpu).
    cpu_backend: Literal["torch", "onnx"] = Field(
        "onnx",
        description="onnx: the model exported once to ONNX (checked against torch, cached in "
        "cpu_export_dir) and run on ONNX Runtime, torch never loaded while serving; torch: "
        "sentence-transformers on torch",
    )
    cpu_quantization: Literal["none", "int8"] = Field(
        "none",
        description="int8: ONNX Runtime's dynamic int8 quantisation of the exported model (onnx "
        "backend only): faster, vectors a little further from the model's; check it with the "
        "quality gate on your own data first",
    )
    cpu_export_dir: str | None = Field(
        None,
        description="where the onnx backend caches its exports, one folder per model, exporter and "
        "library versions; default: $XDG_CACHE_HOME/embedserve/onnx, else ~/.cache/embedserve/onnx",
    )
    cpu_threads: int | None = Field(
        None, ge=1, description="compute threads; default: the cores this process may use "
        "(its CPU affinity, capped by its cgroup's CPU quota)",
    )
