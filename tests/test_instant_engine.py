"""The gateway benchmarks' engine that answers at once: it must speak the engine wire formats
the gateway reads (vectors, a reranker's scores), and say nothing about itself, so that a
gateway in front of it starts with SGLang's defaults instead of waiting for an answer."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from embedserve.contracts import score_wire, wire
from embedserve.loadtest.instant_engine import app
from embedserve.upstream.protocols import ENCODE


def call(method: str, path: str, body: bytes = b"") -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as client:
            return await client.request(method, path, content=body)

    return asyncio.run(go())


def test_it_answers_scores_vectors_and_health_and_nothing_else() -> None:
    scores = call("POST", "/encode", score_wire.encode_request([[1, 2, 3], [4, 5]]))
    assert scores.status_code == 200
    assert ENCODE.decode(scores.content, 2) == pytest.approx(np.array([[0.003], [0.002]]))
    one = call("POST", "/encode", score_wire.encode_request([[1, 2, 3, 4]]))
    assert ENCODE.decode(one.content, 1) == pytest.approx(np.array([[0.004]]))
    vectors = call("POST", "/v1/embeddings", b'{"model": "m", "input": [[1, 2], [3]]}')
    assert wire.decode_response(vectors.content, 2).shape == (2, 384)
    assert call("GET", "/health").status_code == 200
    assert call("GET", "/get_model_info").status_code == 404
