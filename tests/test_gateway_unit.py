"""Fast gateway tests over a fake engine (no model, no network)."""

from __future__ import annotations

import base64
import concurrent.futures
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from embedserve.config import Settings
from embedserve.gateway.app import create_app
from tests.conftest import metric, wait_until
from tests.fake_engine import FakeEngine, HttpxEngineClient, fake_vector

MODEL = "all-MiniLM-L6-v2"


def make_client(engine: FakeEngine, served: Any = None, **gateway: object) -> TestClient:
    """The gateway over ``engine``; ``served``: the served section (rerank limits, models)."""
    settings = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"request_timeout_s": 10.0, "accept_token_ids": True, **gateway},
        served=served or {},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    app = create_app(settings, engine_client=HttpxEngineClient(httpx.ASGITransport(app=engine.app())))
    return TestClient(app)


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with make_client(engine) as c:
        wait_ready(c)
        yield c


def wait_ready(c: TestClient) -> None:
    deadline = time.monotonic() + 10
    while not c.app.state.pool.any_ready:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "fake engine never became ready"
        time.sleep(0.01)


def post(c: TestClient, body: object, **kw: object) -> Any:
    return c.post("/v1/embeddings", json=body, **kw)  # type: ignore[arg-type]


def assert_error(r: Any, status: int, param: str | None = None) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_gateway_does_not_import_torch() -> None:
    code = "import sys, gateway.app, health, embedserve.runtime.stack; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vectors_return_to_their_inputs_under_coalescing(engine: FakeEngine) -> None:
    engine.delay_s = 0.05  # keeps calls in flight so later requests coalesce
    with make_client(engine) as c:
        wait_ready(c)
        token_inputs = [[[i + 10, j + 20, 7] for j in range(1 + i % 3)] for i in range(40)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            responses = list(
                pool.map(
                    lambda ids: post(c, {"model": MODEL, "input": ids, "encoding_format": "float"}),
                    token_inputs,
                )
            )
    for ids_list, r in zip(token_inputs, responses, strict=True):
        assert r.status_code == 200
        for ids, d in zip(ids_list, r.json()["data"], strict=True):
            np.testing.assert_allclose(d["embedding"], fake_vector(ids, 384), atol=1e-6)
    total_inputs = sum(len(x) for x in token_inputs)
    assert sum(len(call) for call in engine.calls) == total_inputs
    assert len(engine.calls) < len(token_inputs), "concurrent requests were not coalesced"


def test_engine_vectors_travel_as_base64_or_floats_with_the_same_result() -> None:
    texts = ["the first text", "a second, longer text about something else entirely"]
    answers = {}
    for base64_vectors in (True, False):
        engine = FakeEngine()
        settings = Settings(
            engine={"kind": "external", "urls": ["http://fake-engine"], "base64_vectors": base64_vectors},
            health={"sample_interval_s": 60},
            _env_file=None,
        )
        client = HttpxEngineClient(httpx.ASGITransport(app=engine.app()))
        with TestClient(create_app(settings, engine_client=client)) as c:
            wait_ready(c)
            answers[base64_vectors] = [
                d["embedding"] for d in post(c, {"model": MODEL, "input": texts}).json()["data"]
            ]
        assert engine.encodings == ["base64" if base64_vectors else None]
    assert answers[True] == answers[False]


def test_base64_is_little_endian_float32(client: TestClient) -> None:
    r = post(client, {"model": MODEL, "input": [[1, 2, 3]], "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, fake_vector([1, 2, 3], 384), atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "input": 5}, "input"),
        ({"model": MODEL, "input": [1.5]}, "input"),
        ({"model": MODEL, "input": ["a", 1]}, "input"),
        ({"model": MODEL}, "input"),
        ({"input": "x"}, "model"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL, "input": "x", "dimensions": "8"}, "dimensions"),
        ({"model": MODEL, "input": "x", "dimensions": 8.5}, "dimensions"),
        ({"model": MODEL, "input": [[-1, 2]]}, "input"),
        ({"model": MODEL, "input": [[]]}, "input"),
        ({"model": MODEL, "input": ["ok", ""]}, "input"),
        ({"model": MODEL, "input": ["x"] * 2049}, "input"),
        ({"model": MODEL, "input": "x", "instruction": "find"}, "instruction"),
        ({"model": MODEL, "input": [[1, 2]], "input_type": "query"}, "input_type"),
    ],
)
def test_invalid_requests(client: TestClient, body: object, param: str) -> None:
    assert_error(post(client, body), 400, param)


def test_null_means_the_default_and_a_blank_input_is_named_as_such(client: TestClient) -> None:
    """Clients send ``null`` for "the default" (``dimensions``, ``encoding_format``); a string of
    only whitespace is refused, and the message says what it holds rather than "empty"."""
    body = {"model": MODEL, "input": "x", "encoding_format": None, "dimensions": None, "user": None}
    assert isinstance(post(client, body).json()["data"][0]["embedding"], list)
    blank = post(client, {"model": MODEL, "input": ["ok", " \n"]})
    assert blank.json()["error"]["message"] == "input[1] has no text (only whitespace or control characters)"
    empty = post(client, {"model": MODEL, "input": ["ok", ""]})
    assert empty.json()["error"]["message"] == "input[1] is empty"


def test_non_json_and_content_types(client: TestClient) -> None:
    assert_error(
        client.post("/v1/embeddings", content=b"{nope", headers={"content-type": "application/json"}), 400
    )
    assert_error(
        client.post("/v1/embeddings", content=b"[1,2]", headers={"content-type": "application/json"}), 400
    )
    assert_error(
        client.post(
            "/v1/embeddings",
            content=b"input=x",
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        415,
    )
    assert_error(
        client.post(
            "/v1/embeddings", content=b'{"input": NaN}', headers={"content-type": "application/json"}
        ),
        400,
    )


def test_framework_errors_use_the_envelope(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/embeddings"), 405)
    assert_error(client.get("/v1/models/other"), 404, "model")


def test_body_over_the_cap_is_413(engine: FakeEngine) -> None:
    with make_client(engine, max_body_bytes=1000) as c:
        wait_ready(c)
        assert_error(post(c, {"model": MODEL, "input": "x" * 2000}), 413)
        assert post(c, {"model": MODEL, "input": [[1, 2]]}).status_code == 200


def test_tokens_per_request_limit(engine: FakeEngine) -> None:
    with make_client(engine, max_tokens_per_request=100) as c:
        wait_ready(c)
        err = assert_error(post(c, {"model": MODEL, "input": [[1] * 60, [2] * 60]}), 400, "input")
        assert err["code"] == "max_tokens_per_request"


def test_engine_failure_is_503_with_retry_after(engine: FakeEngine, client: TestClient) -> None:
    engine.fail_status = 500
    r = post(client, {"model": MODEL, "input": [[1, 2]]})
    assert_error(r, 503)
    assert r.headers["retry-after"]


def test_engine_hang_is_504(engine: FakeEngine) -> None:
    engine.delay_s = 3600  # the engine never answers: only the request deadline can
    with make_client(engine, request_timeout_s=0.3) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        wait_ready(c)
        answer = pool.submit(post, c, {"model": MODEL, "input": [[1, 2]]})
        err = assert_error(answer.result(timeout=120), 504)  # 120: a guard against hanging
        assert err["code"] == "engine_timeout"
        assert len(engine.calls) == 1  # it reached the engine and was given up on there


def test_api_keys(engine: FakeEngine) -> None:
    with make_client(engine, api_keys=["k1", "k2"]) as c:
        wait_ready(c)
        body = {"model": MODEL, "input": [[1]]}
        assert_error(post(c, body), 401)
        assert_error(post(c, body, headers={"authorization": "Bearer nope"}), 401)
        assert post(c, body, headers={"authorization": "Bearer k2"}).status_code == 200
        assert c.get("/health/live").status_code == 200  # probes stay open by default


class SteppingClock:
    """Stands in for the ``time`` module of the pipeline and the coalescer: each reading
    is ``step_s`` after the one before, so every stage takes exactly one step."""

    def __init__(self, step_s: float) -> None:
        self.now = 1000.0
        self.step_s = step_s

    def _tick(self) -> float:
        self.now += self.step_s
        return self.now

    monotonic = perf_counter = _tick


def test_request_id_and_stage_headers(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    from embedserve.core import coalesce
    from embedserve.gateway import pipeline

    with make_client(engine) as c:
        wait_ready(c)
        monkeypatch.setattr(pipeline, "time", SteppingClock(0.25))  # tokenize: start, end
        monkeypatch.setattr(coalesce, "time", SteppingClock(0.5))  # enqueued, dispatched, answered
        r = post(c, {"model": MODEL, "input": "hello"}, headers={"x-request-id": "abc-123"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "abc-123"
        stages = {s: r.headers[f"x-embedserve-{s}-ms"] for s in ("tokenize", "queue", "engine")}
        assert stages == {"tokenize": "250.00", "queue": "500.00", "engine": "500.00"}
        assert c.get("/v1/models").headers["x-request-id"]


@pytest.mark.parametrize(("words", "truncated"), [(5, 0), (2000, 1)])
def test_truncated_inputs_header(client: TestClient, words: int, truncated: int) -> None:
    texts = ["a short one", "word " * words, "another short one"]
    r = post(client, {"model": MODEL, "input": texts, "truncate": True})
    assert r.status_code == 200, r.text
    assert r.headers["x-embedserve-truncated-inputs"] == str(truncated)
    cut = r.json()["truncated_inputs"]
    assert [t["index"] for t in cut] == ([1] if truncated else [])


def test_text_turned_into_unknown_tokens_is_reported(client: TestClient) -> None:
    """A 200,000-character string without spaces is one [UNK] on MiniLM (usage 3): the
    response lists it as dropped content, as it lists truncated inputs, and /metrics counts it."""
    texts = ["a short one", "a" * 200_000, "hello 😀 world"]
    r = post(client, {"model": MODEL, "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 5 + 3 + 5  # [CLS] a short one [SEP], [CLS] [UNK] [SEP], ...
    assert body["unknown_token_inputs"] == [{"index": 1, "unknown_tokens": 1, "unknown_chars": 200_000},
                                            {"index": 2, "unknown_tokens": 1, "unknown_chars": 1}]
    assert r.headers["x-embedserve-unknown-token-inputs"] == "2" and body["truncated_inputs"] == []
    text = client.get("/metrics").text
    assert metric(text, "embedserve_inputs_with_unknown_tokens_total") == 2
    assert metric(text, "embedserve_unknown_token_chars_total") == 200_001
    plain = post(client, {"model": MODEL, "input": "nothing unknown here"})
    assert plain.json()["unknown_token_inputs"] == []
    assert plain.headers["x-embedserve-unknown-token-inputs"] == "0"


@pytest.mark.parametrize("accept_ids", [False, True])
@pytest.mark.parametrize("bad", [5, {"text": "a"}, [1.5, 2.0], ["a", 1], [[1, 2], "a"], [None]])
def test_a_wrong_input_type_says_what_this_server_accepts(
    engine: FakeEngine, accept_ids: bool, bad: object
) -> None:
    """Token ids are named as accepted only where gateway.accept_token_ids is on (the
    default refuses them)."""
    with make_client(engine, accept_token_ids=accept_ids) as c:
        wait_ready(c)
        message = str(assert_error(post(c, {"model": MODEL, "input": bad}), 400, "input")["message"])
    if accept_ids:
        assert "only token ids" in message or "a list of token ids or a list of token-id lists" in message
        assert "takes no token ids" not in message
    else:
        assert "token-id list" not in message and "only token ids" not in message
        assert "takes no token ids" in message


@pytest.mark.parametrize(("inline_chars", "on_thread"), [(0, True), (2048, False)])
def test_short_texts_tokenise_on_the_loop_unless_configured_off(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, inline_chars: int, on_thread: bool
) -> None:
    import threading

    from embedserve.core.tokenize import ModelTokenizer

    seen: list[str] = []
    original = ModelTokenizer.encode_texts

    def spy(self: ModelTokenizer, texts: list[str]) -> Any:
        seen.append(threading.current_thread().name)
        return original(self, texts)

    monkeypatch.setattr(ModelTokenizer, "encode_texts", spy)
    with make_client(engine, inline_tokenize_chars=inline_chars) as c:
        wait_ready(c)
        assert post(c, {"model": MODEL, "input": "a short text"}).status_code == 200
    assert len(seen) == 1 and seen[0].startswith("tokenize") is on_thread


def test_an_unexpected_error_is_a_500_in_the_envelope_and_the_next_request_works(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embedserve.gateway.pipeline import EmbeddingPipeline

    original = EmbeddingPipeline.run
    calls = {"n": 0}

    async def flaky(self: EmbeddingPipeline, req: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug")
        return await original(self, req)

    monkeypatch.setattr(EmbeddingPipeline, "run", flaky)
    with TestClient(make_client(engine).app, raise_server_exceptions=False) as c:
        wait_ready(c)
        err = assert_error(post(c, {"model": MODEL, "input": "x"}), 500)
        assert "a bug" not in str(err)
        assert post(c, {"model": MODEL, "input": "x"}).status_code == 200


def test_token_ids_are_refused_by_default(engine: FakeEngine) -> None:
    """Ids from another tokenizer (LangChain's default sends tiktoken's) would give wrong
    vectors with status 200: by default the gateway refuses ids and says how to fix it."""
    with make_client(engine, accept_token_ids=False) as c:
        wait_ready(c)
        for ids in ([[15339, 1917]], [15339, 1917]):
            r = c.post("/v1/embeddings", json={"model": MODEL, "input": ids})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["code"] == "token_ids_not_accepted" and err["param"] == "input"
            assert "check_embedding_ctx_length=False" in err["message"]
            assert "EMBEDSERVE_GATEWAY__ACCEPT_TOKEN_IDS" in err["message"]
        assert engine.calls == []
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": "hello"}).status_code == 200


def test_engine_prefix_cache_counters_are_re_exported(engine: FakeEngine) -> None:
    """A load test through the gateway reads how much the engines' radix cache served."""
    engine.cache_counters = (1000, 70)
    with make_client(engine) as c:
        wait_ready(c)
        state = c.app.state.pool.engines[0]  # type: ignore[attr-defined]
        state.cache_counters = None
        wait_until(lambda: state.cache_counters is not None, timeout=10)
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
        (prompt,) = families["embedserve_engine_prompt_tokens"].samples
        (cached,) = families["embedserve_engine_cached_tokens"].samples
        assert prompt.value == 1000 and cached.value == 71  # summed over cache sources
        assert prompt.labels == {"engine": "http://fake-engine"}


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["ok", 3, None], "input[1] is a number, but input[0] is a string"),
        (["ok", "fine", None], "input[2] is null, but input[0] is a string"),
        ([[1, 2], "a"], "input[1] is a string, but input[0] is a list"),
        ([[1, 2], [3, "x"]], "input[1][1] is a string"),
        ([None, "a"], "input[0] is null"),
    ],
)
def test_a_mixed_input_list_names_the_element(client: TestClient, given: object, named: str) -> None:
    err = assert_error(post(client, {"model": MODEL, "input": given}), 400, "input")
    assert named in str(err["message"])


@pytest.mark.parametrize("path", ["/embeddings", "/models"])
def test_openai_paths_without_v1_say_where_the_api_is(client: TestClient, path: str) -> None:
    r = client.post(path, json={"model": MODEL, "input": "x"}) if path == "/embeddings" else client.get(path)
    err = assert_error(r, 404)
    assert f"/v1{path}" in str(err["message"]) and "base URL" in str(err["message"])
    assert assert_error(client.get("/nothing-here"), 404)["message"] == "Not found: /nothing-here"


def test_query_options_on_a_model_without_instructions_change_nothing(
    client: TestClient, engine: FakeEngine
) -> None:
    """One behaviour for input_type and instruction: accepted, the text embedded as it is,
    and the response says no instruction was applied."""
    plain = post(client, {"model": MODEL, "input": "a question"})
    for extra in ({"input_type": "query"}, {"input_type": "query", "instruction": "find answers"}):
        r = post(client, {"model": MODEL, "input": "a question", **extra})
        assert r.status_code == 200, r.text
        assert r.headers["x-embedserve-instruction"] == "none"
        assert r.json()["data"][0]["embedding"] == plain.json()["data"][0]["embedding"]
    assert engine.calls[-1] == engine.calls[0]  # the same ids reached the engine
    assert "x-embedserve-instruction" not in plain.headers


def test_a_replaced_engine_leaves_no_ready_series_behind(client: TestClient) -> None:
    """Engine gauges come from the engines the pool holds at scrape time: once an engine is
    replaced, its series is gone instead of keeping its last value."""
    pool = client.app.state.pool  # type: ignore[attr-defined]
    assert metric(client.get("/metrics").text, "embedserve_engine_ready", engine="http://fake-engine") == 1
    pool.add("http://fake-engine-2", ready=False)
    pool.remove("http://fake-engine")
    text = client.get("/metrics").text
    assert metric(text, "embedserve_engine_ready", engine="http://fake-engine-2") == 0
    assert "http://fake-engine\"" not in text
