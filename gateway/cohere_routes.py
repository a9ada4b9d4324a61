"""Cohere's embed API over the embeddings pipeline: ``POST /v2/embed`` and ``/v1/embed``.

A body becomes an ``EmbeddingRequest`` (so tokenising, truncation, admission, batching and the
engine are the OpenAI route's), and the pipeline's vectors leave in Cohere's shape:
``{"id", "embeddings", "texts", "meta": {"api_version", "billed_units": {"input_tokens"}},
"response_type"}``, ``embeddings`` keyed by type (v1 without ``embedding_types``: a list of float
vectors, ``response_type: "embeddings_floats"``), plus our ``truncated_inputs`` and
``unknown_token_inputs``. Errors use the one envelope, with Cohere's field names.

``input_type`` maps onto the model's instruction format as the OpenAI route's ``input_type:
"query"`` does: ``search_query`` gets the query instruction (with ``instruction`` or the
configured default task), ``classification`` and ``clustering`` the same format with a task of
their kind for every text (Qwen3-Embedding instructs all inputs of those tasks), and
``search_document`` nothing. A model without an instruction format embeds every text as it is.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import Response

from embedserve.core.vectors import OutputType, encode_rows
from embedserve.gateway.cohere_schemas import COHERE_TYPES, CohereEmbedBody
from embedserve.gateway.errors import APIError, error_response, renamed, validation_error, what
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.pipeline import EmbeddingResult
from embedserve.gateway.routes import ClientGone, Handler, json_response, read_object, unless_gone
from embedserve.gateway.schemas import EmbeddingRequest

#: the instruction's task for Cohere's input types that instruct every text
TASKS = {
    "classification": "Classify the given text",
    "clustering": "Identify the topic or theme of the given text",
}
#: our field names in error messages -> Cohere's
NAMES = {"'input'": "'texts'", "input[": "texts[", "'dimensions'": "'output_dimension'",
         "truncate=true": '"truncate": "END" or "START"'}
PARAMS = {"input": "texts", "dimensions": "output_dimension"}


def _parse(obj: dict[str, Any]) -> CohereEmbedBody:
    try:
        return CohereEmbedBody.model_validate(obj)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        if loc and loc[0] in ("embedding_types", "texts") and len(loc) > 1 and isinstance(loc[1], int):
            field, i = str(loc[0]), loc[1]
            value = obj[field][i]
            shown = repr(value) if isinstance(value, str) else what(value)
            allowed = "one of " + ", ".join(COHERE_TYPES) if field == "embedding_types" else "a string"
            raise APIError(400, f"Invalid request: {field}[{i}] is {shown}; each must be {allowed}",
                           param=field, code="invalid_value") from exc
        raise validation_error(exc, obj) from exc


def _refused(field: str, message: str) -> APIError:
    return APIError(400, message, param=field, code="invalid_value")


def to_request(body: CohereEmbedBody, model: str) -> EmbeddingRequest:
    """The pipeline's request for a Cohere body (float vectors; the types are encoded here)."""
    if body.images is not None or body.input_type == "image":
        field = "images" if body.images is not None else "input_type"
        raise _refused(field, "This server embeds text: send 'texts' (images are not supported)")
    if body.inputs is not None:
        raise _refused("inputs", "Send 'texts' (a list of strings); 'inputs' is not supported")
    if body.max_tokens is not None:
        raise _refused("max_tokens", "'max_tokens' is not supported: texts are cut at the model's "
                                     "max_seq_len (GET /v1/models), as 'truncate' says")
    if body.texts is None:
        raise APIError(400, "Invalid request: 'texts' is required", param="texts", code="invalid_value")
    query = body.input_type in ("search_query", *TASKS)
    return EmbeddingRequest(
        input=body.texts,
        model=model,
        dimensions=body.output_dimension,
        truncate=body.truncate != "NONE",
        truncation_direction="left" if body.truncate == "START" else "right",
        input_type="query" if query else None,
        instruction=(body.instruction or TASKS.get(body.input_type or "")) if query else body.instruction,
        priority=body.priority,
    )


def by_type(result: EmbeddingResult, types: Sequence[str]) -> dict[str, list[Any]]:
    """``embeddings`` keyed by each asked type, in the order asked (repeats once); ``base64`` is
    the float vector's bytes."""
    return {t: encode_rows(result.vectors, cast(OutputType, "float" if t == "base64" else t), t == "base64")
            for t in dict.fromkeys(types)}


def shape(body: CohereEmbedBody, result: EmbeddingResult, version: int) -> dict[str, Any]:
    tokens = result.body["usage"]["prompt_tokens"]
    floats = version == 1 and body.embedding_types is None
    embeddings: Any = list(result.vectors) if floats else by_type(result, body.embedding_types or ["float"])
    return {
        "id": str(uuid.uuid4()),
        "embeddings": embeddings,
        "texts": body.texts,
        "meta": {"api_version": {"version": str(version)}, "billed_units": {"input_tokens": tokens}},
        "response_type": "embeddings_floats" if floats else "embeddings_by_type",
        "truncated_inputs": result.body["truncated_inputs"],
        "unknown_token_inputs": result.body["unknown_token_inputs"],
    }


def cohere_error(err: APIError) -> APIError:
    """The pipeline's error with Cohere's field names."""
    return renamed(err, NAMES, PARAMS)


def cohere_handler(
    run: Callable[[EmbeddingRequest], Awaitable[EmbeddingResult]],
    metrics: GatewayMetrics,
    default_model: str,
    version: int,
) -> Handler:
    """POST /v{version}/embed; ``run``: the request's model's pipeline; ``default_model``: the
    model a body without ``model`` gets (Cohere's v1 makes it optional)."""

    async def handle(request: Request) -> Response:
        with metrics.request_seconds.time():
            try:
                body = _parse(await read_object(request, metrics))
                req = to_request(body, body.model or default_model)
                result = await unless_gone(request, run(req), metrics)
                response = json_response(shape(body, result, version), headers=result.headers)
            except APIError as err:
                response = error_response(cohere_error(err))
            except ClientGone:
                response = Response(status_code=499)
        metrics.requests.labels(str(response.status_code)).inc()
        return response

    return handle


def add_cohere_routes(
    app: FastAPI,
    run: Callable[[EmbeddingRequest], Awaitable[EmbeddingResult]],
    metrics: GatewayMetrics,
    default_model: str,
) -> None:
    schema = CohereEmbedBody.model_json_schema(ref_template="#/components/schemas/{model}")
    extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
    for version in (1, 2):
        app.add_api_route(
            f"/v{version}/embed",
            cohere_handler(run, metrics, default_model, version),
            methods=["POST"],
            openapi_extra=extra,
        )
