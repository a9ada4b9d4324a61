"""The /v1/embeddings pipeline: validate → tokenise and truncate → admit → coalesce →
post-process. Routes stay thin; every step and its error live here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from embedserve.config import GatewaySettings
from embedserve.contracts.hybrid import HybridOutputs, Output
from embedserve.contracts.wire import Matrix
from embedserve.core import tracing
from embedserve.core.hybrid import DENSE, ordered
from embedserve.core.tokenize import ModelTokenizer, TokenizedInput
from embedserve.core.vectors import encode_rows, shape_vectors
from embedserve.gateway import hybrid_items, late_chunking
from embedserve.gateway.engine_call import EngineCaller, ServingGate
from embedserve.gateway.errors import APIError
from embedserve.gateway.long_inputs import TRUNCATE, LongInputs, plan, refuse_ids
from embedserve.gateway.metrics import GatewayMetrics
from embedserve.gateway.request_step import Limits, Naming, RequestStep, Tokenized, check_text, check_tokens
from embedserve.gateway.schemas import EmbeddingRequest
from embedserve.model_info import ModelInfo

TOKEN_IDS_REFUSED = (
    "'input' holds token ids, but this server embeds text: ids made by another tokenizer would "
    "give wrong vectors. LangChain's OpenAIEmbeddings sends tiktoken ids unless you pass "
    "check_embedding_ctx_length=False; send the texts instead. Clients that tokenise with this "
    "model's own tokenizer can send ids once the server sets EMBEDSERVE_GATEWAY__ACCEPT_TOKEN_IDS=true."
)


#: how errors name an embeddings request's field and items
INPUTS = Naming("input", lambda i: f"input[{i}]")


@dataclass
class EmbeddingResult:
    body: dict[str, Any]
    headers: dict[str, str]
    vectors: Matrix  # as shaped (dimensions, normalised): other routes encode their own types
    outputs: HybridOutputs | None = None  # a request for a model's other outputs: as kept (top-k)


def _as_batch(raw: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """Split OpenAI's four input shapes into strings or token-id lists."""
    if isinstance(raw, str):
        return [raw], None
    if not raw:
        raise APIError(400, "'input' must not be empty", param="input", code="empty_input")
    if isinstance(raw[0], str):
        return list(raw), None
    if isinstance(raw[0], int):
        return None, [list(raw)]
    return None, [list(x) for x in raw]


class EmbeddingPipeline:
    def __init__(
        self,
        settings: GatewaySettings,
        info: ModelInfo,
        tokenizer: ModelTokenizer,
        caller: EngineCaller,
        gate: ServingGate,
        metrics: GatewayMetrics,
        executor: Executor,
        inline_tokenize_chars: int,
        long_inputs: LongInputs = TRUNCATE,
        late_refusal: str | None = None,
    ) -> None:
        """Requests of at most ``inline_tokenize_chars`` characters are tokenised on the loop,
        others on ``executor``; ``long_inputs``: the model's way with over-long inputs;
        ``late_refusal``: why late chunking is not served here (None: it is)."""
        self.settings = settings
        self.info = info
        self.tokenizer = tokenizer
        self.caller = caller
        self.gate = gate
        self.metrics = metrics
        self.step = RequestStep(metrics)
        self.executor = executor
        self.inline_tokenize_chars = inline_tokenize_chars
        self.long_inputs = long_inputs
        self.late_refusal = late_refusal

    # -- validation ------------------------------------------------------------------
    def _check_request(self, req: EmbeddingRequest) -> None:
        if not self.info.serves(req.model):
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server has '{self.info.name}'",
                param="model",
                code="model_not_found",
            )
        if not self.info.embeds:
            raise APIError(
                400,
                f"The model '{req.model}' is a reranker ({self.info.scoring}): it answers /v1/rerank and "
                "/v1/score, not /v1/embeddings",
                param="model",
                code="model_not_embedding",
            )
        if req.dimensions is not None:
            allowed = self.info.matryoshka_dimensions
            if not 1 <= req.dimensions <= self.info.dimension or (allowed and req.dimensions not in allowed):
                span = f"one of {list(allowed)}" if allowed else f"1..{self.info.dimension}"
                raise APIError(
                    400,
                    f"'dimensions' must be {span}, got {req.dimensions}",
                    param="dimensions",
                    code="invalid_dimensions",
                )

    def _outputs(self, req: EmbeddingRequest) -> tuple[Output, ...]:
        """What ``req`` asks of the model's outputs; ``APIError`` 400 for one the model has not,
        or an option that does not apply to what it asks."""
        asked = ordered(req.outputs or DENSE)
        missing = [o for o in asked if o not in self.info.outputs]
        if missing:
            what = f"'outputs' asks {missing[0]}" if req.outputs else "this request asks its dense vector"
            raise APIError(
                400,
                f"The model '{req.model}' has the outputs {list(self.info.outputs)}; {what} (send 'outputs' "
                "with some of those)",
                param="outputs",
                code="unsupported_output",
            )
        if "sparse" not in asked and (req.sparse_top_k is not None or req.sparse_min_weight is not None):
            field = "sparse_top_k" if req.sparse_top_k is not None else "sparse_min_weight"
            raise APIError(400, f"'{field}' applies to the sparse output; add 'sparse' to 'outputs'",
                           param=field, code="invalid_value")
        if asked == DENSE:
            return asked
        refused = (
            ("dimensions", req.dimensions is not None),
            ("embedding_type", req.embedding_type != "float"),
            ("truncate", req.truncate == "chunk"),
            ("late_chunking", req.late_chunking is not None),
        )
        shaping = next((f for f, bad in refused if bad), None)
        if shaping is not None:
            raise APIError(
                400,
                f"'{shaping}' shapes the dense vector alone; with 'outputs' {list(asked)} leave it out "
                "(or ask the dense vector in a request of its own)",
                param=shaping,
                code="invalid_value",
            )
        return asked

    def _check_count(self, count: int) -> None:
        if count > self.settings.max_inputs:
            raise APIError(
                400,
                f"'input' has {count} items; the limit is {self.settings.max_inputs}",
                param="input",
                code="too_many_inputs",
            )

    def _check_texts(self, texts: list[str]) -> None:
        self._check_count(len(texts))
        for i, text in enumerate(texts):
            check_text(text, f"input[{i}]", "input", self.settings.max_string_chars)

    def _check_ids(self, batch: list[list[int]]) -> None:
        self._check_count(len(batch))
        vocab = self.tokenizer.vocab_size
        for i, ids in enumerate(batch):
            if not ids:
                raise APIError(400, f"input[{i}] is empty", param="input", code="empty_input")
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise APIError(
                    400,
                    f"input[{i}] has token id {bad}, outside the vocabulary [0, {vocab})",
                    param="input",
                    code="invalid_token_id",
                )

    def _check_embeddable(self, inputs: list[TokenizedInput]) -> None:
        """Texts that tokenise to an id past the model's embedding rows."""
        if not self.tokenizer.exceeds_vocab:
            return
        vocab = self.tokenizer.vocab_size
        for i, x in enumerate(inputs):
            if max(x.ids) >= vocab:
                bad = next(t for t in x.ids if t >= vocab)
                raise APIError(
                    400,
                    f"input[{i}] contains {self.tokenizer.token_text(bad)!r}, a token (id {bad}) "
                    f"the model has no embedding for (its vocabulary is [0, {vocab}))",
                    param="input",
                    code="invalid_token_id",
                )

    def _apply_instruction(self, req: EmbeddingRequest, texts: list[str]) -> list[str]:
        if req.input_type != "query":
            if req.instruction is not None:
                raise APIError(
                    400,
                    "'instruction' applies to input_type 'query' only",
                    param="instruction",
                    code="invalid_value",
                )
            return texts
        template = self.info.query_template
        if template is None:
            # A model without an instruction format embeds queries as they are; accepting
            # input_type and instruction alike lets an application written for Qwen3 run
            # unchanged on the CPU stack (the header x-embedserve-instruction says "none").
            return texts
        task = req.instruction or self.info.default_task
        return [template.format(task=task, text=t) for t in texts]

    def _check_late(self, req: EmbeddingRequest, texts: list[str] | None) -> None:
        """Late chunking: served for this model, on texts (its spans are characters) embedded as
        documents, without ``truncate: "chunk"``."""
        code, why = "invalid_value", None
        if self.late_refusal:
            code, why = "late_chunking_unsupported", self.late_refusal
        elif texts is None:
            why = "its chunks are spans of text; send the texts, not token ids"
        elif req.input_type == "query":
            why = "it embeds documents; leave out input_type query"
        elif req.truncate == "chunk":
            why = 'it embeds one pass of up to the model\'s cap; truncate "chunk" windows an input instead'
        if why is not None:
            raise APIError(400, f"'late_chunking': {why}", param="late_chunking", code=code)

    async def _tokenise(self, fn: Callable[[list[str]], Any], texts: list[str]) -> Any:
        """``fn(texts)``: on the loop when short, else on the executor."""
        if sum(map(len, texts)) <= self.inline_tokenize_chars:
            return fn(texts)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, texts)

    # -- the pipeline ------------------------------------------------------------------
    async def run(self, req: EmbeddingRequest) -> EmbeddingResult:
        self.gate.check()
        self._check_request(req)
        outputs = self._outputs(req)
        texts, id_batch = _as_batch(req.input)
        late = req.late_chunking
        if late is not None:
            self._check_late(req, texts)
        t0 = time.perf_counter()
        mode = self.long_inputs.mode(req.truncate)
        if mode == "chunk" and outputs != DENSE:
            mode = "truncate"  # the model's default: a sparse or per-token output of windows is no answer
        whole = mode == "chunk" and late is None
        left = req.truncation_direction.lower() == "left"  # cut an over-long input at its start
        offsets: list[list[tuple[int, int]]] = []
        if texts is not None:
            self._check_texts(texts)
            encode = self._encoder(req, whole, left)
            texts = self._apply_instruction(req, texts)
            inputs = await self._tokenise(encode, texts)
            if late is not None:
                offsets = await self._tokenise(self.tokenizer.offsets, texts)
            self._check_embeddable(inputs)
        else:
            assert id_batch is not None
            if not self.settings.accept_token_ids:
                raise APIError(400, TOKEN_IDS_REFUSED, param="input", code="token_ids_not_accepted")
            if req.input_type == "query" or req.instruction is not None:
                raise APIError(
                    400,
                    "'input_type' query and 'instruction' apply to text input, not token ids",
                    param="input_type",
                    code="invalid_value",
                )
            self._check_ids(id_batch)
            inputs = [self.tokenizer.frame_token_ids(ids, left) for ids in id_batch]
            if whole and any(x.truncated for x in inputs):
                raise refuse_ids()
        tokenize_s = time.perf_counter() - t0
        tracing.tokenized(self.info.name, t0, tokenize_s, inputs)
        chunks = plan(inputs, self.tokenizer, self.long_inputs.overlap) if whole else None
        batch = chunks.inputs if chunks else [x.ids for x in inputs]
        tokenized = Tokenized(batch, [x.item() for x in inputs], tokenize_s)
        # late chunking's one pass cuts an over-long input only where truncation is asked for
        cut = mode == "truncate" if late is not None else mode != "refuse"
        limits = Limits(cut, self.tokenizer.max_seq_len, self.settings.max_tokens_per_request)
        late_plan = None
        if late is not None:
            assert texts is not None  # _check_late
            check_tokens(tokenized, limits, INPUTS)  # an input refused for its length, before its chunks
            late_plan = late_chunking.plan(late, texts, inputs, offsets, self.tokenizer, left)
            tokenized = Tokenized(late_plan.inputs, tokenized.items, tokenize_s)
        if outputs != DENSE:
            return await self._other_outputs(req, tokenized, limits, outputs)
        done = await self.step.run(self.caller, tokenized, limits, INPUTS, self.info.name, "embeddings",
                                   priority=req.priority)
        rows = chunks.pool(done.rows) if chunks else done.rows
        vectors = shape_vectors(rows, req.dimensions, self.settings.normalize)
        payload = encode_rows(vectors, req.embedding_type, req.encoding_format == "base64")
        body = {
            "object": "list",
            "data": late_plan.data(payload) if late_plan else
            [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(payload)],
            "model": req.model,
            "usage": {"prompt_tokens": done.tokens, "total_tokens": done.tokens},
            "truncated_inputs": done.truncated,
            "unknown_token_inputs": done.unknown,
        }
        headers = dict(done.headers)
        if chunks:
            body["chunked_inputs"] = chunks.chunked
            headers["x-embedserve-chunked-inputs"] = str(len(chunks.chunked))
            self.metrics.inputs_chunked.inc(len(chunks.chunked))
        if late_plan:
            headers["x-embedserve-late-chunks"] = str(len(late_plan.chunks))
        if req.input_type == "query":
            headers["x-embedserve-instruction"] = "applied" if self.info.query_template else "none"
        return EmbeddingResult(body, headers, vectors)

    async def _other_outputs(
        self, req: EmbeddingRequest, tokenized: Tokenized, limits: Limits, outputs: tuple[Output, ...]
    ) -> EmbeddingResult:
        """A request for the model's sparse or ColBERT outputs (with or without its dense vector)."""
        if "colbert" in outputs:
            hybrid_items.check_colbert_tokens(tokenized.inputs, self.settings.max_colbert_tokens_per_request)
        done = await self.step.run(self.caller, tokenized, limits, INPUTS, self.info.name, "embeddings",
                                   priority=req.priority, outputs=outputs)
        assert done.outputs is not None
        kept = hybrid_items.kept(done.outputs, req.sparse_top_k, req.sparse_min_weight,
                                 self.settings.normalize)
        body = {
            "object": "list",
            "data": hybrid_items.data(kept, req.encoding_format == "base64"),
            "model": req.model,
            "usage": {"prompt_tokens": done.tokens, "total_tokens": done.tokens},
            "truncated_inputs": done.truncated,
            "unknown_token_inputs": done.unknown,
        }
        headers = dict(done.headers)
        if req.input_type == "query":
            headers["x-embedserve-instruction"] = "applied" if self.info.query_template else "none"
        dense = kept.dense if kept.dense is not None else np.empty((0, 0), dtype=np.float32)
        return EmbeddingResult(body, headers, dense, kept)

    def _encoder(
        self, req: EmbeddingRequest, whole: bool, left: bool
    ) -> Callable[[list[str]], list[TokenizedInput]]:
        """The tokeniser call for ``req``'s truncation side (``whole``: over-long inputs keep all
        their content, to be embedded in windows); cut from the start, a query keeps its
        instruction (the template's tokens before the text)."""
        if not left:
            return partial(self.tokenizer.encode_texts, whole=True) if whole else self.tokenizer.encode_texts
        template = self.info.query_template
        head = 0
        if req.input_type == "query" and template is not None:
            before = template.split("{text}", 1)[0].format(task=req.instruction or self.info.default_task)
            head = self.tokenizer.count(before)
        return partial(self.tokenizer.encode_texts, whole=whole, from_start=True, keep_head=head)
