"""The CPU engine: the model on ONNX Runtime (or torch) behind SGLang's token-id ``/v1/embeddings``
(and, for a reranker, ``/encode`` or ``/v1/score``: ``contracts/score_wire.py``). The engine kind
``torch`` is the same server with the torch backend on a GPU: its allocator is then watched and
emptied by the rules SGLang's engines follow (``sglang_plugin.Monitor``).

It speaks exactly what SGLang speaks when launched with ``--is-embedding
--skip-tokenizer-init`` (docs/ARCHITECTURE.md), so the gateway cannot tell the two apart.
Pooling and normalisation come from the model folder's sentence-transformers modules
(mean for MiniLM, last token for Qwen3-Embedding), whichever backend runs them
(``cpu_backends``). Beyond SGLang, it also serves late chunking (``contracts/late_chunks.py``):
the mean of the last hidden states over spans of an input's tokens, one vector per span; and a
model's sparse and ColBERT outputs beside its dense vector (``contracts/hybrid.py``): a request
that names ``outputs`` gets those, from one forward per micro-batch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import Response

from embedserve.background import start_task, stop_tasks
from embedserve.config import Settings, load_settings
from embedserve.contracts import hybrid, late_chunks, score_wire, wire
from embedserve.contracts.stats import EngineStats, stats_path, write_stats
from embedserve.contracts.wire import Matrix
from embedserve.engines.cpu_backends import load_forward, runs_onnx
from embedserve.engines.drill import Leak
from embedserve.engines.engine_profiler import EngineProfiler, ProfileStart
from embedserve.engines.hybrid_rows import HybridAnswer, dropped_ids, outputs_problem, pool_spans
from embedserve.engines.sglang_plugin import engine_monitor
from embedserve.http_server import QuietServer, bounded_httptools, wait_disconnect
from embedserve.model_info import ModelInfo

log = logging.getLogger(__name__)


def _error(status: int, message: str) -> Response:
    return Response(wire.error_body(status, message), status_code=status, media_type="application/json")


class CallCancelled(Exception):
    """The caller left before its call was computed."""


class EngineCall(late_chunks.LateChunkRequest, hybrid.HybridRequest):
    """What ``/v1/embeddings`` reads: token ids, and late chunking's spans or hybrid outputs."""


#: A SPLADE forward holds a logit per vocabulary id for every token of its micro-batch: its
#: micro-batches are cut to keep those under this many bytes (at least one input each).
MAX_LOGITS_BYTES = 256 << 20


class CpuEmbedder:
    """Runs batches one at a time on a dedicated thread (the backend uses the cores itself)."""

    def __init__(self, settings: Settings) -> None:
        self.forward = load_forward(settings)
        self.info = ModelInfo.load(settings.model)
        self.max_seq_len = self.info.max_seq_len
        self.token_budget = settings.engine.batch_token_budget
        if "dense" not in self.info.outputs:  # SPLADE
            self.token_budget = min(self.token_budget, MAX_LOGITS_BYTES // (4 * self.info.dimension))
        # BGE-M3's ids that its sparse vectors leave out
        self.dropped = dropped_ids(self.info.path) if "colbert" in self.info.outputs else None
        self.path = str(settings.model.resolved_path)
        self.dimension = self.forward.dimension
        self.vocab_size = self.forward.vocab_size
        self.lock = threading.Lock()
        self.monitor = engine_monitor(settings) if settings.engine.kind == "torch" else None

    def embed(
        self, batch: list[list[int]], cancelled: threading.Event | None = None,
        spans: list[list[tuple[int, int]] | None] | None = None,
    ) -> np.ndarray:
        """Length-sorted micro-batches keep padding small; rows return in input order.
        ``cancelled`` is checked before each micro-batch: a call whose caller left stops.
        ``spans``: per input, the token spans to pool its token states over (late chunking),
        or None for the model's pooling; each input's rows then follow one another."""
        wanted = spans or [None] * len(batch)
        chunks: dict[int, Matrix] = {}
        out: np.ndarray | None = None
        for group, ids, mask in self.micro_batches(batch, cancelled):
            late = [(row, i, s) for row, i in enumerate(group) if (s := wanted[i]) is not None]
            with self.lock:
                if late:
                    vectors, states = self.forward.with_tokens(ids, mask)
                else:
                    vectors = self.forward(ids, mask)
                self.batch_done()
            for row, i, s in late:
                chunks[i] = pool_spans(states[row], s)
            if out is None:  # the width is what the model produced
                out = np.empty((len(batch), vectors.shape[1]), dtype=np.float32)
            out[group] = vectors
        assert out is not None, "an empty batch never reaches the model"
        if not chunks:
            return out
        return np.concatenate([chunks[i] if i in chunks else out[i : i + 1] for i in range(len(batch))])

    def micro_batches(
        self, batch: list[list[int]], cancelled: threading.Event | None
    ) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
        """Length-sorted groups within the token budget: their inputs' places in ``batch``, and
        their ids right-padded with their attention mask. ``cancelled`` is checked before each."""
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        start = 0
        while start < len(order):
            if cancelled is not None and cancelled.is_set():
                raise CallCancelled
            end = start + 1
            while end < len(order) and len(batch[order[end]]) * (end - start + 1) <= self.token_budget:
                end += 1
            group = order[start:end]
            width = len(batch[group[-1]])
            ids = np.zeros((len(group), width), dtype=np.int64)
            mask = np.zeros((len(group), width), dtype=np.int64)
            for row, i in enumerate(group):
                ids[row, : len(batch[i])] = batch[i]
                mask[row, : len(batch[i])] = 1
            yield group, ids, mask
            start = end

    def hybrid(
        self, batch: list[list[int]], outputs: list[hybrid.Output], cancelled: threading.Event | None = None
    ) -> hybrid.HybridOutputs:
        """The ``outputs`` asked for, of each input, in input order: one forward per micro-batch
        gives all of the model's outputs, and only those asked for are made into answers."""
        answer = HybridAnswer(batch, outputs, self.dropped)
        for group, ids, mask in self.micro_batches(batch, cancelled):
            with self.lock:
                got = self.forward.heads(ids, mask)
                self.batch_done()
            answer.add(group, got)
        return answer.result()

    def batch_done(self) -> None:
        """A GPU engine's allocator rules, after each forward (under the lock)."""
        if self.monitor is not None:
            self.monitor.on_batch()


def load_embedder(settings: Settings) -> CpuEmbedder:
    """Load the model before the server takes over SIGINT and SIGTERM: uvicorn only notes a
    signal during its start-up and acts once that is over, so a Ctrl-C (or ``up`` stopping a
    starting engine) would wait for the model to load. Here either signal ends it at once."""
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)  # no KeyboardInterrupt traceback
    try:
        log.info("cpu engine loading", extra={"model": str(settings.model.resolved_path)})
        return CpuEmbedder(settings)
    finally:
        signal.signal(signal.SIGINT, previous)


def create_engine_app(
    settings: Settings, drill_leak_bytes_per_s: float | None = None, embedder: CpuEmbedder | None = None
) -> FastAPI:
    """``drill_leak_bytes_per_s``: grow on purpose (``embedserve up --drill-leak``);
    ``embedder``: the model loaded already (else the app loads it as it starts)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="cpu-engine")
    state: dict[str, Any] = {}
    stats = EngineStats(source="cpu", model=settings.model.served_name)
    proc = psutil.Process()

    async def publish_stats(stats_dir: str) -> None:
        monitor = state["embedder"].monitor
        while monitor is not None:  # the GPU's allocator, on the thread that runs the forwards
            await asyncio.get_running_loop().run_in_executor(executor, monitor.on_idle)
            await asyncio.sleep(settings.engine.stats_interval_s)
        while True:
            rss = proc.memory_info().rss
            stats.allocated_bytes = stats.reserved_bytes = stats.rss_bytes = rss
            stats.max_reserved_bytes = max(stats.max_reserved_bytes, rss)
            with contextlib.suppress(OSError):
                write_stats(stats_dir, stats)
            await asyncio.sleep(settings.engine.stats_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        state["embedder"] = embedder or await loop.run_in_executor(executor, CpuEmbedder, settings)
        stats_dir = settings.engine.stats_dir
        publisher = None
        if stats_dir:
            publisher = start_task("publish-stats", lambda: publish_stats(stats_dir),
                                   restart_after_s=settings.engine.stats_interval_s)
        leak = None
        if drill_leak_bytes_per_s:
            log.warning("leak drill: growing on purpose", extra={"bytes_per_s": drill_leak_bytes_per_s})
            leak = start_task("leak-drill", Leak(drill_leak_bytes_per_s).run)
        log.info(
            "cpu engine ready",
            extra={"model": state["embedder"].path, "backend": state["embedder"].forward.description},
        )
        try:
            yield
        finally:
            await stop_tasks(publisher, leak)
            executor.shutdown(wait=False, cancel_futures=True)
            if stats_dir:
                stats_path(stats_dir, os.getpid()).unlink(missing_ok=True)

    app = FastAPI(title="embedserve cpu engine", lifespan=lifespan)
    name = settings.model.served_name
    if settings.engine.profile_dir and not runs_onnx(settings):  # ONNX Runtime never imports torch
        profiler = EngineProfiler(Path(settings.engine.profile_dir))

        @app.post("/start_profile")
        async def start_profile(request: Request) -> Response:
            try:
                req = ProfileStart.model_validate_json((await request.body()) or b"{}")
            except ValidationError as exc:
                return _error(400, f"a /start_profile body is SGLang's: {exc.errors()[0]['msg']}")
            why_not = await asyncio.get_running_loop().run_in_executor(executor, profiler.start, req)
            return _error(400, why_not) if why_not else Response("profiling started", media_type="text/plain")

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            done = await asyncio.get_running_loop().run_in_executor(executor, profiler.stop)
            return Response(f"trace written: {done}", media_type="text/plain") if isinstance(done, Path) \
                else _error(400, done)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> Response:
        e: CpuEmbedder = state["embedder"]
        info = wire.EngineInfo.model_validate(
            {"model_path": str(e.path), "engine": "torch" if e.monitor else "cpu", "is_generation": False,
             "hidden_size": e.dimension, "outputs": list(e.info.outputs) if e.info.embeds else []}
        )
        return Response(info.model_dump_json(), media_type="application/json")

    def _problem(e: CpuEmbedder, batch: list[list[int]]) -> Response | None:
        """What SGLang would refuse in these inputs (the gateway never sends it)."""
        if not batch or not all(batch):
            return _error(400, "input must be a non-empty list of non-empty token-id lists")
        bad = next((t for ids in batch for t in ids if not 0 <= t < e.vocab_size), None)
        if bad is not None:
            return _error(400, f"token id {bad} is outside the vocabulary [0, {e.vocab_size})")
        context = e.max_seq_len + 1  # mirrors SGLang launched with --context-length cap+1
        for ids in batch:
            if len(ids) >= context:
                return _error(
                    400,
                    f"The input ({len(ids)} tokens) is longer than the model's "
                    f"context length ({context} tokens).",
                )
        return None

    def _extension_problem(e: CpuEmbedder, req: Any, batch: list[list[int]]) -> Response | None:
        """What is wrong with a request's late chunking (``contracts/late_chunks.py``) or its
        hybrid outputs (``contracts/hybrid.py``)."""
        if not isinstance(req, EngineCall):
            return None
        why = outputs_problem(e.info, req.outputs)
        if why is None and req.chunks is not None and req.outputs is not None:
            why = "late chunking ('chunks') does not go with 'outputs'"
        elif why is None and req.chunks is not None:
            refused = f"late chunking needs an embedding model ({e.path})"
            why = req.problem(batch) if e.info.embeds else refused
        return None if why is None else _error(400, why)

    async def _rows(request: Request, req: Any, batch: list[list[int]]) -> Any:
        """The model's rows for ``batch`` (``req``'s inputs; a request that names ``outputs``:
        its ``HybridOutputs``), or the response that answers instead (a refusal, or 499 when the
        caller left). When the caller leaves or this handler is cancelled (the server stopping),
        the work stops at the next micro-batch."""
        e: CpuEmbedder = state["embedder"]
        problem = _problem(e, batch) or _extension_problem(e, req, batch)
        if problem is not None:
            return problem
        cancelled = threading.Event()
        job: asyncio.Future[Any]
        if isinstance(req, EngineCall) and req.outputs is not None:
            outputs = req.outputs
            job = asyncio.get_running_loop().run_in_executor(executor, e.hybrid, batch, outputs, cancelled)
        else:
            spans = req.chunks if isinstance(req, EngineCall) else None
            job = asyncio.get_running_loop().run_in_executor(executor, e.embed, batch, cancelled, spans)
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # CallCancelled: retrieved
        watch = asyncio.ensure_future(wait_disconnect(request))
        racers: list[asyncio.Future[Any]] = [job, watch]
        try:
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not job.done():
                cancelled.set()
        if not job.done():  # the caller left: answer once the thread has stopped
            await asyncio.wait([job])
            return Response(status_code=499)
        stats.batches += 1
        return job.result()

    def _json(body: bytes) -> Response:
        return Response(body, media_type="application/json")

    async def _call(
        request: Request, shape: type[Any], expected: str
    ) -> tuple[Any, list[list[int]], Any] | Response:
        """The request as ``shape``, its inputs and the model's rows for them, or the response
        that answers instead (its body malformed, the inputs refused, the caller gone)."""
        try:
            req = shape.model_validate_json(await request.body())
        except ValidationError as exc:
            return _error(400, f"expected {expected}: {exc.errors()[0]['msg']}")
        batch = req.batch()
        rows = await _rows(request, req, batch)
        return rows if isinstance(rows, Response) else (req, batch, rows)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        got = await _call(request, EngineCall, "{'input': [[token ids], ...]}")
        if isinstance(got, Response):
            return got
        req, batch, rows = got
        tokens = sum(len(x) for x in batch)
        if isinstance(rows, hybrid.HybridOutputs):
            return _json(hybrid.encode_response(name, rows, tokens))
        return _json(wire.encode_response(name, rows, tokens, req.encoding_format == "base64"))

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        """A reranker's logits, as SGLang's /encode gives them (contracts/score_wire.py)."""
        if state["embedder"].info.embeds:
            return _error(
                400,
                "/encode scores pairs with a reranker; this engine serves an embedding model",
            )
        got = await _call(request, score_wire.EncodeRequest, "{'input_ids': [[token ids], ...]}")
        if isinstance(got, Response):
            return got
        req, batch, rows = got
        return _json(score_wire.encode_response(rows[:, 0].tolist(), [len(x) for x in batch], req.single))

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from embedserve.logs import setup_logging

    ap = argparse.ArgumentParser(prog="embedserve cpu-engine", description=__doc__)
    ap.add_argument("--port", type=int, help="default: engine.port from the config")
    ap.add_argument("--host", help="default: engine.host from the config")
    ap.add_argument("--drill-leak", type=float, metavar="BYTES_PER_S", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    settings = load_settings()
    setup_logging(settings.log_level, settings.log_format)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    embedder = load_embedder(settings)
    g = settings.gateway
    config = uvicorn.Config(
        create_engine_app(settings, drill_leak_bytes_per_s=args.drill_leak, embedder=embedder),
        host=args.host or settings.engine.host,
        port=args.port or settings.engine.port,
        log_config=None,
        timeout_graceful_shutdown=int(settings.gateway.graceful_shutdown_s),
        # httptools is installed, so uvicorn's default would be its unbounded parser
        http=bounded_httptools(g.max_head_bytes, g.header_timeout_s, g.body_idle_timeout_s),
    )
    QuietServer(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
