"""The rerank and score pipeline: validate → tokenise and truncate each pair → admit → coalesce
→ one score per pair. The routes (``gateway/score_routes.py``) turn the clients' shapes into a
``ScoreRequest`` and the result back into their shapes; every step and its error live here.

Pairs take the same path as embeddings once they are token ids (``EngineCaller``): the same
coalescer, whose turns keep a 1,000-document rerank from holding up one-input requests, the same
admission bound and 429s, the same deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from embedserve.config import GatewaySettings
from embedserve.config.served import RerankLimits
from embedserve.core import tracing
from embedserve.core.scorers import PairJob, PreparedTokens, Scorer, Scores, sigmoid
from embedserve.gateway.engine_call import EngineCaller, ServingGate
from embedserve.gateway.errors import APIError
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.request_step import Limits, Naming, RequestStep, Tokenized, check_text
from embedserve.model_info import ModelInfo


@dataclass(frozen=True)
class ScoreRequest:
    """What a client asked for, whatever its shape; ``fields`` names the request's own query
    and document fields in errors (``query``/``documents``, ``query``/``texts``, ``text_1``/``text_2``)."""

    model: str | None
    job: PairJob
    truncate: bool = True
    fields: tuple[str, str] = ("query", "documents")
    route: str = "rerank"  # for the per-model metrics: rerank or score
    priority: int = 0  # lower is served first


@dataclass(frozen=True)
class ScoredModel:
    """A served model that can score, and what scoring with it needs."""

    info: ModelInfo
    scorer: Scorer
    caller: EngineCaller

    @property
    def max_seq_len(self) -> int:
        return self.info.max_seq_len


@dataclass
class ScoreResult:
    model: str
    scores: Scores  # one per pair, in the request's order: after the activation unless raw
    raw: Scores
    cut: list[dict[str, int]]  # the pairs cut to the cap, as /v1/embeddings lists its inputs
    tokens: int
    headers: dict[str, str]

    def truncated(self) -> list[dict[str, int]]:
        """As /v1/embeddings reports it, by pair (document) index."""
        return self.cut

    def activated(self, raw: bool) -> Scores:
        return self.raw if raw else self.scores


class ScorePipeline:
    def __init__(
        self,
        settings: GatewaySettings,
        limits: RerankLimits,
        models: Callable[[str | None, str], ScoredModel],
        gate: ServingGate,
        metrics: GatewayMetrics,
        executor: Executor,
    ) -> None:
        """``models(name, param)``: the scoring model a request names (None: the default one), or
        an ``APIError`` 404 naming ``param``."""
        self.settings = settings
        self.limits = limits
        self.models = models
        self.gate = gate
        self.metrics = metrics
        self.step = RequestStep(metrics)
        self.executor = executor

    # -- validation ------------------------------------------------------------------
    def _check_texts(self, req: ScoreRequest) -> None:
        query_field, docs_field = req.fields
        job = req.job
        if not job.documents:
            raise APIError(400, f"'{docs_field}' must not be empty", param=docs_field, code="empty_input")
        if len(job.documents) > self.limits.max_documents:
            raise APIError(
                400,
                f"'{docs_field}' has {len(job.documents)} items; the limit is {self.limits.max_documents}",
                param=docs_field,
                code="too_many_documents",
            )
        many = len(job.queries) > 1
        for field, texts, indexed in ((query_field, job.queries, many), (docs_field, job.documents, True)):
            for i, text in enumerate(texts):
                where = f"{field}[{i}]" if indexed else f"'{field}'"
                check_text(text, where, field, self.settings.max_string_chars)

    # -- the pipeline ------------------------------------------------------------------
    async def run(self, req: ScoreRequest) -> ScoreResult:
        self.gate.check()
        model = self.models(req.model, "model")
        if model.info.embeds and not {"dense", "colbert"} & set(model.info.outputs):
            raise APIError(
                400,
                f"The model '{model.info.name}' has the outputs {list(model.info.outputs)}; rerank and score "
                "need a dense vector (cosine) or a colbert output (MaxSim)",
                param="model",
                code="unsupported_output",
            )
        self._check_texts(req)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(self.executor, model.scorer.prepare, req.job)
        tokenize_s = time.perf_counter() - t0
        tracing.tokenized(model.info.name, t0, tokenize_s, prepared.pairs)
        tokenized = Tokenized(prepared.inputs, prepared.pairs, tokenize_s)
        limits = Limits(req.truncate, model.max_seq_len, self.limits.max_tokens_per_request)
        outputs = prepared.outputs if isinstance(prepared, PreparedTokens) else None
        done = await self.step.run(model.caller, tokenized, limits, _naming(req), model.info.name, req.route,
                                   priority=req.priority, outputs=outputs)
        if isinstance(prepared, PreparedTokens):
            assert done.outputs is not None and done.outputs.colbert is not None
            raw = prepared.combine(done.outputs.colbert)
        else:
            raw = prepared.combine(done.rows)
        if not np.isfinite(raw).all():  # a model's answer, not the client's input: never a 200
            raise APIError(503, "the engine returned a score that is not a number", code="engine_unavailable")
        scores = sigmoid(raw) if model.scorer.score_kind == "logit" else raw
        headers = {**done.headers, "x-embedserve-score": model.scorer.score_kind}
        return ScoreResult(model.info.name, scores, raw, done.truncated, done.tokens, headers)


def _naming(req: ScoreRequest) -> Naming:
    """How errors name a score request's documents field, its pairs and the whole."""
    docs = req.fields[1]
    return Naming(
        docs,
        lambda i: f"the pair of the query and {docs}[{i}]",
        f"the pairs of the request ('{docs}' with their queries) have",
    )
