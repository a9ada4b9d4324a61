"""An engine that answers 200 with something that is not embeddings: the client gets a 503
in the envelope (the engine's fault, retryable), never a 500, and the next good answer works."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from embedserve.config import Settings
from embedserve.contracts.wire import encode_base64
from embedserve.gateway.app import create_app
from tests.fake_engine import HttpxEngineClient
from tests.test_gateway_unit import wait_ready

MODEL = "all-MiniLM-L6-v2"


def _vectors(n: int, dim: int = 384) -> list[dict[str, object]]:
    return [{"object": "embedding", "index": i, "embedding": [0.05] * dim} for i in range(n)]


def _b64(values: list[float]) -> str:
    return encode_base64(np.asarray([values], dtype=np.float32))[0]


GARBAGE = {
    "not json": b"<html>oops</html>",
    "empty body": b"",
    "no data": b'{"object": "list"}',
    "data not a list": b'{"data": 5}',
    "too few vectors": orjson.dumps({"data": []}),
    "too many vectors": orjson.dumps({"data": _vectors(2)}),
    "vector of strings": orjson.dumps({"data": [{"index": 0, "embedding": ["a"] * 384}]}),
    "no index": orjson.dumps({"data": [{"embedding": [0.1] * 384}]}),
    "overflows float32": orjson.dumps({"data": [{"index": 0, "embedding": [1e39] * 384}]}),
    "ragged": orjson.dumps({"data": [{"index": 0, "embedding": [[0.1], [0.1, 0.2]]}]}),
    "base64 not base64": orjson.dumps({"data": [{"index": 0, "embedding": "not base64!"}]}),
    "base64 empty": orjson.dumps({"data": [{"index": 0, "embedding": ""}]}),
    "base64 odd bytes": orjson.dumps(
        {"data": [{"index": 0, "embedding": base64.b64encode(b"abcde").decode()}]}
    ),
    "base64 NaN": orjson.dumps({"data": [{"index": 0, "embedding": _b64([float("nan")] * 384)}]}),
    "base64 mixed sizes": orjson.dumps(
        {"data": [{"index": 0, "embedding": _b64([0.1] * 384)}, {"index": 1, "embedding": _b64([0.1] * 8)}]}
    ),
}


INPUTS = {"base64 mixed sizes": 2}  # inputs sent, so that the count matches and the sizes do not


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_from_the_engine_is_503(name: str) -> None:
    answer = {"body": GARBAGE[name]}

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, content=answer["body"], headers={"content-type": "application/json"})

    settings = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"accept_token_ids": True},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    with TestClient(create_app(settings, engine_client=HttpxEngineClient(httpx.MockTransport(engine)))) as c:
        wait_ready(c)
        r = c.post("/v1/embeddings", json={"model": MODEL, "input": [[1, 2]] * INPUTS.get(name, 1)})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable" and r.headers["retry-after"]
        answer["body"] = orjson.dumps({"data": _vectors(1)})  # floats: an engine ignoring base64
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": [[1, 2]]}).status_code == 200
