"""Sparse (lexical) and multi-vector (ColBERT) outputs on the engine wire: an extension of
``POST {engine}/v1/embeddings`` that the CPU engine speaks.

A model may have up to three outputs from one forward pass (``Output``): ``dense`` (its pooled
unit vector, what every embedding model has), ``sparse`` (a weight per vocabulary id: BGE-M3's
``sparse_linear`` head, SPLADE's MLM head) and ``colbert`` (one unit vector per kept token:
BGE-M3's ``colbert_linear`` head). ``ModelInfo.outputs`` says which a model has.

``HybridRequest`` is ``EngineRequest`` plus ``outputs``; a request without it is a plain dense
one and is answered as ``wire.py`` says. With it, each ``data`` item carries ``embedding`` (dense,
base64 or floats, null when not asked), ``sparse`` (``{"indices", "values"}``: token ids in
ascending order and their weights, every weight > 0) and ``colbert`` (base64 of little-endian
float32, row-major, ``colbert_rows`` rows of the model's ColBERT width). The gateway writes it and
the CPU engine reads it through this module.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import orjson
from pydantic import BaseModel, ConfigDict, StrictInt

from embedserve.contracts.wire import EngineRequest, Matrix, Output, WireError, encode_base64

OUTPUTS: tuple[Output, ...] = ("dense", "sparse", "colbert")
#: What an SGLang 0.5.17 engine gives of a model's outputs: its dense vector. SGLang's one sparse
#: path (``SGLANG_EMBEDDINGS_SPARSE_HEAD``, docs/SGLANG.md) swaps a whole engine's dense pooler for
#: BGE-M3's sparse head; it has no ColBERT head and no SPLADE pooling. The gateway in front of
#: SGLang engines offers only these.
SGLANG_OUTPUTS: tuple[Output, ...] = ("dense",)


class HybridRequest(EngineRequest):
    outputs: list[Output] | None = None


class SparseWire(BaseModel):
    model_config = ConfigDict(extra="forbid")

    indices: list[StrictInt]
    values: list[float]


@dataclass(frozen=True)
class Sparse:
    """One input's sparse vector: vocabulary ids (ascending, unique) and their weights (> 0)."""

    indices: npt.NDArray[np.int64]
    values: npt.NDArray[np.float32]


@dataclass(frozen=True)
class HybridOutputs:
    """One batch's answer, in input order; a field is None when it was not asked for."""

    dense: Matrix | None
    sparse: list[Sparse] | None
    colbert: list[Matrix] | None


def encode_request(model: str, batch: list[list[int]], outputs: list[Output]) -> bytes:
    return orjson.dumps({"model": model, "input": batch, "encoding_format": "base64", "outputs": outputs})


def encode_response(model: str, answer: HybridOutputs, tokens: int) -> bytes:
    count = next(len(x) for x in (answer.dense, answer.sparse, answer.colbert) if x is not None)
    dense = encode_base64(answer.dense) if answer.dense is not None else None
    data: list[dict[str, object]] = []
    for i in range(count):
        item: dict[str, object] = {"object": "embedding", "index": i}
        item["embedding"] = dense[i] if dense is not None else None
        if answer.sparse is not None:
            s = answer.sparse[i]
            item["sparse"] = {"indices": s.indices.tolist(), "values": s.values.tolist()}
        if answer.colbert is not None:
            rows = answer.colbert[i]
            item["colbert"] = encode_base64(rows.reshape(1, -1))[0]
            item["colbert_rows"] = int(rows.shape[0])
        data.append(item)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return orjson.dumps({"object": "list", "model": model, "data": data, "usage": usage})


def decode_response(content: bytes, expected: int, outputs: list[Output]) -> HybridOutputs:
    """The answer to a request for ``outputs``; ``WireError`` for anything malformed (wrong count,
    a missing output, non-finite values, ids out of order, bad base64)."""
    try:
        data = sorted(orjson.loads(content)["data"], key=lambda d: d["index"])
        if len(data) != expected:
            raise WireError(f"engine returned {len(data)} items for {expected} inputs")
        dense = _dense([d["embedding"] for d in data]) if "dense" in outputs else None
        sparse = [_sparse(d["sparse"]) for d in data] if "sparse" in outputs else None
        colbert = [_colbert(d["colbert"], d["colbert_rows"]) for d in data] if "colbert" in outputs else None
    except WireError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise WireError(f"invalid engine response ({type(exc).__name__})") from exc
    return HybridOutputs(dense=dense, sparse=sparse, colbert=colbert)


def _dense(rows: list[str]) -> Matrix:
    raw = [base64.b64decode(r, validate=True) for r in rows]
    if len({len(r) for r in raw}) != 1 or not raw[0] or len(raw[0]) % 4:
        raise WireError("dense vectors of mixed or odd sizes")
    out = np.frombuffer(b"".join(raw), dtype="<f4").reshape(len(raw), -1).astype(np.float32)
    if not np.isfinite(out).all():
        raise WireError("non-finite dense values")
    return out


def _sparse(item: object) -> Sparse:
    s = SparseWire.model_validate(item)
    indices = np.asarray(s.indices, dtype=np.int64)
    values = np.asarray(s.values, dtype=np.float32)
    if len(indices) != len(values) or (len(indices) and (np.diff(indices) <= 0).any()):
        raise WireError("sparse ids not unique and ascending, or not one weight per id")
    if not np.isfinite(values).all() or (values <= 0).any():
        raise WireError("sparse weights must be finite and > 0")
    return Sparse(indices=indices, values=values)


def _colbert(b64: str, rows: int) -> Matrix:
    flat = np.frombuffer(base64.b64decode(b64, validate=True), dtype="<f4").astype(np.float32)
    if rows < 0 or (rows and flat.size % rows) or (not rows and flat.size):
        raise WireError("colbert rows do not divide its values")
    out = flat.reshape(rows, -1) if rows else flat.reshape(0, 0)
    if not np.isfinite(out).all():
        raise WireError("non-finite colbert values")
    return out
