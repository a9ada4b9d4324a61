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
from typing import Any

import numpy as np

from embedserve.config import GatewaySettings
from embedserve.config.served import RerankLimits
from embedserve.gateway.engine_call import EngineCaller, ServingGate
from embedserve.gateway.errors import APIError
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.scorers import PairJob, PairTokens, PreparedPairs, Scorer, Scores, sigmoid
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
    pairs: list[PairTokens]
    tokens: int
    headers: dict[str, str]

    def truncated(self) -> list[dict[str, int]]:
        """As /v1/embeddings reports it, by pair (document) index."""
        return [
            {"index": i, "original_tokens": p.original, "kept_tokens": p.kept}
            for i, p in enumerate(self.pairs)
            if p.truncated
        ]

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
                if not text.strip():
                    raise APIError(400, f"{where} is empty", param=field, code="empty_input")
                if len(text) > self.settings.max_string_chars:
                    raise APIError(
                        400,
                        f"{where} has {len(text)} characters; the limit is {self.settings.max_string_chars}",
                        param=field,
                        code="input_too_long",
                    )

    def _check_tokens(self, req: ScoreRequest, model: ScoredModel, prepared: PreparedPairs) -> int:
        docs_field = req.fields[1]
        if not req.truncate:
            cut = next((i for i, p in enumerate(prepared.pairs) if p.truncated), None)
            if cut is not None:
                raise APIError(
                    400,
                    f"the pair of the query and {docs_field}[{cut}] has {prepared.pairs[cut].original} "
                    "tokens; "
                    f"the limit is {model.max_seq_len} (send truncate=true to cut it)",
                    param=docs_field,
                    code="context_length_exceeded",
                )
        total = sum(map(len, prepared.inputs))
        if total > self.limits.max_tokens_per_request:
            raise APIError(
                400,
                f"the pairs of the request ('{docs_field}' with their queries) have {total} tokens; "
                f"the limit is {self.limits.max_tokens_per_request}",
                param=docs_field,
                code="max_tokens_per_request",
            )
        return total

    # -- the pipeline ------------------------------------------------------------------
    async def run(self, req: ScoreRequest) -> ScoreResult:
        self.gate.check()
        model = self.models(req.model, "model")
        self._check_texts(req)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(self.executor, model.scorer.prepare, req.job)
        tokenize_s = time.perf_counter() - t0
        total = self._check_tokens(req, model, prepared)
        rows, times = await model.caller.run(prepared.inputs, param=req.fields[1], priority=req.priority)
        raw = prepared.combine(rows)
        if not np.isfinite(raw).all():  # a model's answer, not the client's input: never a 200
            raise APIError(503, "the engine returned a score that is not a number", code="engine_unavailable")
        scores = sigmoid(raw) if model.scorer.score_kind == "logit" else raw
        self._count(prepared, total, tokenize_s, times)
        self.metrics.model_tokens.labels(model.info.name).inc(total)
        self.metrics.model_requests.labels(model.info.name, req.route).inc()
        cut = sum(p.truncated for p in prepared.pairs)
        headers = {
            "x-embedserve-tokenize-ms": f"{tokenize_s * 1000:.2f}",
            "x-embedserve-queue-ms": f"{times.queue_s * 1000:.2f}",
            "x-embedserve-engine-ms": f"{times.engine_s * 1000:.2f}",
            "x-embedserve-truncated-inputs": str(cut),
            "x-embedserve-score": model.scorer.score_kind,
        }
        return ScoreResult(model.info.name, scores, raw, prepared.pairs, total, headers)

    def _count(self, prepared: PreparedPairs, total: int, tokenize_s: float, times: Any) -> None:
        """The engine-work metrics embeddings count too: tokens, inputs, truncation, stages."""
        m = self.metrics
        m.stage_seconds.labels("tokenize").observe(tokenize_s)
        m.stage_seconds.labels("queue").observe(times.queue_s)
        m.stage_seconds.labels("engine").observe(times.engine_s)
        m.tokens.inc(total)
        m.inputs.inc(len(prepared.inputs))
        m.request_tokens.observe(total)
        cut = [p for p in prepared.pairs if p.truncated]
        if cut:
            m.inputs_truncated.inc(len(cut))
            m.tokens_truncated.inc(sum(p.original - p.kept for p in cut))
