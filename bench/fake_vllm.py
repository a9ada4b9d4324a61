"""A stand-in for `vllm serve MODEL --runner pooling ...`, so that the vllm scenario's
orchestration, result JSON and report can be run on a machine without vLLM or a GPU
(`python bench/suite.py --device cpu --only vllm --vllm-cmd "python3 bench/fake_vllm.py"`).

It takes vLLM's command line (the flags it needs, the rest ignored), embeds texts with the
reference forward pass (bench/reference_vectors.py: last-token pooling, L2 norm, on CPU),
answers `POST /v1/embeddings`, `GET /health`, `GET /v1/models` and `GET /metrics` (vLLM's
prefix-cache counters, never a hit) and writes start-up lines shaped like vLLM's, naming
itself as the attention backend. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from typing import Any

from reference_vectors import Reference
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--served-model-name")
    ap.add_argument("--max-model-len", type=int, default=512)
    a, _ = ap.parse_known_args(argv)
    return a


def app(a: argparse.Namespace) -> Starlette:
    ref = Reference(a.model, "cpu")
    name = a.served_model_name or a.model
    lock = threading.Lock()  # one forward pass at a time, like one engine
    queried = [0]

    def embed(texts: list[str]) -> tuple[list[list[float]], list[int]]:
        with lock:
            return ref.embed(texts)

    async def embeddings(request: Request) -> Response:
        body = await request.json()
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        vectors, tokens = await asyncio.to_thread(embed, texts)
        if max(tokens) > a.max_model_len:
            return JSONResponse({"error": {"message": "too long", "type": "BadRequestError"}}, 400)
        queried[0] += sum(tokens)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "model": name, "data": data,
                             "usage": {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}})

    async def metrics(request: Request) -> Response:
        labels = f'engine="0",model_name="{name}"'
        return PlainTextResponse(
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(queried[0])}\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{{{labels}}} 0.0\n")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"]),
                             Route("/metrics", metrics), Route("/health", health),
                             Route("/v1/models", models)])


def main(argv: list[str]) -> None:
    import uvicorn

    a = parse(argv)
    print("INFO [cuda.py] Using FAKE_CPU attention backend out of potential backends: ['FAKE_CPU'].",
          flush=True)
    print("INFO [core.py] Initializing a V1 LLM engine (fake) with config: "
          "compilation_config={'cudagraph_mode': <CUDAGraphMode.NONE: 0>}", flush=True)
    server: Any = uvicorn.Server(uvicorn.Config(app(a), host=a.host, port=a.port, log_level="warning"))
    server.run()


if __name__ == "__main__":
    main(sys.argv[1:])
