"""How an ONNX export is checked against torch before it is cached: the batches it is checked
on, and the bounds an fp32 graph must keep (an embedding model's cosine, a reranker's score)."""

from __future__ import annotations

from typing import Any

import numpy as np

from embedserve.contracts.onnx_export import (
    COLBERT_OUTPUT,
    EMBEDDING_OUTPUTS,
    TOKEN_STATES_OUTPUT,
    VECTORS_OUTPUT,
)

MIN_FP32_COSINE = 0.9999
#: a reranker's fp32 graph: the most its raw score (a logit) may differ from torch's
MAX_FP32_SCORE_DIFF = 1e-3
#: a sparse output's fp32 graph: the most a weight (BGE-M3's token weight, SPLADE's id weight,
#: about 1 on the synthetic models) may differ from torch's
MAX_FP32_SPARSE_DIFF = 1e-3
#: graph outputs held to torch's by cosine (unit vectors, token states); the others by difference
COSINE_OUTPUTS = (VECTORS_OUTPUT, TOKEN_STATES_OUTPUT, COLBERT_OUTPUT)


class ExportMismatch(RuntimeError):
    """The exported graph's answers are not torch's."""


def refuse_mismatch(
    min_cosine_vs_torch: float | None = None,
    max_score_diff_vs_torch: float | None = None,
    max_sparse_diff_vs_torch: float | None = None,
) -> None:
    """An fp32 graph whose answers are not torch's is never cached: the lowest cosine (vectors,
    token states, ColBERT vectors), the largest score difference (rerankers), the largest sparse
    weight difference, each where the graph has such outputs (``OnnxExport``'s fields)."""
    cosine, score, sparse = min_cosine_vs_torch, max_score_diff_vs_torch, max_sparse_diff_vs_torch
    if cosine is not None and cosine < MIN_FP32_COSINE:
        why = f"vectors differ from torch's (min cosine {cosine:.6f} < {MIN_FP32_COSINE})"
    elif score is not None and score > MAX_FP32_SCORE_DIFF:
        why = f"scores differ from torch's (by up to {score:.2g} > {MAX_FP32_SCORE_DIFF})"
    elif sparse is not None and sparse > MAX_FP32_SPARSE_DIFF:
        why = f"sparse weights differ from torch's (by up to {sparse:.2g} > {MAX_FP32_SPARSE_DIFF})"
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


def rounded(agreement: dict[str, float]) -> dict[str, float]:
    """``OnnxExport``'s agreement fields as recorded: cosines to 7 places, differences to 3 figures."""
    return {k: round(v, 7) if k.startswith("min_cosine") else float(f"{v:.3g}") for k, v in agreement.items()}


def compare(
    session: Any, module: Any, outputs: tuple[str, ...], checked: tuple[str, ...], cap: int, vocab: int,
    sep: int | None = None, shortest: int = 2,
) -> dict[str, float]:
    """The graph's ``checked`` outputs on padded batches of mixed lengths (up to ``cap``, from
    ``shortest``) against ``module`` (whose outputs are ``outputs``, in order) run on each input
    alone (``OnnxExport``'s fields): the lowest cosine of a vector, the largest difference of a
    reranker's score or of a sparse weight."""
    import torch

    rng = np.random.default_rng(1)
    worst: dict[str, float] = {}
    for lengths in ([shortest, cap, 1 + cap // 7, 17], [shortest + 1, 9, 30]):
        ids, mask = padded_batch(lengths, vocab, rng, sep)
        got = dict(zip(checked, session.run(list(checked), {"input_ids": ids, "attention_mask": mask}),
                       strict=True))
        for i, n in enumerate(lengths):
            with torch.inference_mode():
                alone = module(torch.from_numpy(ids[i : i + 1, :n]), torch.from_numpy(mask[i : i + 1, :n]))
            want_all = dict(zip(outputs, alone if isinstance(alone, tuple) else (alone,), strict=True))
            for name in checked:
                want = want_all[name][0].float().numpy()
                have = got[name][i][: want.shape[0]]  # the input's own tokens (ids: the whole vocabulary)
                if name in COSINE_OUTPUTS:
                    value = float(cosines(np.atleast_2d(have), np.atleast_2d(want)).min())
                    worst["min_cosine_vs_torch"] = min(worst.get("min_cosine_vs_torch", 1.0), value)
                else:
                    key = "max_score_diff_vs_torch" if name == "score" else "max_sparse_diff_vs_torch"
                    worst[key] = max(worst.get(key, 0.0), float(np.abs(have - want).max()))
    return worst


def min_cosine(session: Any, st: Any, cap: int, vocab: int) -> float:
    """The graph's vectors and token states on padded batches of mixed lengths (up to ``cap``)
    against sentence-transformers (``st``) run on each input alone: the lowest cosine of a vector,
    or of a token's state (late chunking pools those)."""
    import torch

    rng = np.random.default_rng(1)
    worst = 1.0
    for lengths in ([2, cap, 1 + cap // 7, 17], [3, 9, 30]):
        ids, mask = padded_batch(lengths, vocab, rng)
        got, got_states = session.run(list(EMBEDDING_OUTPUTS), {"input_ids": ids, "attention_mask": mask})
        with torch.inference_mode():
            alone = [st({"input_ids": torch.from_numpy(ids[i : i + 1, :n]),
                         "attention_mask": torch.from_numpy(mask[i : i + 1, :n])})
                     for i, n in enumerate(lengths)]
        want = np.stack([out["sentence_embedding"][0].float().numpy() for out in alone])
        states = [(got_states[i, :n], out["token_embeddings"][0].float().numpy())
                  for i, (n, out) in enumerate(zip(lengths, alone, strict=True))]
        for a, b in [(got, want), *states]:
            worst = min(worst, float(cosines(a, b).min()))
    return worst
