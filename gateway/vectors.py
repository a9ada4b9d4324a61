"""Turn engine vectors into the response: Matryoshka slicing, normalising, encoding.
Vectorised with numpy: no per-float Python loops."""

from __future__ import annotations

import numpy as np

from embedserve.contracts.wire import Matrix


def shape_vectors(vectors: Matrix, dimensions: int | None, normalize: bool) -> Matrix:
    """Keep the first ``dimensions`` components and re-normalise (Matryoshka)."""
    out = vectors[:, :dimensions] if dimensions is not None else vectors
    if normalize or dimensions is not None:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, np.float32(1e-12))
    return np.ascontiguousarray(out, dtype=np.float32)
