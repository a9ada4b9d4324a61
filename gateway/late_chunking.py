"""Late chunking (``late_chunking`` on /v1/embeddings): one forward pass over an input, up to the
model's cap, then its tokens' last hidden states mean-pooled per chunk: one vector per chunk, each
made with the whole input in view (Günther et al. 2024, "Late Chunking"). Chunks are the caller's
character spans ``[start, end)``, or runs of ``chunk_tokens`` tokens; a token belongs to the chunk
its first character lies in, special tokens to none. The input goes to the engine whole, as one
input, so the coalescer's turns and admission count all its tokens.

The CPU engine pools the states (``contracts/late_chunks.py``). SGLang 0.5.17's embedding path
returns pooled vectors only (``EmbeddingReqInput`` has ``return_pooled_hidden_states``, no token
states), so on a model it serves late chunking is a 400; so is a model that does not pool by the
mean of its tokens (its chunk vectors would not be comparable with its other vectors).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from embedserve.contracts.late_chunks import Span, SpannedIds
from embedserve.core.tokenize import ModelTokenizer, TokenizedInput
from embedserve.gateway.errors import APIError
from embedserve.model_info import ModelInfo

PARAM = "late_chunking"


class LateChunking(BaseModel):
    """The request's ``late_chunking``: ``chunk_tokens``, or ``chunks`` (one input's spans, or a
    list of spans per input)."""

    model_config = ConfigDict(extra="forbid")

    chunk_tokens: Annotated[StrictInt, Field(ge=1, description="chunks of this many tokens")] | None = None
    chunks: list[Span] | list[list[Span]] | None = Field(
        None, description="character spans [start, end): one input's, or a list per input"
    )

    @model_validator(mode="after")
    def _one_way(self) -> LateChunking:
        if (self.chunk_tokens is None) == (self.chunks is None):
            raise ValueError("give either chunk_tokens or chunks")
        return self

    def spans(self, inputs: int) -> list[list[tuple[int, int]]]:
        """The caller's spans, one list per input."""
        given: list[Any] = self.chunks or []
        per_input = [given] if given and isinstance(given[0], tuple) else given
        if len(per_input) != inputs:
            raise _bad(f"'chunks' has spans for {len(per_input)} inputs; the request has {inputs} (give "
                       "one list of [start, end] spans per input)")
        return per_input


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"'late_chunking': {message}", param=PARAM, code=code)


def pooling_of(folder: Path) -> str:
    """How the model's sentence-transformers modules pool: "mean", or what they do instead."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except FileNotFoundError:
        return "mean"  # a bare transformer: sentence-transformers pools it by the mean
    except (OSError, ValueError):
        return "an unreadable modules.json"
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    extra = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if extra:
        return f"a {', '.join(extra)} module after its pooling"
    pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return "no pooling module"
    try:
        config = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError):
        return "an unreadable pooling configuration"
    prefix = "pooling_mode_"
    modes = [k.removeprefix(prefix) for k, on in config.items() if k.startswith(prefix) and on]
    return "mean" if modes == ["mean_tokens"] else " and ".join(modes) or "no pooling mode"


def refusal(info: ModelInfo, engine_kind: str) -> str | None:
    """Why late chunking cannot be served for this model, or None where it can."""
    if engine_kind == "sglang":
        return (f"late chunking needs the CPU engine, which returns every token's last hidden state; the "
                f"model '{info.name}' is served by SGLang, whose embedding path returns pooled vectors only")
    pooling = pooling_of(info.path)
    if info.embeds and pooling != "mean":  # a reranker: /v1/embeddings refuses it before
        return (f"late chunking mean-pools token states; the model '{info.name}' pools by {pooling}, so "
                "its chunk vectors would not compare with its other vectors")
    return None


@dataclass
class LatePlan:
    """The engine inputs of a late-chunked request and the chunk each row of the answer is."""

    inputs: list[list[int]]
    chunks: list[tuple[int, int, int]]  # per answer row: input index, start and end character

    def data(self, payload: list[Any]) -> list[dict[str, Any]]:
        """The response's ``data``: one item per chunk, in input order."""
        return [
            {"object": "embedding", "index": k, "input_index": i, "span": [start, end], "embedding": v}
            for k, ((i, start, end), v) in enumerate(zip(self.chunks, payload, strict=True))
        ]


def check_spans(spans: list[tuple[int, int]], i: int, chars: int) -> None:
    """Spans within the text, ordered, not overlapping."""
    if not spans:
        raise _bad(f"input[{i}] has no chunks")
    end = 0
    for j, (start, stop) in enumerate(spans):
        where = f"chunk {j} of input[{i}], [{start}, {stop}),"
        if not 0 <= start < stop <= chars:
            raise _bad(f"{where} must have 0 <= start < end <= {chars} (the input's characters)")
        if start < end:
            raise _bad(f"{where} overlaps or precedes the chunk before it (chunks are in order, disjoint)")
        end = stop


def plan(
    spec: LateChunking, texts: list[str], inputs: list[TokenizedInput],
    offsets: list[list[tuple[int, int]]], tokenizer: ModelTokenizer, from_start: bool,
) -> LatePlan:
    """Each input with the token spans of its chunks, its tokens as tokenised and cut
    (``from_start``: its start was cut). 400 for chunks out of range, overlapping, covering no
    token or reaching past what one pass embeds."""
    head, frame = len(tokenizer.prefix), len(tokenizer.prefix) + len(tokenizer.suffix)
    given = spec.spans(len(texts)) if spec.chunks is not None else None
    engine: list[list[int]] = []
    chunks: list[tuple[int, int, int]] = []
    for i, (text, x, offs) in enumerate(zip(texts, inputs, offsets, strict=True)):
        kept = len(x.ids) - frame
        first = len(offs) - kept if from_start else 0  # the first content token embedded
        if given is None:
            assert spec.chunk_tokens is not None
            size, stop = spec.chunk_tokens, first + kept
            runs = [(a, min(a + size, stop)) for a in range(first, stop, size)]
            chars = [(offs[a][0], offs[b - 1][1]) for a, b in runs]
        else:
            chars = given[i]
            check_spans(chars, i, len(text))
            runs = _token_runs(chars, offs, i, first, first + kept)
        engine.append(SpannedIds(x.ids, [(head + a - first, head + b - first) for a, b in runs]))
        chunks += [(i, start, end) for start, end in chars]
    return LatePlan(engine, chunks)


def _token_runs(
    chars: list[tuple[int, int]], offs: list[tuple[int, int]], i: int, first: int, stop: int
) -> list[tuple[int, int]]:
    """The content tokens ``[a, b)`` that start in each span; all within the pass ``[first, stop)``."""
    starts = [o[0] for o in offs]
    runs = []
    for j, (start, end) in enumerate(chars):
        a, b = bisect_left(starts, start), bisect_left(starts, end)
        if a == b:
            raise _bad(f"chunk {j} of input[{i}], [{start}, {end}), holds no token (only spaces?)")
        if a < first or b > stop:
            edge = f"end at character {offs[stop - 1][1]}" if b > stop else f"begin at {offs[first][0]}"
            raise _bad(f"chunk {j} of input[{i}], [{start}, {end}), reaches past the {stop - first} tokens "
                       f"one pass embeds (the model's cap), which {edge}: split the input",
                       code="context_length_exceeded")
        runs.append((a, b))
    return runs
