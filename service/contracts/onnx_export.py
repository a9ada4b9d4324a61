"""The ONNX export's record, ``meta.json`` beside ``model.onnx`` in its cache folder: written by
the export (a process that imports torch) and read by the CPU engine (which does not)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from embedserve.contracts.wire import Output

META_FILE = "meta.json"
MODEL_FILE = "model.onnx"
#: An embedding model's graph outputs: its unit vectors, and the last hidden state of every token
#: (what late chunking pools, ``contracts/late_chunks.py``).
VECTORS_OUTPUT, TOKEN_STATES_OUTPUT = "embedding", "token_embeddings"
EMBEDDING_OUTPUTS = (VECTORS_OUTPUT, TOKEN_STATES_OUTPUT)
#: BGE-M3's graph gives, beside those, its sparse head's weight of every token (batch, sequence)
#: and its ColBERT vectors of every token but the first (batch, sequence - 1, width); SPLADE's
#: gives only its weight of every vocabulary id (batch, vocabulary).
TOKEN_WEIGHTS_OUTPUT, COLBERT_OUTPUT, LEXICAL_OUTPUT = "token_weights", "colbert", "lexical"
M3_OUTPUTS = (*EMBEDDING_OUTPUTS, TOKEN_WEIGHTS_OUTPUT, COLBERT_OUTPUT)
SPLADE_OUTPUTS = (LEXICAL_OUTPUT,)


#: A reranker's graph output: one raw score per input.
SCORE_OUTPUT = "score"


def graph_outputs(outputs: tuple[Output, ...], embeds: bool = True) -> tuple[str, ...]:
    """A model's graph outputs, from what it gives (``ModelInfo.outputs``, ``ModelInfo.embeds``)."""
    if not embeds:
        return (SCORE_OUTPUT,)
    if "colbert" in outputs:
        return M3_OUTPUTS
    return EMBEDDING_OUTPUTS if "dense" in outputs else SPLADE_OUTPUTS


def dynamic_axes(names: tuple[str, ...]) -> dict[str, dict[int, str]]:
    """The axes of the inputs and of the outputs ``names`` that vary from call to call: the batch,
    and the tokens where an output has a row per token."""
    tokens = {0: "batch", 1: "sequence"}
    per_input = {0: "batch"}
    own = {VECTORS_OUTPUT: per_input, LEXICAL_OUTPUT: per_input, SCORE_OUTPUT: per_input,
           COLBERT_OUTPUT: {0: "batch", 1: "sequence_after_first"}}
    return {"input_ids": tokens, "attention_mask": tokens, **{name: own.get(name, tokens) for name in names}}


class OnnxExport(BaseModel):
    """What was exported, how, and how close its vectors came to torch's."""

    model_config = ConfigDict(extra="ignore")

    key: str  # the cache key: model files, exporter, quantisation, library versions
    model_path: str
    exporter: str  # torch.onnx's "torchscript" tracer or its "dynamo" exporter
    quantization: str  # "none" or "int8"
    opset: int
    versions: dict[str, str]
    dimension: int
    vocab_size: int
    export_seconds: float
    #: the lowest cosine between this graph's vectors (and token states) and torch's, on padded
    #: batches of mixed lengths
    min_cosine_vs_torch: float | None = None
    #: a reranker's graph: the largest difference between its raw scores and torch's, on the same batches
    max_score_diff_vs_torch: float | None = None
    #: a sparse output's graph: the largest difference between its weights and torch's, on the same batches
    max_sparse_diff_vs_torch: float | None = None
