"""vLLM's ``POST /pooling`` over the fake engine speaking the hybrid wire: its response against a
copy of vLLM's ``PoolingResponse`` schema, its values against /v1/embeddings' for the same
inputs (dense and ColBERT, floats and base64), the 400s, truncation, metrics and the API key."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

from tests import test_hybrid_outputs as hybrid
from tests.conftest import metric_samples
from tests.fake_engine import COLBERT_DIM, FakeEngine, fake_colbert
from tests.test_gateway_unit import assert_error, wait_ready
from tests.test_hybrid_outputs import M3, MODEL, TEXTS, client_for, ids_of


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class UsageInfo(Strict):  # vllm/entrypoints/openai/engine/protocol.py
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None
    prompt_tokens_details: dict[str, Any] | None


class PoolingResponseData(Strict):  # vllm/entrypoints/pooling/pooling/protocol.py
    index: int
    object: str
    data: list[list[float]] | list[float] | str


class PoolingResponse(Strict):
    id: str
    object: str
    created: int
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


engine, m3 = hybrid.engine, hybrid.m3  # its fixtures


def pooling(client: TestClient, **body: Any) -> PoolingResponse:
    r = client.post("/pooling", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    answer = PoolingResponse.model_validate(r.json())
    assert answer.id.startswith("pool-") and (answer.object, answer.model) == ("list", MODEL)
    assert [(d.index, d.object) for d in answer.data] == [(i, "pooling") for i in range(len(answer.data))]
    return answer


def embeddings(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def test_embed_answers_vllms_shape_with_the_dense_vectors_of_v1_embeddings(m3: TestClient) -> None:
    got = pooling(m3, input=TEXTS)  # task: embed by default, as vLLM's embedding models
    want = embeddings(m3, input=TEXTS)
    assert [d.data for d in got.data] == [item["embedding"] for item in want["data"]]
    assert isinstance(got.data[0].data[0], float)
    assert got.usage.prompt_tokens == got.usage.total_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == 0
    b64 = pooling(m3, input=TEXTS[0], task="embed", encoding_format="base64")
    want = embeddings(m3, input=TEXTS[0], encoding_format="base64")
    assert b64.data[0].data == want["data"][0]["embedding"]


def test_token_embed_answers_the_colbert_vectors_of_v1_embeddings(m3: TestClient, engine: FakeEngine) -> None:
    got = pooling(m3, input=TEXTS, task="token_embed")
    want = embeddings(m3, input=TEXTS, outputs=["colbert"])
    assert [d.data for d in got.data] == [item["colbert_embedding"] for item in want["data"]]
    assert engine.asked[0] == ["colbert"]
    # base64: one string per input, the whole array's little-endian float32 bytes (vLLM's tensor2binary)
    b64 = pooling(m3, input=TEXTS[1], task="token_embed", encoding_format="base64")
    raw = b64.data[0].data
    assert isinstance(raw, str)
    (x,) = ids_of(TEXTS[1:])
    rows = np.frombuffer(base64.b64decode(raw), dtype="<f4").reshape(-1, COLBERT_DIM)
    np.testing.assert_allclose(rows, fake_colbert(x), atol=1e-7)


def test_token_ids_and_truncation_follow_vllms_fields(engine: FakeEngine) -> None:
    with client_for(engine, M3, accept_token_ids=True) as c:
        wait_ready(c)
        (x,) = ids_of(TEXTS[:1])
        assert pooling(c, input=x).data[0].data == pooling(c, input=TEXTS[0]).data[0].data
        long = "word " * 600
        cut = pooling(c, input=long, task="token_embed", truncate_prompt_tokens=-1)
        assert len(cut.data[0].data) == 255 and cut.usage.prompt_tokens == 256
        refused = c.post("/pooling", json={"model": MODEL, "input": long})  # null: no truncation, as vLLM
        assert assert_error(refused, 400, "input")["code"] == "context_length_exceeded"


def test_a_task_the_model_has_no_output_for_is_a_400_naming_its_outputs(
    m3: TestClient, engine: FakeEngine
) -> None:
    err = assert_error(m3.post("/pooling", json={"input": "a", "task": "token_classify"}), 400, "task")
    assert "['dense', 'sparse', 'colbert']" in str(err["message"]) and "/embed_sparse" in str(err["message"])
    assert "['embed', 'token_embed']" in str(err["message"]) and err["code"] == "unsupported_output"
    assert_error(m3.post("/pooling", json={"input": "a", "task": "classify"}), 400, "task")
    assert_error(m3.post("/pooling", json={"input": "a", "task": "bm25"}), 400, "task")
    with client_for(engine, ("dense",)) as c:
        wait_ready(c)
        err = assert_error(c.post("/pooling", json={"input": "a", "task": "token_embed"}), 400, "task")
        assert "['dense']" in str(err["message"]) and "['embed']" in str(err["message"])
    assert engine.calls == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"encoding_format": "bytes"}, "encoding_format"),
        ({"embed_dtype": "float16"}, "embed_dtype"),
        ({"endianness": "big"}, "endianness"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"dimensions": 64}, "dimensions"),
        ({"use_activation": False}, "use_activation"),
        ({"add_special_tokens": False}, "add_special_tokens"),
        ({"input": []}, "input"),
    ],
)
def test_fields_this_server_cannot_honour_are_refused_by_name(
    m3: TestClient, engine: FakeEngine, extra: dict[str, Any], param: str
) -> None:
    assert_error(m3.post("/pooling", json={"model": MODEL, "input": "a", **extra}), 400, param)
    assert engine.calls == []


def test_unknown_fields_are_ignored_as_vllm_does(m3: TestClient) -> None:
    got = pooling(m3, input="a b", user="u", request_id="r", cache_salt="s" * 8, priority=3)
    assert got.data[0].data == pooling(m3, input="a b").data[0].data


def test_pooling_counts_in_the_request_metrics(m3: TestClient) -> None:
    def requests(status: str) -> float:
        samples = metric_samples(m3.get("/metrics").text)
        return samples.get(("embedserve_requests_total", frozenset({("status", status)})), 0.0)

    ok, refused = requests("200"), requests("400")
    m3.post("/pooling", json={"input": TEXTS})
    m3.post("/pooling", json={"input": "a", "task": "token_classify"})
    assert (requests("200"), requests("400")) == (ok + 1, refused + 1)


def test_pooling_needs_the_api_key(engine: FakeEngine) -> None:
    with client_for(engine, M3, api_keys=["k"]) as c:
        wait_ready(c)
        assert c.post("/pooling", json={"input": "a"}).status_code == 401
        ok = c.post("/pooling", json={"input": "a"}, headers={"authorization": "Bearer k"})
        assert ok.status_code == 200, ok.text
