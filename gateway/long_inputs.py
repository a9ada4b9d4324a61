"""Inputs longer than the model's cap, embedded whole: ``truncate: "chunk"`` (or the model's
``long_inputs: chunk``) splits the content into windows of the cap, ``chunk_overlap_tokens``
shared by neighbours, each framed with the model's special tokens as a short input is, and pools
their vectors into one: the mean weighted by each window's content tokens, renormalised (vLLM's
chunked processing pools the same way). The windows are inputs of the same request: they take
their turns in the coalescer and count against admission and ``max_tokens_per_request`` like
any other, so the whole input's tokens are what a request costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import PlainValidator, WithJsonSchema

from embedserve.config.model import ModelSettings
from embedserve.contracts.wire import Matrix
from embedserve.core.tokenize import ModelTokenizer, TokenizedInput
from embedserve.gateway.errors import APIError
from embedserve.settings_errors import ConfigError

#: What a request does with an over-long input: cut it, refuse it (400), or embed it whole.
Mode = Literal["truncate", "refuse", "chunk"]


def _truncate(value: object) -> bool | str:
    if isinstance(value, bool) or value == "chunk":
        return value
    raise ValueError('expected true, false or "chunk"')


#: The request's ``truncate``: strict (no 1 for true), one error that names the field.
Truncate = Annotated[
    bool | Literal["chunk"], PlainValidator(_truncate), WithJsonSchema({"enum": [True, False, "chunk"]})
]


@dataclass(frozen=True)
class LongInputs:
    """A model's policy (``model.long_inputs``, ``model.chunk_overlap_tokens``)."""

    default: Literal["truncate", "chunk"] = "truncate"
    overlap: int = 0

    def mode(self, truncate: bool | str | None) -> Mode:
        """The request's ``truncate`` (true, false, "chunk", or absent: the model's default)."""
        if truncate is None:
            return self.default
        if truncate == "chunk":
            return "chunk"
        return "truncate" if truncate else "refuse"


#: The default: over-long inputs are cut.
TRUNCATE = LongInputs()


def windows(content: list[int], width: int, overlap: int) -> list[list[int]]:
    """``content`` in windows of ``width`` tokens, each starting ``width - overlap`` after the
    last; the last one ends at the content's end."""
    step = width - overlap
    starts = range(0, max(len(content) - overlap, 1), step)
    return [content[s : s + width] for s in starts]


@dataclass
class ChunkPlan:
    """The engine inputs of a request whose over-long inputs are split, and how to pool them."""

    inputs: list[list[int]]
    rows: list[tuple[int, int]]  # per request input: its windows' rows in ``inputs``
    weights: list[int]  # per engine input: its content tokens
    chunked: list[dict[str, int]]  # what the response reports, per input split

    def pool(self, vectors: Matrix) -> Matrix:
        """One row per request input: its windows' weighted mean, renormalised."""
        if len(self.rows) == len(self.inputs):
            return vectors
        weights = np.asarray(self.weights, dtype=np.float32)[:, None]
        out = np.empty((len(self.rows), vectors.shape[1]), dtype=np.float32)
        for i, (start, end) in enumerate(self.rows):
            mean = (vectors[start:end] * weights[start:end]).sum(axis=0)
            out[i] = mean / max(float(np.linalg.norm(mean)), 1e-12)
        return out

    def report(self) -> dict[str, Any]:
        return {"chunked_inputs": self.chunked}


def plan(inputs: list[TokenizedInput], tokenizer: ModelTokenizer, overlap: int) -> ChunkPlan:
    """Each over-long input's content in windows of the cap; the others as they are."""
    frame = len(tokenizer.prefix) + len(tokenizer.suffix)
    width = tokenizer.max_seq_len - frame
    engine: list[list[int]] = []
    rows: list[tuple[int, int]] = []
    weights: list[int] = []
    chunked: list[dict[str, int]] = []
    for i, x in enumerate(inputs):
        start = len(engine)
        if x.truncated and x.content is not None:
            parts = windows(x.content, width, overlap)
            engine += [tokenizer.prefix + part + tokenizer.suffix for part in parts]
            weights += [len(part) for part in parts]
            chunked.append({"index": i, "original_tokens": x.original_tokens, "chunks": len(parts),
                            "overlap_tokens": overlap})
        else:
            engine.append(x.ids)
            weights.append(len(x.ids) - frame)
        rows.append((start, len(engine)))
    return ChunkPlan(engine, rows, weights, chunked)


def long_inputs(model: ModelSettings, tokenizer: ModelTokenizer) -> LongInputs:
    """The model's policy; an overlap must leave each window new content."""
    width = tokenizer.max_seq_len - len(tokenizer.prefix) - len(tokenizer.suffix)
    if model.chunk_overlap_tokens >= width:
        raise ConfigError(
            f"EMBEDSERVE_MODEL__CHUNK_OVERLAP_TOKENS must be below {width} (the content tokens of "
            f"one window of {tokenizer.max_seq_len}), got {model.chunk_overlap_tokens}"
        )
    return LongInputs(model.long_inputs, model.chunk_overlap_tokens)


def refuse_ids() -> APIError:
    return APIError(
        400,
        "'truncate' \"chunk\" splits text input; send the texts, or truncate=true to cut token ids",
        param="truncate",
        code="invalid_value",
    )
