"""The quality gate: what a configuration (ONNX, int8, FP8, another attention backend)
costs in embedding quality against a baseline, over HTTP, on a real-text retrieval corpus
(``embedserve quality``, ``embedserve quality-corpus``)."""
