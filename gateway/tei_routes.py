"""TEI's sparse and per-token routes over the embeddings pipeline: ``POST /embed_sparse`` and
``/embed_all``, for a model with a sparse or a ColBERT output.

A body becomes an ``EmbeddingRequest`` asking that output (so tokenising, truncation, admission,
the coalescer's turns and the engine are ``/v1/embeddings``'), and the answer leaves in TEI's
shape: ``/embed_sparse`` a list per input of ``{"index": token id, "value": weight}`` (ids
ascending, as TEI lists the non-zero ones), ``/embed_all`` a list per input of its token vectors
(the ColBERT head's: TEI answers the raw last hidden states there, which a ColBERT model does not
score with). A single string is a batch of one, as in TEI. Errors come in the one envelope, as
on TEI's ``/rerank`` here, with TEI's field name (``inputs``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)
from starlette.responses import Response

from embedserve.contracts.hybrid import Output
from embedserve.gateway.errors import APIError, renamed
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.pipeline import EmbeddingResult
from embedserve.gateway.priority import PRIORITY, Priority
from embedserve.gateway.request_scope import Handler, unless_gone
from embedserve.gateway.routes import counted, json_response, read_body
from embedserve.gateway.schemas import EmbeddingRequest

#: our field names in error messages -> TEI's
NAMES = {"'input'": "'inputs'", "input[": "inputs["}
PARAMS = {"input": "inputs"}


class TeiEmbedBody(BaseModel):
    """TEI's ``EmbedSparseRequest`` and ``EmbedAllRequest`` (text inputs), and our few fields."""

    model_config = ConfigDict(extra="ignore")

    inputs: StrictStr | list[StrictStr]
    truncate: StrictBool | None = Field(None, description="default true (TEI's auto-truncate)")
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: StrictStr | None = Field(
        None, description="'query': the model's query instruction, as input_type query; no other prompts"
    )
    model: StrictStr | None = Field(
        None, description="ours: which model (default: the first with the route's output)"
    )
    sparse_top_k: Annotated[StrictInt, Field(ge=1)] | None = Field(None, description="ours, /embed_sparse")
    sparse_min_weight: Annotated[StrictInt | StrictFloat, Field(ge=0)] | None = Field(
        None, description="ours, /embed_sparse"
    )
    priority: Priority = PRIORITY


def to_request(body: TeiEmbedBody, output: Output, model: str) -> EmbeddingRequest:
    if body.prompt_name not in (None, "query"):
        raise APIError(400, f"'prompt_name' may be 'query' (the model's query instruction), got "
                            f"{body.prompt_name!r}", param="prompt_name", code="invalid_value")
    return EmbeddingRequest(
        input=body.inputs,
        model=model,
        truncate=True if body.truncate is None else body.truncate,
        truncation_direction=body.truncation_direction,
        input_type="query" if body.prompt_name else None,
        outputs=[output],
        sparse_top_k=body.sparse_top_k,
        sparse_min_weight=body.sparse_min_weight,
        priority=body.priority,
    )


def shape(result: EmbeddingResult, output: Output) -> list[Any]:
    answer = result.outputs
    assert answer is not None
    if output == "sparse":
        assert answer.sparse is not None
        return [[{"index": i, "value": v} for i, v in zip(s.indices, s.values, strict=True)]
                for s in answer.sparse]
    assert answer.colbert is not None
    return list(answer.colbert)


def tei_handler(
    run: Callable[[EmbeddingRequest], Awaitable[EmbeddingResult]],
    metrics: GatewayMetrics,
    default_model: str,
    output: Output,
) -> Handler:
    """``run``: the request's model's pipeline; ``default_model``: what a body without ``model`` gets."""

    async def handle(request: Request) -> Response:
        body = await read_body(request, metrics, TeiEmbedBody)
        try:
            req = to_request(body, output, body.model or default_model)
            result = await unless_gone(request, run(req), metrics)
        except APIError as err:
            raise renamed(err, NAMES, PARAMS) from err
        return json_response(shape(result, output), headers=result.headers)

    return counted(handle, metrics)


ROUTES: dict[str, Output] = {"/embed_sparse": "sparse", "/embed_all": "colbert"}


def add_tei_routes(
    app: FastAPI,
    run: Callable[[EmbeddingRequest], Awaitable[EmbeddingResult]],
    metrics: GatewayMetrics,
    default_model: Callable[[Output], str],
) -> None:
    """``default_model(output)``: the model a body without ``model`` gets on that output's route."""
    schema = TeiEmbedBody.model_json_schema(ref_template="#/components/schemas/{model}")
    extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
    for path, output in ROUTES.items():
        app.add_api_route(
            path, tei_handler(run, metrics, default_model(output), output), methods=["POST"],
            openapi_extra=extra,
        )
