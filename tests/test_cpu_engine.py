"""The CPU engine on its own: a call whose caller left stops between micro-batches, and ids
outside the vocabulary are a 400, not a crash."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from embedserve.config import Settings
from embedserve.engines.cpu import CallCancelled, CpuEmbedder, create_engine_app


@pytest.fixture(scope="module")
def embedder() -> CpuEmbedder:
    return CpuEmbedder(Settings(_env_file=None, engine={"batch_token_budget": 64}))


def test_a_cancelled_call_stops_between_micro_batches(embedder: CpuEmbedder) -> None:
    batch = [[101, 2000 + i, 102] for i in range(200)]  # 64-token budget: many micro-batches
    seen: list[int] = []
    forward = embedder.model.forward
    cancelled = threading.Event()

    def counting_forward(features: Any) -> Any:
        seen.append(1)
        cancelled.set()  # the caller leaves while the first micro-batch runs
        return forward(features)

    embedder.model.forward = counting_forward  # type: ignore[method-assign,assignment]
    try:
        with pytest.raises(CallCancelled):
            embedder.embed(batch, cancelled)
    finally:
        embedder.model.forward = forward  # type: ignore[method-assign]
    assert seen == [1]  # one micro-batch, not the dozens the call holds
    assert embedder.embed(batch[:2]).shape == (2, embedder.dimension)


def test_ids_outside_the_vocabulary_are_a_400() -> None:
    app = create_engine_app(Settings(_env_file=None, engine={"stats_dir": None}))
    with TestClient(app) as c:
        r = c.post("/v1/embeddings", json={"input": [[101, 10**6]]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["message"]
        assert c.post("/v1/embeddings", json={"input": [[101, 102]]}).status_code == 200
