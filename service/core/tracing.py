"""Where the request pipeline reports to a trace: one context variable holding the request's trace,
``None`` unless tracing is on (``gateway/otel.py`` sets it for each API request). With tracing off
each hook is one context-variable read: nothing here imports OpenTelemetry or makes a span.

The engine client sends ``engine_headers`` (the engine call's ``traceparent``) with each call made
in a context where it is set; the coalescer sets it for the call it dispatches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any, Protocol


class Tokenized(Protocol):
    """One tokenised input (or pair): was it cut to the cap?"""

    @property
    def truncated(self) -> bool: ...


class EngineCallTrace(Protocol):
    def headers(self) -> dict[str, str]:
        """What the engine call carries: its W3C ``traceparent``."""
        ...

    def end(self, call: asyncio.Future[Any]) -> None:
        """The engine call's done-callback."""
        ...


class RequestTrace(Protocol):
    """One API request's span and its children."""

    def tokenized(self, model: str, started: float, seconds: float, inputs: Sequence[Tokenized]) -> None:
        """The tokenise span, from ``started`` (``time.perf_counter``) for ``seconds``, and the
        request's model, inputs and truncated inputs."""
        ...

    def queued(self, inputs: Sequence[Sequence[int]]) -> None:
        """``inputs`` (token ids) wait for engine calls: the queue span starts."""
        ...

    def answered(self) -> None:
        """The engines answered all of the request's inputs: the response span starts."""
        ...

    def engine_call(self, traces: Sequence[RequestTrace], inputs: int, tokens: int) -> EngineCallTrace:
        """An engine call of ``inputs`` inputs holding inputs of ``traces`` (this one first, once
        per input): an engine span in each request's trace; this request's is sent to the engine."""
        ...


request_trace: ContextVar[RequestTrace | None] = ContextVar("embedserve_request_trace", default=None)
engine_headers: ContextVar[dict[str, str] | None] = ContextVar("embedserve_engine_headers", default=None)


def tokenized(model: str, started: float, seconds: float, inputs: Sequence[Tokenized]) -> None:
    trace = request_trace.get()
    if trace is not None:
        trace.tokenized(model, started, seconds, inputs)


def engine_call(traces: Sequence[RequestTrace], inputs: Sequence[Sequence[int]]) -> EngineCallTrace:
    """The spans of an engine call holding inputs of ``traces`` (one per input); the engine client
    sends the first one's ``traceparent`` with the calls made from this context."""
    call = traces[0].engine_call(traces, len(inputs), sum(map(len, inputs)))
    engine_headers.set(call.headers())
    return call
