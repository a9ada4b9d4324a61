"""The gateway's FastAPI app: thin routes over ``EmbeddingPipeline``, health mounted beside.

Build with ``create_app(settings)``; everything the app holds (engine pool, coalescer,
metrics registry, health sampler) is created here and torn down by its lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from gateway.admission import TokenAdmission
from gateway.batcher import Coalescer
from gateway.engine_client import EngineClient
from gateway.engine_pool import EnginePool
from gateway.errors import APIError, error_response, install_error_handlers, validation_error
from gateway.jsonbody import parse_object
from gateway.metrics import GatewayMetrics
from gateway.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HeadLimitMiddleware,
    RequestContextMiddleware,
    RouteFastPath,
)
from gateway.model_card import ModelCard
from gateway.pipeline import EmbeddingPipeline
from gateway.schemas import EmbeddingRequest
from gateway.tokenization import ModelTokenizer
from health import create_health
from health.engine_view import EngineStatus, EngineView
from service.settings import Settings


@dataclass
class SupervisorView:
    """What a local supervisor knows that HTTP cannot tell: is the process there at all."""

    alive: bool
    restarts: int
    pids: dict[str, int]
    detail: str = ""


def _load_api_keys(settings: Settings) -> list[str]:
    keys = [k.get_secret_value() for k in settings.gateway.api_keys]
    if settings.gateway.api_keys_file:
        with open(settings.gateway.api_keys_file) as fh:
            keys += [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    return keys


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def create_app(
    settings: Settings,
    supervisor: Callable[[], SupervisorView] | None = None,
    engine_client: EngineClient | None = None,
    engine_kind: str = "external",
) -> FastAPI:
    """``engine_client`` replaces the network to the engines (tests use a fake engine)."""
    gw = settings.gateway
    card = ModelCard.from_settings(settings.model)
    tokenizer = ModelTokenizer(settings.model.resolved_path, card.max_seq_len)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    pool = EnginePool(
        settings.engine_urls(),
        card.name,
        request_timeout_s=gw.request_timeout_s,
        client=engine_client,
        base64_vectors=settings.engine.base64_vectors,
    )
    coalescer = Coalescer(
        pool,
        token_budget=settings.engine.batch_token_budget,
        max_wait_s=gw.batch_max_wait_ms / 1000,
        max_concurrent_calls=gw.engine_calls_per_engine * len(pool.engines),
        max_inputs_per_call=gw.max_inputs_per_engine_call,
    )
    admission = TokenAdmission(settings.tokens_in_flight_limit(engine_kind))
    executor = ThreadPoolExecutor(gw.tokenizer_threads, thread_name_prefix="tokenize")
    pipeline = EmbeddingPipeline(gw, card, tokenizer, coalescer, admission, metrics, executor)

    def engine_view() -> EngineView:
        sup = supervisor() if supervisor else None
        started = any(e.ever_ready for e in pool.engines)
        reachable = pool.any_ready or not started or any(e.consecutive_failures < 5 for e in pool.engines)
        detail = "; ".join(
            f"{e.url}: {'ready' if e.ready else e.last_error or 'starting'}" for e in pool.engines
        )
        return EngineView(
            ready=pool.any_ready,
            alive=(sup.alive if sup else True) and reachable,
            started=started,
            restarts=sup.restarts if sup else 0,
            last_success_age_s=pool.last_success_age_s(),
            oldest_inflight_age_s=pool.oldest_inflight_age_s(),
            detail=(sup.detail + "; " if sup and sup.detail else "") + detail,
            engines=tuple(
                EngineStatus(e.url, e.ready, e.outstanding_tokens, e.calls, e.last_error)
                for e in pool.engines
            ),
        )

    def process_pids() -> dict[str, int]:
        import os

        pids = {"gateway": os.getpid()}
        if supervisor:
            pids.update(supervisor().pids)
        return pids

    health = create_health(settings, registry, engine_view, process_pids)

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

    app = FastAPI(title="embedserve", version="0.1.0", lifespan=lifespan)
    app.state.pool = pool
    app.state.coalescer = coalescer
    app.state.metrics = metrics
    app.state.card = card
    install_error_handlers(app)
    app.include_router(health.router)

    request_schema = EmbeddingRequest.model_json_schema(ref_template="#/components/schemas/{model}")

    @app.post(
        "/v1/embeddings",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}}
        },
    )
    async def embeddings(request: Request) -> Response:
        """OpenAI's embeddings endpoint (and ``truncate``, ``input_type``, ``instruction``)."""
        with metrics.request_seconds.time():
            try:
                response = await _embeddings(request)
            except APIError as err:
                response = error_response(err)
        metrics.requests.labels(str(response.status_code)).inc()
        return response

    async def _embeddings(request: Request) -> Response:
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise APIError(
                415, f"Content-Type must be application/json, got '{ctype}'", code="unsupported_media_type"
            )
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone mid-upload: nobody to answer, nothing to log as an error
            metrics.client_disconnects.inc()
            return Response(status_code=499)
        obj = parse_object(raw)
        try:
            req = EmbeddingRequest.model_validate(obj)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        work = asyncio.ensure_future(pipeline.run(req))
        watch = asyncio.ensure_future(_wait_disconnect(request))
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client went away: drop its queued inputs, answer nobody
            work.cancel()
            metrics.client_disconnects.inc()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            return Response(status_code=499)
        watch.cancel()
        result = work.result()
        return _json(result.body, headers=result.headers)

    def _model_entry() -> dict[str, Any]:
        return {
            "id": card.name,
            "object": "model",
            "created": card.created,
            "owned_by": "embedserve",
            "dimension": card.dimension,
            "max_seq_len": card.max_seq_len,
        }

    @app.get("/v1/models")
    async def list_models() -> Response:
        data = [_model_entry()] + [dict(_model_entry(), id=a) for a in card.aliases]
        return _json({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if not card.serves(model_id):
            raise APIError(
                404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
            )
        return _json(dict(_model_entry(), id=model_id))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        for e in pool.engines:
            metrics.engine_ready.labels(e.url).set(1 if e.ready else 0)
        metrics.queue_inputs.set(coalescer.queued_inputs)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    protected = (
        ("/v1",) + (("/health",) if gw.protect_health else ()) + (("/metrics",) if gw.protect_metrics else ())
    )
    keys = _load_api_keys(settings)
    # added first, so innermost: CORS, keys, size caps and request ids still apply to it
    app.add_middleware(RouteFastPath, method="POST", path="/v1/embeddings", handler=embeddings)
    if gw.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=gw.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"]
        )
    app.add_middleware(ApiKeyMiddleware, keys=keys, protected_prefixes=protected)
    app.add_middleware(BodyLimitMiddleware, max_bytes=gw.max_body_bytes)
    app.add_middleware(HeadLimitMiddleware, max_bytes=gw.max_head_bytes)
    app.add_middleware(RequestContextMiddleware)
    return app
