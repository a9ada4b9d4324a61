"""A model run in the client's own process, no HTTP on the measured path: the ceiling a server
of the same backend could reach. ``python bench/inprocess.py BACKEND MODEL_DIR PORT`` loads
it once (``ort-export`` given a 4th argument: that ONNX graph, not embedserve's export) and
answers, on 127.0.0.1:PORT (plain HTTP, only to take orders):

- ``GET /health``;
- ``POST /v1/embeddings`` ``{"input": [text, ...]}``: vectors, for the vector check;
- ``POST /run`` ``{"batch", "words", "seconds", "seed"}``: embeds unique texts of ``words``
  words (loadtest's word builder), ``batch`` at a time, in a loop for ``seconds``; answers
  inputs/s and the P50 of one call.

Backends: ``st-torch`` and ``st-onnx`` (sentence-transformers; ONNX reads model.onnx from the
folder), ``ort-export`` (ONNX Runtime on embedserve's own export, its tokenizer, 256 tokens).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import numpy as np
import psutil

from embedserve.loadtest.textbuild import WordBuilder

Encode = Callable[[list[str]], np.ndarray]


def load(backend: str, model_dir: str, graph: str | None = None) -> Encode:
    if backend.startswith("st-"):
        from sentence_transformers import SentenceTransformer

        onnx: dict[str, Any] = {"backend": "onnx", "model_kwargs": {"file_name": "model.onnx"}}
        onnx = onnx if backend == "st-onnx" else {}
        model = SentenceTransformer(model_dir, device="cpu", local_files_only=True, **onnx)
        return lambda texts: np.asarray(model.encode(texts, batch_size=len(texts), normalize_embeddings=True))
    from embedserve.config import Settings
    from embedserve.engines.cpu_backends import OnnxForward
    from embedserve.loadtest.textbuild import load_tokenizer

    forward = OnnxForward(Settings(_env_file=None)) if graph is None else graph_forward(graph)
    tok = load_tokenizer(model_dir)
    tok.enable_truncation(256)

    def encode(texts: list[str]) -> np.ndarray:
        rows = [e.ids for e in tok.encode_batch(texts)]
        ids = np.zeros((len(rows), max(map(len, rows))), dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, x in enumerate(rows):
            ids[i, : len(x)], mask[i, : len(x)] = x, 1
        return np.asarray(forward(ids, mask))

    return encode


def graph_forward(graph: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """ONNX Runtime on ``graph``, with the engine's session options."""
    import onnxruntime as ort

    from embedserve.engines.cores import usable_cores
    from embedserve.engines.cpu_backends import session_options

    session = ort.InferenceSession(graph, session_options(usable_cores()), providers=["CPUExecutionProvider"])
    return lambda ids, mask: np.asarray(session.run(None, {"input_ids": ids, "attention_mask": mask})[0])


def run(encode: Encode, batch: int, words: int, seconds: float, seed: int) -> dict[str, Any]:
    builder, rng, serial, lat = WordBuilder(seed), random.Random(seed), 0, []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        texts = [builder.build(words, rng, serial + i)[0] for i in range(batch)]
        serial += batch
        t0 = time.perf_counter()
        encode(texts)
        lat.append(time.perf_counter() - t0)
    return {"inputs_s": round(len(lat) * batch / sum(lat), 1),
            "p50_ms": round(1000 * statistics.median(lat), 2),
            "requests": len(lat), "errors": 0, "seconds": round(sum(lat), 1),
            "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1)}


def serve(encode: Encode, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def answer(self, doc: dict[str, Any]) -> None:
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self.answer({})

        def do_POST(self) -> None:
            cmd = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/run":
                self.answer(run(encode, cmd["batch"], cmd["words"], cmd["seconds"], cmd["seed"]))
            else:
                vectors = encode(cmd["input"]).tolist()
                self.answer({"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]})

        def log_message(self, *args: Any) -> None:
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    backend, model_dir, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = load(backend, model_dir, sys.argv[4] if len(sys.argv) > 4 else None)
    model(["warm up"] * 4)
    serve(model, port)
