"""A model's sparse and ColBERT outputs on the gateway's side of the engine wire
(``contracts/hybrid.py``): an engine call's answer split into its inputs' and joined again into a
request's (the coalescer batches inputs of many requests), a sparse vector cut to what a request
keeps, and the MaxSim score of two ColBERT matrices.
"""

from __future__ import annotations

import numpy as np

from embedserve.contracts.hybrid import OUTPUTS, HybridOutputs, Output, Sparse
from embedserve.contracts.wire import Matrix

#: The outputs of a request that asks the plain dense vector: it travels on the plain wire.
DENSE: tuple[Output, ...] = ("dense",)


def ordered(outputs: list[Output] | tuple[Output, ...]) -> tuple[Output, ...]:
    """``outputs`` without repeats, in the wire's order (dense, sparse, colbert): the key that
    decides which inputs may share an engine call."""
    return tuple(o for o in OUTPUTS if o in outputs)


def split(answer: HybridOutputs, count: int) -> list[HybridOutputs]:
    """One engine call's answer, one part per input."""
    return [
        HybridOutputs(
            dense=None if answer.dense is None else answer.dense[i : i + 1],
            sparse=None if answer.sparse is None else [answer.sparse[i]],
            colbert=None if answer.colbert is None else [answer.colbert[i]],
        )
        for i in range(count)
    ]


def join(parts: list[HybridOutputs]) -> HybridOutputs:
    """A request's inputs' parts, in order, as one answer."""
    first = parts[0]
    return HybridOutputs(
        dense=None if first.dense is None else np.vstack([p.dense for p in parts if p.dense is not None]),
        sparse=None if first.sparse is None else [s for p in parts for s in p.sparse or ()],
        colbert=None if first.colbert is None else [m for p in parts for m in p.colbert or ()],
    )


def trim_sparse(s: Sparse, top_k: int | None, min_weight: float | None) -> Sparse:
    """``s`` with weights under ``min_weight`` dropped and at most its ``top_k`` largest weights
    kept (ties: the lower id), ids still ascending."""
    keep = np.ones(len(s.values), dtype=bool) if min_weight is None else s.values >= min_weight
    if top_k is not None and keep.sum() > top_k:
        order = np.lexsort((s.indices, -s.values))  # largest weight first, then lowest id
        best = order[keep[order]][:top_k]
        keep = np.zeros(len(s.values), dtype=bool)
        keep[best] = True
    return Sparse(indices=s.indices[keep], values=s.values[keep])


def maxsim(query: Matrix, document: Matrix) -> float:
    """BGE-M3's ColBERT score: for each query token the largest dot product with a document
    token, averaged over the query's tokens (its reference divides ColBERT's sum by them, so a
    score of unit rows lies in [-1, 1] like a cosine; one query's order is the sum's)."""
    if not len(query) or not len(document):
        return 0.0
    return float((query @ document.T).max(axis=1).astype(np.float64).mean())
