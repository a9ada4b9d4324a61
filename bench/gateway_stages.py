"""The gateway's CPU stages timed in process, per request shape: parsing and validation,
tokenisation, the engine reply's parsing, normalising and encoding the response (median µs
per request over many repeats). What the gateway spends beyond their sum (HTTP, routing,
asyncio, the engine call's client) is the difference to its CPU per request over HTTP."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from embedserve.contracts.wire import decode_response, encode_base64
from embedserve.gateway.schemas import EmbeddingRequest
from embedserve.gateway.tokenize import ModelTokenizer
from embedserve.gateway.vectors import shape_vectors
from embedserve.loadtest.instant_engine import reply

SHORT = "How do I keep GPU memory flat when inputs vary in length?"
LONG = " ".join(["the embedding service truncates long inputs and keeps the EOS token"] * 30)
SHAPES: dict[str, dict[str, Any]] = {
    "1 short text, float": {"input": SHORT, "encoding_format": "float"},
    "1 short text, base64": {"input": SHORT, "encoding_format": "base64"},
    "32 short texts, base64": {"input": [SHORT] * 32, "encoding_format": "base64"},
    "1 long text (256 tokens), base64": {"input": LONG, "encoding_format": "base64"},
}


def median_us(fn: Callable[[], object], repeats: int = 7, number: int = 200) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return round(statistics.median(times) * 1e6, 1)


def stages(tok: ModelTokenizer, fields: dict[str, Any]) -> dict[str, float]:
    body = orjson.dumps({"model": "m", **fields})
    req = EmbeddingRequest.model_validate(orjson.loads(body))
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    engine_reply = reply(len(texts))
    vectors = decode_response(engine_reply, len(texts))

    def respond() -> bytes:
        shaped = shape_vectors(vectors, None, True)
        payload = encode_base64(shaped) if req.encoding_format == "base64" else list(shaped)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(payload)]
        return orjson.dumps({"object": "list", "data": data}, option=orjson.OPT_SERIALIZE_NUMPY)

    out = {"parse_validate_us": median_us(lambda: EmbeddingRequest.model_validate(orjson.loads(body))),
           "tokenize_us": median_us(lambda: tok.encode_texts(texts)),
           "engine_reply_parse_us": median_us(lambda: decode_response(engine_reply, len(texts))),
           "normalise_encode_us": median_us(respond)}
    return out | {"sum_us": round(sum(out.values()), 1)}


def stage_rows(model_dir: str, cap: int = 256) -> list[dict[str, Any]]:
    tok = ModelTokenizer(Path(model_dir), cap)
    return [{"request": name, **stages(tok, fields)} for name, fields in SHAPES.items()]
