"""Late chunking on the engine wire: an extension of ``POST {engine}/v1/embeddings`` that only the
CPU engine speaks (SGLang 0.5.17's embedding path returns pooled vectors only: docs/CPU.md).

``LateChunkRequest`` is ``EngineRequest`` plus ``chunks``: for each input, the spans ``[start,
end)`` of its token ids whose last hidden states are mean-pooled into one unit vector each, or
null for the model's own pooling. The answer is ``EngineRequest``'s, with one vector per span
(per input without spans), in input order. The gateway writes it and the CPU engine reads it
through this module.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import StrictInt

from embedserve.contracts import wire
from embedserve.contracts.wire import EngineRequest, Matrix

Span = tuple[StrictInt, StrictInt]


class SpannedIds(list[int]):
    """An engine input (its token ids) whose vectors are its token states pooled over ``spans``:
    it travels through the gateway's queue as any input does, and is as long."""

    def __init__(self, ids: Iterable[int], spans: list[tuple[int, int]]) -> None:
        super().__init__(ids)
        self.spans = spans


def spans_of(batch: list[list[int]]) -> list[list[tuple[int, int]] | None] | None:
    """Each input's spans (None: the model's pooling); None when no input has any."""
    spans = [x.spans if isinstance(x, SpannedIds) else None for x in batch]
    return spans if any(s is not None for s in spans) else None


class LateChunkRequest(EngineRequest):
    chunks: list[list[Span] | None] | None = None

    def problem(self, batch: list[list[int]]) -> str | None:
        """What is wrong with ``chunks`` for ``batch`` (the inputs), or None."""
        if self.chunks is None:
            return None
        if len(self.chunks) != len(batch):
            return f"'chunks' has {len(self.chunks)} entries for {len(batch)} inputs"
        for i, (ids, spans) in enumerate(zip(batch, self.chunks, strict=True)):
            if spans is not None and not spans:
                return f"chunks[{i}] is empty (null pools input {i} as the model does)"
            for start, end in spans or ():
                if not 0 <= start < end <= len(ids):
                    return f"chunks[{i}] has the span [{start}, {end}), outside input {i}'s {len(ids)} tokens"
        return None


def encode_request(model: str, batch: list[list[int]], base64_vectors: bool = True) -> bytes:
    """``wire.encode_request``, with ``chunks`` when an input is a ``SpannedIds``."""
    spans = spans_of(batch)
    if spans is None:
        return wire.encode_request(model, batch, base64_vectors)
    req = LateChunkRequest(
        model=model, input=[list(x) for x in batch], encoding_format="base64" if base64_vectors else "float",
        chunks=spans,
    )
    return req.model_dump_json().encode()


def expected_rows(batch: list[list[int]]) -> int:
    """How many vectors the engine answers for ``batch``."""
    spans = spans_of(batch)
    return len(batch) if spans is None else sum(1 if s is None else len(s) for s in spans)


def per_input(rows: Matrix, batch: list[list[int]]) -> Matrix | list[Matrix]:
    """The engine's answer to ``batch`` by input: ``rows`` as they are when no input has spans,
    else a list of each input's row, or of the rows of its spans (a matrix)."""
    spans = spans_of(batch)
    if spans is None:
        return rows
    out: list[Matrix] = []
    start = 0
    for s in spans:
        count = 1 if s is None else len(s)
        out.append(rows[start] if s is None else rows[start : start + count])
        start += count
    return out

