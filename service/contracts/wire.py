"""The engine wire format: token ids in, vectors out, as SGLang speaks it when launched
with ``--is-embedding --skip-tokenizer-init``.

``POST {engine}/v1/embeddings`` takes ``EngineRequest`` and answers ``EngineResponse``;
vectors travel as base64 of little-endian float32 (what SGLang 0.5.17 packs), so neither
side prints or parses thousands of floats as text. Float lists are still accepted from
engines that ignore ``encoding_format``. The gateway, the CPU engine and the test engines
all encode and decode through this module.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
import numpy.typing as npt
import orjson
from pydantic import BaseModel, ConfigDict, StrictInt

Matrix = npt.NDArray[np.float32]
#: What a model gives for an input (``contracts/hybrid.py``): its pooled unit vector, a weight per
#: vocabulary id, one unit vector per token (ColBERT).
Output = Literal["dense", "sparse", "colbert"]


class WireError(ValueError):
    """An engine answer that does not follow the format."""


class EngineRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    input: list[list[StrictInt]] | list[StrictInt]
    encoding_format: Literal["float", "base64"] = "float"

    def batch(self) -> list[list[int]]:
        """The inputs as a list of id lists (one flat list is one input, as SGLang reads it)."""
        flat = [x for x in self.input if isinstance(x, int)]
        if flat:
            return [flat]
        return [x for x in self.input if isinstance(x, list)]


class EngineInfo(BaseModel):
    """``GET {engine}/get_model_info``, read by a gateway in front of engines it did not start to
    learn what they are (``engine.external_kind``). embedserve's own engine says ``engine: "cpu"``, or
    ``"torch"`` on a GPU; SGLang's own answer has no such field, so an answer without it is SGLang's."""

    model_config = ConfigDict(extra="allow")

    model_path: str = ""
    engine: Literal["cpu", "sglang", "torch"] = "sglang"
    #: what the engine computes for an input; SGLang's answer has no such field: dense
    outputs: list[Output] = ["dense"]


def encode_request(model: str, batch: list[list[int]], base64_vectors: bool = True) -> bytes:
    body: dict[str, object] = {"model": model, "input": batch}
    if base64_vectors:
        body["encoding_format"] = "base64"
    return orjson.dumps(body)


def encode_base64(vectors: Matrix) -> list[str]:
    """Little-endian float32 per row, as SGLang sends it and OpenAI's clients decode it."""
    le = vectors.astype("<f4", copy=False)
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in le]


def encode_response(model: str, vectors: Matrix, tokens: int, base64_vectors: bool) -> bytes:
    rows: list[str] | list[list[float]] = encode_base64(vectors) if base64_vectors else vectors.tolist()
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(rows)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return orjson.dumps({"object": "list", "model": model, "data": data, "usage": usage})


def decode_response(content: bytes, expected: int) -> Matrix:
    """Vectors in input order; ``WireError`` for anything malformed (wrong count, mixed
    sizes, non-finite values, bad base64)."""
    try:
        data = orjson.loads(content)["data"]
        if len(data) != expected:
            raise WireError(f"engine returned {len(data)} vectors for {expected} inputs")
        data.sort(key=lambda d: d["index"])
        embeddings = [d["embedding"] for d in data]
        if all(isinstance(e, str) for e in embeddings):
            rows = [base64.b64decode(e, validate=True) for e in embeddings]
            if len({len(r) for r in rows}) != 1 or len(rows[0]) % 4:
                raise WireError("base64 vectors of mixed or odd sizes")
            vectors = np.frombuffer(b"".join(rows), dtype="<f4").reshape(expected, -1).astype(np.float32)
        else:
            with np.errstate(over="ignore"):  # overflow becomes inf, refused just below
                vectors = np.asarray(embeddings, dtype=np.float32)
    except WireError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise WireError(f"invalid engine response ({type(exc).__name__})") from exc
    if vectors.ndim != 2 or vectors.shape[1] == 0 or not np.isfinite(vectors).all():
        raise WireError("vectors of mixed sizes or non-finite values")
    return vectors


def error_message(content: bytes) -> str:
    """The human part of an engine's error body, whatever shape it has."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content[:200].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(data.get("message", err))
    return str(data)[:200]


def error_body(status: int, message: str) -> bytes:
    """An engine's error answer, shaped as SGLang shapes it."""
    return orjson.dumps({"object": "error", "message": message, "type": "BadRequestError", "code": status})
