"""Prometheus metrics of the gateway, in a registry owned by the app (no global state)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedserve.config import GatewayLimits
from embedserve.contracts.hybrid import OUTPUTS
from embedserve.upstream.pool import EnginePool

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "embedserve_requests", "Requests by HTTP status", ["status"], registry=registry
        )
        self.request_seconds = Histogram(
            "embedserve_request_seconds",
            "End-to-end latency of /v1/embeddings",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.stage_seconds = Histogram(
            "embedserve_stage_seconds",
            "Latency per pipeline stage",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter("embedserve_tokens", "Tokens embedded", registry=registry)
        self.inputs = Counter("embedserve_inputs", "Inputs embedded", registry=registry)
        self.inputs_truncated = Counter(
            "embedserve_inputs_truncated",
            "Inputs cut to the max sequence length",
            registry=registry,
        )
        self.inputs_chunked = Counter(
            "embedserve_inputs_chunked",
            "Inputs over the max sequence length embedded whole, in windows pooled into one vector",
            registry=registry,
        )
        self.tokens_truncated = Counter(
            "embedserve_truncated_tokens", "Tokens dropped by truncation", registry=registry
        )
        self.inputs_unknown = Counter(
            "embedserve_inputs_with_unknown_tokens",
            "Inputs with text the tokenizer turned into unknown tokens",
            registry=registry,
        )
        self.unknown_chars = Counter(
            "embedserve_unknown_token_chars",
            "Characters the tokenizer turned into unknown tokens (the model sees none of them)",
            registry=registry,
        )
        self.request_tokens = Histogram(
            "embedserve_request_tokens",
            "Tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.rejected = Counter(
            "embedserve_rejected",
            "Requests refused by admission control",
            ["reason"],
            registry=registry,
        )
        self.tokens_in_flight = Gauge(
            "embedserve_tokens_in_flight",
            "Tokens admitted and not yet answered",
            registry=registry,
        )
        self.queue_inputs = Gauge(
            "embedserve_queue_inputs", "Inputs waiting for an engine call", registry=registry
        )
        self.engine_replacements = Counter(
            "embedserve_engine_replacements",
            "Engines `up` replaced before they ran out of memory",
            registry=registry,
        )
        self.score_requests = Counter(
            "embedserve_score_requests",
            "Rerank (/v1/rerank, /rerank, /v2/rerank) and score (/v1/score, /score) requests by HTTP status",
            ["route", "status"],
            registry=registry,
        )
        self.score_seconds = Histogram(
            "embedserve_score_request_seconds",
            "End-to-end latency of the rerank and score routes",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.model_tokens = Counter(
            "embedserve_model_tokens",
            "Tokens sent to the engines, by served model (embeddings and pairs)",
            ["model"],
            registry=registry,
        )
        self.model_requests = Counter(
            "embedserve_model_requests",
            "Requests answered, by served model and route (embeddings, rerank, score)",
            ["model", "route"],
            registry=registry,
        )
        self.priority_queue_seconds = Histogram(
            "embedserve_priority_queue_seconds",
            "Time a request's inputs waited for an engine call, by its priority (clamped to -10..10)",
            ["priority"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.priority_aged = Counter(
            "embedserve_priority_aged",
            "Requests that waited gateway.priority_aging_s and then went ahead of their priority",
            registry=registry,
        )
        self.output_inputs = Counter(
            "embedserve_output_inputs",
            "Inputs of requests that asked a model's sparse or ColBERT output, by output asked (dense, "
            "sparse, colbert); a request for the dense vector alone counts in embedserve_inputs only",
            ["output"],
            registry=registry,
        )
        for output in OUTPUTS:  # each series from the start, at 0
            self.output_inputs.labels(output)
        self.client_disconnects = Counter(
            "embedserve_client_disconnects",
            "Requests abandoned by their client",
            registry=registry,
        )


class EngineCacheCollector(Collector):
    """The series of each engine the pools hold at scrape time, so an engine that was replaced
    or removed leaves no series behind: whether it is ready (``embedserve_engine_ready``), which
    model it serves (``embedserve_engine_model{engine, model} 1``, to join on), and its
    prefix-cache counters, read by the pools' health loops (how many prompt tokens it embedded
    and how many of those its radix cache served)."""

    def __init__(self, pools: list[EnginePool]) -> None:
        self.pools = pools

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def _models(self) -> Iterator[Metric]:
        served = GaugeMetricFamily(
            "embedserve_engine_model", "The model an engine serves", labels=["engine", "model"]
        )
        for pool in self.pools:
            for engine in pool.engines:
                served.add_metric([engine.url, pool.model], 1)
        yield served

    def collect(self) -> Iterator[Metric]:
        yield from self._models()
        ready = GaugeMetricFamily("embedserve_engine_ready", "1 if the engine is ready", labels=["engine"])
        for engine in (e for pool in self.pools for e in pool.engines):
            ready.add_metric([engine.url], 1 if engine.ready else 0)
        yield ready
        prompt = CounterMetricFamily(
            "embedserve_engine_prompt_tokens", "Prompt tokens the engine embedded", labels=["engine"]
        )
        cached = CounterMetricFamily(
            "embedserve_engine_cached_tokens",
            "Prompt tokens the engine's prefix cache served",
            labels=["engine"],
        )
        for engine in (e for pool in self.pools for e in pool.engines):
            if engine.cache_counters is not None:
                prompt.add_metric([engine.url], engine.cache_counters[0])
                cached.add_metric([engine.url], engine.cache_counters[1])
        yield from (prompt, cached)


class LimitsCollector(Collector):
    """Each served model's limits as the gateway resolved them (their defaults follow the kind of
    the model's engines, which an external engine tells), so a dashboard shows what a pod runs
    with: ``embedserve_gateway_limit{model, limit}`` and ``embedserve_engine_kind{model, kind} 1``."""

    def __init__(self, limits: dict[str, GatewayLimits]) -> None:
        self.limits = limits

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        kinds = GaugeMetricFamily(
            "embedserve_engine_kind", "The kind of a model's engines, whose defaults the gateway takes",
            labels=["model", "kind"],
        )
        limits = GaugeMetricFamily(
            "embedserve_gateway_limit",
            "The gateway's limits per model: engine_calls_per_engine, max_tokens_per_engine_call, "
            "max_tokens_in_flight, inline_tokenize_chars",
            labels=["model", "limit"],
        )
        for model, lim in self.limits.items():
            kinds.add_metric([model, lim.engine_kind], 1)
            for name, value in lim.model_dump(exclude={"engine_kind"}).items():
                limits.add_metric([model, name], value)
        yield from (kinds, limits)
