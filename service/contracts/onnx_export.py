"""The ONNX export's record, ``meta.json`` beside ``model.onnx`` in its cache folder: written by
the export (a process that imports torch) and read by the CPU engine (which does not)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

META_FILE = "meta.json"
MODEL_FILE = "model.onnx"
#: An embedding model's graph outputs: its unit vectors, and the last hidden state of every token
#: (what late chunking pools, ``contracts/late_chunks.py``).
VECTORS_OUTPUT, TOKEN_STATES_OUTPUT = "embedding", "token_embeddings"
EMBEDDING_OUTPUTS = (VECTORS_OUTPUT, TOKEN_STATES_OUTPUT)


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
