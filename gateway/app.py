"""Builds the gateway: the pipeline, the engine pool, health and the routes, wired once.

``create_app(settings, info)`` returns the FastAPI app; its lifespan starts and stops the
engine pool, the coalescer and the health sampler.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CollectorRegistry

import embedserve
from embedserve.config import GatewaySettings, Settings
from embedserve.engines.client import EngineClient
from embedserve.engines.pool import EnginePool
from embedserve.gateway.admission import TokenAdmission
from embedserve.gateway.coalesce import Coalescer
from embedserve.gateway.errors import install_error_handlers
from embedserve.gateway.load import LoadCollector, LoadSignal
from embedserve.gateway.metrics import EngineCacheCollector, GatewayMetrics
from embedserve.gateway.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HeadLimitMiddleware,
    RequestContextMiddleware,
    RouteFastPath,
)
from embedserve.gateway.pipeline import EmbeddingPipeline, ServingGate
from embedserve.gateway.routes import add_routes, embeddings_handler
from embedserve.gateway.tokenize import ModelTokenizer
from embedserve.health import EngineView, create_health
from embedserve.model_info import ModelInfo


@dataclass
class SupervisorView:
    """What a local supervisor knows that HTTP cannot tell: is the process there at all."""

    alive: bool
    restarts: int
    pids: dict[str, int]
    detail: str = ""
    replacements: int = 0


def load_api_keys(gw: GatewaySettings) -> list[str]:
    keys = [k.get_secret_value() for k in gw.api_keys]
    if gw.api_keys_file:
        with open(gw.api_keys_file) as fh:
            keys += [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    return keys


def engine_view(
    pool: EnginePool, gate: ServingGate, supervisor: Callable[[], SupervisorView] | None
) -> EngineView:
    """What the probes see: the pool's state, and the supervisor's where there is one."""
    sup = supervisor() if supervisor else None
    return EngineView(
        ready=pool.any_ready and gate.is_open,
        alive=(sup.alive if sup else True) and pool.reachable(),
        started=pool.ever_ready,
        restarts=sup.restarts if sup else 0,
        last_success_age_s=pool.last_success_age_s(),
        oldest_inflight_age_s=pool.oldest_inflight_age_s(),
        detail=(sup.detail + "; " if sup and sup.detail else "") + pool.detail(),
        engines=tuple(pool.statuses()),
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
) -> FastAPI:
    """``engine_client`` replaces the network to the engines (tests use a fake engine).
    ``starting``: requests get 503 "warming up" until ``app.state.gate.open()``."""
    gw, eng = settings.gateway, settings.engine
    info = info or ModelInfo.load(settings.model)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    pool = EnginePool(
        settings.engine_urls(),
        info.name,
        request_timeout_s=gw.request_timeout_s,
        health_interval_s=eng.health_check_interval_s,
        health_timeout_s=eng.health_check_timeout_s,
        unreachable_after_failures=eng.unreachable_after_failures,
        client=engine_client,
        base64_vectors=eng.base64_vectors,
        capacity_call_tokens=settings.engine_call_tokens(engine_kind) // 4,
        gpus=settings.engine_gpus() if engine_kind == "sglang" else None,
    )
    coalescer = Coalescer(
        pool.embed,
        token_budget=settings.engine_call_tokens(engine_kind),
        max_wait_s=gw.batch_max_wait_ms / 1000,
        max_concurrent_calls=settings.engine_calls(engine_kind) * len(pool.engines),
        max_inputs_per_call=gw.max_inputs_per_engine_call,
    )
    executor = ThreadPoolExecutor(gw.tokenizer_threads, thread_name_prefix="tokenize")
    admission = TokenAdmission(settings.tokens_in_flight_limit(engine_kind))
    load = LoadSignal(pool.tokens_per_s, admission.limit, lambda: pool.any_ready)
    pipeline = EmbeddingPipeline(
        gw,
        info,
        ModelTokenizer(info.path, info.max_seq_len),
        coalescer,
        admission,
        metrics,
        executor,
        load,
        settings.inline_tokenize_limit(engine_kind),
    )

    if starting:
        pipeline.gate.close("warming up")

    def process_pids() -> dict[str, int]:
        return {"gateway": os.getpid(), **(supervisor().pids if supervisor else {})}

    registry.register(EngineCacheCollector(pool))
    registry.register(LoadCollector(load))
    health = create_health(
        settings, registry, lambda: engine_view(pool, pipeline.gate, supervisor), process_pids
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        await coalescer.start()
        await health.start()
        try:
            yield
        finally:
            await health.stop()
            await coalescer.stop()
            await pool.stop()
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="embedserve", version=embedserve.__version__, lifespan=lifespan)
    app.state.pool = pool
    app.state.coalescer = coalescer
    app.state.metrics = metrics
    app.state.load = load
    app.state.info = info
    app.state.gate = pipeline.gate
    app.state.health = health
    install_error_handlers(app)
    app.include_router(health.router)
    embeddings = embeddings_handler(pipeline, metrics)
    add_routes(app, embeddings, info, pool, coalescer, metrics, registry)

    protected = (
        ("/v1",) + (("/health",) if gw.protect_health else ()) + (("/metrics",) if gw.protect_metrics else ())
    )
    # added first, so innermost: CORS, keys, size caps and request ids still apply to it
    app.add_middleware(RouteFastPath, method="POST", path="/v1/embeddings", handler=embeddings)
    if gw.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=gw.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"]
        )
    app.add_middleware(ApiKeyMiddleware, keys=load_api_keys(gw), protected_prefixes=protected)
    app.add_middleware(BodyLimitMiddleware, max_bytes=gw.max_body_bytes)
    app.add_middleware(HeadLimitMiddleware, max_bytes=gw.max_head_bytes)
    app.add_middleware(RequestContextMiddleware)
    return app
