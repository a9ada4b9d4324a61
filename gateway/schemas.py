"""The OpenAI wire format (and our few additions). Not what flows through the pipeline:
``gateway.pipeline`` turns a validated request into internal work items."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from embedserve.contracts.hybrid import Output
from embedserve.core.vectors import OutputType
from embedserve.gateway.late_chunking import LateChunking
from embedserve.gateway.long_inputs import Truncate
from embedserve.gateway.priority import PRIORITY, Priority

TokenIds = list[StrictInt]
EmbeddingInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


def _null_is_float(value: object) -> object:
    return "float" if value is None else value


#: ``null`` (what some clients send for "the default", as for ``dimensions``) is ``float``
EncodingFormat = Annotated[Literal["float", "base64"], BeforeValidator(_null_is_float)]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings. Unknown fields are ignored, as OpenAI's server does."""

    model_config = ConfigDict(extra="ignore")

    input: EmbeddingInput = Field(
        ..., description="a string, a list of strings, token ids or a list of token-id lists"
    )
    model: StrictStr
    encoding_format: EncodingFormat = "float"
    dimensions: Annotated[StrictInt, Field(description="Matryoshka: keep the first N")] | None = None
    user: StrictStr | None = None
    truncate: Truncate | None = Field(
        None,
        description="true: cut over-long inputs (keeping special tokens); false: 400 instead; "
        "'chunk': embed them whole, in windows of the cap pooled into one vector. Default: the "
        "model's long_inputs (truncate unless set)",
    )
    truncation_direction: Literal["right", "left", "Right", "Left"] = Field(
        "right", description="TEI's: cut an over-long input at its end (right) or its start (left)"
    )
    embedding_type: OutputType = Field(
        "float",
        description="float, int8, uint8 (fixed range [-1, 1]), binary or ubinary (packed sign bits), "
        "as sentence-transformers' quantize_embeddings; with encoding_format base64, the bytes",
    )
    input_type: Literal["query", "document"] | None = Field(
        None, description="'query' applies the model's instruction format (Qwen3-Embedding)"
    )
    instruction: StrictStr | None = Field(
        None, description="task description for queries; default from the service config"
    )
    priority: Priority = PRIORITY
    late_chunking: LateChunking | None = Field(
        None,
        description="one pass over each input, its token states mean-pooled per chunk: one vector per "
        "chunk (data items with input_index and span); CPU engine, mean-pooling models only",
    )
    outputs: Annotated[list[Output], Field(min_length=1)] | None = Field(
        None,
        description="what each item carries, of the model's outputs (GET /v1/models): dense ('embedding'), "
        "sparse ('sparse_embedding': {indices, values}), colbert ('colbert_embedding': a vector per token). "
        "Default: dense",
    )
    sparse_top_k: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="keep each sparse vector's K largest weights"
    )
    sparse_min_weight: Annotated[StrictInt | StrictFloat, Field(ge=0)] | None = Field(
        None, description="drop sparse weights below this"
    )
