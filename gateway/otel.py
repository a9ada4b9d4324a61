"""OpenTelemetry traces of the API requests, exported over OTLP (HTTP or gRPC). Imported only when
``tracing.endpoint`` is set: with tracing off the gateway never loads OpenTelemetry.

Each POST gets a server span (``POST /v1/embeddings``), a child of the caller's W3C
``traceparent`` when it sends one, with children:

- ``tokenize``: tokenising and truncating the request's texts;
- ``queue``: admitted, until the last of its inputs leaves in an engine call (coalescing wait);
- ``engine``: one per engine call holding its inputs. A call carries the inputs of several requests;
  each request's trace gets its own span, and the call sends the first one's context to the engine
  as ``traceparent``, the others linking to it;
- ``response``: from the engines' last answer until the body is handed to the server.

Attributes: the model (``gen_ai.request.model``), tokens after truncation
(``gen_ai.usage.input_tokens``), inputs and truncated inputs, the HTTP status. Never request text.
Spans are exported in batches from the SDK's own thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import embedserve
from embedserve.config.tracing import TracingSettings
from embedserve.core import tracing
from embedserve.core.tracing import EngineCallTrace, RequestTrace, Tokenized
from embedserve.gateway.middleware import ASGIApp, Message, Receive, Scope, Send
from embedserve.logs import request_id_var

W3C = TraceContextTextMapPropagator()


def exporter(settings: TracingSettings) -> SpanExporter:
    """OTLP over ``settings.protocol``; headers, certificates, compression and timeouts as the
    ``OTEL_EXPORTER_OTLP_*`` variables set them."""
    assert settings.endpoint is not None
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=settings.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=settings.endpoint.rstrip("/") + "/v1/traces")


def provider(settings: TracingSettings) -> TracerProvider:
    """The gateway's own provider, exporting in batches from the SDK's thread (``OTEL_BSP_*`` tune
    them); its sampler follows ``OTEL_TRACES_SAMPLER``. Not the process-wide one: FastAPI (0.16x)
    traces every request itself as soon as a global provider is set, which would double the
    server spans and add its own per-request work."""
    named = {"service.name": settings.service_name, "service.version": embedserve.__version__}
    made = TracerProvider(resource=Resource.create(named))
    made.add_span_processor(BatchSpanProcessor(exporter(settings)))
    return made


def _ns(perf: float) -> int:
    """A ``time.perf_counter`` reading as the wall-clock nanoseconds spans carry."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


class _EngineCall:
    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        W3C.inject(carrier, set_span_in_context(self.spans[0]))
        return carrier

    def end(self, call: Any) -> None:
        """As the call's done-callback: an error status when it failed or was cancelled."""
        failed = "cancelled" if call.cancelled() else call.exception() and type(call.exception()).__name__
        for span in self.spans:
            if failed:
                span.set_status(StatusCode.ERROR, failed)
            span.end()


class _RequestTrace:
    def __init__(self, tracer: Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self.context = set_span_in_context(span)
        self.queue: Span | None = None
        self.waiting = 0
        self.tokens = 0
        self.response: Span | None = None

    def tokenized(self, model: str, started: float, seconds: float, inputs: Sequence[Tokenized]) -> None:
        self.span.set_attributes(
            {
                "gen_ai.request.model": model,
                "embedserve.inputs": len(inputs),
                "embedserve.truncated_inputs": sum(x.truncated for x in inputs),
            }
        )
        start = _ns(started)
        self.tracer.start_span("tokenize", self.context, start_time=start).end(start + int(seconds * 1e9))

    def queued(self, inputs: Sequence[Sequence[int]]) -> None:
        self.waiting += len(inputs)
        self.tokens += sum(map(len, inputs))
        self.span.set_attribute("gen_ai.usage.input_tokens", self.tokens)
        if self.queue is None:
            self.queue = self.tracer.start_span("queue", self.context)

    def dispatched(self, inputs: int) -> None:
        self.waiting -= inputs
        if self.waiting <= 0 and self.queue is not None:
            self.queue.end()
            self.queue = None

    def answered(self) -> None:
        if self.response is None:  # a request that calls the engines twice: from the first answer
            self.response = self.tracer.start_span("response", self.context)

    def engine_call(self, traces: Sequence[RequestTrace], inputs: int, tokens: int) -> EngineCallTrace:
        counts = Counter(traces)
        call = {
            "embedserve.engine_call.inputs": inputs,
            "embedserve.engine_call.tokens": tokens,
            "embedserve.engine_call.requests": len(counts),
        }
        spans: list[Span] = []
        for trace, own in counts.items():
            assert isinstance(trace, _RequestTrace)
            links = [Link(spans[0].get_span_context())] if spans else None
            spans.append(
                trace.tracer.start_span(
                    "engine", trace.context, SpanKind.CLIENT, {**call, "embedserve.inputs": own}, links
                )
            )
            trace.dispatched(own)
        return _EngineCall(spans)

    def finish(self, status: int) -> None:
        for child in (self.queue, self.response):
            if child is not None:
                child.end()
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(StatusCode.ERROR)
        self.span.end()


class TracingMiddleware:
    """A server span around each POST (the API's routes), the request's trace in
    ``tracing.request_trace`` for the pipeline's hooks."""

    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope.get("headers", ())
            if k in (b"traceparent", b"tracestate")
        }
        attributes = {"http.request.method": "POST", "url.path": scope["path"]}
        if (rid := request_id_var.get()) is not None:
            attributes["embedserve.request_id"] = rid
        parent = W3C.extract(carrier)
        span = self.tracer.start_span(f"POST {scope['path']}", parent, SpanKind.SERVER, attributes)
        trace = _RequestTrace(self.tracer, span)
        token = tracing.request_trace.set(trace)
        status = 500

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and trace.response:
                trace.response.end()
                trace.response = None

        try:
            await self.app(scope, receive, traced_send)
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            tracing.request_trace.reset(token)
            trace.finish(status)
