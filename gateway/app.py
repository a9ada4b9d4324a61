"""Builds the gateway: each served model's engine pool and pipelines (``served.py``), health
and the routes, wired once.

``create_app(settings, info)`` returns the FastAPI app; its lifespan starts and stops the
engine pools, the coalescers and the health sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CollectorRegistry

import embedserve
from embedserve.catalog import served_models
from embedserve.config import Settings
from embedserve.config.gateway import api_keys
from embedserve.contracts.hybrid import Output
from embedserve.gateway.cohere_routes import add_cohere_routes
from embedserve.gateway.engine_call import ServingGate
from embedserve.gateway.errors import install_error_handlers
from embedserve.gateway.load import LoadCollector
from embedserve.gateway.metrics import EngineCacheCollector, GatewayMetrics, LimitsCollector
from embedserve.gateway.middleware import (
    PROBE_PATHS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HeadLimitMiddleware,
    RequestContextMiddleware,
    RouteFastPath,
)
from embedserve.gateway.routes import add_routes, embeddings_handler
from embedserve.gateway.score_routes import ROUTES as SCORE_ROUTES
from embedserve.gateway.score_routes import add_score_routes
from embedserve.gateway.scoring import ScorePipeline
from embedserve.gateway.served import ModelRouter, build_runtime
from embedserve.gateway.tei_routes import add_tei_routes
from embedserve.gateway.trim import MemoryTrimmer, glibc_malloc_trim
from embedserve.gateway.vllm_routes import add_vllm_routes
from embedserve.health import EngineView, create_health
from embedserve.model_info import ModelInfo
from embedserve.upstream.client import EngineClient
from embedserve.upstream.pool import EnginePool


@dataclass
class SupervisorView:
    """What a local supervisor knows that HTTP cannot tell: is the process there at all."""

    alive: bool
    restarts: int
    pids: dict[str, int]
    detail: str = ""
    replacements: int = 0


def engine_view(
    pools: list[EnginePool], gate: ServingGate, supervisor: Callable[[], SupervisorView] | None
) -> EngineView:
    """What the probes see: the pools' state, and the supervisor's where there is one. With
    several models the pod is ready when every model has a ready engine."""
    sup = supervisor() if supervisor else None
    successes = [a for p in pools if (a := p.last_success_age_s()) is not None]
    stuck = [a for p in pools if (a := p.oldest_inflight_age_s()) is not None]
    return EngineView(
        ready=all(p.any_ready for p in pools) and gate.is_open,
        alive=(sup.alive if sup else True) and all(p.reachable() for p in pools),
        started=all(p.ever_ready for p in pools),
        restarts=sup.restarts if sup else 0,
        last_success_age_s=min(successes) if successes else None,
        oldest_inflight_age_s=max(stuck) if stuck else None,
        detail=(sup.detail + "; " if sup and sup.detail else "") + "; ".join(p.detail() for p in pools),
        engines=tuple(e for p in pools for e in p.statuses()),
        replacements=sup.replacements if sup else 0,
        closed_for=gate.reason,
    )


def create_app(
    settings: Settings,
    info: ModelInfo | None = None,
    supervisor: Callable[[], SupervisorView] | None = None,
    engine_client: EngineClient | None = None,
    engine_kind: str = "external",
    starting: bool = False,
    models: list[tuple[ModelInfo, str]] | None = None,
) -> FastAPI:
    """``engine_client`` replaces the network to the engines (tests use a fake engine).
    ``starting``: requests get 503 "warming up" until ``app.state.gate.open()``. ``info`` and
    ``engine_kind`` are the one model's; with several (``served.models``), ``models`` gives each
    one's ``ModelInfo`` and engine kind, in catalog order (else they are read here)."""
    gw = settings.gateway
    entries = served_models(settings)
    if models is None:
        one = info if info is not None and len(entries) == 1 else None
        models = [(one or e.load_info(), engine_kind) for e in entries]
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    executor = ThreadPoolExecutor(gw.tokenizer_threads, thread_name_prefix="tokenize")
    gate = ServingGate()
    runtimes = [
        build_runtime(entry, model_info, kind, gate, metrics, executor, engine_client)
        for entry, (model_info, kind) in zip(entries, models, strict=True)
    ]
    router = ModelRouter(runtimes)
    pools = [r.pool for r in runtimes]
    metrics.tokens_in_flight.set_function(lambda: sum(r.admission.in_flight for r in runtimes))
    scoring = ScorePipeline(gw, settings.served.rerank, router.scoring_model, gate, metrics, executor)

    if starting:
        gate.close("warming up")
    traces = None
    if settings.tracing.enabled:  # else OpenTelemetry is never imported
        from embedserve.gateway import otel

        traces = otel.provider(settings.tracing)

    def process_pids() -> dict[str, int]:
        return {"gateway": os.getpid(), **(supervisor().pids if supervisor else {})}

    registry.register(EngineCacheCollector(pools))
    registry.register(LoadCollector({r.name: r.load for r in runtimes}))
    registry.register(LimitsCollector({r.name: r.limits for r in runtimes}))
    health = create_health(
        settings, registry, lambda: engine_view(pools, gate, supervisor), process_pids
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for r in runtimes:
            await r.pool.start()
            await r.coalescer.start()
        await health.start()
        try:
            yield
        finally:
            await health.stop()
            for r in runtimes:
                await r.coalescer.stop()
                await r.pool.stop()
            executor.shutdown(wait=False, cancel_futures=True)
            if traces is not None:  # the last spans out, off the loop
                await asyncio.to_thread(traces.shutdown)

    first = runtimes[0]
    app = FastAPI(title="embedserve", version=embedserve.__version__, lifespan=lifespan)
    app.state.runtimes = runtimes
    app.state.pool = first.pool  # the first model's, as with one model
    app.state.coalescer = first.coalescer
    app.state.metrics = metrics
    app.state.load = first.load
    app.state.info = first.info
    app.state.gate = gate
    app.state.health = health
    install_error_handlers(app)
    app.include_router(health.router)
    embeddings = embeddings_handler(router.embed, metrics, gw.accept_token_ids)
    add_routes(app, embeddings, runtimes, metrics, registry)
    add_score_routes(app, scoring, metrics)
    embedders = [r for r in runtimes if r.info.embeds] or runtimes
    add_cohere_routes(app, router.embed, metrics, embedders[0].name)

    def default_model(output: Output) -> str:
        return next((r for r in embedders if output in r.info.outputs), embedders[0]).name

    add_tei_routes(app, router.embed, metrics, default_model)
    add_vllm_routes(app, router.embed, metrics, default_model,
                    lambda name: next((r.info.outputs for r in runtimes if r.info.serves(name)), None))

    # the score routes keep vLLM's and TEI's paths, TEI's sparse and per-token routes and vLLM's
    # pooling route theirs
    api = ("/v1", "/v2/", "/rerank", "/score", "/embed_sparse", "/embed_all", "/pooling")
    protected = (
        api + (("/health",) if gw.protect_health else ()) + (("/metrics",) if gw.protect_metrics else ())
    )
    # added first, so innermost: CORS, keys, size caps and request ids still apply to it
    app.add_middleware(RouteFastPath, method="POST", path="/v1/embeddings", handler=embeddings)
    if gw.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=gw.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"]
        )

    def refused(scope: MutableMapping[str, Any], status: int) -> None:
        """The API's requests a middleware answers (a body or head over its cap, no key) count
        by status with those their route answers (rerank and score apart); probes and scrapes do not."""
        path = scope.get("path", "")
        if path in SCORE_ROUTES:
            metrics.score_requests.labels(SCORE_ROUTES[path][0], str(status)).inc()
        elif not path.startswith(PROBE_PATHS):
            metrics.requests.labels(str(status)).inc()

    app.add_middleware(ApiKeyMiddleware, keys=api_keys(gw), protected_prefixes=protected, refused=refused)
    trimmer = MemoryTrimmer(glibc_malloc_trim())
    app.state.trimmer = trimmer
    app.add_middleware(BodyLimitMiddleware, max_bytes=gw.max_body_bytes,
                       after_large_body=trimmer.request_done, refused=refused)
    app.add_middleware(HeadLimitMiddleware, max_bytes=gw.max_head_bytes, refused=refused)
    if traces is not None:
        app.add_middleware(otel.TracingMiddleware, tracer=traces.get_tracer("embedserve.gateway"))
    app.add_middleware(RequestContextMiddleware, access=settings.log_access, warming=lambda: not gate.is_open)
    return app
