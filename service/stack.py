"""``embedserve up``: the engine under supervision plus the gateway, in one command."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import sys

import httpx
import uvicorn

from service.settings import Settings
from service.supervisor import EngineStartError, LaunchSpec, ProcessSupervisor

log = logging.getLogger(__name__)


def gpu_present() -> bool:
    """NVML, not torch: the gateway process must not create a CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()) > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


def resolve_engine_kind(settings: Settings) -> str:
    kind = settings.engine.kind
    if kind != "auto":
        return kind
    if settings.engine.urls:
        return "external"
    return "sglang" if importlib.util.find_spec("sglang") and gpu_present() else "cpu"


def engine_launch(settings: Settings, kind: str) -> LaunchSpec:
    if kind == "cpu":
        return LaunchSpec([sys.executable, "-m", "service.cpu_engine"], {"HF_HUB_OFFLINE": "1"})
    from service.sglang_launch import build_launch

    spec = build_launch(settings)
    return LaunchSpec(list(spec.argv), dict(spec.env))


async def warm_up(settings: Settings) -> None:
    """One call at the largest batch the gateway will send, so an out-of-memory shows
    at boot rather than under the first burst of traffic."""
    cap = settings.model.effective_max_seq_len()
    n = max(1, settings.engine.batch_token_budget // cap)
    body = {"model": settings.model.served_name, "input": [[1] * cap for _ in range(n)]}
    url = settings.engine_urls()[0] + "/v1/embeddings"
    async with httpx.AsyncClient(timeout=settings.engine.startup_timeout_s) as client:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            raise EngineStartError(f"warm-up failed: {r.status_code} {r.text[:300]}")


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


async def run_stack(settings: Settings) -> int:
    from gateway.app import SupervisorView, create_app

    kind = resolve_engine_kind(settings)
    supervisor: ProcessSupervisor | None = None
    if kind != "external":
        spec = engine_launch(settings, kind)
        supervisor = ProcessSupervisor(
            kind,
            spec,
            settings.engine_urls()[0] + "/health",
            startup_timeout_s=settings.engine.startup_timeout_s,
            backoff_s=settings.engine.restart_backoff_s,
            backoff_max_s=settings.engine.restart_backoff_max_s,
        )
        await supervisor.start()

    def view() -> SupervisorView:
        assert supervisor is not None
        detail = f"{supervisor.name} engine exited ({supervisor.last_exit})" if not supervisor.alive else ""
        return SupervisorView(
            alive=supervisor.alive,
            restarts=supervisor.restarts,
            pids={"engine": supervisor.pid} if supervisor.pid else {},
            detail=detail,
        )

    app = create_app(settings, supervisor=view if supervisor else None)
    g = settings.gateway
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=g.host,
            port=g.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(g.graceful_shutdown_s),
            h11_max_incomplete_event_size=65536,
        )
    )

    async def announce() -> None:
        try:
            if supervisor:
                await supervisor.wait_ready()
                await warm_up(settings)
            while not server.started:  # noqa: ASYNC110  (uvicorn exposes a flag, not an event)
                await asyncio.sleep(0.05)
            print(_banner(settings), flush=True)
        except EngineStartError as exc:
            log.error("engine did not start", extra={"error": str(exc)})
            print(f"embedserve: the engine did not start:\n{exc}", file=sys.stderr, flush=True)
            server.should_exit = True

    announcer = asyncio.create_task(announce())
    try:
        await server.serve()
    finally:
        announcer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await announcer
        if supervisor:
            await supervisor.stop(settings.gateway.graceful_shutdown_s)
    return 1 if supervisor and supervisor.failed else 0
