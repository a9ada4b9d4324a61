"""How an ONNX export is checked against torch before it is cached: the batches it is checked
on, and the bounds an fp32 graph must keep (an embedding model's cosine, a reranker's score)."""

from __future__ import annotations

import numpy as np

MIN_FP32_COSINE = 0.9999
#: a reranker's fp32 graph: the most its raw score (a logit) may differ from torch's
MAX_FP32_SCORE_DIFF = 1e-3


class ExportMismatch(RuntimeError):
    """The exported graph's answers are not torch's."""


def refuse_mismatch(embeds: bool, agreement: float) -> None:
    """An fp32 graph whose answers are not torch's is never cached: ``agreement`` is the lowest
    cosine (embeddings) or the largest score difference (rerankers)."""
    if embeds and agreement < MIN_FP32_COSINE:
        why = f"vectors differ from torch's (min cosine {agreement:.6f} < {MIN_FP32_COSINE})"
    elif not embeds and agreement > MAX_FP32_SCORE_DIFF:
        why = f"scores differ from torch's (by up to {agreement:.2g} > {MAX_FP32_SCORE_DIFF})"
    else:
        return
    raise ExportMismatch(
        f"the ONNX graph's {why}; set engine.cpu_backend=torch (EMBEDSERVE_ENGINE__CPU_BACKEND=torch)"
    )


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each row of ``a`` against the same row of ``b``."""
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def padded_batch(
    lengths: list[int], vocab: int, rng: np.random.Generator, sep: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Random ids, right-padded to the longest, as the engine pads; with ``sep``, a pair's
    separators in the middle and at the end."""
    ids = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(min(1000, vocab // 2), vocab, n)
        if sep is not None and n >= 3:
            ids[row, [n // 2, n - 1]] = sep
        mask[row, :n] = 1
    return ids, mask
