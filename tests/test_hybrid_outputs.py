"""A model's sparse and ColBERT outputs through the gateway, over the fake engine speaking the
hybrid wire (no model): /v1/embeddings' ``outputs`` and its shapes, TEI's /embed_sparse and
/embed_all, MaxSim on the rerank and score routes against a brute-force computation, the 400s,
truncation, the metrics, and the coalescer keeping requests for other outputs out of a call."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from embedserve.config import Settings
from embedserve.contracts.hybrid import HybridOutputs, Output, Sparse
from embedserve.core.coalesce import Coalescer
from embedserve.core.hybrid import maxsim, trim_sparse
from embedserve.core.tokenize import ModelTokenizer
from embedserve.gateway.app import create_app
from embedserve.model_info import ModelInfo
from tests.conftest import MINILM_DIR, metric, metric_samples
from tests.fake_engine import (
    COLBERT_DIM,
    FakeEngine,
    HttpxEngineClient,
    fake_colbert,
    fake_sparse,
    fake_vector,
)
from tests.test_coalesce import settle
from tests.test_gateway_unit import assert_error, wait_ready

MODEL = "all-MiniLM-L6-v2"
TOKENIZER = ModelTokenizer(MINILM_DIR, 256)
M3: tuple[Output, ...] = ("dense", "sparse", "colbert")  # BGE-M3's outputs
TEXTS = ["how do I sort a list", "sorted() returns a new sorted list"]
QUERY = "how do I sort a list"
DOCS = ["sorted() returns a new sorted list", "a banana is yellow", "list.sort() sorts in place", "tea"]


def client_for(engine: FakeEngine, outputs: tuple[Output, ...], **gateway: object) -> TestClient:
    settings = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"request_timeout_s": 10.0, **gateway},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    info = dataclasses.replace(ModelInfo.load(settings.model), outputs=outputs)
    transport = httpx.ASGITransport(app=engine.app())
    return TestClient(create_app(settings, info=info, engine_client=HttpxEngineClient(transport)))


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def m3(engine: FakeEngine) -> Iterator[TestClient]:
    with client_for(engine, M3) as c:
        wait_ready(c)
        yield c


def ids_of(texts: list[str]) -> list[list[int]]:
    return [x.ids for x in TOKENIZER.encode_texts(texts)]


def unpack(rows: list[str]) -> np.ndarray:
    return np.stack([np.frombuffer(base64.b64decode(r), dtype="<f4") for r in rows])


# -- /v1/embeddings' outputs --------------------------------------------------------------------


def test_each_item_carries_the_outputs_asked_and_a_plain_request_stays_plain(
    m3: TestClient, engine: FakeEngine
) -> None:
    body = {"model": MODEL, "input": TEXTS, "outputs": ["colbert", "sparse", "dense"]}
    r = m3.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    ids = ids_of(TEXTS)
    for item, x in zip(r.json()["data"], ids, strict=True):
        assert set(item) == {"object", "index", "embedding", "sparse_embedding", "colbert_embedding"}
        np.testing.assert_allclose(item["embedding"], fake_vector(x, 384), atol=1e-6)
        want = fake_sparse(x)
        assert item["sparse_embedding"]["indices"] == want.indices.tolist()
        np.testing.assert_allclose(item["sparse_embedding"]["values"], want.values, rtol=1e-6)
        np.testing.assert_allclose(item["colbert_embedding"], fake_colbert(x), atol=1e-6)
        assert len(item["colbert_embedding"]) == len(x) - 1  # the first token dropped
    assert engine.asked == [["dense", "sparse", "colbert"]]  # the wire's order, one call
    plain = m3.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS}).json()
    assert set(plain["data"][0]) == {"object", "index", "embedding"}
    assert engine.asked[-1] is None  # the plain wire: what SGLang and every engine speak


def test_base64_encodes_the_dense_vector_and_each_colbert_row(m3: TestClient) -> None:
    body = {"model": MODEL, "input": TEXTS[1], "outputs": ["sparse", "colbert"], "encoding_format": "base64"}
    item = m3.post("/v1/embeddings", json=body).json()["data"][0]
    assert "embedding" not in item  # not asked
    (x,) = ids_of(TEXTS[1:])
    np.testing.assert_allclose(unpack(item["colbert_embedding"]), fake_colbert(x), atol=1e-7)
    assert item["colbert_embedding"][0] != fake_colbert(x)[0].tolist()
    assert item["sparse_embedding"]["indices"] == fake_sparse(x).indices.tolist()  # numbers either way


def test_sparse_top_k_and_min_weight_keep_the_largest_weights_in_id_order(m3: TestClient) -> None:
    (x,) = ids_of(DOCS[:1])
    full = fake_sparse(x)
    weights = dict(zip(full.indices.tolist(), full.values.tolist(), strict=True))
    best = sorted(weights, key=lambda t: (-weights[t], t))[:3]
    body = {"model": MODEL, "input": DOCS[0], "outputs": ["sparse"], "sparse_top_k": 3}
    got = m3.post("/v1/embeddings", json=body).json()["data"][0]["sparse_embedding"]
    assert got["indices"] == sorted(best)
    floor = sorted(weights.values())[len(weights) // 2]
    body = {"model": MODEL, "input": DOCS[0], "outputs": ["sparse"], "sparse_min_weight": floor}
    got = m3.post("/v1/embeddings", json=body).json()["data"][0]["sparse_embedding"]
    assert got["indices"] == sorted(t for t, w in weights.items() if w >= floor)
    assert 0 < len(got["indices"]) < len(weights)


def test_trim_sparse_breaks_ties_by_the_lower_id() -> None:
    s = Sparse(np.asarray([2, 5, 9, 11]), np.asarray([0.5, 0.9, 0.5, 0.1], dtype=np.float32))
    cut = trim_sparse(s, 2, None)
    assert cut.indices.tolist() == [2, 5]
    assert trim_sparse(s, None, 0.5).indices.tolist() == [2, 5, 9]
    assert trim_sparse(s, 1, 0.95).indices.tolist() == []


def test_an_over_long_input_is_cut_and_reported_for_every_output(m3: TestClient) -> None:
    long = "word " * 600
    before = metric(m3.get("/metrics").text, "embedserve_inputs_truncated_total")
    r = m3.post("/v1/embeddings", json={"model": MODEL, "input": [long, "short"], "outputs": ["colbert"]})
    assert r.status_code == 200, r.text
    assert r.json()["truncated_inputs"] == [{"index": 0, "original_tokens": 602, "kept_tokens": 256}]
    assert len(r.json()["data"][0]["colbert_embedding"]) == 255
    assert metric(m3.get("/metrics").text, "embedserve_inputs_truncated_total") == before + 1
    body = {"model": MODEL, "input": long, "outputs": ["sparse"], "truncate": False}
    refused = m3.post("/v1/embeddings", json=body)
    assert assert_error(refused, 400, "input")["code"] == "context_length_exceeded"


def test_the_metrics_count_each_output_and_the_tei_routes_requests(m3: TestClient) -> None:
    def sample(output: str) -> float:
        return metric(m3.get("/metrics").text, "embedserve_output_inputs_total", output=output)

    def requests(status: str) -> float:  # none yet: no series
        samples = metric_samples(m3.get("/metrics").text)
        return samples.get(("embedserve_requests_total", frozenset({("status", status)})), 0.0)

    before = {o: sample(o) for o in M3}
    ok, refused = requests("200"), requests("400")
    m3.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS, "outputs": ["sparse", "colbert"]})
    m3.post("/embed_sparse", json={"inputs": TEXTS[0]})
    m3.post("/embed_all", json={"inputs": TEXTS})
    assert {o: sample(o) - before[o] for o in M3} == {"dense": 0, "sparse": 3, "colbert": 4}
    m3.post("/embed_sparse", json={"inputs": ""})
    assert (requests("200"), requests("400")) == (ok + 3, refused + 1)


def test_models_list_each_models_outputs(m3: TestClient) -> None:
    assert m3.get(f"/v1/models/{MODEL}").json()["outputs"] == list(M3)
    assert m3.get("/v1/models").json()["data"][0]["outputs"] == list(M3)


# -- TEI's shapes ----------------------------------------------------------------------------------


def test_embed_sparse_answers_teis_shape(m3: TestClient) -> None:
    r = m3.post("/embed_sparse", json={"inputs": TEXTS, "truncate": True, "truncation_direction": "Right"})
    assert r.status_code == 200, r.text
    for got, x in zip(r.json(), ids_of(TEXTS), strict=True):
        want = fake_sparse(x)
        assert [v["index"] for v in got] == want.indices.tolist()
        assert all(set(v) == {"index", "value"} for v in got)
        np.testing.assert_allclose([v["value"] for v in got], want.values, rtol=1e-6)
    single = m3.post("/embed_sparse", json={"inputs": TEXTS[0], "sparse_top_k": 2}).json()
    assert len(single) == 1 and len(single[0]) == 2  # a string is a batch of one, as in TEI


def test_embed_all_answers_each_inputs_token_vectors(m3: TestClient) -> None:
    r = m3.post("/embed_all", json={"inputs": [TEXTS[1]]})
    assert r.status_code == 200, r.text
    (x,) = ids_of(TEXTS[1:])
    assert np.asarray(r.json()).shape == (1, len(x) - 1, COLBERT_DIM)
    np.testing.assert_allclose(r.json()[0], fake_colbert(x), atol=1e-6)


def test_tei_routes_answer_errors_in_the_envelope_with_teis_field_names(m3: TestClient) -> None:
    err = assert_error(m3.post("/embed_sparse", json={"inputs": ["fine", " "]}), 400, "inputs")
    assert "inputs[1]" in str(err["message"])
    assert_error(m3.post("/embed_all", json={"inputs": 3}), 400, "inputs")
    assert_error(m3.post("/embed_sparse", json={"inputs": "a", "prompt_name": "passage"}), 400, "prompt_name")


# -- bad input ---------------------------------------------------------------------------------------


def test_an_output_the_model_lacks_is_a_400_naming_its_outputs(engine: FakeEngine) -> None:
    with client_for(engine, ("dense",)) as c:
        wait_ready(c)
        body = {"model": MODEL, "input": "a", "outputs": ["sparse"]}
        err = assert_error(c.post("/v1/embeddings", json=body), 400, "outputs")
        assert "['dense']" in str(err["message"]) and err["code"] == "unsupported_output"
        err = assert_error(c.post("/embed_all", json={"inputs": "a"}), 400, "outputs")
        assert "colbert" in str(err["message"]) and "['dense']" in str(err["message"])
        assert_error(c.post("/v1/embeddings", json={**body, "outputs": []}), 400, "outputs")
        err = assert_error(c.post("/v1/embeddings", json={**body, "outputs": ["bm25"]}), 400, "outputs.0")
        assert "'dense', 'sparse' or 'colbert'" in str(err["message"])
    assert engine.calls == []


def test_in_front_of_sglang_a_bge_m3_offers_its_dense_vector_only(engine: FakeEngine) -> None:
    """SGLang's embedding path gives no sparse or ColBERT output: the gateway says so, and never
    sends it a request it would answer with the dense vector alone."""
    sglang = {"kind": "external", "urls": ["http://fake-engine"], "external_kind": "sglang"}
    settings = Settings(engine=sglang, health={"sample_interval_s": 60}, _env_file=None)
    info = dataclasses.replace(ModelInfo.load(settings.model), outputs=M3)
    transport = httpx.ASGITransport(app=engine.app())
    with TestClient(create_app(settings, info=info, engine_client=HttpxEngineClient(transport))) as c:
        wait_ready(c)
        assert c.get(f"/v1/models/{MODEL}").json()["outputs"] == ["dense"]
        body = {"model": MODEL, "input": "a", "outputs": ["sparse"]}
        err = assert_error(c.post("/v1/embeddings", json=body), 400, "outputs")
        assert "['dense']" in str(err["message"])
    assert engine.calls == []


def test_a_sparse_only_model_refuses_the_dense_vector_and_scoring(engine: FakeEngine) -> None:
    with client_for(engine, ("sparse",)) as c:  # SPLADE
        wait_ready(c)
        err = assert_error(c.post("/v1/embeddings", json={"model": MODEL, "input": "a"}), 400, "outputs")
        assert "['sparse']" in str(err["message"])
        assert_error(c.post("/v2/embed", json={"model": MODEL, "texts": ["a"]}), 400)
        assert_error(c.post("/v1/rerank", json={"query": "a", "documents": ["b"]}), 400, "model")
        ok = c.post("/v1/embeddings", json={"model": MODEL, "input": "a b", "outputs": ["sparse"]})
        assert ok.status_code == 200, ok.text
    assert engine.asked == [["sparse"]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"dimensions": 64}, "dimensions"),
        ({"embedding_type": "int8"}, "embedding_type"),
        ({"truncate": "chunk"}, "truncate"),
        ({"late_chunking": {"chunk_tokens": 4}}, "late_chunking"),
    ],
)
def test_options_that_shape_the_dense_vector_are_refused_beside_other_outputs(
    m3: TestClient, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "a b c", "outputs": ["dense", "colbert"], **extra}
    err = assert_error(m3.post("/v1/embeddings", json=body), 400, param)
    assert "dense vector alone" in str(err["message"])


def test_sparse_options_need_the_sparse_output(m3: TestClient) -> None:
    body = {"model": MODEL, "input": "a", "sparse_top_k": 3}
    assert_error(m3.post("/v1/embeddings", json=body), 400, "sparse_top_k")
    body = {**body, "outputs": ["sparse"], "sparse_top_k": 0}
    assert_error(m3.post("/v1/embeddings", json=body), 400, "sparse_top_k")


def test_a_colbert_request_past_its_token_cap_is_refused(engine: FakeEngine) -> None:
    with client_for(engine, M3, max_colbert_tokens_per_request=20) as c:
        wait_ready(c)
        body = {"model": MODEL, "input": ["one two three four five six"] * 3, "outputs": ["colbert"]}
        err = assert_error(c.post("/v1/embeddings", json=body), 400, "input")
        assert "MAX_COLBERT_TOKENS_PER_REQUEST" in str(err["message"])
        assert c.post("/v1/embeddings", json={**body, "outputs": ["sparse"]}).status_code == 200
        assert c.post("/v1/embeddings", json={**body, "input": body["input"][:1]}).status_code == 200


# -- MaxSim --------------------------------------------------------------------------------------------


def brute_maxsim(query: str, document: str) -> float:
    """Each query token's best dot product with a document token, by loops, averaged."""
    q, d = (fake_colbert(x) for x in ids_of([query, document]))
    best = [max(float(sum(float(a) * float(b) for a, b in zip(qr, dr, strict=True))) for dr in d) for qr in q]
    return sum(best) / len(best)


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank"])
def test_a_colbert_model_reranks_by_maxsim(m3: TestClient, engine: FakeEngine, path: str) -> None:
    r = m3.post(path, json={"model": MODEL, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    want = sorted(((i, brute_maxsim(QUERY, d)) for i, d in enumerate(DOCS)), key=lambda x: -x[1])
    results = r.json()["results"]
    assert [x["index"] for x in results] == [i for i, _ in want]
    np.testing.assert_allclose([x["relevance_score"] for x in results], [s for _, s in want], atol=1e-5)
    assert r.headers["x-embedserve-score"] == "maxsim"
    sent = [ids for call in engine.calls for ids in call]
    assert len(sent) == 1 + len(DOCS)  # the query's vectors once for all its documents
    assert {tuple(a or ()) for a in engine.asked} == {("colbert",)}


def test_tei_rerank_and_vllm_score_use_maxsim_too(m3: TestClient) -> None:
    ranks = m3.post("/rerank", json={"query": QUERY, "texts": DOCS}).json()
    want = [brute_maxsim(QUERY, d) for d in DOCS]
    np.testing.assert_allclose([x["score"] for x in ranks], [want[x["index"]] for x in ranks], atol=1e-5)
    assert [x["index"] for x in ranks] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    pairs = m3.post("/v1/score", json={"text_1": ["tea", QUERY], "text_2": DOCS[:2]}).json()["data"]
    want = [brute_maxsim("tea", DOCS[0]), brute_maxsim(QUERY, DOCS[1])]
    np.testing.assert_allclose([d["score"] for d in pairs], want, atol=1e-5)


def test_maxsim_matches_the_brute_force_sum_over_query_tokens() -> None:
    rng = np.random.default_rng(0)
    q, d = (rng.standard_normal((n, 8)).astype(np.float32) for n in (5, 9))
    want = np.mean([max(float(np.dot(a, b)) for b in d) for a in q])
    assert maxsim(q, d) == pytest.approx(want, abs=1e-5)
    assert maxsim(q[:0], d) == 0.0


# -- the coalescer -----------------------------------------------------------------------------------


class OutputsEngine:
    """Records each call's inputs and outputs; answers at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], list[str] | None]] = []

    async def embed(self, batch: list[list[int]]) -> np.ndarray:
        self.calls.append((batch, None))
        await asyncio.sleep(0)
        return np.asarray([[float(ids[0]), 1.0] for ids in batch], dtype=np.float32)

    async def embed_outputs(self, batch: list[list[int]], outputs: list[Output]) -> HybridOutputs:
        self.calls.append((batch, list(outputs)))
        await asyncio.sleep(0)
        return HybridOutputs(dense=None, sparse=[fake_sparse([0, *ids, 0]) for ids in batch], colbert=None)


def test_a_call_carries_only_inputs_that_ask_the_same_outputs_and_the_others_go_next() -> None:
    async def go() -> OutputsEngine:
        engine = OutputsEngine()
        c = Coalescer(engine.embed, token_budget=4, max_wait_s=0, max_concurrent_calls=1,
                      embed_outputs=engine.embed_outputs)
        await c.start()
        first = asyncio.create_task(c.embed([[9]]))  # takes the one slot
        await asyncio.sleep(0)
        dense_a = asyncio.create_task(c.embed([[1]] * 3))
        sparse = asyncio.create_task(c.embed_outputs([[5], [6]], ("sparse",)))
        dense_b = asyncio.create_task(c.embed([[2]] * 3))
        await settle()
        for _ in range(20):
            await settle()
        vectors, _ = dense_a.result()
        assert vectors[:, 0].tolist() == [1.0] * 3
        answer, _ = sparse.result()
        assert answer.sparse is not None and [s.indices.tolist() for s in answer.sparse] == [[5], [6]]
        assert dense_b.result()[0][:, 0].tolist() == [2.0] * 3 and first.done()
        await c.stop()
        return engine

    calls = asyncio.run(go()).calls
    # the dense requests' turns pass the sparse one over, which then goes first, not after them
    assert calls[1:] == [([[1], [2], [1], [2]], None), ([[5], [6]], ["sparse"]), ([[2], [1]], None)]


def test_loadtest_outputs_are_sent_in_every_request() -> None:
    from embedserve.loadtest.args import build_parser
    from embedserve.loadtest.cli import prepare

    a = build_parser().parse_args(["http://127.0.0.1:9/v1", "--model", MODEL, "--mix", "fixed:8",
                                   "--outputs", "dense,colbert", "--requests", "1"])
    _, factory, _ = prepare(a)
    assert orjson.loads(factory.make().body)["outputs"] == ["dense", "colbert"]
