"""Turn engine vectors into the response: Matryoshka slicing, normalising, encoding.
Vectorised with numpy: no per-float Python loops."""

from __future__ import annotations

import base64

import numpy as np
import numpy.typing as npt

Matrix = npt.NDArray[np.float32]


def shape_vectors(vectors: Matrix, dimensions: int | None, normalize: bool) -> Matrix:
    """Keep the first ``dimensions`` components and re-normalise (Matryoshka)."""
    out = vectors[:, :dimensions] if dimensions is not None else vectors
    if normalize or dimensions is not None:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, np.float32(1e-12))
    return np.ascontiguousarray(out, dtype=np.float32)


def encode_base64(vectors: Matrix) -> list[str]:
    """Little-endian float32, as OpenAI's clients decode it."""
    le = vectors.astype("<f4", copy=False)
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in le]
