"""The gateway's routes: thin handlers over the pipeline. ``/v1/embeddings`` is also
served by ``RouteFastPath`` (gateway/middleware.py), past FastAPI's router."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from embedserve.engines.pool import EnginePool
from embedserve.gateway.coalesce import Coalescer
from embedserve.gateway.errors import APIError, error_response, validation_error
from embedserve.gateway.jsonbody import parse_object
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.pipeline import EmbeddingPipeline
from embedserve.gateway.schemas import EmbeddingRequest
from embedserve.http_server import wait_disconnect
from embedserve.model_info import ModelInfo

Handler = Callable[[Request], Awaitable[Response]]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def embeddings_handler(pipeline: EmbeddingPipeline, metrics: GatewayMetrics) -> Handler:
    """POST /v1/embeddings: OpenAI's endpoint (and ``truncate``, ``input_type``, ``instruction``)."""

    async def embeddings(request: Request) -> Response:
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
            raise validation_error(exc, obj, pipeline.settings.accept_token_ids) from exc
        work = asyncio.ensure_future(pipeline.run(req))
        watch = asyncio.ensure_future(wait_disconnect(request))
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client went away: drop its queued inputs, answer nobody
            work.cancel()
            metrics.client_disconnects.inc()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            return Response(status_code=499)
        watch.cancel()
        result = work.result()
        return json_response(result.body, headers=result.headers)

    return embeddings


def add_routes(
    app: FastAPI,
    embeddings: Handler,
    info: ModelInfo,
    pool: EnginePool,
    coalescer: Coalescer,
    metrics: GatewayMetrics,
    registry: CollectorRegistry,
) -> None:
    request_schema = EmbeddingRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    app.add_api_route(
        "/v1/embeddings",
        embeddings,
        methods=["POST"],
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}}
        },
    )

    def model_entry(model_id: str) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": info.created,
            "owned_by": "embedserve",
            "dimension": info.dimension,
            "max_seq_len": info.max_seq_len,
        }

    @app.get("/v1/models")
    async def list_models() -> Response:
        data = [model_entry(name) for name in (info.name, *info.aliases)]
        return json_response({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if not info.serves(model_id):
            raise APIError(
                404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
            )
        return json_response(model_entry(model_id))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        for e in pool.engines:
            metrics.engine_ready.labels(e.url).set(1 if e.ready else 0)
        metrics.queue_inputs.set(coalescer.queued_inputs)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
