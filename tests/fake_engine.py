"""A fake engine speaking the engine protocol, for fast gateway tests.

Each vector is a deterministic function of its token ids, so a test can check that every
answer went back to the input it belongs to, through coalescing and splitting."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import numpy as np
import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from embedserve.contracts import hybrid, score_wire
from embedserve.contracts.hybrid import HybridOutputs, Sparse
from embedserve.contracts.score_wire import EncodeRequest
from embedserve.contracts.wire import EngineRequest, encode_response
from embedserve.upstream.client import JSON, CallFailed, CallTimeout


@contextlib.contextmanager
def _mapped_errors() -> Iterator[None]:
    """httpx's errors as the gateway's engine client raises them."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise CallTimeout(type(exc).__name__) from exc
    except httpx.HTTPError as exc:
        raise CallFailed(type(exc).__name__) from exc


class HttpxEngineClient:
    """The gateway's engine client over any httpx transport: a fake engine app in-process
    (``httpx.ASGITransport``) or a handler (``httpx.MockTransport``), no sockets."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._client = httpx.AsyncClient(transport=transport, timeout=30)

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes]:
        with _mapped_errors():
            r = await self._client.post(url, content=body, headers=JSON)
        return r.status_code, r.content

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        with _mapped_errors():
            r = await self._client.get(url, timeout=timeout_s)
        return r.status_code, r.content

    async def aclose(self) -> None:
        await self._client.aclose()


def fake_vector(ids: list[int], dim: int) -> np.ndarray:
    v = np.zeros(dim, dtype=np.float64)
    for pos, t in enumerate(ids):
        v[(t * 31 + pos) % dim] += 1.0 + (t % 7)
    return (v / np.linalg.norm(v)).astype(np.float32)


#: the width of the fake engine's ColBERT vectors
COLBERT_DIM = 16


def fake_sparse(ids: list[int]) -> Sparse:
    """A weight per distinct id of the input but its first and last (the special tokens), ids
    ascending: a function of the id alone, so a test can recompute it."""
    kept = sorted(set(ids[1:-1]))
    values = [0.05 + (t * 7919 % 1000) / 1000 for t in kept]
    return Sparse(np.asarray(kept, dtype=np.int64), np.asarray(values, dtype=np.float32))


def fake_colbert(ids: list[int]) -> np.ndarray:
    """A unit vector per token after the first (BGE-M3 drops its CLS), a function of the token."""
    rows = np.stack([np.random.default_rng(t).standard_normal(COLBERT_DIM) for t in ids[1:]])
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def fake_outputs(batch: list[list[int]], outputs: list[str], dim: int) -> HybridOutputs:
    return HybridOutputs(
        dense=np.stack([fake_vector(ids, dim) for ids in batch]) if "dense" in outputs else None,
        sparse=[fake_sparse(ids) for ids in batch] if "sparse" in outputs else None,
        colbert=[fake_colbert(ids) for ids in batch] if "colbert" in outputs else None,
    )


@dataclass
class FakeEngine:
    dim: int = 384
    delay_s: float = 0.0
    fail_status: int | None = None
    calls: list[list[list[int]]] = field(default_factory=list)
    encodings: list[str | None] = field(default_factory=list)
    asked: list[list[str] | None] = field(default_factory=list)  # each call's outputs (None: plain)
    cache_counters: tuple[int, int] = (0, 0)
    # while set, calls wait until a test opens it (``gate.set()``): work stays in the engine
    gate: threading.Event | None = None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            """SGLang's prefix-cache counters, as its --enable-metrics exposes them."""
            prompt, cached = self.cache_counters
            text = (
                "# TYPE sglang:prompt_tokens counter\n"
                f'sglang:prompt_tokens_total{{model_name="m",is_streaming="false"}} {prompt}\n'
                "# TYPE sglang:cached_tokens counter\n"
                f'sglang:cached_tokens_total{{model_name="m",cache_source="device"}} {cached}\n'
                f'sglang:cached_tokens_total{{model_name="m",cache_source="host"}} 1\n'
            )
            return Response(text, media_type="text/plain")

        @app.post("/v1/embeddings")
        async def embed(request: Request) -> Response:
            body = orjson.loads(await request.body())
            batch = body["input"]
            self.encodings.append(body.get("encoding_format"))
            self.calls.append(batch)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            # a threading.Event: the test thread opens it, outside this event loop
            while self.gate is not None and not self.gate.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            if self.fail_status:
                return Response(b'{"message":"boom"}', status_code=self.fail_status)
            self.asked.append(body.get("outputs"))
            if body.get("outputs") is not None:
                outs = fake_outputs(body["input"], body["outputs"], self.dim)
                tokens = sum(map(len, body["input"]))
                return Response(hybrid.encode_response(body["model"], outs, tokens),
                                media_type="application/json")
            req = EngineRequest.model_validate(body)
            vectors = np.stack([fake_vector(ids, self.dim) for ids in req.batch()])
            tokens = sum(map(len, req.batch()))
            answer = encode_response(req.model, vectors, tokens, req.encoding_format == "base64")
            return Response(answer, media_type="application/json")

        @app.post("/encode")
        async def encode(request: Request) -> Response:
            """A cross-encoder's logits as SGLang's /encode answers them (one per input)."""
            req = EncodeRequest.model_validate_json(await request.body())
            self.calls.append(req.batch())
            if self.fail_status:
                return Response(b'{"message":"boom"}', status_code=self.fail_status)
            scores = [fake_score(ids) for ids in req.batch()]
            return Response(score_wire.encode_response(scores, [len(x) for x in req.batch()], req.single),
                            media_type="application/json")

        return app


def fake_score(ids: list[int]) -> float:
    """A logit that follows the ids, so a test can tell which pair it belongs to."""
    return float(sum(ids) % 97) / 10 - 4.8
