"""The models one gateway serves (``service/catalog.py``), each with its own engine pool,
coalescer, admission bound and load signal, and the routing of requests to them by ``model``.

A model's requests wait only in its own coalescer and admission, so a burst of reranking cannot
refuse embeddings with a 429 (and the reverse); the tokenizer threads, the deadline and the
metrics registry are shared.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, replace

from embedserve.catalog import CatalogEntry
from embedserve.config import GatewayLimits
from embedserve.contracts.hybrid import SGLANG_OUTPUTS
from embedserve.core.admission import TokenAdmission
from embedserve.core.coalesce import Coalescer
from embedserve.core.scorers import scorer_for
from embedserve.core.tokenize import ModelTokenizer
from embedserve.gateway.engine_call import EngineCaller, ServingGate
from embedserve.gateway.errors import APIError
from embedserve.gateway.late_chunking import refusal
from embedserve.gateway.load import LoadSignal
from embedserve.gateway.long_inputs import long_inputs
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.pipeline import EmbeddingPipeline, EmbeddingResult
from embedserve.gateway.schemas import EmbeddingRequest
from embedserve.gateway.scoring import ScoredModel
from embedserve.model_info import ModelInfo
from embedserve.upstream.client import EngineClient
from embedserve.upstream.pool import EnginePool
from embedserve.upstream.protocols import protocol_for


@dataclass
class ModelRuntime:
    """One served model and what serves it."""

    entry: CatalogEntry
    info: ModelInfo
    engine_kind: str
    limits: GatewayLimits
    pool: EnginePool
    coalescer: Coalescer
    admission: TokenAdmission
    load: LoadSignal
    pipeline: EmbeddingPipeline
    scored: ScoredModel

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def kind(self) -> str:
        return "embed" if self.info.embeds else "rerank"


def build_runtime(
    entry: CatalogEntry,
    info: ModelInfo,
    engine_kind: str,
    gate: ServingGate,
    metrics: GatewayMetrics,
    executor: Executor,
    engine_client: EngineClient | None,
) -> ModelRuntime:
    settings = entry.settings
    gw, eng = settings.gateway, settings.engine
    entry.check_kind(info)
    if settings.gateway_kind(engine_kind) == "sglang":  # its engines give a model's dense vector only
        info = replace(info, outputs=tuple(o for o in info.outputs if o in SGLANG_OUTPUTS))
    limits = entry.limits(engine_kind)
    pool = EnginePool(
        settings.engine_urls(),
        info.name,
        request_timeout_s=gw.request_timeout_s,
        health_interval_s=eng.health_check_interval_s,
        health_timeout_s=eng.health_check_timeout_s,
        unreachable_after_failures=eng.unreachable_after_failures,
        client=engine_client,
        base64_vectors=eng.base64_vectors,
        capacity_call_tokens=limits.max_tokens_per_engine_call // 4,
        gpus=settings.engine_gpus() if engine_kind in ("sglang", "torch") else None,
        protocol=protocol_for(info),
    )
    coalescer = Coalescer(
        pool.embed,
        token_budget=limits.max_tokens_per_engine_call,
        max_wait_s=gw.batch_max_wait_ms / 1000,
        max_concurrent_calls=limits.engine_calls_per_engine * len(pool.engines),
        max_inputs_per_call=gw.max_inputs_per_engine_call,
        aging_s=gw.priority_aging_s,
        on_aged=metrics.priority_aged.inc,
        embed_outputs=pool.embed_outputs,
    )
    admission = TokenAdmission(limits.max_tokens_in_flight)
    load = LoadSignal(pool.tokens_per_s, admission.limit, lambda: pool.any_ready)
    caller = EngineCaller(coalescer, admission, metrics, load, gw.request_timeout_s)
    tokenizer = ModelTokenizer(info.path, info.max_seq_len)
    pipeline = EmbeddingPipeline(
        gw, info, tokenizer, caller, gate, metrics, executor, limits.inline_tokenize_chars,
        long_inputs(settings.model, tokenizer), refusal(info, engine_kind),
    )
    scored = ScoredModel(info, scorer_for(info, tokenizer), caller)
    return ModelRuntime(entry, info, engine_kind, limits, pool, coalescer, admission, load, pipeline, scored)


def _names(runtimes: list[ModelRuntime]) -> str:
    return ", ".join(f"'{r.name}'" for r in runtimes)


class ModelRouter:
    """Finds the runtime a request names; 404 in the envelope for a model nobody serves."""

    def __init__(self, runtimes: list[ModelRuntime]) -> None:
        self.runtimes = runtimes
        rerankers = [r for r in runtimes if not r.info.embeds]
        self.default_scorer = (rerankers or runtimes)[0]

    def find(self, name: str | None, param: str = "model") -> ModelRuntime:
        if name is None:
            return self.default_scorer
        found = next((r for r in self.runtimes if r.info.serves(name)), None)
        if found is None:
            has = "has" if len(self.runtimes) == 1 else "serves"
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server {has} {_names(self.runtimes)}",
                param=param,
                code="model_not_found",
            )
        return found

    def scoring_model(self, name: str | None, param: str) -> ScoredModel:
        return self.find(name, param).scored

    async def embed(self, req: EmbeddingRequest) -> EmbeddingResult:
        return await self.find(req.model).pipeline.run(req)
