"""The rerank and score routes over the fake engine (no model): each client shape, its ordering
and fields, truncation reported as /v1/embeddings reports it, the limits, and the admission
and 429s they share with embeddings. The bundled model answers the same routes in
test_rerank_stack.py."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from embedserve.core.tokenize import ModelTokenizer
from tests.conftest import MINILM_DIR, metric, metric_samples, wait_until
from tests.fake_engine import FakeEngine, fake_vector
from tests.test_gateway_unit import assert_error, make_client, wait_ready

MODEL = "all-MiniLM-L6-v2"
QUERY = "how do I sort a list"
DOCS = ["sorted() returns a new sorted list", "a banana is yellow", "list.sort() sorts in place", "tea"]
TOKENIZER = ModelTokenizer(MINILM_DIR, 256)


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def client(engine: FakeEngine) -> Any:
    with make_client(engine) as c:
        wait_ready(c)
        yield c


def cosine(query: str, document: str) -> float:
    """The fake engine's vectors for the two texts as the gateway tokenises them."""
    q, d = (fake_vector(x.ids, 384) for x in TOKENIZER.encode_texts([query, document]))
    return float(np.dot(q, d) / np.linalg.norm(q) / np.linalg.norm(d))


def expected_order(query: str, docs: list[str]) -> list[tuple[int, float]]:
    scores = [cosine(query, d) for d in docs]
    return sorted(enumerate(scores), key=lambda x: -x[1])


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_cohere_and_jina_rerank_ranks_by_cosine_best_first(client: TestClient, path: str) -> None:
    body = {"model": MODEL, "query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    want = expected_order(QUERY, DOCS)
    assert [x["index"] for x in out["results"]] == [i for i, _ in want]
    np.testing.assert_allclose(
        [x["relevance_score"] for x in out["results"]], [s for _, s in want], atol=1e-6
    )
    assert all("document" not in x for x in out["results"])  # return_documents defaults to false
    assert out["model"] == MODEL and out["id"].startswith("rerank-") and out["truncated_inputs"] == []
    assert r.headers["x-embedserve-score"] == "cosine" and r.headers["x-embedserve-truncated-inputs"] == "0"


def test_top_n_and_return_documents_and_the_default_model(client: TestClient) -> None:
    r = client.post(
        "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": True}
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    best = [i for i, _ in expected_order(QUERY, DOCS)[:2]]
    assert [x["index"] for x in results] == best
    assert [x["document"] for x in results] == [{"text": DOCS[i]} for i in best]
    everything = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 99}).json()
    assert len(everything["results"]) == len(DOCS)


def test_the_query_is_embedded_once_however_many_documents(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 200
    sent = [ids for call in engine.calls for ids in call]
    assert len(sent) == 1 + len(DOCS)
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(map(len, sent))


def test_tei_rerank_is_a_bare_list_best_first(client: TestClient) -> None:
    r = client.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True, "raw_scores": True})
    assert r.status_code == 200, r.text
    want = expected_order(QUERY, DOCS)
    assert [x["index"] for x in r.json()] == [i for i, _ in want]
    assert [x["text"] for x in r.json()] == [DOCS[i] for i, _ in want]
    assert set(client.post("/rerank", json={"query": QUERY, "texts": DOCS}).json()[0]) == {"index", "score"}


def test_vllm_score_one_to_many_and_pair_by_pair_in_order(client: TestClient) -> None:
    r = client.post("/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [d["index"] for d in out["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in out["data"]) and out["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in out["data"]], [cosine(QUERY, d) for d in DOCS], atol=1e-6)
    pairs = client.post("/score", json={"text_1": ["tea", QUERY], "text_2": DOCS[:2]}).json()["data"]
    want = [cosine("tea", DOCS[0]), cosine(QUERY, DOCS[1])]
    np.testing.assert_allclose([d["score"] for d in pairs], want, atol=1e-6)
    one = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS[0]}).json()["data"]
    assert len(one) == 1


def test_an_over_long_pair_is_cut_and_reported_as_embeddings_report_it(client: TestClient) -> None:
    long_doc = "word " * 600
    before = metric(client.get("/metrics").text, "embedserve_inputs_truncated_total")
    r = client.post("/v1/rerank", json={"query": QUERY, "documents": ["short", long_doc]})
    assert r.status_code == 200, r.text
    cut = r.json()["truncated_inputs"]
    query_tokens = len(TOKENIZER.encode_texts([QUERY])[0].ids)
    assert cut == [{"index": 1, "original_tokens": query_tokens + 602, "kept_tokens": query_tokens + 256}]
    assert r.headers["x-embedserve-truncated-inputs"] == "1"
    assert metric(client.get("/metrics").text, "embedserve_inputs_truncated_total") == before + 1
    refused = client.post(
        "/v1/rerank", json={"query": QUERY, "documents": ["short", long_doc], "truncate": False}
    )
    err = assert_error(refused, 400, "documents")
    assert err["code"] == "context_length_exceeded" and "documents[1]" in str(err["message"])


def test_request_caps_cut_pairs_shorter(client: TestClient) -> None:
    """vLLM's truncate_prompt_tokens and Cohere v2's max_tokens_per_doc are caps below the model's."""
    r = client.post(
        "/v1/score", json={"text_1": QUERY, "text_2": ["word " * 50], "truncate_prompt_tokens": 10}
    )
    assert r.json()["truncated_inputs"][0]["kept_tokens"] == 10 + len(TOKENIZER.encode_texts([QUERY])[0].ids)
    r = client.post(
        "/v2/rerank", json={"query": QUERY, "documents": ["word " * 50], "max_tokens_per_doc": 12}
    )
    query = len(TOKENIZER.encode_texts([QUERY])[0].ids)
    assert r.json()["truncated_inputs"][0]["kept_tokens"] == query + 12 + 2  # the document's [CLS] and [SEP]


def test_documents_and_tokens_per_request_limits(engine: FakeEngine) -> None:
    with make_client(engine, served={"rerank": {"max_documents": 3, "max_tokens_per_request": 40}}) as c:
        wait_ready(c)
        err = assert_error(c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}), 400, "documents")
        assert err["code"] == "too_many_documents"
        err = assert_error(
            c.post("/rerank", json={"query": QUERY, "texts": ["word " * 30] * 2}), 400, "texts"
        )
        assert err["code"] == "max_tokens_per_request"
        assert c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS[:3]}).status_code == 200


def test_rerank_waits_in_the_same_admission_as_embeddings() -> None:
    """An embeddings request holding the tokens-in-flight bound makes a rerank request a 429."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    with (
        make_client(engine, max_tokens_in_flight=20, accept_token_ids=True) as c,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        wait_ready(c)
        held = pool.submit(c.post, "/v1/embeddings", json={"model": MODEL, "input": [[5] * 20]})
        wait_until(lambda: len(engine.calls) == 1, timeout=30, interval=0.01)
        r = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        err = assert_error(r, 429)
        assert err["code"] == "overloaded" and r.headers["retry-after"]
        gate.set()
        assert held.result(timeout=60).status_code == 200
        assert c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).status_code == 200
        text = c.get("/metrics").text
        assert metric(text, "embedserve_score_requests_total", route="rerank", status="429") == 1
        assert metric(text, "embedserve_score_requests_total", route="rerank", status="200") == 1
        assert metric(text, "embedserve_tokens_in_flight") == 0


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"])
def test_api_keys_protect_every_score_route(engine: FakeEngine, path: str) -> None:
    body = {"query": QUERY, "documents": DOCS, "text_1": QUERY, "text_2": DOCS}
    body = {k: v for k, v in body.items() if (k in ("text_1", "text_2")) == path.endswith("score")}
    with make_client(engine, api_keys=["k1"]) as c:
        wait_ready(c)
        assert_error(c.post(path, json=body), 401)
        assert c.post(path, json=body, headers={"authorization": "Bearer k1"}).status_code == 200


def test_engine_failure_is_503_and_warming_up_is_503(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_status = 500
    r = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert_error(r, 503)
    engine.fail_status = None
    client.app.state.gate.close("warming up")  # type: ignore[attr-defined]
    r = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
    assert assert_error(r, 503)["code"] == "warming_up" and r.headers["retry-after"]


#: what the engines did, as /metrics counts it for every route
ENGINE_WORK = (
    "embedserve_tokens_total", "embedserve_inputs_total", "embedserve_request_tokens_count",
    "embedserve_inputs_truncated_total", "embedserve_truncated_tokens_total",
    "embedserve_inputs_with_unknown_tokens_total", "embedserve_unknown_token_chars_total",
    "embedserve_stage_seconds_count", "embedserve_model_tokens_total", "embedserve_model_requests_total",
)


def _moved(client: TestClient, path: str, body: dict[str, Any]) -> tuple[set[str], Any]:
    """The engine-work series one request moved, and its response."""
    before = metric_samples(client.get("/metrics").text)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    after = metric_samples(client.get("/metrics").text)
    moved = {name for (name, labels), v in after.items()
             if name in ENGINE_WORK and v != before.get((name, labels), 0.0)}
    return moved, r


def test_scores_count_what_embeddings_count(client: TestClient) -> None:
    """One shared step: a score request over a cut document and one with text the tokenizer
    cannot spell moves every series an embeddings request over the same texts moves, and
    reports the same headers."""
    texts = ["word " * 600, "hello \U0001F600 world"]
    embedded, e = _moved(client, "/v1/embeddings", {"model": MODEL, "input": [QUERY, *texts]})
    scored, s = _moved(client, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": texts})
    assert embedded == scored == set(ENGINE_WORK)
    ours = {h for h in e.headers if h.startswith("x-embedserve-")}
    assert ours == {h for h in s.headers if h.startswith("x-embedserve-")} - {"x-embedserve-score"}
    assert s.headers["x-embedserve-unknown-token-inputs"] == "1"
    before = metric_samples(client.get("/metrics").text)
    client.post("/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": texts[1]})
    text = client.get("/metrics").text
    no_labels: frozenset[tuple[str, str]] = frozenset()
    unknown = before[("embedserve_inputs_with_unknown_tokens_total", no_labels)]
    assert metric(text, "embedserve_inputs_with_unknown_tokens_total") == unknown + 1
    assert metric(text, "embedserve_model_requests_total", model=MODEL, route="score") >= 1
