"""vLLM's pooling route over the embeddings pipeline: ``POST /pooling``, whose answer the
request's ``task`` decides.

``task: "embed"`` (the default) is the model's dense vector and ``"token_embed"`` its ColBERT
vectors (vLLM's BGE-M3 and ColBERT models answer that task with the ``colbert_linear`` head's
rows). A body becomes an ``EmbeddingRequest`` asking that output, so tokenising, truncation,
admission, the coalescer's turns and the engine are ``/v1/embeddings``'; the answer leaves in
vLLM's ``PoolingResponse`` shape: per input ``{"index", "object": "pooling", "data"}``, ``data``
the vector, the list of token vectors, or with base64 one string of the whole array's
little-endian float32 bytes (vLLM's ``tensor2binary`` of the output).

vLLM answers BGE-M3's ``token_classify`` with each token's ``sparse_linear`` weight, BOS and EOS
dropped, one per position; our sparse output is already the weights' max per token id (zeros
and special tokens dropped), from which the per-position list cannot be rebuilt. So that task is
a 400 naming the tasks served here and the routes that answer the sparse vector. Unknown fields
are ignored, as vLLM's server does (it logs them); fields we cannot honour are refused by name.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.responses import Response

from embedserve.contracts.hybrid import Output
from embedserve.contracts.wire import encode_base64
from embedserve.gateway.errors import APIError
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.pipeline import EmbeddingResult
from embedserve.gateway.priority import PRIORITY, Priority
from embedserve.gateway.request_scope import Handler, unless_gone
from embedserve.gateway.routes import counted, json_response, read_body
from embedserve.gateway.schemas import EmbeddingInput, EmbeddingRequest

#: vLLM's pooling tasks
Task = Literal["embed", "classify", "token_embed", "token_classify", "embed&token_classify", "plugin"]
#: the tasks served here, and the output each answers
TASKS: dict[str, Output] = {"embed": "dense", "token_embed": "colbert"}


class PoolingBody(BaseModel):
    """vLLM's ``PoolingCompletionRequest`` (``input``, not chat ``messages``), the fields it reads."""

    model_config = ConfigDict(extra="ignore")

    input: EmbeddingInput
    model: StrictStr | None = Field(None, description="default: the first model with the task's output")
    task: Task = Field("embed", description="embed: the dense vector; token_embed: the ColBERT vectors")
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: StrictStr = Field("float32", description="float32 only")
    endianness: Literal["native", "little", "big"] = Field("native", description="native or little")
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = Field(
        None, description="-1: cut an over-long input at the model's cap; null: 400 instead"
    )
    truncation_side: Literal["left", "right"] = "right"
    add_special_tokens: StrictBool = Field(True, description="true only")
    dimensions: StrictInt | None = Field(None, description="refused, as vLLM's /pooling does")
    use_activation: StrictBool | None = Field(None, description="null or true: vectors as /v1/embeddings'")
    priority: Priority = PRIORITY


def _refuse(field: str, why: str) -> APIError:
    return APIError(400, f"'{field}' {why}", param=field, code="invalid_value")


def check_fields(body: PoolingBody) -> None:
    """``APIError`` 400 naming a field vLLM takes that this server cannot honour."""
    if body.embed_dtype != "float32":
        raise _refuse("embed_dtype", f"may be 'float32' (the only dtype served), got {body.embed_dtype!r}")
    if body.endianness == "big":
        raise _refuse("endianness", "may be 'native' or 'little' (base64 here is little-endian float32)")
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens != -1:
        raise _refuse("truncate_prompt_tokens", "may be -1 (cut at the model's cap) or null (an over-long "
                      f"input is a 400); a cap of its own is not served, got {body.truncate_prompt_tokens}")
    if not body.add_special_tokens:
        raise _refuse("add_special_tokens", "may be true only: the model's vectors are made with them")
    if body.dimensions is not None:
        raise _refuse("dimensions", "is not served on /pooling (as in vLLM); use /v1/embeddings")
    if body.use_activation is False:
        raise _refuse("use_activation", "may be true or null: the vectors are as /v1/embeddings gives them")


def check_task(task: str, model: str, outputs: tuple[Output, ...] | None) -> Output:
    """The output ``task`` asks of ``model`` (``outputs``: its outputs; None: not served here,
    left to the pipeline's 404); ``APIError`` 400 naming what the model serves."""
    output = TASKS.get(task)
    offered = tuple(TASKS.values()) if outputs is None else outputs
    served = [t for t, o in TASKS.items() if o in offered]
    if output is None or output not in offered:
        has = "" if outputs is None else f"The model '{model}' has the outputs {list(outputs)}: "
        sparse = ""
        if task == "token_classify" and outputs and "sparse" in outputs:
            sparse = (" (its sparse vector, the weights' max per token id, is on /embed_sparse and on "
                      "/v1/embeddings with outputs [\"sparse\"]; vLLM's per-position weights are not kept)")
        raise APIError(
            400,
            f"{has}/pooling serves the tasks {served}, not {task!r}{sparse}",
            param="task",
            code="unsupported_output",
        )
    return output


def to_request(body: PoolingBody, output: Output, model: str) -> EmbeddingRequest:
    return EmbeddingRequest(
        input=body.input,
        model=model,
        encoding_format=body.encoding_format,
        truncate=body.truncate_prompt_tokens == -1,
        truncation_direction=body.truncation_side,
        outputs=[output],
        priority=body.priority,
    )


def pooled(result: EmbeddingResult, output: Output, as_base64: bool) -> list[Any]:
    """Each input's ``data``: the pipeline's own items where they are vLLM's shape already."""
    if output == "dense":
        return [item["embedding"] for item in result.body["data"]]
    answer = result.outputs
    assert answer is not None and answer.colbert is not None
    if not as_base64:
        return [item["colbert_embedding"] for item in result.body["data"]]
    return [encode_base64(m.reshape(1, -1))[0] for m in answer.colbert]  # one string holds all its rows


def response(result: EmbeddingResult, output: Output, as_base64: bool, created: int) -> dict[str, Any]:
    """vLLM's ``PoolingResponse``."""
    usage = result.body["usage"]
    return {
        "id": f"pool-{uuid.uuid4().hex}",
        "object": "list",
        "created": created,
        "model": result.body["model"],
        "data": [{"index": i, "object": "pooling", "data": d}
                 for i, d in enumerate(pooled(result, output, as_base64))],
        "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"],
                  "completion_tokens": 0, "prompt_tokens_details": None},
    }


def pooling_handler(
    run: Callable[[EmbeddingRequest], Awaitable[EmbeddingResult]],
    metrics: GatewayMetrics,
    default_model: Callable[[Output], str],
    outputs_of: Callable[[str], tuple[Output, ...] | None],
    clock: Callable[[], float] = time.time,
) -> Handler:
    """``default_model(output)``: what a body without ``model`` gets; ``outputs_of(model)``: its
    outputs (None: no such model)."""

    async def handle(request: Request) -> Response:
        body = await read_body(request, metrics, PoolingBody)
        check_fields(body)
        model = body.model or default_model(TASKS.get(body.task, "dense"))
        output = check_task(body.task, model, outputs_of(model))
        result = await unless_gone(request, run(to_request(body, output, model)), metrics)
        as_base64 = body.encoding_format == "base64"
        return json_response(response(result, output, as_base64, int(clock())), headers=result.headers)

    return counted(handle, metrics)


def add_vllm_routes(
    app: FastAPI,
    run: Callable[[EmbeddingRequest], Awaitable[EmbeddingResult]],
    metrics: GatewayMetrics,
    default_model: Callable[[Output], str],
    outputs_of: Callable[[str], tuple[Output, ...] | None],
) -> None:
    schema = PoolingBody.model_json_schema(ref_template="#/components/schemas/{model}")
    extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
    app.add_api_route("/pooling", pooling_handler(run, metrics, default_model, outputs_of),
                      methods=["POST"], openapi_extra=extra)
