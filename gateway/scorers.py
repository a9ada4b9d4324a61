"""How a model scores query-document pairs: what it sends the engine, and how the engine's rows
become one score per pair. No HTTP here; ``gateway/scoring.py`` runs the steps.

- ``CosineScorer``: an embedding model. The query (with the model's instruction format, as
  ``input_type: "query"`` gets it) and each document are embedded alone, each cut to the cap, and
  a pair scores the cosine of the two vectors: what vLLM's score API does for embedding models.
  The query is embedded once however many documents it is paired with.

A scorer's ``prepare`` is CPU-heavy (it tokenises): call it off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from embedserve.contracts.wire import Matrix
from embedserve.gateway.tokenize import ModelTokenizer
from embedserve.model_info import ModelInfo

Scores = npt.NDArray[np.float64]


@dataclass(frozen=True)
class PairJob:
    """Pairs to score: pair ``i`` is ``(queries[query_of[i]], documents[i])``."""

    queries: list[str]
    documents: list[str]
    query_of: list[int]
    instruction: str | None = None
    max_pair_tokens: int | None = None  # a request's own, lower cap (vLLM's truncate_prompt_tokens)
    max_document_tokens: int | None = None  # Cohere v2's max_tokens_per_doc


@dataclass(frozen=True)
class PairTokens:
    """One pair's tokens before and after truncation."""

    original: int
    kept: int

    @property
    def truncated(self) -> bool:
        return self.original > self.kept


@dataclass
class PreparedPairs:
    """What to send the engine and how to read its answer."""

    inputs: list[list[int]]
    pairs: list[PairTokens]
    combine: Callable[[Matrix], Scores]  # the engine's rows (one per input) -> raw score per pair


class Scorer(Protocol):
    #: what the raw score is: "cosine", or "logit" (a relevance probability after the sigmoid)
    score_kind: str

    def prepare(self, job: PairJob) -> PreparedPairs: ...


def sigmoid(x: Scores) -> Scores:
    out: Scores = 1.0 / (1.0 + np.exp(-x))
    return out


class CosineScorer:
    """An embedding model's cosine between the query's vector and each document's."""

    score_kind = "cosine"

    def __init__(self, info: ModelInfo, tokenizer: ModelTokenizer) -> None:
        self.info = info
        self.tokenizer = tokenizer

    def _query_texts(self, job: PairJob) -> list[str]:
        template = self.info.query_template
        if template is None:
            return job.queries
        task = job.instruction or self.info.default_task
        return [template.format(task=task, text=q) for q in job.queries]

    def prepare(self, job: PairJob) -> PreparedPairs:
        queries = self.tokenizer.encode_texts(self._query_texts(job), job.max_pair_tokens)
        doc_cap = min(
            c for c in (job.max_pair_tokens, job.max_document_tokens, self.tokenizer.max_seq_len) if c
        )
        documents = self.tokenizer.encode_texts(job.documents, doc_cap)
        pairs = [
            PairTokens(queries[q].original_tokens + d.original_tokens, len(queries[q].ids) + len(d.ids))
            for q, d in zip(job.query_of, documents, strict=True)
        ]
        n_queries = len(queries)
        query_of = np.asarray(job.query_of)

        def combine(rows: Matrix) -> Scores:
            unit = rows.astype(np.float64)
            unit /= np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
            cos: Scores = np.einsum("pd,pd->p", unit[:n_queries][query_of], unit[n_queries:])
            return cos

        return PreparedPairs([x.ids for x in queries + documents], pairs, combine)
