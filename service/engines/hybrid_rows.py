"""The CPU engine's answer to a request that names ``outputs`` (``contracts/hybrid.py``), from its
graph's outputs (``hybrid_modules``), in numpy; and late chunking's vectors from token states.

BGE-M3's graph gives a weight per token; FlagEmbedding's ``_process_token_weights`` keeps, for
each id of the input, its largest weight, leaving out zero weights and the tokenizer's cls, eos,
pad and unk tokens. SPLADE's graph gives a weight per vocabulary id already; its nonzero weights
are the vector.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from embedserve.contracts.hybrid import OUTPUTS, HybridOutputs, Output, Sparse
from embedserve.contracts.onnx_export import (
    COLBERT_OUTPUT,
    LEXICAL_OUTPUT,
    TOKEN_WEIGHTS_OUTPUT,
    VECTORS_OUTPUT,
)
from embedserve.contracts.wire import Matrix
from embedserve.model_info import ModelInfo

#: The special tokens FlagEmbedding leaves out of a BGE-M3 sparse vector.
DROPPED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")


def dropped_ids(folder: Path) -> np.ndarray:
    """The ids of the folder's ``DROPPED_TOKENS`` (its tokenizer_config.json, then
    special_tokens_map.json, as transformers reads them), those it names."""
    named: dict[str, object] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            named.update(json.loads((folder / name).read_text()))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = set()
    for key in DROPPED_TOKENS:
        token = named.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and (found := tokenizer.token_to_id(token)) is not None:
            ids.add(found)
    return np.array(sorted(ids), dtype=np.int64)


def sparse_of_tokens(weights: np.ndarray, ids: list[int], dropped: np.ndarray) -> Sparse:
    """BGE-M3: each id's largest weight over the input's tokens (``weights``: one per id of
    ``ids``), ``dropped`` ids and zero weights left out."""
    tokens = np.asarray(ids, dtype=np.int64)
    keep = (weights > 0) & ~np.isin(tokens, dropped)
    indices, where = np.unique(tokens[keep], return_inverse=True)
    values = np.zeros(len(indices), dtype=np.float32)
    np.maximum.at(values, where, weights[keep].astype(np.float32))
    return Sparse(indices=indices, values=values)


def sparse_of_vocabulary(weights: np.ndarray) -> Sparse:
    """SPLADE: the nonzero weights of the vocabulary-wide vector."""
    indices = np.flatnonzero(weights > 0).astype(np.int64)
    return Sparse(indices=indices, values=weights[indices].astype(np.float32))


def outputs_problem(info: ModelInfo, asked: list[Output] | None) -> str | None:
    """Why this model cannot answer a request's ``outputs`` (None: a plain request, answered with
    the dense vector, or a reranker's scores), or None when it can."""
    if asked is None:
        if not info.embeds or "dense" in info.outputs:
            return None
        return ("this model has no dense vector, which a request without 'outputs' asks for: "
                f"this model's outputs are {', '.join(info.outputs)}")
    if not asked:
        return "outputs must name at least one of dense, sparse, colbert"
    if not info.embeds:
        return f"'outputs' needs an embedding model, but {info.path.name} is a reranker ({info.scoring})"
    missing = [o for o in OUTPUTS if o in asked and o not in info.outputs]
    if not missing:
        return None
    have = ", ".join(info.outputs)
    return f"this model has no {', '.join(missing)} output: this model's outputs are {have}"


class HybridAnswer:
    """One call's answer, filled from its micro-batches' graph outputs (``Forward.heads``)."""

    def __init__(self, batch: list[list[int]], outputs: list[Output], dropped: np.ndarray | None) -> None:
        """``dropped``: BGE-M3's ids left out of its sparse vectors; None: SPLADE's vectors."""
        self.batch, self.outputs, self.dropped = batch, set(outputs), dropped
        self.dense: list[np.ndarray] = [np.empty(0, np.float32)] * len(batch)
        self.sparse: list[Sparse] = [Sparse(np.empty(0, np.int64), np.empty(0, np.float32))] * len(batch)
        self.colbert: list[Matrix] = [np.empty((0, 0), np.float32)] * len(batch)

    def add(self, group: list[int], got: dict[str, np.ndarray]) -> None:
        """The outputs of the inputs at ``group``'s places in the batch (rows of ``got``, in order)."""
        for row, i in enumerate(group):
            n = len(self.batch[i])
            if "dense" in self.outputs:
                self.dense[i] = got[VECTORS_OUTPUT][row]
            if "sparse" in self.outputs:
                self.sparse[i] = (
                    sparse_of_vocabulary(got[LEXICAL_OUTPUT][row]) if self.dropped is None
                    else sparse_of_tokens(got[TOKEN_WEIGHTS_OUTPUT][row, :n], self.batch[i], self.dropped)
                )
            if "colbert" in self.outputs:  # every token but the first
                self.colbert[i] = np.ascontiguousarray(got[COLBERT_OUTPUT][row, : n - 1])

    def result(self) -> HybridOutputs:
        return HybridOutputs(
            dense=np.stack(self.dense) if "dense" in self.outputs else None,
            sparse=self.sparse if "sparse" in self.outputs else None,
            colbert=self.colbert if "colbert" in self.outputs else None,
        )


def pool_spans(states: Matrix, spans: list[tuple[int, int]]) -> Matrix:
    """One unit vector per span: the mean of ``states`` (one row per token) over it."""
    means = np.stack([states[start:end].mean(axis=0) for start, end in spans])
    return (means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)).astype(np.float32)
