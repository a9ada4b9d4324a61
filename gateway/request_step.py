"""What ``/v1/embeddings`` and the score routes have in common, written once so the two cannot
drift: each text checked before it is tokenised (empty, too long), the tokenised request checked
(``truncate=false``, the per-request token limit), the engines called through ``EngineCaller``,
and what they did accounted for: the stage, token and input metrics (truncated inputs and inputs
with unknown tokens among them), the per-model counters, the timing headers, and the lists of
truncated inputs and inputs with unknown tokens.

A request's items are what it reports on: its inputs for embeddings, its pairs for scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embedserve.contracts.hybrid import HybridOutputs, Output
from embedserve.contracts.wire import Matrix
from embedserve.core.tokenize import ItemTokens, blank
from embedserve.gateway.engine_call import EngineCaller
from embedserve.gateway.errors import APIError
from embedserve.gateway.metrics import GatewayMetrics


def check_text(text: str, where: str, param: str, max_chars: int) -> None:
    """``where`` (``input[3]``) is neither blank nor longer than ``max_chars``."""
    if blank(text):
        what = "is empty" if not text else "has no text (only whitespace or control characters)"
        raise APIError(400, f"{where} {what}", param=param, code="empty_input")
    if len(text) > max_chars:
        raise APIError(
            400,
            f"{where} has {len(text)} characters; the limit is {max_chars}",
            param=param,
            code="input_too_long",
        )


@dataclass(frozen=True)
class Naming:
    """How errors name a request's field, one of its items, and the whole of it."""

    param: str  # the field a 400 names
    item: Callable[[int], str]  # item 3 -> "input[3]"
    whole: str = "the request has"


@dataclass(frozen=True)
class Tokenized:
    """A request after tokenising: what the engines get, what it reports, and how long it took."""

    inputs: list[list[int]]
    items: list[ItemTokens]
    seconds: float


@dataclass(frozen=True)
class Limits:
    truncate: bool  # the request's own: False refuses an item over the cap
    max_seq_len: int
    max_tokens_per_request: int


@dataclass
class StepResult:
    rows: Matrix  # one per engine input, in order
    tokens: int
    truncated: list[dict[str, int]]
    unknown: list[dict[str, int]]
    headers: dict[str, str]
    outputs: HybridOutputs | None = None  # what a request for a model's outputs got (rows: its dense)


def check_tokens(tokenized: Tokenized, limits: Limits, naming: Naming) -> int:
    """The request's tokens; ``APIError`` 400 for an item cut without ``truncate``, or more
    tokens than one request may have."""
    if not limits.truncate:
        cut = next((i for i, x in enumerate(tokenized.items) if x.truncated), None)
        if cut is not None:
            raise APIError(
                400,
                f"{naming.item(cut)} has {tokenized.items[cut].original_tokens} tokens; the limit is "
                f"{limits.max_seq_len} (send truncate=true to cut it)",
                param=naming.param,
                code="context_length_exceeded",
            )
    total = sum(map(len, tokenized.inputs))
    if total > limits.max_tokens_per_request:
        raise APIError(
            400,
            f"{naming.whole} {total} tokens; the limit is {limits.max_tokens_per_request}",
            param=naming.param,
            code="max_tokens_per_request",
        )
    return total


class RequestStep:
    """Checks, the engines' call and the accounting, for any route."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def run(
        self,
        caller: EngineCaller,
        tokenized: Tokenized,
        limits: Limits,
        naming: Naming,
        model: str,
        route: str,
        priority: int = 0,
        outputs: tuple[Output, ...] | None = None,
    ) -> StepResult:
        """The engines' rows for a tokenised request, counted under ``model`` and ``route``;
        ``outputs``: a model's outputs to ask instead of its dense vector alone."""
        total = check_tokens(tokenized, limits, naming)
        answer = None
        if outputs is None:
            rows, times = await caller.run(tokenized.inputs, param=naming.param, priority=priority)
        else:
            answer, times = await caller.run_outputs(tokenized.inputs, outputs, naming.param, priority)
            rows = answer.dense if answer.dense is not None else np.empty((0, 0), dtype=np.float32)
            for output in outputs:
                self.metrics.output_inputs.labels(output).inc(len(tokenized.items))
        items = tokenized.items
        truncated = [
            {"index": i, "original_tokens": x.original_tokens, "kept_tokens": x.kept_tokens}
            for i, x in enumerate(items)
            if x.truncated
        ]
        unknown = [
            {"index": i, "unknown_tokens": x.unknown.tokens, "unknown_chars": x.unknown.chars}
            for i, x in enumerate(items)
            if x.unknown
        ]
        m = self.metrics
        m.stage_seconds.labels("tokenize").observe(tokenized.seconds)
        m.stage_seconds.labels("queue").observe(times.queue_s)
        m.stage_seconds.labels("engine").observe(times.engine_s)
        m.tokens.inc(total)
        m.model_tokens.labels(model).inc(total)
        m.model_requests.labels(model, route).inc()
        m.inputs.inc(len(tokenized.items))
        m.request_tokens.observe(total)
        if truncated:
            m.inputs_truncated.inc(len(truncated))
            m.tokens_truncated.inc(sum(t["original_tokens"] - t["kept_tokens"] for t in truncated))
        if unknown:
            m.inputs_unknown.inc(len(unknown))
            m.unknown_chars.inc(sum(u["unknown_chars"] for u in unknown))
        headers = {
            "x-embedserve-tokenize-ms": f"{tokenized.seconds * 1000:.2f}",
            "x-embedserve-queue-ms": f"{times.queue_s * 1000:.2f}",
            "x-embedserve-engine-ms": f"{times.engine_s * 1000:.2f}",
            "x-embedserve-truncated-inputs": str(len(truncated)),
            "x-embedserve-unknown-token-inputs": str(len(unknown)),
        }
        return StepResult(rows, total, truncated, unknown, headers, answer)
