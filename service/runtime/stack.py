"""``embedserve up``: the engine under supervision plus the gateway, in one command."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import uvicorn

from embedserve.config import Settings
from embedserve.engines.launch import engine_launch
from embedserve.engines.sglang import LaunchConfigError, plan_engines
from embedserve.http_server import QuietServer, bounded_httptools
from embedserve.logs import resolve_format
from embedserve.model_info import ModelInfo
from embedserve.nvml import gpu_count
from embedserve.runtime.ports import PortInUse, check_owner
from embedserve.runtime.preflight import check_engine_kind, check_ports
from embedserve.runtime.replace import EngineReplacer
from embedserve.runtime.supervisor import EngineStartError, ProcessSupervisor

log = logging.getLogger(__name__)


def resolve_engine_kind(settings: Settings) -> str:
    kind = settings.engine.kind
    if kind != "auto":
        return kind
    if settings.engine.urls:
        return "external"
    return "sglang" if importlib.util.find_spec("sglang") and gpu_count() > 0 else "cpu"


async def warm_up(
    settings: Settings, info: ModelInfo, kind: str, urls: list[str]
) -> list[tuple[int, float]]:
    """One call per engine at the largest batch the gateway will send, so an out-of-memory
    shows at boot rather than under the first burst of traffic. Returns each call's tokens
    and seconds: the engines' first measured capacity."""
    cap = info.max_seq_len
    n = max(1, settings.engine_call_tokens(kind) // cap)
    body = {"model": info.name, "input": [[1] * cap for _ in range(n)]}
    timings = []
    async with httpx.AsyncClient(timeout=settings.engine.startup_timeout_s) as client:
        for url in urls:
            t0 = time.monotonic()
            r = await client.post(url + "/v1/embeddings", json=body)
            if r.status_code != 200:
                raise EngineStartError(f"warm-up of {url} failed: {r.status_code} {r.text[:300]}")
            timings.append((n * cap, time.monotonic() - t0))
    return timings


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


class _StackServer(QuietServer):
    """uvicorn takes SIGINT and SIGTERM while it serves and re-raises them after its graceful
    shutdown, which would kill this process before it stops the engines it started (they
    would be orphaned). Here ``run_stack`` owns the signals from its first line to its last
    and hands them to ``handle_exit``; it then stops the engines and returns."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


#: Engines that never became ready have nothing to drain: stop them at once.
STARTING_ENGINE_GRACE_S = 2.0


async def run_stack(settings: Settings, drill_leak: float | None = None) -> int:
    """Exit status: 0 after a clean stop of a stack that was up, 130 (SIGINT) or 143 (SIGTERM)
    when a signal stopped it before it was up, 1 when an engine failed to start, 2 when a port
    is taken (by another stack, or any other process). ``drill_leak``: bytes/s the engines grow
    on purpose (a leak drill)."""
    try:
        return await _run_stack(settings, drill_leak)
    except (PortInUse, LaunchConfigError) as exc:  # one plain sentence, on a terminal or in a log collector
        print(f"embedserve: {exc}", file=sys.stderr, flush=True)
        return 2


def resolve_engines_per_gpu(settings: Settings, info: ModelInfo, kind: str) -> Settings:
    """``engine.engines_per_gpu`` as a number: SGLang's from the model and the GPU (fewer than
    asked for by ``auto`` when they would not fit, with the reason logged); one otherwise."""
    if kind != "sglang":
        if settings.engine.engines_per_gpu not in ("auto", 1):
            log.warning("engines_per_gpu applies to SGLang engines only: starting one",
                        extra={"engine_kind": kind})
        return settings.with_engine(engines_per_gpu=1)
    plan = plan_engines(settings, info)
    for note in plan.notes:
        log.warning(note)
    memory = plan.engine
    log.info("engines per GPU", extra={
        "engines_per_gpu": plan.per_gpu,
        "engine_gb": round(memory.total / 1e9, 1) if memory else None,
        "all_engines_gb": round(plan.per_gpu * memory.total / 1e9, 1) if memory else None,
        "usable_gb": round(plan.usable_bytes / 1e9, 1) if plan.usable_bytes else None,
    })
    return settings.with_engine(engines_per_gpu=plan.per_gpu)


async def _run_stack(settings: Settings, drill_leak: float | None) -> int:
    from embedserve.gateway.app import SupervisorView, create_app

    # A Ctrl-C or SIGTERM during set-up (engines starting, the app being built) stops the stack
    # before it serves, the engines stopped like any; once it serves, the server shuts down.
    loop = asyncio.get_running_loop()
    early_stop = asyncio.Event()
    announced = asyncio.Event()
    interrupted: list[int] = []  # a signal that came before the stack was up
    servers: list[_StackServer] = []

    def on_signal(sig: int) -> None:
        early_stop.set()
        if not announced.is_set():
            interrupted.append(sig)
        for srv in servers:
            srv.handle_exit(sig, None)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    kind = resolve_engine_kind(settings)
    check_engine_kind(settings, kind)
    info = ModelInfo.load(settings.model)
    local = kind != "external"
    settings = resolve_engines_per_gpu(settings, info, kind)
    check_ports(settings, local)
    if kind == "cpu" and settings.engine.cpu_backend == "onnx":
        from embedserve.engines.onnx_export import check_export_dir

        check_export_dir(settings)
    private_stats = None
    if local and settings.engine.stats_dir is None:  # two stacks on one host never mix stats
        private_stats = tempfile.mkdtemp(prefix="embedserve-stats-")
        settings = settings.with_engine(stats_dir=private_stats)
    settings = settings.model_copy(update={"log_format": resolve_format(settings.log_format)})
    def supervisor(index: int, port: int, name: str) -> ProcessSupervisor:
        return ProcessSupervisor(
            name,
            engine_launch(settings, kind, index, port=port, drill_leak=drill_leak),
            f"http://{settings.engine.host}:{port}/health",
            startup_timeout_s=settings.engine.startup_timeout_s,
            backoff_s=settings.engine.restart_backoff_s,
            backoff_max_s=settings.engine.restart_backoff_max_s,
        )

    replaced = 0
    supervisors = [
        supervisor(index, settings.engine.port + index, f"{kind}-{index}")
        for index in range(len(settings.engine_urls()) if local else 0)
    ]
    async def stop_engines() -> None:
        grace = settings.gateway.graceful_shutdown_s
        await asyncio.gather(
            *(s.stop(grace if s.ready_once else STARTING_ENGINE_GRACE_S) for s in supervisors)
        )
        if private_stats:
            shutil.rmtree(private_stats, ignore_errors=True)

    for sup in supervisors:
        await sup.start()
    if early_stop.is_set():  # stopped while the engines started: no app to build
        await stop_engines()
        return 128 + interrupted[0]

    def view() -> SupervisorView:
        dead = [s for s in supervisors if not s.alive]
        pids = {("engine" if i == 0 else f"engine-{i}"): s.pid for i, s in enumerate(supervisors) if s.pid}
        return SupervisorView(
            alive=len(dead) < len(supervisors),
            restarts=sum(s.restarts for s in supervisors),
            pids=pids,
            detail="; ".join(f"{s.name} exited ({s.last_exit})" for s in dead),
            replacements=replaced,
        )

    app = create_app(
        settings, info, supervisor=view if supervisors else None, engine_kind=kind, starting=True
    )
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
            http=bounded_httptools(g.max_head_bytes, g.header_timeout_s, g.body_idle_timeout_s),
        )
    )
    failure: list[BaseException] = []

    async def announce() -> None:
        try:
            for index, sup in enumerate(supervisors):
                await sup.wait_ready()
                assert sup.pid is not None
                check_owner(settings.engine.port + index, sup.pid, sup.name)
            if supervisors:
                timings = await warm_up(settings, info, kind, settings.engine_urls())
                for engine, (tokens, seconds) in zip(app.state.pool.engines, timings, strict=True):
                    engine.throughput.record(tokens, seconds)
            while not server.started:  # noqa: ASYNC110  (uvicorn exposes a flag, not an event)
                await asyncio.sleep(0.05)
            app.state.gate.open()
            announced.set()
            print(_banner(settings), flush=True)
        except (EngineStartError, PortInUse) as exc:
            failure.append(exc)
            if isinstance(exc, EngineStartError):
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
            for sup in list(supervisors):
                url = sup.ready_url.removesuffix("/health")
                stuck = app.state.pool.by_url(url).stuck_for_s(now)
                if stuck is not None and stuck > hang_after:
                    sup.kill(f"a call has waited {stuck:.0f} s (limit {hang_after:.0f} s)")
                    app.state.pool.forget_stuck(url)

    def on_replaced(reason: str) -> None:
        nonlocal replaced
        replaced += 1
        app.state.metrics.engine_replacements.inc()

    async def warm_one(url: str) -> tuple[int, float]:
        return (await warm_up(settings, info, kind, [url]))[0]

    replacer = EngineReplacer(
        settings,
        app.state.pool,
        supervisors,
        lambda index, port: supervisor(index, port, f"{kind}-{index}.{replaced + 1}"),
        warm_one,
        app.state.gate.close,
        app.state.gate.open,
        on_replaced,
    )

    async def replace_when_due() -> None:
        await announced.wait()
        monitor = app.state.health.monitor
        await replacer.run(lambda: monitor.state.report if monitor.state else None)

    announcer = asyncio.create_task(announce())
    watchdog = asyncio.create_task(restart_hung_engines()) if supervisors else None
    replacing = (
        asyncio.create_task(replace_when_due()) if supervisors and settings.health.replace_engines else None
    )
    servers.append(server)
    try:
        if not early_stop.is_set():
            await server.serve()
    finally:
        for task in (announcer, watchdog, replacing):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await stop_engines()
    if any(isinstance(f, PortInUse) for f in failure):
        raise failure[0]
    if interrupted:  # a start cut short: as a shell reports a process a signal ended
        return 128 + interrupted[0]
    return 1 if failure or any(s.failed for s in supervisors) else 0
