"""A model's sparse and ColBERT outputs in the answers: each item of ``/v1/embeddings`` with the
outputs its request asked (``embedding``, ``sparse_embedding``, ``colbert_embedding``), and the
checks and cuts they share with TEI's ``/embed_sparse`` and ``/embed_all``."""

from __future__ import annotations

from typing import Any

from embedserve.contracts.hybrid import HybridOutputs
from embedserve.core.hybrid import trim_sparse
from embedserve.core.vectors import encode_rows, shape_vectors
from embedserve.gateway.errors import APIError


def check_colbert_tokens(inputs: list[list[int]], limit: int) -> None:
    """A ColBERT answer holds a vector per token: ``APIError`` 400 past ``limit`` tokens."""
    total = sum(map(len, inputs))
    if total > limit:
        raise APIError(
            400,
            f"the request has {total} tokens; one that asks the colbert output (a vector per token) "
            f"may have {limit} (EMBEDSERVE_GATEWAY__MAX_COLBERT_TOKENS_PER_REQUEST): send fewer inputs",
            param="input",
            code="max_tokens_per_request",
        )


def kept(
    answer: HybridOutputs, top_k: int | None, min_weight: float | None, normalize: bool
) -> HybridOutputs:
    """What a request keeps of the engines' answer: its sparse vectors cut to ``top_k`` and
    ``min_weight``, its dense vectors as ``/v1/embeddings`` shapes them."""
    cut = top_k is not None or min_weight is not None
    return HybridOutputs(
        dense=None if answer.dense is None else shape_vectors(answer.dense, None, normalize),
        sparse=answer.sparse if answer.sparse is None or not cut else
        [trim_sparse(s, top_k, min_weight) for s in answer.sparse],
        colbert=answer.colbert,
    )


def data(answer: HybridOutputs, as_base64: bool) -> list[dict[str, Any]]:
    """``/v1/embeddings``' items: ``embedding`` (as ever), ``sparse_embedding`` (``indices``:
    token ids ascending, ``values``: their weights) and ``colbert_embedding`` (a vector per kept
    token, each a list of numbers or, with base64, its little-endian float32 bytes), where asked."""
    count = next(len(x) for x in (answer.dense, answer.sparse, answer.colbert) if x is not None)
    dense = None if answer.dense is None else encode_rows(answer.dense, "float", as_base64)
    items: list[dict[str, Any]] = []
    for i in range(count):
        item: dict[str, Any] = {"object": "embedding", "index": i}
        if dense is not None:
            item["embedding"] = dense[i]
        if answer.sparse is not None:
            s = answer.sparse[i]
            item["sparse_embedding"] = {"indices": s.indices, "values": s.values}
        if answer.colbert is not None:
            item["colbert_embedding"] = encode_rows(answer.colbert[i], "float", as_base64)
        items.append(item)
    return items
