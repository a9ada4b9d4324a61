"""``embedserve up``: the engine under supervision plus the gateway, in one command."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import httpx
import uvicorn

from embedserve.background import start_task, stop_tasks
from embedserve.config import Settings
from embedserve.contracts import hybrid
from embedserve.engines.launch import engine_launch
from embedserve.engines.sglang import LaunchConfigError
from embedserve.http_server import QuietServer, bounded_httptools
from embedserve.logs import resolve_format
from embedserve.model_info import ModelInfo
from embedserve.runtime.model_plan import PlannedModel, plan_models
from embedserve.runtime.ports import PortInUse, check_owner
from embedserve.runtime.preflight import check_api_keys, check_ports, check_tracing
from embedserve.runtime.replace import EngineReplacer, run_replacers
from embedserve.runtime.supervisor import EngineStartError, ProcessSupervisor
from embedserve.runtime.watchdog import watch_hung
from embedserve.upstream.client import JSON
from embedserve.upstream.protocols import protocol_for

log = logging.getLogger(__name__)


async def warm_up(
    settings: Settings, info: ModelInfo, kind: str, urls: list[str]
) -> list[tuple[int, float]]:
    """One call per engine at the largest batch the gateway will send, so an out-of-memory
    shows at boot rather than under the first burst of traffic. Returns each call's tokens
    and seconds: the engines' first measured capacity."""
    cap = info.max_seq_len
    n = max(1, settings.engine_call_tokens(kind) // cap)
    protocol = protocol_for(info)  # a reranker's call, for a reranker
    batch = [[1] * cap for _ in range(n)]
    body = protocol.encode(info.name, batch, False)
    if "dense" not in info.outputs:  # SPLADE: a plain call asks for the dense vector it has not
        body = hybrid.encode_request(info.name, batch, list(info.outputs))
    timings = []
    async with httpx.AsyncClient(timeout=settings.engine.startup_timeout_s) as client:
        for url in urls:
            t0 = time.monotonic()
            try:
                r = await client.post(url + protocol.path, content=body, headers=JSON)
            except httpx.HTTPError as exc:  # the engine died or hung during its warm-up
                raise EngineStartError(f"warm-up of {url} failed: {type(exc).__name__}: {exc}") from exc
            if r.status_code != 200:
                raise EngineStartError(f"warm-up of {url} failed: {r.status_code} {r.text[:300]}")
            timings.append((n * cap, time.monotonic() - t0))
    return timings


def _banner(settings: Settings, models: list[ModelInfo]) -> str:
    g = settings.gateway
    host = "127.0.0.1" if g.host in ("0.0.0.0", "::") else g.host
    url = f"http://{host}:{g.port}"
    names = ", ".join(f"'{m.name}'" + ("" if m.embeds else " (rerank)") for m in models)
    first = next((m for m in models if m.embeds), None)
    key = " -H 'Authorization: Bearer YOUR_API_KEY'" if g.api_keys or g.api_keys_file else ""
    example = (
        f"  curl -s {url}/v1/embeddings -H 'Content-Type: application/json'{key} \\\n"
        f'    -d \'{{"model": "{first.name}", "input": "hello world"}}\'\n'
        if first else
        f"  curl -s {url}/v1/rerank -H 'Content-Type: application/json'{key} \\\n"
        f'    -d \'{{"model": "{models[0].name}", "query": "hello", "documents": ["hello world"]}}\'\n'
    )
    label = "model" if len(models) == 1 else "models"
    return (
        f"\nembedserve is up: {url}  ({label} {names})\n"
        + example
        + f"  health: {url}/health/memory   metrics: {url}/metrics\n"
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


@dataclass
class ModelEngines:
    """One model's plan and the supervisors of its local engines."""

    plan: PlannedModel
    supervisors: list[ProcessSupervisor]


@dataclass
class Owned:
    """What `up` started and stops however it ends (a crash, a signal, an error while it sets up):
    every engine, replacements included, and the engines' private stats folder."""

    engines: list[ProcessSupervisor] = field(default_factory=list)
    stats_dir: str | None = None

    async def release(self, grace_s: float) -> None:
        """Engines that never became ready have nothing to drain; stopping one that has stopped
        already does nothing."""
        engines = list(self.engines)
        stops = [s.stop(grace_s if s.ready_once else STARTING_ENGINE_GRACE_S) for s in engines]
        for sup, result in zip(engines, await asyncio.gather(*stops, return_exceptions=True), strict=True):
            if isinstance(result, BaseException):  # the others are stopped all the same
                log.error("stopping an engine failed", exc_info=result, extra={"engine": sup.name})
        if self.stats_dir:
            shutil.rmtree(self.stats_dir, ignore_errors=True)


async def run_stack(settings: Settings, drill_leak: float | None = None) -> int:
    """Exit status: 0 after a clean stop of a stack that was up, 130 (SIGINT) or 143 (SIGTERM)
    when a signal stopped it before it was up, 1 when an engine failed to start or the start-up
    crashed (its traceback logged), 2 when a port is taken (by another stack, or any other
    process). However it ends, every engine it started is stopped before it returns.
    ``drill_leak``: bytes/s the engines grow on purpose (a leak drill)."""
    owned = Owned()
    try:
        return await _run_stack(settings, drill_leak, owned)
    except (PortInUse, LaunchConfigError) as exc:  # one plain sentence, on a terminal or in a log collector
        print(f"embedserve: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        await owned.release(settings.gateway.graceful_shutdown_s)


async def _run_stack(settings: Settings, drill_leak: float | None, owned: Owned) -> int:
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
    check_api_keys(settings)
    settings, planned = plan_models(settings)
    check_tracing(settings)
    for m in planned:  # the gateway's port, then each model's engines'
        check_ports(m.settings, m.local)
    for m in planned:
        if m.kind == "cpu" and m.settings.engine.cpu_backend == "onnx":
            from embedserve.engines.onnx_export import check_export_dir

            check_export_dir(m.settings)
    private_stats = None
    if any(m.local for m in planned) and settings.engine.stats_dir is None:  # two stacks never mix stats
        private_stats = owned.stats_dir = tempfile.mkdtemp(prefix="embedserve-stats-")
    shared = {"log_format": resolve_format(settings.log_format)}

    def own(s: Settings) -> Settings:
        s = s.with_engine(stats_dir=private_stats) if private_stats else s
        return s.model_copy(update=shared)

    settings = own(settings)
    planned = [m.with_settings(own(m.settings)) for m in planned]

    def supervisor(m: PlannedModel, index: int, port: int, name: str) -> ProcessSupervisor:
        e = m.settings.engine
        owned.engines.append(ProcessSupervisor(
            name,
            engine_launch(m.settings, m.kind, index, port=port, drill_leak=drill_leak),
            f"http://{e.host}:{port}/health",
            startup_timeout_s=e.startup_timeout_s,
            backoff_s=e.restart_backoff_s,
            backoff_max_s=e.restart_backoff_max_s,
        ))
        return owned.engines[-1]

    def engine_name(n: int, m: PlannedModel, index: int) -> str:
        return f"{m.kind}-{index}" if len(planned) == 1 else f"{m.kind}-{n}.{index}"

    replaced = 0
    groups = [
        ModelEngines(m, [supervisor(m, i, port, engine_name(n, m, i)) for i, port in enumerate(m.ports())])
        for n, m in enumerate(planned)
    ]
    supervisors = [s for g in groups for s in g.supervisors]

    for sup in supervisors:  # from here on, run_stack stops them however this ends
        await sup.start()
    if early_stop.is_set():  # stopped while the engines started: no app to build
        return 128 + interrupted[0]

    def view() -> SupervisorView:
        serving = [s for g in groups for s in g.supervisors]  # replacements swap theirs in
        dead = [s for s in serving if not s.alive]
        pids = {("engine" if i == 0 else f"engine-{i}"): s.pid for i, s in enumerate(serving) if s.pid}
        return SupervisorView(
            alive=len(dead) < len(serving),
            restarts=sum(s.restarts for s in serving),
            pids=pids,
            detail="; ".join(f"{s.name} exited ({s.last_exit})" for s in dead),
            replacements=replaced,
        )

    app = create_app(
        settings, supervisor=view if supervisors else None, starting=True,
        models=[(m.info, m.kind) for m in planned],
    )
    runtimes = app.state.runtimes
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

    def stop_stack(exc: BaseException) -> None:
        """A task the stack cannot serve without crashed: stop, exit 1."""
        failure.append(exc)
        print(f"embedserve: stopping: {type(exc).__name__}: {exc} (traceback in the log)", file=sys.stderr,
              flush=True)
        server.should_exit = True

    async def announce() -> None:
        try:
            for group in groups:
                for port, sup in zip(group.plan.ports(), group.supervisors, strict=True):
                    await sup.wait_ready()
                    assert sup.pid is not None
                    check_owner(port, sup.pid, sup.name)
            for group, runtime in zip(groups, runtimes, strict=True):
                if group.supervisors:
                    m = group.plan
                    urls = m.settings.engine_urls()
                    timings = await warm_up(m.settings, m.info, m.kind, urls)
                    for url, (tokens, seconds) in zip(urls, timings, strict=True):
                        runtime.pool.warmed(url, tokens, seconds)
            while not server.started:  # noqa: ASYNC110  (uvicorn exposes a flag, not an event)
                await asyncio.sleep(0.05)
            app.state.gate.open()
            announced.set()
            print(_banner(settings, [r.info for r in runtimes]), flush=True)
        except (EngineStartError, PortInUse) as exc:
            failure.append(exc)
            if isinstance(exc, EngineStartError):
                log.error("engine did not start", extra={"error": str(exc)})
                print(f"embedserve: the engine did not start:\n{exc}", file=sys.stderr, flush=True)
            server.should_exit = True

    async def restart_hung_engines() -> None:
        models = [(g.supervisors, r.pool) for g, r in zip(groups, runtimes, strict=True)]
        await watch_hung(models, settings.hang_after_s())

    def on_replaced(reason: str) -> None:
        nonlocal replaced
        replaced += 1
        app.state.metrics.engine_replacements.inc()

    def warm_one(m: PlannedModel) -> Callable[[str], Awaitable[tuple[int, float]]]:
        async def warm(url: str) -> tuple[int, float]:
            return (await warm_up(m.settings, m.info, m.kind, [url]))[0]

        return warm

    def make(n: int, m: PlannedModel) -> Callable[[int, int], ProcessSupervisor]:
        return lambda index, port: supervisor(m, index, port, f"{engine_name(n, m, index)}.{replaced + 1}")

    spare = max((p for m in planned for p in m.ports()), default=settings.engine.port) + 1
    replacers = [
        EngineReplacer(
            g.plan.settings, r.pool, g.supervisors, make(n, g.plan), warm_one(g.plan), app.state.gate.close,
            app.state.gate.open, on_replaced,
            spare_ports=None if len(groups) == 1 else (spare + n, len(groups)),
        )
        for n, (g, r) in enumerate(zip(groups, runtimes, strict=True))
        if g.supervisors
    ]

    async def replace_when_due() -> None:
        await announced.wait()
        monitor = app.state.health.monitor
        interval = settings.health.sample_interval_s
        await run_replacers(replacers, lambda: monitor.state.report if monitor.state else None, interval)

    # Without its announcement the stack never serves: a crash there stops it. The watchdog and
    # the replacer only keep it healthy: after a crash they start again.
    announcer = start_task("announce", announce, on_crash=stop_stack)
    watchdog = (
        start_task("hung-engine-watchdog", restart_hung_engines, restart_after_s=5.0) if supervisors else None
    )
    replacing = (
        start_task("engine-replacer", replace_when_due, restart_after_s=settings.health.sample_interval_s)
        if supervisors and settings.health.replace_engines else None
    )
    servers.append(server)
    try:
        if not early_stop.is_set():
            await server.serve()
    finally:  # then run_stack stops the engines
        await stop_tasks(announcer, watchdog, replacing)
    if any(isinstance(f, PortInUse) for f in failure):
        raise failure[0]
    if interrupted:  # a start cut short: as a shell reports a process a signal ended
        return 128 + interrupted[0]
    return 1 if failure or any(s.failed for s in supervisors) else 0
