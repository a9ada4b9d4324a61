"""The rerank and score routes' wire formats, in the shapes clients already send. Not what
flows through the pipeline: each body becomes a ``gateway.scoring.ScoreRequest``.

- ``RerankBody``: Cohere's ``/v1/rerank`` and ``/v2/rerank``, Jina's ``/v1/rerank`` (documents as
  strings or ``{"text": ...}``), as vLLM and Infinity serve them;
- ``TeiRerankBody``: TEI's ``/rerank`` (``texts``, ``raw_scores``, ``return_text``);
- ``ScoreBody``: vLLM's ``/v1/score`` and ``/score`` (``text_1`` and ``text_2``, one or many).

Unknown fields are ignored, as the peers' servers do; fields we take but the peers do not
(``truncate``, ``instruction``) are ours.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from embedserve.gateway.priority import PRIORITY, Priority

PositiveInt = Annotated[StrictInt, Field(ge=1)]
TRUNCATE = Field(True, description="cut over-long pairs (keeping special tokens); false: 400 instead")
INSTRUCTION = Field(
    None,
    description="the task, for models with an instruction format (Qwen3-Embedding's queries, Qwen3-Reranker)",
)


class TextDocument(BaseModel):
    """Jina's and Cohere's document object; other keys are ignored."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankBody(BaseModel):
    """Cohere / Jina rerank."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="default: the first model that can rerank")
    query: StrictStr
    documents: list[StrictStr | TextDocument]
    top_n: PositiveInt | None = Field(None, description="return the best N; default: all")
    return_documents: StrictBool = False
    raw_scores: StrictBool = Field(False, description="Infinity's: the model's logit, not its probability")
    max_tokens_per_doc: PositiveInt | None = Field(
        None, description="Cohere v2's: cut each document to N tokens"
    )
    truncate: StrictBool = TRUNCATE
    instruction: StrictStr | None = INSTRUCTION
    priority: Priority = PRIORITY

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class TeiRerankBody(BaseModel):
    """TEI's rerank; told apart from Cohere's by ``texts``."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="ours: which model, when several can rerank")
    query: StrictStr
    texts: list[StrictStr]
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool | None = Field(None, description="default true (TEI's auto-truncate)")
    truncation_direction: Literal["right", "Right"] = Field(
        "right", description="documents are cut at their end; 'left' is refused"
    )
    instruction: StrictStr | None = INSTRUCTION
    priority: Priority = PRIORITY


class ScoreBody(BaseModel):
    """vLLM's score: pairs 1:1, 1:N (``text_1`` one string) or N:N."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = Field(
        None, description="cut each pair to N tokens; -1 or null: the model's cap"
    )
    use_activation: StrictBool | None = Field(None, description="false: the model's logit (default true)")
    truncate: StrictBool = TRUNCATE
    instruction: StrictStr | None = INSTRUCTION
    priority: Priority = PRIORITY
