"""How the gateway asks an engine for one row per token-id input, by what the model is (SGLang
and the CPU engine speak the same for each: ``contracts/wire.py``, ``contracts/score_wire.py``).

- ``EMBEDDINGS``: ``POST /v1/embeddings``, an embedding model's vectors;
- ``ENCODE``: a reranker, ``POST /encode`` with ``input_ids``: its logit (a cross-encoder's
  classifier, Qwen3-Reranker's ``logit(yes) - logit(no)`` after its prompt, which SGLang gives
  through embedserve's score head: ``engines/label_head.py``). SGLang 0.5.17's OpenAI routes
  cannot carry it: a one-label classifier's pooled output is a number, which ``/v1/embeddings``
  and ``/v1/score`` put in a list-typed field (a 400), while ``/v1/rerank`` takes text only and
  tokenises it without truncation.

Each decode raises ``WireError`` for an answer that does not fit.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import orjson

from embedserve.contracts import late_chunks, score_wire, wire
from embedserve.contracts.wire import Matrix, WireError
from embedserve.model_info import ModelInfo


class EngineProtocol(Protocol):
    @property
    def path(self) -> str: ...

    def encode(self, model: str, batch: list[list[int]], base64_vectors: bool) -> bytes: ...

    def decode(self, content: bytes, expected: int) -> Matrix: ...


class Embeddings:
    path = "/v1/embeddings"

    def encode(self, model: str, batch: list[list[int]], base64_vectors: bool) -> bytes:
        return late_chunks.encode_request(model, batch, base64_vectors)

    def decode(self, content: bytes, expected: int) -> Matrix:
        return wire.decode_response(content, expected)


EMBEDDINGS = Embeddings()


def _rows(values: list[float], expected: int) -> Matrix:
    if len(values) != expected:
        raise WireError(f"engine returned {len(values)} scores for {expected} inputs")
    out = np.asarray(values, dtype=np.float32).reshape(expected, 1)
    if not np.isfinite(out).all():
        raise WireError("non-finite scores")
    return out


def _number(x: Any) -> float:
    value = x[0] if isinstance(x, list) and len(x) == 1 else x
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(f"a score that is not a number: {str(x)[:40]}")
    return float(value)


class Encode:
    path = "/encode"

    def encode(self, model: str, batch: list[list[int]], base64_vectors: bool) -> bytes:
        return score_wire.encode_request(batch)

    def decode(self, content: bytes, expected: int) -> Matrix:
        try:
            data = orjson.loads(content)
            items = [data] if isinstance(data, dict) else data
            return _rows([_number(item["embedding"]) for item in items], expected)
        except WireError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise WireError(f"invalid engine response ({type(exc).__name__})") from exc


ENCODE = Encode()


def protocol_for(info: ModelInfo) -> EngineProtocol:
    return EMBEDDINGS if info.embeds else ENCODE
