"""OpenTelemetry traces, received by real OTLP receivers (HTTP and gRPC) in the test process: the
caller's ``traceparent`` is the request span's parent, the stages are its children, the engine gets
its engine span's ``traceparent``, the attributes count tokens and truncated inputs, and no request
text leaves in a span. With no endpoint set, OpenTelemetry's SDK is never imported."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from embedserve.config import Settings, load_settings
from embedserve.gateway.app import create_app
from embedserve.runtime.preflight import check_tracing
from embedserve.settings_errors import ConfigError
from tests.conftest import free_port, wait_until
from tests.fake_engine import FakeEngine
from tests.otlp_receiver import Received, grpc_receiver, http_receiver

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SECRET = "zanzibarquokka"  # a word of the request's text, to look for in what was exported


@pytest.fixture()
def engine() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A fake engine on a real socket (the gateway's own aiohttp client calls it), recording the
    headers of every embedding call."""
    seen: list[dict[str, str]] = []
    inner = FakeEngine().app()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await inner(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=10, interval=0.02)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(10)


def gateway(engine_url: str, **tracing: str) -> TestClient:
    settings = Settings(
        engine={"kind": "external", "urls": [engine_url]},
        health={"sample_interval_s": 60},
        tracing=tracing,
        _env_file=None,
    )
    return TestClient(create_app(settings))


def attrs(span: Any) -> dict[str, Any]:
    def value(v: Any) -> Any:
        return getattr(v, v.WhichOneof("value"))

    return {a.key: value(a.value) for a in span.attributes}


def embed_traced(client: TestClient) -> dict[str, Any]:
    """One request with the caller's ``traceparent``: a short input and one cut to the cap. Leaving
    the client runs the gateway's shutdown, which flushes the spans."""
    with client:
        wait_until(lambda: client.app.state.pool.any_ready, timeout=10, interval=0.02)  # type: ignore[attr-defined]
        body = {"model": "all-MiniLM-L6-v2", "input": [f"{SECRET} is short", f"{SECRET} " * 400]}
        headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "tracestate": "vendor=1"}
        r = client.post("/v1/embeddings", json=body, headers=headers)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_spans_reach_an_otlp_receiver_with_the_callers_parent(
    engine: tuple[str, list[dict[str, str]]], protocol: str
) -> None:
    engine_url, engine_headers = engine
    receiver = http_receiver if protocol == "http/protobuf" else grpc_receiver
    with receiver() as (endpoint, received):
        answer = embed_traced(gateway(engine_url, endpoint=endpoint, protocol=protocol, service_name="emb-a"))
        wait_until(lambda: any(s.name == "POST /v1/embeddings" for s in received.spans), timeout=10)
    check_trace(received, answer, engine_headers)


def check_trace(received: Received, answer: dict[str, Any], engine_headers: list[dict[str, str]]) -> None:
    assert received.services == {"emb-a"}
    spans = {s.name: s for s in received.spans}
    request = spans["POST /v1/embeddings"]
    assert request.trace_id.hex() == CALLER_TRACE
    assert request.parent_span_id.hex() == CALLER_SPAN  # the caller's traceparent honoured
    assert set(spans) == {"POST /v1/embeddings", "tokenize", "queue", "engine", "response"}
    for name in ("tokenize", "queue", "engine", "response"):
        child = spans[name]
        assert child.trace_id.hex() == CALLER_TRACE
        assert child.parent_span_id == request.span_id, name
        assert request.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= request.end_time_unix_nano, name
    tokenize, queue, engine, response = (spans[n] for n in ("tokenize", "queue", "engine", "response"))
    assert tokenize.end_time_unix_nano <= queue.start_time_unix_nano
    assert queue.end_time_unix_nano <= engine.end_time_unix_nano <= response.start_time_unix_nano

    got = attrs(request)
    assert got["gen_ai.request.model"] == "all-MiniLM-L6-v2"
    assert got["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert got["embedserve.inputs"] == 2
    assert got["embedserve.truncated_inputs"] == len(answer["truncated_inputs"]) == 1
    assert got["http.response.status_code"] == 200
    assert attrs(engine)["embedserve.inputs"] == 2

    # the engine call carried its engine span's context, in the caller's trace
    traced = [h["traceparent"] for h in engine_headers if "traceparent" in h]
    assert traced == [f"00-{CALLER_TRACE}-{engine.span_id.hex()}-01"]
    assert all(SECRET.encode() not in raw for raw in received.raw)  # never the request's text


def test_a_rerank_is_traced_with_its_pairs(engine: tuple[str, list[dict[str, str]]]) -> None:
    engine_url, _ = engine
    with http_receiver() as (endpoint, received):
        client = gateway(engine_url, endpoint=endpoint)
        with client:
            wait_until(lambda: client.app.state.pool.any_ready, timeout=10, interval=0.02)  # type: ignore[attr-defined]
            r = client.post("/v1/rerank", json={"query": "q", "documents": ["a b", f"{SECRET} " * 400]})
            assert r.status_code == 200, r.text
        wait_until(lambda: any(s.name == "POST /v1/rerank" for s in received.spans), timeout=10)
    spans = {s.name: s for s in received.spans}
    assert {"tokenize", "queue", "engine", "response"} <= set(spans)
    got = attrs(spans["POST /v1/rerank"])
    assert got["embedserve.inputs"] == 2
    assert got["embedserve.truncated_inputs"] == len(r.json()["truncated_inputs"]) == 1
    assert got["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert not spans["POST /v1/rerank"].parent_span_id  # no traceparent sent: a root span


def test_without_an_endpoint_the_sdk_is_never_imported() -> None:
    """(OpenTelemetry's API is there: FastAPI imports it. Its SDK, the exporters and our tracing
    module are not.)"""
    code = (
        "import sys\n"
        "from embedserve.config import Settings\n"
        "from embedserve.gateway.app import create_app\n"
        "create_app(Settings(engine={'kind': 'external', 'urls': ['http://127.0.0.1:9']}, _env_file=None))\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))]\n"
        "assert not loaded and 'embedserve.gateway.otel' not in sys.modules, loaded\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_the_standard_variables_set_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    s = load_settings()
    assert (s.tracing.endpoint, s.tracing.protocol, s.tracing.enabled) == (
        "http://collector:4317",
        "grpc",
        True,
    )
    monkeypatch.setenv("EMBEDSERVE_TRACING__ENDPOINT", "http://other:4318")
    monkeypatch.setenv("EMBEDSERVE_TRACING__PROTOCOL", "http/protobuf")
    assert load_settings().tracing.endpoint == "http://other:4318"
    monkeypatch.setenv("EMBEDSERVE_TRACING__PROTOCOL", "http/json")
    with pytest.raises(
        ConfigError, match=r"EMBEDSERVE_TRACING__PROTOCOL must be one of 'http/protobuf', 'grpc'"
    ):
        load_settings()
    monkeypatch.delenv("EMBEDSERVE_TRACING__PROTOCOL")
    monkeypatch.setenv("EMBEDSERVE_TRACING__ENDPOINT", "collector:4317")
    with pytest.raises(ConfigError, match=r"^EMBEDSERVE_TRACING__ENDPOINT must be an http:// or https://"):
        load_settings()
    monkeypatch.delenv("EMBEDSERVE_TRACING__ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317")  # the default: no traceback either
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_ENDPOINT .* got 'collector:4317'$"):
        load_settings()


def test_tracing_without_the_otel_extra_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(tracing={"endpoint": "http://collector:4318"}, _env_file=None)
    check_tracing(settings)  # installed here (the dev extra has it)

    def missing(name: str, *args: Any) -> Any:
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", missing)
    with pytest.raises(ConfigError, match=r"install the otel extra \(pip install 'embedserve\[otel\]'\)"):
        check_tracing(settings)
    check_tracing(Settings(tracing={"endpoint": None}, _env_file=None))  # off: nothing to check
