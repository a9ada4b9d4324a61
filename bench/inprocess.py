"""A model in one process, no HTTP on its measured path: the ceiling a server of the same backend
could reach, and the reference vectors are compared against.

    python bench/inprocess.py BACKEND MODEL_DIR PORT
    python bench/inprocess.py serve MODEL_DIR --port P ...   # vLLM's command line (--vllm-cmd)

Backends: ``st-torch`` and ``st-onnx`` (sentence-transformers; ONNX reads model.onnx from the
folder), ``ort-export`` (ONNX Runtime on embedserve's export, its tokenizer at 256 tokens),
``transformers`` (last-token pooling, L2 norm, as Qwen3-Embedding's sentence-transformers files
say; each text alone, no padding to get wrong; on the GPU where there is one). ``POST /run``
measures the model in its own loop (``run``); ``serve`` stands in for `vllm serve` (bench/README.md)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from embedserve.loadtest.textbuild import WordBuilder, load_tokenizer

Encode = Callable[[list[str]], tuple[np.ndarray, list[int]]]  # vectors, and tokens per text


def load(backend: str, model_dir: str) -> Encode:
    if backend == "transformers":
        return forward_pass(model_dir)
    if backend.startswith("st-"):
        from sentence_transformers import SentenceTransformer

        onnx = {"backend": "onnx", "model_kwargs": {"file_name": "model.onnx"}}
        st = SentenceTransformer(model_dir, device="cpu", local_files_only=True,
                                 **(onnx if backend == "st-onnx" else {}))  # type: ignore[arg-type]
        return lambda texts: (np.asarray(st.encode(texts, batch_size=len(texts), normalize_embeddings=True)),
                              [len(t.split()) for t in texts])
    from embedserve.config import Settings
    from embedserve.engines.cpu_backends import OnnxForward

    forward = OnnxForward(Settings(_env_file=None))
    tok = load_tokenizer(model_dir)
    tok.enable_truncation(256)
    tok.enable_padding()  # zeros on the right, as the engine pads

    def encode(texts: list[str]) -> tuple[np.ndarray, list[int]]:
        rows = tok.encode_batch(texts)
        ids = np.array([e.ids for e in rows], dtype=np.int64)
        mask = np.array([e.attention_mask for e in rows], dtype=np.int64)
        return np.asarray(forward(ids, mask)), [int(m.sum()) for m in mask]

    return encode


def forward_pass(model_dir: str) -> Encode:
    import torch
    from transformers import AutoModel, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModel.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def encode(texts: list[str]) -> tuple[np.ndarray, list[int]]:
        vectors, tokens = [], []
        with torch.inference_mode():
            for text in texts:
                ids = tok(text, return_tensors="pt")["input_ids"].to(device)
                hidden = model(input_ids=ids).last_hidden_state[0, -1].float()
                vectors.append(torch.nn.functional.normalize(hidden, dim=0).cpu().numpy())
                tokens.append(int(ids.shape[1]))
        return np.asarray(vectors), tokens

    return encode


def run(encode: Encode, batch: int, words: int, seconds: float, seed: int) -> dict[str, Any]:
    """``POST /run``: unique texts of ``words`` words, ``batch`` at a time, for ``seconds``."""
    builder, rng, serial, lat = WordBuilder(seed), random.Random(seed), 0, []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        texts = [builder.build(words, rng, serial + i)[0] for i in range(batch)]
        serial += batch
        t0 = time.perf_counter()
        encode(texts)
        lat.append(time.perf_counter() - t0)
    return {"inputs_s": round(len(lat) * batch / sum(lat), 1),
            "p50_ms": round(1000 * statistics.median(lat), 2), "requests": len(lat), "errors": 0,
            "seconds": round(sum(lat), 1), "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1)}


def serve(encode: Encode, port: int, name: str = "", max_len: int | None = None, traces: str = "") -> None:
    """Answer until killed, one call of the model at a time (like one engine); ``max_len``: a
    longer input gets a 400, as vLLM answers it; ``traces``: between ``/start_profile`` and
    ``/stop_profile`` each forward pass is a "kernel" of a trace written there, as vLLM writes its own."""
    queried, lock, recording = [0, 0], threading.Lock(), list[list[dict[str, Any]]]()  # tokens, passes

    class Handler(BaseHTTPRequestHandler):
        def answer(self, doc: Any, status: int = 200, text: bool = False) -> None:
            body = doc.encode() if text else json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/metrics":  # vLLM's prefix-cache counters (never a hit), tokens per step
                labels = f'engine="0",model_name="{name}"'
                self.answer(f"vllm:prefix_cache_queries_total{{{labels}}} {float(queried[0])}\n"
                            f"vllm:prefix_cache_hits_total{{{labels}}} 0.0\n"
                            f"vllm:iteration_tokens_total_count{{{labels}}} {float(queried[1])}\n"
                            f"vllm:iteration_tokens_total_sum{{{labels}}} {float(queried[0])}\n", text=True)
            else:
                self.answer({"object": "list", "data": [{"id": name, "object": "model"}]})

        def do_POST(self) -> None:
            cmd = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path in ("/start_profile", "/stop_profile") and traces:
                with lock:
                    if self.path == "/start_profile":
                        recording[:] = [[]]
                    elif recording:
                        Path(traces).mkdir(parents=True, exist_ok=True)
                        Path(traces, f"worker.{time.time_ns()}.pt.trace.json").write_text(
                            json.dumps({"traceEvents": recording.pop()}))
                return self.answer("", text=True)
            if self.path == "/run":
                with lock:
                    return self.answer(run(encode, cmd["batch"], cmd["words"], cmd["seconds"], cmd["seed"]))
            texts = cmd["input"] if isinstance(cmd["input"], list) else [cmd["input"]]
            with lock:
                t0 = time.time()
                vectors, tokens = encode(texts)
                for events in recording:
                    events.append({"ph": "X", "cat": "kernel", "name": "forward", "ts": t0 * 1e6,
                                   "dur": (time.time() - t0) * 1e6})
            if max_len and max(tokens) > max_len:
                return self.answer({"error": {"message": "too long", "type": "BadRequestError"}}, 400)
            queried[:] = [queried[0] + sum(tokens), queried[1] + 1]  # one forward pass a call
            self.answer({"object": "list", "model": name, "usage": {"prompt_tokens": sum(tokens),
                                                                    "total_tokens": sum(tokens)},
                         "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                                  for i, v in enumerate(vectors)]})

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer.request_queue_size = 1024  # a load of many connections at once
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        ap = argparse.ArgumentParser()
        for arg in ("command", "model", "--served-model-name", "--port", "--max-model-len",
                    "--profiler-config"):
            ap.add_argument(arg)
        a = ap.parse_known_args()[0]
        traces = json.loads(a.profiler_config or "{}").get("torch_profiler_dir", "")
        print("INFO [cuda.py] Using FAKE_CPU attention backend out of potential backends: ['FAKE_CPU'].\n"
              "INFO [core.py] Initializing a V1 LLM engine (fake) with config: "
              "compilation_config={'cudagraph_mode': <CUDAGraphMode.NONE: 0>}", flush=True)
        serve(load("transformers", a.model), int(a.port), a.served_model_name, int(a.max_model_len), traces)
    else:
        model = load(sys.argv[1], sys.argv[2])
        model(["warm up"] * 4)
        serve(model, int(sys.argv[3]))
