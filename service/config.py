"""The one typed configuration object of the stack.

Read once by ``load_settings`` (``EMBEDSERVE_*`` environment variables, an optional ``.env``
and the command line's flags), then passed down; engine processes that ``up`` starts get
the parent's resolved settings whole, as JSON in one variable. Nested fields use ``__``:
``EMBEDSERVE_ENGINE__PORT=30001``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from embedserve.contracts.models import BUNDLED_MODEL, resolve_model_path
from embedserve.settings_errors import ConfigError, bad_json, describe

#: Set by ``up`` for the engine processes it starts: the parent's settings, as JSON.
CHILD_SETTINGS_ENV = "EMBEDSERVE_SETTINGS_JSON"


class ModelSettings(BaseModel):
    """What is served, and how its inputs are shaped."""

    path: str = BUNDLED_MODEL
    name: str | None = Field(None, description="model id clients send; default: folder name")
    aliases: list[str] = Field(default_factory=list, description="other ids accepted for it")
    max_seq_len: int | None = Field(
        None,
        ge=8,
        description="longest input in tokens, special tokens included; drives gateway "
        "truncation, SGLang --context-length, prefill sizes and the KV pool. Default: "
        "sentence-transformers' max_seq_length, else the model's positions, capped at 8192",
    )
    default_query_task: str = "Given a web search query, retrieve relevant passages that answer the query"
    query_template: str | None = Field(
        None,
        description="instruction format for queries; default: Qwen3-Embedding's "
        "'Instruct: {task}\\nQuery:{text}' for Qwen3 models, none otherwise",
    )
    matryoshka_dimensions: list[int] | None = None

    @property
    def resolved_path(self) -> Path:
        return resolve_model_path(self.path)

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.path == BUNDLED_MODEL:
            return "all-MiniLM-L6-v2"
        return Path(self.path).name or self.path


class CacheClearSettings(BaseModel):
    """When the SGLang plugin empties the CUDA caching allocator (all rules OR-ed)."""

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

    kind: Literal["auto", "cpu", "sglang", "external"] = Field(
        "auto", description="auto: sglang when a GPU and sglang are present, else cpu"
    )
    urls: list[str] = Field(
        default_factory=list, description="engines to use instead of starting one (external)"
    )
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    replicas: int = Field(
        1, ge=1, description="GPUs to use: SGLang engines are started on GPU 0 .. replicas-1"
    )
    engines_per_gpu: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="SGLang engines on each GPU (ports port, port+1, ...), so one engine's CPU "
        "work overlaps another's forward passes. auto: by model size (docs/PERFORMANCE.md), "
        "lowered to what fits the GPU's memory; a number that does not fit is refused at start",
    )
    batch_token_budget: int = Field(
        16384, ge=64, description="tokens per engine batch (prefill chunk, prefill budget)"
    )
    max_running_requests: int = Field(128, ge=1)
    kv_pool_tokens: int | None = Field(
        None, description="SGLang --max-total-tokens; default: the batch budget, at least 2 x max seq"
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
        "paged",
        description="paged: SGLang's paged KV cache (every layer writes its K/V to a pool of "
        "kv_pool_tokens). none: SGLang's embedding-only prefill (--prefill-only-disable-kv-cache, "
        "--chunked-prefill-size -1): attention reads the batch's own K/V, nothing is written and "
        "no pool is allocated; needs the fa3 or fa4 attention backend and prefix_cache off "
        "(on one H200 the 4B engine held 9.7 GB instead of 13.9: docs/PERFORMANCE.md). "
        "auto: none where it can, else paged",
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


class GatewaySettings(BaseModel):
    """The OpenAI-compatible front door."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_inputs: int = 2048
    max_tokens_per_request: int = 300_000
    max_body_bytes: int = 16 << 20
    max_head_bytes: int = Field(32 * 1024, ge=1024, description="request line + headers; 431 beyond")
    max_string_chars: int = Field(1_000_000, description="longest string accepted before tokenisation")
    batch_max_wait_ms: float = Field(
        0.0, ge=0, description="extra wait for more inputs while all engine calls are busy"
    )
    engine_calls_per_engine: int | None = Field(
        None,
        ge=1,
        description="coalesced calls in flight per engine (default 4 for SGLang, 1 for the CPU "
        "engine, which computes one at a time); while all are busy, "
        "inputs of concurrent requests gather into the next call",
    )
    max_inputs_per_engine_call: int = Field(256, ge=1)
    max_tokens_per_engine_call: int | None = Field(
        None,
        ge=8,
        description="one engine call's token budget, so other requests' inputs interleave with a "
        "large request's. Default: engine.batch_token_budget for SGLang, 512 for the CPU "
        "engine (a fraction of a second of its work on two cores)",
    )
    max_tokens_in_flight: int | None = Field(
        None,
        ge=1,
        description="admission control: beyond this, 429 with Retry-After. Default: 262,144 for "
        "a GPU engine, 32,768 for the CPU engine (tens of seconds of its work, so overload "
        "answers 429 instead of queueing into 504s)",
    )
    request_timeout_s: float = Field(60.0, gt=0, description="per-request deadline (504)")
    tokenizer_threads: int = Field(2, ge=1)
    inline_tokenize_chars: int | None = Field(
        None,
        ge=0,
        description="requests with at most this many characters are tokenised on the event loop "
        "instead of a tokenizer thread. Default: 0 (all to the threads) in front of SGLang: with "
        "Qwen3's tokenizer the threads cut the loop's time per request by 18-30%, and on one H200 "
        "the 0.6B ran 1.19x on short inputs; 2,048 for the CPU engine",
    )
    event_loop: Literal["asyncio", "uvloop"] = Field(
        "asyncio",
        description="the gateway process's event loop: asyncio's own, or uvloop (libuv) where it "
        "is installed (asyncio otherwise, with a warning). On one H200 the 0.6B measured no faster "
        "with uvloop",
    )
    normalize: bool = True
    accept_token_ids: bool = Field(
        False,
        description="embed token-id input as this model's own ids. Off: ids are refused (400), "
        "because ids from another tokenizer (LangChain's default sends tiktoken's) would give "
        "wrong vectors with no error",
    )
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_keys_file: str | None = None
    protect_health: bool = False
    protect_metrics: bool = False
    cors_origins: list[str] = Field(default_factory=list)
    graceful_shutdown_s: float = 30.0
    header_timeout_s: float = Field(
        20.0,
        gt=0,
        description="a request head (request line and headers) must arrive within this many "
        "seconds of its first byte (of the connection, for its first request): 408 and closed "
        "beyond, so a client trickling its head cannot hold a connection",
    )
    body_idle_timeout_s: float = Field(
        20.0,
        gt=0,
        description="a request body may stall at most this long, and must average 500 bytes/s "
        "beyond this allowance: 408 and closed beyond",
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description="idle keep-alive; longer than clients' pools (httpx and the OpenAI SDK 5 s, "
        "aiohttp 15 s) and load balancers' (AWS ALB 60 s), so the server never closes a "
        "connection a client is reusing at that instant",
    )


class HealthSettings(BaseModel):
    """Memory sampling and the hours-to-OOM forecast."""

    sample_interval_s: float = Field(5.0, gt=0)
    history_max_samples: int = Field(20_000, ge=10, description="bounded history; older samples are thinned")
    persist_path: str | None = None
    warmup_s: float = Field(300.0, ge=0)
    min_span_s: float = Field(1800.0, ge=0)
    min_samples: int = Field(30, ge=3)
    window_s: float = Field(6 * 3600.0, gt=0)
    horizon_cap_hours: float = Field(168.0, gt=0)
    warning_hours: float = Field(6.0, gt=0, description="readiness fails (pod drained) under this many hours")
    critical_hours: float = Field(
        1.0, gt=0, description="liveness fails (pod restarted) under this many hours"
    )
    hang_after_s: float | None = Field(
        None,
        gt=0,
        description="an engine call older than this means a hung engine: liveness "
        "fails and `up` restarts it; default 4 x gateway.request_timeout_s",
    )
    gpu_memory_limit_bytes: int | None = None
    host_memory_limit_bytes: int | None = None
    replace_engines: bool = Field(
        True,
        description="`up` replaces an engine whose memory runs out within replace_below_hours, one "
        "at a time, before it runs out. Turn it off where a Kubernetes restart controller is in "
        "charge (a pod whose `up` drains itself would race it)",
    )
    replace_below_hours: float | None = Field(
        None, gt=0, description="hours to out-of-memory that start a replacement; default warning_hours"
    )
    replace_min_age_s: float = Field(600.0, ge=0, description="never replace an engine younger than this")
    replace_cooldown_s: float = Field(600.0, ge=0, description="at least this long between two replacements")


class ControllerSettings(BaseModel):
    """The restart controller (``EMBEDSERVE_CONTROLLER__<FIELD>``): evicts pods running out of memory."""

    namespace: str | None = Field(
        None, description="namespace of the pods; default: the service account's own"
    )
    label_selector: str = Field("app.kubernetes.io/name=embedserve", description="selects the serving pods")
    health_port: int = Field(8000, ge=1, le=65535, description="the gateway port that serves /health/memory")
    health_path: str = "/health/memory"
    health_scheme: Literal["http", "https"] = "http"
    health_timeout_s: float = Field(2.0, gt=0)
    health_api_key: SecretStr | None = Field(
        None, description="bearer token when gateway.protect_health is on"
    )
    threshold_hours: float | None = Field(
        None,
        gt=0,
        description="evict at or under this many hours to OOM; default health.warning_hours",
    )
    follow_recommendation: bool = Field(
        True, description="also evict when /health/memory says recommends_restart"
    )
    min_pod_age_s: float = Field(
        600.0, ge=0, description="never evict a pod younger than this (fresh forecasts)"
    )
    api_url: str | None = Field(None, description="API server; default: in-cluster")
    api_timeout_s: float = Field(10.0, gt=0)
    dry_run: bool = False
    # Surge before evict: a replacement first, so a restart never costs serving capacity.
    deployment: str = Field("embedserve", description="the Deployment that runs the serving pods")
    surge: Literal["auto", "always", "never"] = Field(
        "auto",
        description="ask for one more pod and wait until it is ready before evicting: auto when "
        "the Deployment's rollingUpdate.maxSurge allows one (the operator's word that the cluster "
        "has a spare GPU), always, or never (evict first)",
    )
    surge_timeout_s: float = Field(
        900.0,
        gt=0,
        allow_inf_nan=False,  # an endless wait would never fall back to the eviction
        description="seconds a surge pod may take to become ready (a cold start takes up to 290 s); "
        "past it the count is restored and the pod evicted without a replacement",
    )
    surge_poll_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="seconds between checks while a surge starts"
    )
    metrics_port: int | None = Field(
        None, description="serve the controller's own /metrics (its steps) on this port; none: no endpoint"
    )
    target_load: float = Field(
        0.8,
        gt=0,
        le=2,
        description="the embedserve_load the autoscaler holds each pod at (the autoscaling "
        "manifests' target); no surge when the other ready pods stay at or under it without the "
        "pod being restarted",
    )


class Settings(BaseSettings):
    """Everything, read once at start."""

    model_config = SettingsConfigDict(
        env_prefix="EMBEDSERVE_", env_nested_delimiter="__", env_file=".env", extra="ignore"
    )

    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    controller: ControllerSettings = Field(default_factory=ControllerSettings)
    log_level: str = "INFO"
    log_format: Literal["auto", "json", "text"] = Field(
        "auto", description="auto: readable lines on a terminal, JSON lines otherwise"
    )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.health.critical_hours >= self.health.warning_hours:
            raise ValueError(
                f"EMBEDSERVE_HEALTH__CRITICAL_HOURS ({self.health.critical_hours:g}) must be below "
                f"EMBEDSERVE_HEALTH__WARNING_HOURS ({self.health.warning_hours:g})"
            )
        if self.engine.cpu_quantization != "none" and self.engine.cpu_backend != "onnx":
            raise ValueError(
                f"EMBEDSERVE_ENGINE__CPU_QUANTIZATION={self.engine.cpu_quantization} (--cpu-quantization) "
                "needs EMBEDSERVE_ENGINE__CPU_BACKEND=onnx (--cpu-backend)"
            )
        return self

    def tokens_in_flight_limit(self, engine_kind: str) -> int:
        if self.gateway.max_tokens_in_flight is not None:
            return self.gateway.max_tokens_in_flight
        return 32_768 if engine_kind == "cpu" else 262_144

    def inline_tokenize_limit(self, engine_kind: str) -> int:
        if self.gateway.inline_tokenize_chars is not None:
            return self.gateway.inline_tokenize_chars
        return 2048 if engine_kind == "cpu" else 0

    def engine_calls(self, engine_kind: str) -> int:
        if self.gateway.engine_calls_per_engine is not None:
            return self.gateway.engine_calls_per_engine
        return 1 if engine_kind == "cpu" else 4

    def engine_call_tokens(self, engine_kind: str) -> int:
        if self.gateway.max_tokens_per_engine_call is not None:
            return self.gateway.max_tokens_per_engine_call
        return 512 if engine_kind == "cpu" else self.engine.batch_token_budget

    def hang_after_s(self) -> float:
        return self.health.hang_after_s or 4 * self.gateway.request_timeout_s

    def engines_per_gpu(self) -> int:
        """As resolved at start (``auto`` counts as one until then)."""
        n = self.engine.engines_per_gpu
        return n if isinstance(n, int) else 1

    def local_engine_count(self) -> int:
        return self.engine.replicas * self.engines_per_gpu()

    def engine_gpu(self, index: int) -> int:
        """The GPU (among the visible ones) of local engine ``index``."""
        return index // self.engines_per_gpu()

    def engine_urls(self) -> list[str]:
        e = self.engine
        return e.urls or [f"http://{e.host}:{e.port + i}" for i in range(self.local_engine_count())]

    def engine_gpus(self) -> list[int | None]:
        """The GPU of each engine in ``engine_urls``; None for engines this stack did not start."""
        if self.engine.urls:
            return [None] * len(self.engine.urls)
        return [self.engine_gpu(i) for i in range(self.local_engine_count())]

    def with_engine(self, **changes: Any) -> Settings:
        return self.model_copy(update={"engine": self.engine.model_copy(update=changes)})

    def for_replica(self, index: int) -> Settings:
        """The same settings as seen by local engine ``index`` (its own port)."""
        return self.with_engine(port=self.engine.port + index, replicas=1, engines_per_gpu=1)

    def child_env(self) -> dict[str, str]:
        """What an engine process needs to see exactly these settings (secrets stay hidden:
        engines need none)."""
        return {CHILD_SETTINGS_ENV: self.model_dump_json()}

    def redacted(self) -> dict[str, object]:
        """For logging: secrets stay hidden (SecretStr dumps as '**********')."""
        return json.loads(self.model_dump_json())


def load_settings(
    overrides: dict[str, Any] | None = None, flags: Mapping[str, str] | None = None
) -> Settings:
    """The settings of this process: a parent's, when it started this one (see
    ``Settings.child_env``), else the environment and ``.env`` with ``overrides`` on top.
    A mistake raises ``ConfigError``, one sentence naming the variable and, from ``flags``
    (``"gateway.port": "--port"``), the flag."""
    inherited = os.environ.get(CHILD_SETTINGS_ENV)
    try:
        if inherited:
            return Settings.model_validate_json(inherited)
        return Settings(**(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(describe(exc, Settings, flags)) from None
    except SettingsError as exc:  # a list or object variable that is not JSON
        section = str(exc).split('"')[1] if str(exc).count('"') >= 2 else ""
        raise ConfigError(bad_json(section, Settings, os.environ)) from None
