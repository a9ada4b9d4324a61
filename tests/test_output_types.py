"""Output types (``embedding_type`` on /v1/embeddings): each one is sentence-transformers'
``quantize_embeddings`` of the float vector the same request would get, binary and ubinary
exactly, int8 and uint8 with the fixed range [-1, 1]; base64 carries the same bytes."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sentence_transformers.util.quantization import quantize_embeddings

from embedserve.core.vectors import quantize, shape_vectors
from tests import fake_engine
from tests.fake_engine import FakeEngine
from tests.test_gateway_unit import MODEL, assert_error, make_client, post, wait_ready

TYPES = ["int8", "uint8", "binary", "ubinary"]
TEXTS = ["hello world", "a", "Memory grows slowly; the pod restarts before the kernel kills it."]


def st_reference(floats: np.ndarray, kind: str) -> np.ndarray:
    ranges = np.array([[-1.0] * floats.shape[1], [1.0] * floats.shape[1]])
    out: np.ndarray = quantize_embeddings(floats, kind, ranges=ranges)  # type: ignore[arg-type,assignment]
    return out


def signed_vector(ids: list[int], dim: int) -> np.ndarray:
    """A unit vector of both signs that follows the ids (the fake engine's own is non-negative)."""
    v = np.random.default_rng(sum(t * 7919 ** i for i, t in enumerate(ids)) % 2**32).standard_normal(dim)
    return (v / np.linalg.norm(v)).astype(np.float32)


@pytest.fixture()
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setattr(fake_engine, "fake_vector", signed_vector)
    with make_client(FakeEngine()) as c:
        wait_ready(c)
        yield c


def embed(c: TestClient, **fields: Any) -> list[Any]:
    r = post(c, {"model": MODEL, "input": TEXTS, **fields})
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


@pytest.mark.parametrize("kind", TYPES)
def test_quantize_is_sentence_transformers_on_unit_vectors(kind: str) -> None:
    rng = np.random.default_rng(0)
    vectors = shape_vectors(rng.standard_normal((64, 100)).astype(np.float32), None, True)
    edges = np.zeros((3, 100), dtype=np.float32)
    edges[0, 0], edges[1, 1], edges[2, :4] = 1.0, -1.0, 0.5  # the range's ends, zeros, a tie
    vectors = np.concatenate([vectors, edges])
    got, want = quantize(vectors, kind), st_reference(vectors, kind)  # type: ignore[arg-type]
    assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("dimensions", [None, 100])
@pytest.mark.parametrize("kind", TYPES)
def test_each_type_is_quantize_embeddings_of_the_float_answer(
    client: TestClient, kind: str, dimensions: int | None
) -> None:
    """Matryoshka first (the first N components, re-normalised), then the type."""
    floats = np.asarray(embed(client, dimensions=dimensions), dtype=np.float32)
    assert floats.shape == (3, dimensions or 384) and (floats < 0).any()
    want = st_reference(floats, kind)
    as_list = np.asarray(embed(client, dimensions=dimensions, embedding_type=kind))
    assert as_list.shape == want.shape and np.array_equal(as_list, want)
    as_base64 = embed(client, dimensions=dimensions, embedding_type=kind, encoding_format="base64")
    raw = np.stack([np.frombuffer(base64.b64decode(s), dtype=want.dtype) for s in as_base64])
    assert np.array_equal(raw, want)


def test_binary_and_ubinary_differ_by_128(client: TestClient) -> None:
    binary = np.asarray(embed(client, embedding_type="binary"))
    ubinary = np.asarray(embed(client, embedding_type="ubinary"))
    assert binary.shape == (3, 48) and binary.min() >= -128 and ubinary.max() <= 255
    assert np.array_equal(ubinary - binary, np.full_like(binary, 128))


def test_float_base64_is_unchanged(client: TestClient) -> None:
    floats = np.asarray(embed(client), dtype=np.float32)
    explicit = np.asarray(embed(client, embedding_type="float"), dtype=np.float32)
    packed = embed(client, encoding_format="base64")
    assert np.array_equal(floats, explicit)
    assert np.array_equal(np.stack([np.frombuffer(base64.b64decode(s), "<f4") for s in packed]), floats)


def test_int8_of_unnormalised_vectors_uses_their_unit_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    """With gateway.normalize off the range [-1, 1] still holds: the unit vector is quantised."""
    monkeypatch.setattr(fake_engine, "fake_vector", lambda ids, dim: 3 * signed_vector(ids, dim))
    with make_client(FakeEngine(), normalize=False) as c:
        wait_ready(c)
        floats = np.asarray(embed(c), dtype=np.float32)
        assert np.allclose(np.linalg.norm(floats, axis=1), 3, atol=1e-4)
        got = np.asarray(embed(c, embedding_type="int8"))
    unit = floats / np.linalg.norm(floats, axis=1, keepdims=True)
    assert np.array_equal(got, st_reference(unit, "int8"))


@pytest.mark.parametrize("value", ["int4", "INT8", 8, None, ["int8"]])
def test_an_unknown_embedding_type_is_a_400_naming_it(client: TestClient, value: object) -> None:
    err = assert_error(post(client, {"model": MODEL, "input": "x", "embedding_type": value}), 400,
                       "embedding_type")
    assert "'binary'" in str(err["message"])
