"""The gateway's routes: thin handlers over the pipeline. ``/v1/embeddings`` is also
served by ``RouteFastPath`` (gateway/middleware.py), past FastAPI's router."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from embedserve.gateway.errors import APIError, validation_error
from embedserve.gateway.jsonbody import parse_object
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.pipeline import EmbeddingResult
from embedserve.gateway.request_scope import ClientGone, Handler, answered, unless_gone
from embedserve.gateway.schemas import EmbeddingRequest
from embedserve.gateway.served import ModelRuntime

Body = TypeVar("Body", bound=BaseModel)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def read_object(request: Request, metrics: GatewayMetrics) -> dict[str, Any]:
    """The JSON object of the body; ``APIError`` 400 / 415, ``ClientGone`` mid-upload."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(
            415, f"Content-Type must be application/json, got '{ctype}'", code="unsupported_media_type"
        )
    try:
        raw = await request.body()
    except ClientDisconnect as exc:  # gone mid-upload: nobody to answer, nothing to log as an error
        metrics.client_disconnects.inc()
        raise ClientGone from exc
    return parse_object(raw)


async def read_body(
    request: Request, metrics: GatewayMetrics, model: type[Body], accept_token_ids: bool = True
) -> Body:
    """The body as ``model``; ``APIError`` 400 naming the field for one that does not fit."""
    obj = await read_object(request, metrics)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc, obj, accept_token_ids) from exc


def counted(handle: Callable[[Request], Awaitable[Response]], metrics: GatewayMetrics) -> Handler:
    """``handle`` answered in the envelope and counted with the embeddings routes' requests."""

    def observe(status: int, seconds: float) -> None:
        metrics.request_seconds.observe(seconds)
        metrics.requests.labels(str(status)).inc()

    return answered(handle, observe)


def embeddings_handler(
    run: Callable[[EmbeddingRequest], Awaitable[EmbeddingResult]], metrics: GatewayMetrics,
    accept_token_ids: bool,
) -> Handler:
    """POST /v1/embeddings: OpenAI's endpoint (and ``truncate``, ``input_type``, ``instruction``);
    ``run``: the request's model's pipeline; ``accept_token_ids``: as the gateway is set."""

    async def embeddings(request: Request) -> Response:
        req = await read_body(request, metrics, EmbeddingRequest, accept_token_ids)
        result = await unless_gone(request, run(req), metrics)
        return json_response(result.body, headers=result.headers)

    return counted(embeddings, metrics)


def add_routes(
    app: FastAPI,
    embeddings: Handler,
    runtimes: list[ModelRuntime],
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

    def model_entry(model_id: str, r: ModelRuntime) -> dict[str, Any]:
        info = r.info
        return {
            "id": model_id,
            "object": "model",
            "created": info.created,
            "owned_by": "embedserve",
            "kind": r.kind,  # embed: /v1/embeddings and rerank by cosine; rerank: /v1/rerank and /v1/score
            "dimension": info.dimension,
            "max_seq_len": info.max_seq_len,
            "outputs": list(info.outputs) if info.embeds else [],  # what /v1/embeddings' 'outputs' may ask
        }

    @app.get("/v1/models")
    async def list_models() -> Response:
        data = [model_entry(name, r) for r in runtimes for name in (r.info.name, *r.info.aliases)]
        return json_response({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        found = next((r for r in runtimes if r.info.serves(model_id)), None)
        if found is None:
            raise APIError(
                404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
            )
        return json_response(model_entry(model_id, found))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.queue_inputs.set(sum(r.coalescer.queued_inputs for r in runtimes))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
