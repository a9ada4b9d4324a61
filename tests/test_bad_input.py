"""Bad input, case by case and fuzzed: always a 4xx in the OpenAI envelope that names the
problem (and the field, where there is one), never a 5xx, and the next good request works.

The table runs against the fake-engine app (fast); a subset runs against the real stack, and
against the gateway at ``$EMBEDSERVE_E2E_URL`` when it is set (the containers in CI)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Served
from tests.fake_engine import FakeEngine
from tests.test_gateway_unit import make_client, wait_ready

MODEL = "all-MiniLM-L6-v2"  # the fake-engine app serves the bundled model's card and tokenizer
VOCAB = 30522
GOOD = {"model": MODEL, "input": "still healthy?"}
JSON = {"content-type": "application/json"}


@dataclass
class Case:
    name: str
    body: Any  # bytes are sent as they are; anything else as JSON
    status: int = 400
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    real: bool = False  # also run against the real stack

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def req(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hello", **fields}


def raw(text: str) -> bytes:
    return text.encode()


def with_model(rest: str) -> bytes:
    """A raw body: the model, then ``rest`` (JSON members, not necessarily valid)."""
    return raw(f'{{"model": "{MODEL}", {rest}}}')


CASES = [
    # -- the body is not a usable JSON object --------------------------------------------
    Case("malformed json", raw('{"model": "m", input: x}'), code="invalid_json", real=True),
    Case("truncated json", raw('{"model": "m", "input": "a"'), code="invalid_json"),
    Case("trailing garbage", raw(f'{{"model": "{MODEL}", "input": "a"}} xyz'), code="invalid_json"),
    Case("top-level array", raw("[1, 2]"), code="invalid_json"),
    Case("top-level string", raw('"hello"'), code="invalid_json"),
    Case("top-level null", raw("null"), code="invalid_json"),
    Case("empty body", b"", code="invalid_json"),
    Case("whitespace body", b" \n\t ", code="invalid_json"),
    Case("NaN", raw(f'{{"model": "{MODEL}", "input": [NaN]}}'), code="invalid_json", real=True),
    Case("Infinity", with_model('"input": "a", "dimensions": Infinity'), code="invalid_json"),
    Case("1e400 dimensions", with_model('"input": "a", "dimensions": 1e400'), code="invalid_json"),
    Case("1e400 token id", raw(f'{{"model": "{MODEL}", "input": [1e400]}}'), code="invalid_json"),
    Case("invalid utf-8", b'{"model": "' + MODEL.encode() + b'", "input": "\xff\xfe\xfa"}', real=True),
    Case("lone surrogate", raw(f'{{"model": "{MODEL}", "input": "\\ud800"}}'), code="invalid_json"),
    Case("utf-16 body", json.dumps(req()).encode("utf-16"), code="invalid_json"),
    Case("deep nesting", raw('{"input": ' + "[" * 5000 + "]" * 5000 + "}"), code="invalid_json"),
    Case(
        "duplicate input",
        raw(f'{{"model": "{MODEL}", "input": "a", "input": "b"}}'),
        param="input",
        code="duplicate_key",
        real=True,
    ),
    Case(
        "duplicate input, escaped",
        raw(f'{{"model": "{MODEL}", "input": "a", "\\u0069nput": "b"}}'),
        param="input",
        code="duplicate_key",
    ),
    # within orjson's nesting limit, beyond Python's recursion limit
    Case("1000 nested inputs", raw('{"input": ' * 1000 + '"a"' + "}" * 1000), code="invalid_json"),
    Case(
        "duplicate model",
        raw(f'{{"model": "other", "input": "a", "model": "{MODEL}"}}'),
        param="model",
        code="duplicate_key",
    ),
    # -- framing: content type and size ------------------------------------------------------
    Case("text/plain", req(), 415, headers={"content-type": "text/plain"}, real=True),
    Case("form", b"input=a&model=b", 415, headers={"content-type": "application/x-www-form-urlencoded"}),
    Case("multipart", b"--x\r\n\r\n--x--", 415, headers={"content-type": "multipart/form-data; boundary=x"}),
    Case("50 MB body", req(input="a" * (50 << 20)), 413, code="request_too_large", real=True),
    # -- wrong types ------------------------------------------------------------------------
    Case("missing input", {"model": MODEL}, param="input"),
    Case("missing model", {"input": "a"}, param="model"),
    Case("input null", req(input=None), param="input"),
    Case("input number", req(input=5), param="input", real=True),
    Case("input floats", req(input=[1.5, 2.0]), param="input"),
    Case("input bools", req(input=[True, False]), param="input"),
    Case("input mixed str/int", req(input=["a", 1]), param="input"),
    Case("input mixed ids/str", req(input=[[1, 2], "a"]), param="input"),
    Case("input object", req(input={"text": "a"}), param="input"),
    Case("input nested garbage", req(input=[[[1, 2]], {"a": [None]}]), param="input", real=True),
    Case("input list of objects", req(input=[{"input": "a"}]), param="input"),
    Case("model number", req(model=123), param="model"),
    Case("model null", req(model=None), param="model"),
    Case("user number", req(user=42), param="user"),
    Case("truncate string", req(truncate="yes"), param="truncate"),
    Case("truncate int", req(truncate=1), param="truncate"),
    Case("input_type unknown", req(input_type="passage"), param="input_type"),
    # -- empty and too much -------------------------------------------------------------------
    Case("empty string", req(input=""), param="input", code="empty_input", real=True),
    Case("whitespace string", req(input="   \n"), param="input", code="empty_input"),
    Case("NUL string", req(input="\u0000"), param="input", code="empty_input", real=True),
    Case("control and format characters only", req(input=["ok", "\u200b\u0001\ufeff\t"]), param="input",
         code="empty_input"),
    Case("empty list", req(input=[]), param="input", code="empty_input", real=True),
    Case("empty string in list", req(input=["ok", ""]), param="input", code="empty_input"),
    Case("empty id list", req(input=[[]]), param="input", code="empty_input"),
    Case("empty id list second", req(input=[[1, 2], []]), param="input", code="empty_input"),
    Case("2049 strings", req(input=["a"] * 2049), param="input", code="too_many_inputs", real=True),
    Case("2049 id lists", req(input=[[1]] * 2049), param="input", code="too_many_inputs"),
    Case(
        "over 300k tokens of text",
        req(input=["word " * 300] * 2048),
        param="input",
        code="max_tokens_per_request",
        real=True,
    ),
    Case(
        "over 300k tokens",
        req(input=[[1000] * 200] * 2048),
        param="input",
        code="max_tokens_per_request",
    ),
    Case("10M characters", req(input="a" * 10_000_000), param="input", code="input_too_long", real=True),
    Case(
        "over-long with truncate false",
        req(input="word " * 600, truncate=False),
        param="input",
        code="context_length_exceeded",
    ),
    # -- token ids ----------------------------------------------------------------------------
    Case("negative id", req(input=[[-1, 5]]), param="input", code="invalid_token_id"),
    Case("negative id flat", req(input=[7, -5]), param="input", code="invalid_token_id"),
    Case("id = vocab size", req(input=[[VOCAB]]), param="input", code="invalid_token_id"),
    Case("id 2**63 - 1", req(input=[[2**63 - 1]]), param="input", code="invalid_token_id"),
    Case("id beyond int64", req(input=[[10**30]]), param="input"),
    # -- dimensions ---------------------------------------------------------------------------
    Case("dimensions 0", req(dimensions=0), param="dimensions", code="invalid_dimensions", real=True),
    Case("dimensions negative", req(dimensions=-8), param="dimensions", code="invalid_dimensions"),
    Case("dimensions above model", req(dimensions=385), param="dimensions", code="invalid_dimensions"),
    Case("dimensions huge", req(dimensions=2**62), param="dimensions", code="invalid_dimensions"),
    Case("dimensions float", req(dimensions=8.5), param="dimensions"),
    Case("dimensions integral float", req(dimensions=8.0), param="dimensions"),
    Case("dimensions string", req(dimensions="8"), param="dimensions"),
    Case("dimensions bool", req(dimensions=True), param="dimensions"),
    # -- encoding_format and model ------------------------------------------------------------
    Case("encoding_format unknown", req(encoding_format="int8"), param="encoding_format", real=True),
    Case("encoding_format empty", req(encoding_format=""), param="encoding_format"),
    Case("encoding_format number", req(encoding_format=1), param="encoding_format"),
    Case("encoding_format case", req(encoding_format="FLOAT"), param="encoding_format"),
    Case("unknown model", req(model="text-embedding-3-small"), 404, "model", "model_not_found", real=True),
    Case("empty model", req(model=""), 404, "model", "model_not_found"),
    # -- instructions -------------------------------------------------------------------------
    Case("instruction without query", req(instruction="find"), param="instruction"),
    Case("query on token ids", req(input=[[1, 2]], input_type="query"), param="input_type"),
    Case("instruction number", req(input_type="query", instruction=5), param="instruction"),
]


@dataclass
class ScoreCase(Case):
    path: str = "/v1/rerank"


def rr(path: str = "/v1/rerank", **fields: Any) -> dict[str, Any]:
    """A rerank body (``path`` decides the shape: TEI's ``texts`` for /rerank with ``texts``)."""
    base: dict[str, Any] = {"model": MODEL, "query": "q", "documents": ["a", "b"]}
    if path.endswith("score"):
        base = {"model": MODEL, "text_1": "q", "text_2": ["a", "b"]}
    return {**base, **fields}


def sc(name: str, path: str, body: Any, status: int = 400, param: str | None = None, code: str | None = None,
       real: bool = False) -> ScoreCase:
    return ScoreCase(name, body, status, param, code, real=real, path=path)


SCORE_CASES = [
    # -- the rerank routes (Cohere, Jina, vLLM v2; TEI's body on /rerank) --------------------
    sc("no documents", "/v1/rerank", rr(documents=[]), param="documents", code="empty_input", real=True),
    sc("documents missing", "/v1/rerank", {"model": MODEL, "query": "q"}, param="documents"),
    sc("documents a string", "/v1/rerank", rr(documents="a"), param="documents"),
    sc("document a number", "/v1/rerank", rr(documents=["a", 5]), param="documents", real=True),
    sc("document object without text", "/v1/rerank", rr(documents=[{"content": "a"}]), param="documents"),
    sc("document text a number", "/v2/rerank", rr(documents=[{"text": 3}]), param="documents"),
    sc("empty document", "/v1/rerank", rr(documents=["a", " "]), param="documents", code="empty_input"),
    sc("empty query", "/v1/rerank", rr(query=""), param="query", code="empty_input", real=True),
    sc("whitespace query", "/v2/rerank", rr(query=" \n"), param="query", code="empty_input"),
    sc("NUL document", "/v1/rerank", rr(documents=["a", "\u0000"]), param="documents", code="empty_input",
       real=True),
    sc("zero-width query", "/v1/score", rr("/v1/score", text_1="\u200b"), param="text_1", code="empty_input"),
    sc("query missing", "/v1/rerank", {"model": MODEL, "documents": ["a"]}, param="query"),
    sc("query a list", "/v1/rerank", rr(query=["q"]), param="query"),
    sc("top_n 0", "/v1/rerank", rr(top_n=0), param="top_n", real=True),
    sc("top_n negative", "/v2/rerank", rr(top_n=-3), param="top_n"),
    sc("top_n a string", "/v1/rerank", rr(top_n="2"), param="top_n"),
    sc("top_n a float", "/v1/rerank", rr(top_n=1.5), param="top_n"),
    sc("top_n a bool", "/v1/rerank", rr(top_n=True), param="top_n"),
    sc("return_documents a string", "/v1/rerank", rr(return_documents="yes"), param="return_documents"),
    sc("max_tokens_per_doc 0", "/v2/rerank", rr(max_tokens_per_doc=0), param="max_tokens_per_doc"),
    sc("rerank unknown model", "/v1/rerank", rr(model="rerank-english-v3.0"), 404, "model", "model_not_found",
       real=True),
    sc("rerank model a number", "/rerank", rr(model=7), param="model"),
    sc("1001 documents", "/v1/rerank", rr(documents=["a"] * 1001), param="documents",
       code="too_many_documents", real=True),
    sc("over 300k pair tokens", "/v1/score", rr("/v1/score", text_1=["word " * 300] * 700,
                                                 text_2=["word " * 300] * 700),
       param="text_2", code="max_tokens_per_request"),
    sc("over-long pair, truncate false", "/v1/rerank", rr(documents=["word " * 600], truncate=False),
       param="documents", code="context_length_exceeded"),
    sc("10M-character document", "/v1/rerank", rr(documents=["a" * 10_000_000]), param="documents",
       code="input_too_long"),
    sc("rerank not an object", "/v1/rerank", raw('["q", "a"]'), code="invalid_json"),
    sc("rerank duplicate query", "/rerank", raw('{"query": "a", "documents": ["b"], "query": "c"}'),
       param="query", code="duplicate_key"),
    sc("rerank text/plain", "/v1/rerank", rr(), 415),
    sc("TEI no texts", "/rerank", {"query": "q", "texts": []}, param="texts", code="empty_input", real=True),
    sc("TEI text a number", "/rerank", {"query": "q", "texts": ["a", 1]}, param="texts"),
    sc("TEI empty query", "/rerank", {"query": "", "texts": ["a"]}, param="query", code="empty_input"),
    sc("TEI left truncation", "/rerank", {"query": "q", "texts": ["a"], "truncation_direction": "left"},
       param="truncation_direction"),
    sc("TEI raw_scores a string", "/rerank", {"query": "q", "texts": ["a"], "raw_scores": "no"},
       param="raw_scores"),
    *(sc(f"texts and documents both, {path}", path, {"query": "q", "texts": ["a"], "documents": ["b"]},
         param="texts") for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    sc("neither texts nor documents", "/rerank", {"query": "q"}, param="documents"),
    # -- the score routes (vLLM) ---------------------------------------------------------------
    sc("score no text_2", "/v1/score", rr("/v1/score", text_2=[]), param="text_2", code="empty_input",
       real=True),
    sc("score no text_1", "/score", rr("/score", text_1=[]), param="text_1", code="empty_input"),
    sc("score text_1 missing", "/v1/score", {"text_2": ["a"]}, param="text_1"),
    sc("score text_1 a number", "/v1/score", rr("/v1/score", text_1=5), param="text_1"),
    sc("score text_2 with a number", "/score", rr("/score", text_2=["a", None]), param="text_2"),
    sc("score 2 against 3", "/v1/score", rr("/v1/score", text_1=["a", "b"], text_2=["a", "b", "c"]),
       param="text_2", real=True),
    sc("score empty text_1", "/v1/score", rr("/v1/score", text_1=""), param="text_1", code="empty_input"),
    sc("score empty text in text_2", "/score", rr("/score", text_2=["a", ""]), param="text_2",
       code="empty_input"),
    sc("score truncate_prompt_tokens -2", "/v1/score", rr("/v1/score", truncate_prompt_tokens=-2),
       param="truncate_prompt_tokens"),
    sc("score use_activation a string", "/v1/score", rr("/v1/score", use_activation="no"),
       param="use_activation"),
    sc("score unknown model", "/v1/score", rr("/v1/score", model="bge-reranker-v2-m3"), 404, "model",
       "model_not_found"),
    sc("score 1001 pairs", "/score", rr("/score", text_2=["a"] * 1001), param="text_2",
       code="too_many_documents"),
]
for _case in SCORE_CASES:
    if _case.name == "rerank text/plain":
        _case.headers = {"content-type": "text/plain"}


def check_error(r: httpx.Response, case: Case) -> None:
    assert r.status_code == case.status, (case.name, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, case.name
    assert isinstance(err["message"], str) and len(err["message"]) > 10, case.name
    assert err["type"] == ("not_found_error" if case.status == 404 else "invalid_request_error")
    assert err["param"] == case.param, (case.name, err)
    if case.code:
        assert err["code"] == case.code, (case.name, err)
    if case.param:  # the message names the field too
        assert case.param.split(".")[0] in err["message"] or case.param == "input", (case.name, err)
    assert r.headers.get("x-request-id")


def test_table_has_at_least_50_cases() -> None:
    assert len(CASES) >= 50
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def fake_client() -> Iterator[TestClient]:
    with make_client(FakeEngine()) as c:
        wait_ready(c)
        yield c


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input_fake_engine(fake_client: TestClient, case: Case) -> None:
    r = fake_client.post("/v1/embeddings", content=case.content(), headers=case.headers)
    check_error(r, case)  # type: ignore[arg-type]
    assert fake_client.post("/v1/embeddings", json=GOOD).status_code == 200
    assert fake_client.get("/health/live").status_code == 200


def test_score_table_has_a_case_per_route() -> None:
    assert {c.path for c in SCORE_CASES} == {"/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"}
    assert len({c.name for c in SCORE_CASES}) == len(SCORE_CASES)


def score_still_healthy(c: TestClient) -> None:
    assert c.post("/v1/rerank", json=rr()).status_code == 200
    assert c.post("/v1/score", json=rr("/v1/score")).status_code == 200


@pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: c.name)
def test_bad_score_input_fake_engine(fake_client: TestClient, case: ScoreCase) -> None:
    r = fake_client.post(case.path, content=case.content(), headers=case.headers)
    check_error(r, case)  # type: ignore[arg-type]
    score_still_healthy(fake_client)


def test_streamed_body_over_the_cap_is_413() -> None:
    """No Content-Length (chunked): the cap counts bytes as they arrive."""
    with make_client(FakeEngine(), max_body_bytes=100_000) as c:
        wait_ready(c)
        chunks = (b'{"model": "m", "input": "' + b"a" * 50_000 for _ in range(4))
        r = c.post("/v1/embeddings", content=chunks, headers=JSON)
        check_error(r, Case("chunked", b"", 413, code="request_too_large"))  # type: ignore[arg-type]
        assert c.post("/v1/embeddings", json=GOOD).status_code == 200


@pytest.mark.parametrize("case", [c for c in CASES if c.real], ids=lambda c: c.name)
def test_bad_input_real_stack(served: Served, case: Case) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as c:
        try:
            r = c.post("/v1/embeddings", content=case.content(), headers=case.headers)
        except httpx.WriteError:  # the server may answer 413 and close before reading it all
            assert case.status == 413
        else:
            check_error(r, case)
        good = c.post("/v1/embeddings", json={**GOOD, "model": served.model_name})
        assert good.status_code == 200
        assert c.get("/health/ready").status_code == 200


@pytest.mark.parametrize("case", [c for c in SCORE_CASES if c.real], ids=lambda c: c.name)
def test_bad_score_input_real_stack(served: Served, case: ScoreCase) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as c:
        body = case.content().replace(MODEL.encode(), served.model_name.encode())
        check_error(c.post(case.path, content=body, headers=case.headers), case)
        good = rr(model=served.model_name)
        assert c.post("/v1/rerank", json=good).status_code == 200
        assert c.get("/health/ready").status_code == 200


# -- property-based fuzzing of the request schema -----------------------------------------

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
token_ids = st.lists(st.integers(min_value=-3, max_value=VOCAB + 3), max_size=6)
plausible_input = (
    st.text(max_size=40)
    | st.lists(st.text(max_size=20), max_size=5)
    | token_ids
    | st.lists(token_ids, max_size=4)
)
FIELDS = {
    "input": plausible_input | json_any,
    "model": st.sampled_from([MODEL, "", "gpt-4"]) | json_any,
    "encoding_format": st.sampled_from(["float", "base64", "int8"]) | json_any,
    "dimensions": st.integers(min_value=-2, max_value=400) | json_any,
    "user": st.text(max_size=5) | json_any,
    "truncate": st.booleans() | json_any,
    "input_type": st.sampled_from(["query", "document", "x"]) | json_any,
    "instruction": st.text(max_size=10) | json_any,
    "extra": json_any,
}
request_bodies = st.fixed_dictionaries({}, optional=dict(FIELDS)) | json_any


def assert_contract(r: Any) -> None:
    assert r.status_code < 500, r.text[:300]
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def assert_still_healthy(c: TestClient) -> None:
    assert c.post("/v1/embeddings", json=GOOD).status_code == 200
    assert c.get("/health/ready").status_code == 200


def test_fuzz_request_schema(fake_client: TestClient) -> None:
    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=request_bodies)
    def fuzz(body: Any) -> None:
        assert_contract(fake_client.post("/v1/embeddings", content=json.dumps(body), headers=JSON))

    fuzz()
    assert_still_healthy(fake_client)


SCORE_FIELDS = {
    "model": st.sampled_from([MODEL, "", "rerank-v3.5"]) | json_any,
    "query": st.text(max_size=20) | json_any,
    "documents": st.lists(st.text(max_size=10) | st.fixed_dictionaries({"text": st.text(max_size=5)}),
                          max_size=4) | json_any,
    "texts": st.lists(st.text(max_size=10), max_size=4) | json_any,
    "text_1": st.text(max_size=10) | st.lists(st.text(max_size=10), max_size=3) | json_any,
    "text_2": st.text(max_size=10) | st.lists(st.text(max_size=10), max_size=3) | json_any,
    "top_n": st.integers(min_value=-2, max_value=6) | json_any,
    "return_documents": st.booleans() | json_any,
    "raw_scores": st.booleans() | json_any,
    "truncate_prompt_tokens": st.integers(min_value=-3, max_value=600) | json_any,
    "truncate": st.booleans() | json_any,
}
score_bodies = st.fixed_dictionaries({}, optional=dict(SCORE_FIELDS)) | json_any


def test_fuzz_score_routes(fake_client: TestClient) -> None:
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=score_bodies, path=st.sampled_from(["/v1/rerank", "/rerank", "/v2/rerank", "/v1/score"]))
    def fuzz(body: Any, path: str) -> None:
        assert_contract(fake_client.post(path, content=json.dumps(body), headers=JSON))

    fuzz()
    score_still_healthy(fake_client)


def test_fuzz_raw_bytes(fake_client: TestClient) -> None:
    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=st.binary(max_size=200), ctype=st.sampled_from(["application/json", "text/plain", ""]))
    def fuzz(body: bytes, ctype: str) -> None:
        assert_contract(fake_client.post("/v1/embeddings", content=body, headers={"content-type": ctype}))

    fuzz()
    assert_still_healthy(fake_client)
