"""The CPU engine on its own: the ONNX backend gives torch's vectors (padded batches of mixed
lengths included), a call whose caller left stops between micro-batches, and ids outside the
vocabulary are a 400, not a crash."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from embedserve.config import Settings
from embedserve.engines.cpu import CallCancelled, CpuEmbedder, create_engine_app
from embedserve.engines.cpu_backends import OnnxForward
from tests.asgi_post import post_and_stay


def settings(**engine: object) -> Settings:
    return Settings(_env_file=None, engine=engine)


@pytest.fixture(scope="module")
def onnx_embedder() -> CpuEmbedder:
    """The default backend, its export in the user's cache (made here when missing)."""
    return CpuEmbedder(settings(batch_token_budget=64))


@pytest.fixture(scope="module")
def torch_embedder() -> CpuEmbedder:
    return CpuEmbedder(settings(cpu_backend="torch"))


def mixed_lengths(rng: np.random.Generator, n: int, longest: int) -> list[list[int]]:
    """[CLS] random ids [SEP], lengths from 2 to ``longest``, the extremes included."""
    lengths = [2, longest, *rng.integers(2, longest, n - 2).tolist()]
    return [[101, *rng.integers(1000, 30000, k - 2).tolist(), 102] for k in lengths]


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


@pytest.mark.parametrize("budget", [64, 16384])  # many micro-batches; one padded to the longest
def test_onnx_gives_torchs_vectors_on_padded_batches(
    onnx_embedder: CpuEmbedder, torch_embedder: CpuEmbedder, budget: int
) -> None:
    assert isinstance(onnx_embedder.forward, OnnxForward)
    batch = mixed_lengths(np.random.default_rng(budget), 24, onnx_embedder.max_seq_len)
    onnx_embedder.token_budget = budget
    try:
        got = onnx_embedder.embed(batch)
    finally:
        onnx_embedder.token_budget = 64
    alone = np.concatenate([torch_embedder.embed([ids]) for ids in batch])  # no padding at all
    assert got.shape == (len(batch), torch_embedder.dimension) == alone.shape
    assert min_cosine(got, alone) >= 0.9999
    assert onnx_embedder.vocab_size == torch_embedder.vocab_size


def test_int8_is_close_to_torch_but_not_identical(torch_embedder: CpuEmbedder) -> None:
    """int8 is an option; its vectors move a little (the quality gate says how much matters)."""
    int8 = CpuEmbedder(settings(cpu_quantization="int8"))
    assert isinstance(int8.forward, OnnxForward) and "int8" in int8.forward.description
    batch = mixed_lengths(np.random.default_rng(3), 16, 128)
    got, want = int8.embed(batch), torch_embedder.embed(batch)
    cos = min_cosine(got, want)
    print(f"int8 min cosine vs torch: {cos:.4f}")
    assert 0.9 < cos < 0.99999


def test_a_cancelled_call_stops_between_micro_batches(onnx_embedder: CpuEmbedder) -> None:
    batch = [[101, 2000 + i, 102] for i in range(200)]  # 64-token budget: many micro-batches
    seen: list[int] = []
    forward = onnx_embedder.forward
    cancelled = threading.Event()

    def counting_forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        seen.append(1)
        cancelled.set()  # the caller leaves while the first micro-batch runs
        return forward(ids, mask)

    onnx_embedder.forward = counting_forward  # type: ignore[assignment]
    try:
        with pytest.raises(CallCancelled):
            onnx_embedder.embed(batch, cancelled)
    finally:
        onnx_embedder.forward = forward
    assert seen == [1]  # one micro-batch, not the dozens the call holds
    assert onnx_embedder.embed(batch[:2]).shape == (2, onnx_embedder.dimension)


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_ids_outside_the_vocabulary_are_a_400(backend: str) -> None:
    app = create_engine_app(settings(stats_dir=None, cpu_backend=backend))
    with TestClient(app) as c:
        r = c.post("/v1/embeddings", json={"input": [[101, 10**6]]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["message"]
        assert c.post("/v1/embeddings", json={"input": [[101, 102]]}).status_code == 200
        assert c.get("/get_model_info").json()["hidden_size"] == 384


def test_a_cancelled_handler_stops_its_call_between_micro_batches(onnx_embedder: CpuEmbedder) -> None:
    """The engine's handler cancelled (the server stopping) while the first micro-batch runs:
    the cancellation propagates and the call stops before the second."""
    batch = [[101, 2000 + i, 102] for i in range(200)]  # 64-token budget: many micro-batches
    body = orjson.dumps({"input": batch})
    seen: list[int] = []
    running, proceed, finished = threading.Event(), threading.Event(), threading.Event()
    forward, embed = onnx_embedder.forward, onnx_embedder.embed

    def held_forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        seen.append(1)
        running.set()
        proceed.wait(10)
        return forward(ids, mask)

    def noting_embed(*args: Any) -> np.ndarray:
        try:
            return embed(*args)
        finally:
            finished.set()

    async def go() -> None:
        app = create_engine_app(settings(stats_dir=None), embedder=onnx_embedder)
        async with app.router.lifespan_context(app):
            onnx_embedder.forward = held_forward  # type: ignore[assignment]
            onnx_embedder.embed = noting_embed  # type: ignore[method-assign, assignment]
            handler = asyncio.create_task(post_and_stay(app, "/v1/embeddings", body))
            while not running.is_set():  # noqa: ASYNC110  (a thread's event)
                await asyncio.sleep(0.01)
            handler.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handler
            proceed.set()
            while not finished.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.01)

    try:
        asyncio.run(go())
    finally:
        onnx_embedder.forward, onnx_embedder.embed = forward, embed  # type: ignore[method-assign]
    assert seen == [1]  # one micro-batch of the ten the call holds
