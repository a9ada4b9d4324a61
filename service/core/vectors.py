"""Turn engine vectors into the response: Matryoshka slicing, normalising, output types, encoding.
Vectorised with numpy: no per-float Python loops.

Output types are sentence-transformers' ``quantize_embeddings`` precisions (and Cohere's
``embedding_types``):

- ``int8`` / ``uint8``: each component bucketed into 256 steps over a fixed range of
  [-1, 1], ``floor((x + 1) / (2 / 255))`` clipped to 0..255 (uint8), minus 128 (int8).
  The range is fixed, not calibrated on a corpus: a unit vector's components all lie in it,
  so nothing is ever clipped, and a vector stored today compares with one asked for after
  a restart, on another replica or with other ``dimensions`` (calibrated ranges change with
  the calibration set and the served dimensions). The cost is resolution, which the quality
  gate measures (results/quality-types-cpu/). A vector that is not of unit length (with
  ``gateway.normalize`` off) is normalised first, so the range holds for it too.
- ``binary`` / ``ubinary``: the signs, 8 components a byte, big-end first (``numpy.packbits``
  of ``x > 0``; a length not a multiple of 8 is padded with zero bits); ubinary is the byte,
  binary the byte minus 128.
"""

from __future__ import annotations

import base64
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from embedserve.contracts.wire import Matrix

OutputType = Literal["float", "int8", "uint8", "binary", "ubinary"]
OUTPUT_TYPES: tuple[str, ...] = get_args(OutputType)
#: the fixed int8 / uint8 range: every component of a unit vector lies in it
INT8_RANGE = (-1.0, 1.0)


def shape_vectors(vectors: Matrix, dimensions: int | None, normalize: bool) -> Matrix:
    """Keep the first ``dimensions`` components and re-normalise (Matryoshka)."""
    out = vectors[:, :dimensions] if dimensions is not None else vectors
    if normalize or dimensions is not None:
        out = _unit(out)
    return np.ascontiguousarray(out, dtype=np.float32)


def _unit(vectors: Matrix) -> Matrix:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, np.float32(1e-12))).astype(np.float32, copy=False)


def _within_range(vectors: Matrix) -> Matrix:
    """Rows of unit length as they are (dividing again would move some by an ulp, and so across
    a bucket's edge), others normalised."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    off = np.abs(norms - 1) > 1e-4
    return np.where(off, vectors / np.maximum(norms, np.float32(1e-12)), vectors).astype(np.float32)


def quantize(vectors: Matrix, kind: OutputType) -> npt.NDArray[Any]:
    """``vectors`` (rows) as ``kind``: float32, int8, uint8, or packed sign bits (int8, uint8)."""
    if kind == "float":
        return vectors
    if kind in ("binary", "ubinary"):
        packed = np.packbits(vectors > 0, axis=-1)
        return packed if kind == "ubinary" else (packed.astype(np.int16) - 128).astype(np.int8)
    # the same float32 arithmetic as sentence-transformers' quantize_embeddings with these ranges
    start, stop = np.float32(INT8_RANGE[0]), np.float32(INT8_RANGE[1])
    step = (stop - start) / np.float32(255)
    buckets = np.clip(np.floor((_within_range(vectors) - start) / step), 0, 255)
    return buckets.astype(np.uint8) if kind == "uint8" else (buckets - 128).astype(np.int8)


def encode_rows(vectors: Matrix, kind: OutputType, as_base64: bool) -> list[Any]:
    """One response item per row: a list of numbers (serialised by orjson from numpy), or the
    row's bytes in base64 (little-endian float32 for ``float``, one byte a value otherwise)."""
    rows = quantize(vectors, kind)
    if not as_base64:
        return list(rows)
    if rows.dtype == np.float32:
        rows = rows.astype("<f4", copy=False)
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
