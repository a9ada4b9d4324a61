"""Long inputs embedded whole (``truncate: "chunk"``): an input of three times the cap against the
mean of its windows computed by hand through the real CPU engine and the bundled model; overlap,
the model's default and the limits over the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from embedserve.config import BUNDLED_MODEL, Settings, resolve_model_path
from embedserve.gateway.app import create_app
from embedserve.gateway.long_inputs import windows
from embedserve.settings_errors import ConfigError
from tests.conftest import RunningStack, metric
from tests.fake_engine import FakeEngine, HttpxEngineClient, fake_vector
from tests.test_gateway_unit import wait_ready

CAP = 256  # the bundled model's max_seq_len
CLS, SEP = 101, 102
TOKENIZER = Tokenizer.from_file(str(resolve_model_path(BUNDLED_MODEL) / "tokenizer.json"))
TOKENIZER.no_truncation()


def long_text(content_tokens: int) -> str:
    """Distinct words, one token each for MiniLM's WordPiece, ``content_tokens`` of them."""
    words = ["alpha", "river", "stone", "cloud", "paper", "light", "green", "music", "table", "house"]
    text = " ".join(f"{words[i % len(words)]}" for i in range(content_tokens))
    assert len(TOKENIZER.encode(text, add_special_tokens=False).ids) == content_tokens
    return text


def content_ids(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


def by_hand(vectors: np.ndarray, weights: list[int]) -> np.ndarray:
    mean = (vectors * np.asarray(weights, dtype=np.float64)[:, None]).sum(axis=0)
    return mean / np.linalg.norm(mean)


def test_three_caps_embedded_whole_is_the_weighted_mean_of_its_windows(minilm_stack: RunningStack) -> None:
    width = CAP - 2  # [CLS] ... [SEP]
    text = long_text(3 * width - 40)  # three windows, the last one shorter
    ids = content_ids(text)
    parts = [ids[0:width], ids[width : 2 * width], ids[2 * width :]]
    framed = [[CLS, *p, SEP] for p in parts]
    # each window through the real CPU engine, as token ids
    engine = minilm_stack.engine_url + "/v1/embeddings"
    r = httpx.post(engine, json={"model": "m", "input": framed}, timeout=60)
    assert r.status_code == 200, r.text
    rows = np.asarray([d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])])
    expected = by_hand(rows, [len(p) for p in parts])

    url = minilm_stack.url + "/v1/embeddings"
    body: dict[str, Any] = {"model": minilm_stack.model_name, "input": [text, "short"], "truncate": "chunk"}
    got = httpx.post(url, json=body, timeout=60)
    assert got.status_code == 200, got.text
    answer = got.json()
    vector = np.asarray(answer["data"][0]["embedding"])
    np.testing.assert_allclose(vector, expected, atol=2e-6)
    assert answer["chunked_inputs"] == [{"index": 0, "original_tokens": len(ids) + 2, "chunks": 3,
                                         "overlap_tokens": 0}]
    assert answer["truncated_inputs"] == []
    assert answer["usage"]["prompt_tokens"] == sum(map(len, framed)) + 3  # and "short" framed
    assert got.headers["x-embedserve-chunked-inputs"] == "1"
    # not the truncated vector: the first window alone
    cut = httpx.post(url, json={**body, "truncate": True}, timeout=60).json()
    assert cut["truncated_inputs"][0]["kept_tokens"] == CAP
    np.testing.assert_allclose(cut["data"][0]["embedding"], rows[0], atol=2e-6)
    assert float(np.dot(cut["data"][0]["embedding"], vector)) < 0.999
    metrics = httpx.get(minilm_stack.url + "/metrics", timeout=10).text
    assert metric(metrics, "embedserve_inputs_chunked_total") >= 1


def fake_client(engine: FakeEngine, gateway: dict[str, object] | None = None, **model: object) -> TestClient:
    settings = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"request_timeout_s": 10.0, "accept_token_ids": True, **(gateway or {})},
        model=model,
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    transport = httpx.ASGITransport(app=engine.app())
    return TestClient(create_app(settings, engine_client=HttpxEngineClient(transport)))


@pytest.fixture()
def chunking() -> Iterator[tuple[TestClient, FakeEngine]]:
    engine = FakeEngine()
    with fake_client(engine, long_inputs="chunk", chunk_overlap_tokens=16) as c:
        wait_ready(c)
        yield c, engine


def test_the_model_default_chunks_with_overlap(chunking: tuple[TestClient, FakeEngine]) -> None:
    client, engine = chunking
    text = long_text(600)
    ids = content_ids(text)
    body: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "input": text}
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    parts = [ids[s : s + 254] for s in (0, 238, 476)]  # 254 wide, 16 shared with the one before
    assert parts == windows(ids, 254, 16)
    assert engine.calls[-1] == [[CLS, *p, SEP] for p in parts]
    expected = by_hand(np.stack([fake_vector([CLS, *p, SEP], 384) for p in parts]), [len(p) for p in parts])
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], expected, atol=2e-6)
    assert r.json()["chunked_inputs"][0]["chunks"] == 3
    # the request's own truncate still wins
    cut = client.post("/v1/embeddings", json={**body, "truncate": True})
    assert len(cut.json()["truncated_inputs"]) == 1 and "chunked_inputs" not in cut.json()
    body = {"model": "all-MiniLM-L6-v2", "input": text, "truncate": False}
    refused = client.post("/v1/embeddings", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"


def test_windows_cover_the_content_once_without_overlap() -> None:
    content = list(range(10))
    assert windows(content, 4, 0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(content, 4, 1) == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert windows(content[:4], 4, 1) == [[0, 1, 2, 3]]


def test_chunks_count_against_the_request_limit_and_token_ids_are_refused() -> None:
    engine = FakeEngine()
    with fake_client(engine, {"max_tokens_per_request": 700}) as client:
        wait_ready(client)
        text = long_text(900)  # 256 tokens cut, 906 whole (four windows)
        body = {"model": "all-MiniLM-L6-v2", "input": text}
        cut = client.post("/v1/embeddings", json=body)
        whole = client.post("/v1/embeddings", json={**body, "truncate": "chunk"})
        framed = [[CLS, *content_ids(text), SEP]]
        ids = client.post("/v1/embeddings", json={**body, "input": framed, "truncate": "chunk"})
    assert cut.status_code == 200
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "max_tokens_per_request"
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "truncate"


def test_an_overlap_as_wide_as_a_window_is_a_configuration_mistake() -> None:
    with (
        pytest.raises(ConfigError, match="CHUNK_OVERLAP_TOKENS must be below 254"),
        fake_client(FakeEngine(), long_inputs="chunk", chunk_overlap_tokens=254),
    ):
        pass
