"""Cohere's embed wire format (``/v1/embed``, ``/v2/embed``), as the Cohere SDK, LangChain's
``CohereEmbeddings`` and LlamaIndex's ``CohereEmbedding`` send it. Not what flows through the
pipeline: ``gateway.cohere_routes`` turns a body into an ``EmbeddingRequest``.

Unknown fields are ignored, as Cohere's server does; fields Cohere has but a text embedding
server cannot honour (``images``, ``inputs``, ``input_type: "image"``) or that we do not
(``max_tokens``) are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from embedserve.core.vectors import OUTPUT_TYPES
from embedserve.gateway.priority import PRIORITY, Priority

#: Cohere's embedding types: ours, and ``base64`` (the float vector's little-endian float32 bytes)
CohereType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
COHERE_TYPES: tuple[str, ...] = get_args(CohereType)
assert set(OUTPUT_TYPES) < set(COHERE_TYPES)
InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


class CohereEmbedBody(BaseModel):
    """``POST /v1/embed`` and ``/v2/embed``."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="default: the first model that embeds")
    texts: list[StrictStr] | None = None
    images: list[Any] | None = Field(None, description="refused: this server embeds text")
    inputs: list[Any] | None = Field(None, description="v2's mixed inputs, refused: send texts")
    input_type: InputType | None = Field(
        None,
        description="search_query: the model's query instruction; classification, clustering: the "
        "instruction with a task of that kind; search_document: none",
    )
    embedding_types: list[CohereType] | None = Field(
        None, description="default: float (v1 then answers response_type embeddings_floats)"
    )
    truncate: Literal["NONE", "START", "END"] | None = Field(
        "END", description="cut an over-long text at its end or start (null: END); NONE: 400 instead"
    )
    output_dimension: PositiveInt | None = Field(None, description="Matryoshka: keep the first N")
    max_tokens: PositiveInt | None = Field(
        None, description="v2's per-text cap, refused: texts are cut at the model's max_seq_len"
    )
    instruction: StrictStr | None = Field(
        None, description="ours: the task for the instruction of models that have one (Qwen3-Embedding)"
    )
    priority: Priority = PRIORITY
