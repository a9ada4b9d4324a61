"""How a model scores query-document pairs: what it sends the engine, and how the engine's rows
become one score per pair. No HTTP here; ``gateway/scoring.py`` runs the steps.

- ``CosineScorer``: an embedding model. The query (with the model's instruction format, as
  ``input_type: "query"`` gets it) and each document are embedded alone, each cut to the cap, and
  a pair scores the cosine of the two vectors: what vLLM's score API does for embedding models.
  The query is embedded once however many documents it is paired with.

- ``MaxSimScorer``: a model with a ColBERT output (BGE-M3). The query and each document are
  tokenised as for ``CosineScorer`` and the engine answers their token vectors; a pair scores
  their MaxSim (``core/hybrid.py``). The query's vectors are computed once per request.

- ``PairScorer``: a reranker. Each pair is one input (``service/core/pairs.py`` frames and cuts it),
  and the engine answers its logit: a cross-encoder's one label, or Qwen3-Reranker's "yes" over
  "no"; the relevance score is its sigmoid.

A scorer's ``prepare`` is CPU-heavy (it tokenises): call it off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from embedserve.contracts.hybrid import Output
from embedserve.contracts.wire import Matrix
from embedserve.core.hybrid import maxsim
from embedserve.core.pairs import CrossEncoderPairs, PairIds, YesNoPrompts
from embedserve.core.tokenize import ItemTokens, ModelTokenizer, UnknownTokens
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


@dataclass
class PreparedPairs:
    """What to send the engine and how to read its answer."""

    inputs: list[list[int]]
    pairs: list[ItemTokens]  # one per pair: its tokens before and after truncation, and unknown ones
    combine: Callable[[Matrix], Scores]  # the engine's rows (one per input) -> raw score per pair


@dataclass
class PreparedTokens:
    """What to send the engine for its ``outputs`` (ColBERT's), and how to score them."""

    inputs: list[list[int]]
    pairs: list[ItemTokens]
    outputs: tuple[Output, ...]
    combine: Callable[[list[Matrix]], Scores]  # each input's token vectors -> raw score per pair


class Scorer(Protocol):
    #: what the raw score is: "cosine", "maxsim", or "logit" (a relevance probability after the sigmoid)
    score_kind: str

    def prepare(self, job: PairJob) -> PreparedPairs | PreparedTokens: ...


def sigmoid(x: Scores) -> Scores:
    out: Scores = 1.0 / (1.0 + np.exp(-x))
    return out


class _QueryDocuments:
    """An embedding model's pairs: the queries (in its instruction format) and the documents
    embedded alone."""

    def __init__(self, info: ModelInfo, tokenizer: ModelTokenizer) -> None:
        self.info = info
        self.tokenizer = tokenizer

    def _query_texts(self, job: PairJob) -> list[str]:
        template = self.info.query_template
        if template is None:
            return job.queries
        task = job.instruction or self.info.default_task
        return [template.format(task=task, text=q) for q in job.queries]

    def _tokens(self, job: PairJob) -> tuple[list[list[int]], list[ItemTokens]]:
        """The queries' ids, then the documents', each cut to the cap; each pair's tokens."""
        queries = self.tokenizer.encode_texts(self._query_texts(job), job.max_pair_tokens)
        frame = len(self.tokenizer.prefix) + len(self.tokenizer.suffix)
        own = job.max_document_tokens + frame if job.max_document_tokens else None
        doc_cap = min(c for c in (job.max_pair_tokens, own, self.tokenizer.max_seq_len) if c)
        documents = self.tokenizer.encode_texts(job.documents, doc_cap)
        pairs = [
            ItemTokens(
                queries[q].original_tokens + d.original_tokens,
                len(queries[q].ids) + len(d.ids),
                UnknownTokens.of(queries[q].unknown, d.unknown),
            )
            for q, d in zip(job.query_of, documents, strict=True)
        ]
        return [x.ids for x in queries + documents], pairs


class CosineScorer(_QueryDocuments):
    """An embedding model's cosine between the query's vector and each document's."""

    score_kind = "cosine"

    def prepare(self, job: PairJob) -> PreparedPairs:
        inputs, pairs = self._tokens(job)
        n_queries = len(job.queries)
        query_of = np.asarray(job.query_of)

        def combine(rows: Matrix) -> Scores:
            unit = rows.astype(np.float64)
            unit /= np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
            cos: Scores = np.einsum("pd,pd->p", unit[:n_queries][query_of], unit[n_queries:])
            return cos

        return PreparedPairs(inputs, pairs, combine)


class MaxSimScorer(_QueryDocuments):
    """A ColBERT model's MaxSim between the query's token vectors and each document's."""

    score_kind = "maxsim"

    def prepare(self, job: PairJob) -> PreparedTokens:
        inputs, pairs = self._tokens(job)
        n_queries = len(job.queries)

        def combine(vectors: list[Matrix]) -> Scores:
            return np.asarray(
                [maxsim(vectors[q], vectors[n_queries + p]) for p, q in enumerate(job.query_of)],
                dtype=np.float64,
            )

        return PreparedTokens(inputs, pairs, ("colbert",), combine)


class PairScorer:
    """A reranker's logit per pair: a cross-encoder, or Qwen3-Reranker (its prompt and ``instruction``)."""

    score_kind = "logit"

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.pairs = (
            CrossEncoderPairs(info.path, info.max_seq_len)
            if info.scoring == "cross-encoder"
            else YesNoPrompts(info.path, info.max_seq_len)
        )

    def _encode(self, job: PairJob) -> list[PairIds]:
        if isinstance(self.pairs, CrossEncoderPairs):
            return self.pairs.encode(
                job.queries, job.documents, job.query_of, job.max_pair_tokens, job.max_document_tokens
            )
        return self.pairs.encode(
            job.queries,
            job.documents,
            job.query_of,
            job.instruction,
            job.max_pair_tokens,
            job.max_document_tokens,
        )

    def prepare(self, job: PairJob) -> PreparedPairs:
        encoded = self._encode(job)
        pairs = [ItemTokens(p.original_tokens, len(p.ids), p.unknown) for p in encoded]

        def combine(rows: Matrix) -> Scores:
            logits: Scores = rows[:, 0].astype(np.float64)
            return logits

        return PreparedPairs([p.ids for p in encoded], pairs, combine)


def scorer_for(info: ModelInfo, tokenizer: ModelTokenizer) -> Scorer:
    """A reranker scores its pairs; a model with a ColBERT output ranks by MaxSim; other
    embedding models by cosine."""
    if not info.embeds:
        return PairScorer(info)
    return MaxSimScorer(info, tokenizer) if "colbert" in info.outputs else CosineScorer(info, tokenizer)
