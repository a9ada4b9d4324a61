"""``embedserve up``: the engine under supervision plus the gateway, in one command."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import signal
import sys
import time
from collections.abc import Iterator

import httpx
import uvicorn

from embedserve.config import Settings
from embedserve.engines.launch import engine_launch
from embedserve.http_server import bounded_httptools
from embedserve.model_info import ModelInfo
from embedserve.nvml import gpu_count
from embedserve.runtime.supervisor import EngineStartError, ProcessSupervisor

log = logging.getLogger(__name__)


def resolve_engine_kind(settings: Settings) -> str:
    kind = settings.engine.kind
    if kind != "auto":
        return kind
    if settings.engine.urls:
        return "external"
    return "sglang" if importlib.util.find_spec("sglang") and gpu_count() > 0 else "cpu"


async def warm_up(settings: Settings, info: ModelInfo) -> None:
    """One call at the largest batch the gateway will send, so an out-of-memory shows
    at boot rather than under the first burst of traffic."""
    cap = info.max_seq_len
    n = max(1, settings.engine.batch_token_budget // cap)
    body = {"model": info.name, "input": [[1] * cap for _ in range(n)]}
    async with httpx.AsyncClient(timeout=settings.engine.startup_timeout_s) as client:
        for url in settings.engine_urls():
            r = await client.post(url + "/v1/embeddings", json=body)
            if r.status_code != 200:
                raise EngineStartError(f"warm-up of {url} failed: {r.status_code} {r.text[:300]}")


def _banner(settings: Settings) -> str:
    g = settings.gateway
    host = "127.0.0.1" if g.host in ("0.0.0.0", "::") else g.host
    url = f"http://{host}:{g.port}"
    return (
        f"\nembedserve is up: {url}  (model '{settings.model.served_name}')\n"
        f"  curl -s {url}/v1/embeddings -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{settings.model.served_name}", "input": "hello world"}}\'\n'
        f"  health: {url}/health/memory   metrics: {url}/metrics\n"
    )


class _StackServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, which would kill this
    process before it stops the engines it started (they would be orphaned). Here the
    signal only starts the shutdown; ``run_stack`` then stops the engines and returns."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def run_stack(settings: Settings) -> int:
    from embedserve.gateway.app import SupervisorView, create_app

    kind = resolve_engine_kind(settings)
    info = ModelInfo.load(settings.model)
    supervisors: list[ProcessSupervisor] = []
    if kind != "external":
        for index, url in enumerate(settings.engine_urls()):
            supervisors.append(
                ProcessSupervisor(
                    f"{kind}-{index}",
                    engine_launch(settings, kind, index),
                    url + "/health",
                    startup_timeout_s=settings.engine.startup_timeout_s,
                    backoff_s=settings.engine.restart_backoff_s,
                    backoff_max_s=settings.engine.restart_backoff_max_s,
                )
            )
        for sup in supervisors:
            await sup.start()

    def view() -> SupervisorView:
        dead = [s for s in supervisors if not s.alive]
        pids = {("engine" if i == 0 else f"engine-{i}"): s.pid for i, s in enumerate(supervisors) if s.pid}
        return SupervisorView(
            alive=len(dead) < len(supervisors),
            restarts=sum(s.restarts for s in supervisors),
            pids=pids,
            detail="; ".join(f"{s.name} exited ({s.last_exit})" for s in dead),
        )

    app = create_app(settings, info, supervisor=view if supervisors else None, engine_kind=kind)
    g = settings.gateway
    server = _StackServer(
        uvicorn.Config(
            app,
            host=g.host,
            port=g.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(g.graceful_shutdown_s),
            timeout_keep_alive=int(g.keep_alive_s),
            http=bounded_httptools(g.max_head_bytes),
        )
    )

    async def announce() -> None:
        try:
            if supervisors:
                await asyncio.gather(*(s.wait_ready() for s in supervisors))
                await warm_up(settings, info)
            while not server.started:  # noqa: ASYNC110  (uvicorn exposes a flag, not an event)
                await asyncio.sleep(0.05)
            print(_banner(settings), flush=True)
        except EngineStartError as exc:
            log.error("engine did not start", extra={"error": str(exc)})
            print(f"embedserve: the engine did not start:\n{exc}", file=sys.stderr, flush=True)
            server.should_exit = True

    async def restart_hung_engines() -> None:
        """Liveness fails at ``hang_after_s`` so Kubernetes restarts a hung pod; without
        Kubernetes `up` restarts the engine itself, a little later so the two never race."""
        hang_after = 1.5 * settings.hang_after_s()
        while True:
            await asyncio.sleep(min(5.0, hang_after / 4))
            now = time.monotonic()
            for index, (sup, engine) in enumerate(zip(supervisors, app.state.pool.engines, strict=True)):
                stuck = engine.stuck_for_s(now)
                if stuck is not None and stuck > hang_after:
                    sup.kill(f"a call has waited {stuck:.0f} s (limit {hang_after:.0f} s)")
                    app.state.pool.forget_stuck(index)

    announcer = asyncio.create_task(announce())
    watchdog = asyncio.create_task(restart_hung_engines()) if supervisors else None
    try:
        await server.serve()
    finally:
        for task in (announcer, watchdog):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.gather(*(s.stop(settings.gateway.graceful_shutdown_s) for s in supervisors))
    return 1 if any(s.failed for s in supervisors) else 0
