"""The gate's arithmetic: cosines, nearest neighbours, their agreement, and retrieval
quality against ground truth. Plain numpy on vectors; nothing here knows about HTTP.

Neighbours are ranked by cosine, best first, ties in passage order. The query x passage
score matrix is computed a block of queries at a time, so a corpus of tens of thousands of
passages needs no more than ``BLOCK`` x passages scores in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Vectors = npt.NDArray[np.float64]
Indices = npt.NDArray[np.int64]
BLOCK = 256


def normalised(v: Vectors) -> Vectors:
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def cosine_stats(a: Vectors, b: Vectors) -> dict[str, float]:
    """Row by row cosine between two embeddings of the same inputs: median, 1st percentile, min."""
    cos = np.sum(normalised(a) * normalised(b), axis=1)
    return {"median": float(np.median(cos)), "p1": float(np.percentile(cos, 1)), "min": float(cos.min())}


@dataclass(frozen=True)
class Neighbours:
    """Each query's ``depth`` nearest passages (best first) and their cosines."""

    index: Indices  # queries x depth
    score: Vectors  # queries x depth


def nearest(queries: Vectors, passages: Vectors, depth: int) -> Neighbours:
    """The ``depth`` nearest passages of every query, by cosine (ties in passage order)."""
    depth = min(depth, len(passages))
    q, p = normalised(queries), normalised(passages)
    index = np.empty((len(q), depth), dtype=np.int64)
    score = np.empty((len(q), depth), dtype=np.float64)
    for start in range(0, len(q), BLOCK):
        block = q[start:start + BLOCK] @ p.T
        order = np.argsort(-block, axis=1, kind="stable")[:, :depth]
        index[start:start + BLOCK] = order
        score[start:start + BLOCK] = np.take_along_axis(block, order, 1)
    return Neighbours(index, score)


def top_k(queries: Vectors, passages: Vectors, k: int) -> Indices:
    """Each query's k nearest passages by cosine, best first."""
    return nearest(queries, passages, k).index


def overlap(base: Indices, cand: Indices, k: int = 10) -> float:
    """Mean share of the baseline's top-k passages that the candidate's top-k also holds."""
    k = min(k, base.shape[1])
    return float(np.mean([len(set(b[:k]) & set(c[:k])) / k for b, c in zip(base, cand, strict=True)]))


def top_k_overlap(base_q: Vectors, base_p: Vectors, cand_q: Vectors, cand_p: Vectors, k: int = 10) -> float:
    """:func:`overlap` of the two sides' own top-k."""
    return overlap(top_k(base_q, base_p, k), top_k(cand_q, cand_p, k), k)


def boundary(base: Neighbours, cand_q: Vectors, cand_p: Vectors, k: int = 10) -> dict[str, float]:
    """How close the top-k boundary is to a tie: the baseline's median gap between its k-th
    and (k+1)-th score, and the median change the candidate makes to the baseline's top-k
    scores (``base`` must hold k + 1 neighbours a query, or all passages)."""
    k = min(k, base.index.shape[1] - 1)
    q, p = normalised(cand_q), normalised(cand_p)
    cand_scores = np.concatenate([
        np.einsum("qd,qkd->qk", q[i:i + BLOCK], p[base.index[i:i + BLOCK, :k]])
        for i in range(0, len(q), BLOCK)])
    moved = np.abs(cand_scores - base.score[:, :k])
    return {"gap_k_to_next_median": float(np.median(base.score[:, k - 1] - base.score[:, k])),
            "score_change_median": float(np.median(moved))}


def recall_at_k(ranked: Indices, relevant: Sequence[set[int]], k: int = 10) -> float:
    """Mean over queries of the share of a query's relevant passages found in its top k."""
    return float(np.mean([len(set(r[:k].tolist()) & rel) / len(rel)
                          for r, rel in zip(ranked, relevant, strict=True)]))


def ndcg_at_k(ranked: Indices, relevant: Sequence[set[int]], k: int = 10) -> float:
    """Mean over queries of nDCG@k with binary relevance: the discounted gain of the relevant
    passages where they rank (1 / log2(rank + 1)), over the gain of the best possible order."""
    discount = 1.0 / np.log2(np.arange(2, k + 2))
    out = []
    for r, rel in zip(ranked, relevant, strict=True):
        gain = sum(discount[i] for i, passage in enumerate(r[:k].tolist()) if passage in rel)
        out.append(gain / discount[: min(len(rel), k)].sum())
    return float(np.mean(out))
