"""The rerank and score routes: each client shape in, through ``ScorePipeline``, its shape out.

- ``POST /v1/rerank``, ``/rerank``, ``/v2/rerank``: Cohere's and Jina's body -> ``{"results":
  [{index, relevance_score, document?}], "usage"}``, best first; ``/rerank`` also takes TEI's body
  (``texts`` instead of ``documents``) -> ``[{index, score, text?}]``, best first;
- ``POST /v1/score``, ``/score``: vLLM's ``text_1`` / ``text_2`` -> ``{"data": [{index, score,
  object: "score"}], "usage"}``, in pair order.

Scores are relevance probabilities (a cross-encoder's sigmoid) or cosines (an embedding model);
``raw_scores`` / ``use_activation: false`` give a cross-encoder's logit. Each response lists the
pairs cut to the cap in ``truncated_inputs`` (TEI's bare list cannot: the header still counts them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from embedserve.core.scorers import PairJob
from embedserve.gateway.errors import APIError, validation_error, what
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.request_scope import Handler, answered, unless_gone
from embedserve.gateway.routes import json_response, read_object
from embedserve.gateway.score_schemas import RerankBody, ScoreBody, TeiRerankBody
from embedserve.gateway.scoring import ScorePipeline, ScoreRequest, ScoreResult

Shaped = tuple[Any, dict[str, str]]


#: list fields whose items are texts: what one item may be
ITEMS = {
    "documents": "a string or an object with a string 'text'",
    "texts": "a string",
    "text_1": "a string",
    "text_2": "a string",
}


def _parse(model: type[BaseModel], obj: dict[str, Any]) -> Any:
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        field = loc[0] if loc else None
        if field in ITEMS and len(loc) > 1 and isinstance(loc[1], int):
            i = loc[1]
            raise APIError(
                400,
                f"Invalid request: {field}[{i}] is {what(obj[field][i])}; each item must be {ITEMS[field]}",
                param=str(field),
                code="invalid_value",
            ) from exc
        raise validation_error(exc, obj) from exc


def _ranked(result: ScoreResult, raw: bool, top_n: int | None) -> list[tuple[int, float]]:
    """(index, score), best first (ties in document order), the best ``top_n``."""
    scores = result.activated(raw).tolist()
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [(i, scores[i]) for i in order[:top_n]]


def _usage(result: ScoreResult) -> dict[str, int]:
    return {"prompt_tokens": result.tokens, "total_tokens": result.tokens}


def _one_document_field(obj: dict[str, Any]) -> None:
    """A rerank body with TEI's ``texts`` and Cohere's ``documents`` is refused on every rerank
    route: ranking one list would drop the other without a word."""
    if "texts" in obj and "documents" in obj:
        raise APIError(
            400,
            "Send either 'documents' (Cohere, Jina) or 'texts' (TEI), not both",
            param="texts",
            code="invalid_value",
        )


async def cohere_rerank(
    pipeline: ScorePipeline, obj: dict[str, Any], request: Request, metrics: GatewayMetrics
) -> Shaped:
    _one_document_field(obj)
    body: RerankBody = _parse(RerankBody, obj)
    documents = body.texts()
    job = PairJob(
        [body.query],
        documents,
        [0] * len(documents),
        body.instruction,
        max_document_tokens=body.max_tokens_per_doc,
    )
    req = ScoreRequest(body.model, job, body.truncate, priority=body.priority)
    result = await unless_gone(request, pipeline.run(req), metrics)
    results = [
        {
            "index": i,
            "relevance_score": s,
            **({"document": {"text": documents[i]}} if body.return_documents else {}),
        }
        for i, s in _ranked(result, body.raw_scores, body.top_n)
    ]
    shaped = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": result.model,
        "results": results,
        "usage": _usage(result),
        "truncated_inputs": result.truncated(),
    }
    return shaped, result.headers


async def tei_rerank(
    pipeline: ScorePipeline, obj: dict[str, Any], request: Request, metrics: GatewayMetrics
) -> Shaped:
    _one_document_field(obj)
    body: TeiRerankBody = _parse(TeiRerankBody, obj)
    job = PairJob([body.query], body.texts, [0] * len(body.texts), body.instruction)
    truncate = True if body.truncate is None else body.truncate
    req = ScoreRequest(body.model, job, truncate, fields=("query", "texts"), priority=body.priority)
    result = await unless_gone(request, pipeline.run(req), metrics)
    ranks = [
        {"index": i, "score": s, **({"text": body.texts[i]} if body.return_text else {})}
        for i, s in _ranked(result, body.raw_scores, None)
    ]
    return ranks, result.headers


async def rerank_either(
    pipeline: ScorePipeline, obj: dict[str, Any], request: Request, metrics: GatewayMetrics
) -> Shaped:
    """``/rerank`` serves Cohere's and Jina's body and TEI's, told apart by their fields."""
    shape = tei_rerank if "texts" in obj else cohere_rerank
    return await shape(pipeline, obj, request, metrics)


def _pairs(body: ScoreBody) -> tuple[list[str], list[str], list[int]]:
    """vLLM's pairing: one text_1 against every text_2 (1:N), else pair by pair (N:N)."""
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not first:
        raise APIError(400, "'text_1' must not be empty", param="text_1", code="empty_input")
    if len(first) > 1 and len(first) != len(second):
        raise APIError(
            400,
            f"'text_1' has {len(first)} texts and 'text_2' {len(second)}: pairs are 1:1, 1:N or N:N",
            param="text_2",
            code="invalid_value",
        )
    return first, second, [0] * len(second) if len(first) == 1 else list(range(len(second)))


async def vllm_score(
    pipeline: ScorePipeline, obj: dict[str, Any], request: Request, metrics: GatewayMetrics
) -> Shaped:
    body: ScoreBody = _parse(ScoreBody, obj)
    first, second, query_of = _pairs(body)
    cap = body.truncate_prompt_tokens if body.truncate_prompt_tokens not in (None, -1, 0) else None
    job = PairJob(first, second, query_of, body.instruction, max_pair_tokens=cap)
    req = ScoreRequest(
        body.model, job, body.truncate, fields=("text_1", "text_2"), route="score", priority=body.priority
    )
    result = await unless_gone(request, pipeline.run(req), metrics)
    scores = result.activated(body.use_activation is False).tolist()
    shaped = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": result.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": _usage(result),
        "truncated_inputs": result.truncated(),
    }
    return shaped, result.headers


Shape = Callable[[ScorePipeline, dict[str, Any], Request, GatewayMetrics], Awaitable[Shaped]]


def score_handler(pipeline: ScorePipeline, metrics: GatewayMetrics, route: str, shape: Shape) -> Handler:
    """One route: the body, the shape's answer or the error envelope, and the route's metrics."""

    async def handle(request: Request) -> Response:
        answer, headers = await shape(pipeline, await read_object(request, metrics), request, metrics)
        return json_response(answer, headers=headers)

    def observe(status: int, seconds: float) -> None:
        metrics.score_seconds.labels(route).observe(seconds)
        metrics.score_requests.labels(route, str(status)).inc()

    return answered(handle, observe)


#: path -> (the metrics' route label, the shape)
ROUTES: dict[str, tuple[str, Shape]] = {
    "/v1/rerank": ("rerank", cohere_rerank),
    "/v2/rerank": ("rerank", cohere_rerank),
    "/rerank": ("rerank", rerank_either),
    "/v1/score": ("score", vllm_score),
    "/score": ("score", vllm_score),
}


BODIES: dict[Shape, tuple[type[BaseModel], ...]] = {
    cohere_rerank: (RerankBody,),
    rerank_either: (RerankBody, TeiRerankBody),
    vllm_score: (ScoreBody,),
}


def _request_schema(models: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    schemas = [m.model_json_schema(ref_template="#/components/schemas/{model}") for m in models]
    schema = schemas[0] if len(schemas) == 1 else {"oneOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_score_routes(app: FastAPI, pipeline: ScorePipeline, metrics: GatewayMetrics) -> None:
    for path, (route, shape) in ROUTES.items():
        app.add_api_route(
            path,
            score_handler(pipeline, metrics, route, shape),
            methods=["POST"],
            openapi_extra=_request_schema(BODIES[shape]),
        )
