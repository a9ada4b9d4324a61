"""How the gateway asks an engine for one row per token-id input, by what the model is (SGLang
and the CPU engine speak the same for each: ``contracts/wire.py``, ``contracts/score_wire.py``).

- ``EMBEDDINGS``: ``POST /v1/embeddings``, an embedding model's vectors;
- ``ENCODE``: a cross-encoder, ``POST /encode`` with ``input_ids``: its logit. SGLang 0.5.17's
  OpenAI routes cannot carry it: a one-label classifier's pooled output is a number, which
  ``/v1/embeddings`` and ``/v1/score`` put in a list-typed field (a 400), while ``/v1/rerank``
  takes text only and tokenises it without truncation;
- ``LabelScores``: Qwen3-Reranker (SGLang in generation mode), ``POST /v1/score`` with the
  prompt's ids and ``label_token_ids`` ``[no, yes]``: the two tokens' probabilities after it,
  normalised, whose log ratio is ``logit(yes) - logit(no)``.

Each decode raises ``WireError`` for an answer that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson

from embedserve.contracts import late_chunks, score_wire, wire
from embedserve.contracts.wire import Matrix, WireError
from embedserve.core.pairs import label_ids
from embedserve.model_info import ModelInfo

#: probabilities are clipped here before their log ratio: a logit of at most about +-69
SMALLEST_PROBABILITY = 1e-30


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


@dataclass(frozen=True)
class LabelScores:
    no_id: int
    yes_id: int
    path: str = "/v1/score"

    def encode(self, model: str, batch: list[list[int]], base64_vectors: bool) -> bytes:
        return score_wire.label_score_request(model, batch, self.no_id, self.yes_id)

    def decode(self, content: bytes, expected: int) -> Matrix:
        try:
            pairs = np.asarray(orjson.loads(content)["scores"], dtype=np.float64).reshape(-1, 2)
        except (ValueError, KeyError, TypeError) as exc:
            raise WireError(f"invalid engine response ({type(exc).__name__})") from exc
        p = np.clip(pairs, SMALLEST_PROBABILITY, None)
        return _rows((np.log(p[:, 1]) - np.log(p[:, 0])).tolist(), expected)


def protocol_for(info: ModelInfo) -> EngineProtocol:
    if info.scoring == "cross-encoder":
        return ENCODE
    if info.scoring == "qwen3-reranker":
        return LabelScores(*label_ids(info.path))
    return EMBEDDINGS
