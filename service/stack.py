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

from service.http_protocol import bounded_httptools
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


def engine_launch(settings: Settings, kind: str, index: int) -> LaunchSpec:
    """Local engine ``index`` listens on ``engine.port + index``; SGLang replicas get a GPU each."""
    own = settings.for_replica(index)
    if kind == "cpu":
        env = {"HF_HUB_OFFLINE": "1", "EMBEDSERVE_ENGINE__PORT": str(own.engine.port)}
        return LaunchSpec([sys.executable, "-m", "service.cpu_engine"], env)
    from service.sglang_launch import build_launch

    spec = build_launch(own)
    env = dict(spec.env)
    if settings.engine.replicas > 1:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    return LaunchSpec(list(spec.argv), env)


async def warm_up(settings: Settings) -> None:
    """One call at the largest batch the gateway will send, so an out-of-memory shows
    at boot rather than under the first burst of traffic."""
    cap = settings.model.effective_max_seq_len()
    n = max(1, settings.engine.batch_token_budget // cap)
    body = {"model": settings.model.served_name, "input": [[1] * cap for _ in range(n)]}
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
    from gateway.app import SupervisorView, create_app

    kind = resolve_engine_kind(settings)
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

    app = create_app(settings, supervisor=view if supervisors else None, engine_kind=kind)
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
                await warm_up(settings)
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
            for sup, engine in zip(supervisors, app.state.pool.engines, strict=True):
                stuck = engine.stuck_for_s(now)
                if stuck is not None and stuck > hang_after:
                    sup.kill(f"a call has waited {stuck:.0f} s (limit {hang_after:.0f} s)")
                    engine.inflight_since.clear()
                    engine.stalled_since = None

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
