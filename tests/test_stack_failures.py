"""`up` stops what it started however it ends. In process, over a stand-in engine (a real
process that answers /health but drops its warm-up call): a warm-up that fails stops the stack
with exit 1 and its engine; so does a crash of the task that announces the stack. A replacement
in progress while the watchdog runs is no error. The real CPU engine, killed mid-warm-up or sent
SIGTERM during a replacement, leaves no engine process behind (slow)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from embedserve.config import BUNDLED_MODEL, Settings
from embedserve.contracts.launch import LaunchSpec
from embedserve.runtime import replace, stack
from embedserve.runtime.replace import Due, EngineReplacer
from embedserve.runtime.stack import run_stack
from embedserve.runtime.watchdog import watch_hung
from embedserve.upstream.pool import EnginePool
from tests.conftest import free_port, start_stack, wait_until
from tests.test_engine_pool import GatedClient

#: answers GET /health; drops every POST without a word (the engine dying mid-call)
STAND_IN = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        self.close_connection = True
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

#: how long a stack that failed may take to stop (its gateway and a stand-in engine): a bound
#: that tells a stop from a stack left serving 503 forever
STOPS_WITHIN_S = 30.0


def stand_in(settings: Settings, kind: str, index: int, port: int, **_: Any) -> LaunchSpec:
    return LaunchSpec([sys.executable, "-c", STAND_IN, str(port)])


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stack_settings(tmp_path: Path) -> Settings:
    return Settings(
        engine={"kind": "cpu", "port": free_port(), "stats_dir": str(tmp_path), "restart_backoff_s": 60},
        gateway={"port": free_port(), "graceful_shutdown_s": 5},
        health={"sample_interval_s": 60, "replace_engines": False},
        _env_file=None,
    )


def run_until_stopped(settings: Settings) -> tuple[int | None, list[int], list[int]]:
    """``run_stack``'s exit status (None: still running after ``STOPS_WITHIN_S``, then
    cancelled), the engines' pids and those still alive once it returned (killed here then)."""
    pids: list[int] = []
    left: list[int] = []
    spawn = stack.ProcessSupervisor._spawn

    async def noting(sup: Any) -> None:
        await spawn(sup)
        pids.append(sup.pid)

    async def go() -> int | None:
        try:
            return await asyncio.wait_for(run_stack(settings), STOPS_WITHIN_S)
        except TimeoutError:
            return None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stack.ProcessSupervisor, "_spawn", noting)
        try:
            code = asyncio.run(go())
        finally:
            left.extend(p for p in pids if alive(p))
            for p in left:
                os.kill(p, signal.SIGKILL)
    return code, pids, left


@pytest.mark.parametrize("fault", ["the engine drops the warm-up call", "the announcement crashes"])
def test_a_failed_start_stops_the_stack_and_its_engine(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(stack, "engine_launch", stand_in)
    if fault == "the announcement crashes":
        async def bug(*_: object) -> list[tuple[int, float]]:
            raise ZeroDivisionError("injected")

        monkeypatch.setattr(stack, "warm_up", bug)
    code, pids, left = run_until_stopped(stack_settings(tmp_path))
    err = capsys.readouterr().err
    assert code == 1, f"the stack did not stop by itself ({code}):\n{err[-2000:]}"
    assert pids and left == []
    assert "embedserve is up" not in err
    if fault == "the announcement crashes":
        assert "embedserve: stopping: ZeroDivisionError: injected" in err
    else:
        assert "the engine did not start" in err and "warm-up of" in err and "RemoteProtocolError" in err


class StandInSupervisor:
    """What the replacer and the watchdog see of an engine's supervisor; ``wait_ready`` holds
    until the test lets it go."""

    def __init__(self, url: str, ready: asyncio.Event | None = None) -> None:
        self.ready_url = url + "/health"
        self.name = url
        self.pid = os.getpid()
        self.ready = ready
        self.starting = asyncio.Event()
        self.killed: list[str] = []
        self.stopped = False

    async def start(self) -> None:
        pass

    async def wait_ready(self) -> None:
        self.starting.set()
        if self.ready is not None:
            await self.ready.wait()

    async def stop(self, grace_s: float) -> None:
        self.stopped = True

    def kill(self, why: str) -> None:
        self.killed.append(why)


def test_a_drain_first_replacement_in_progress_while_the_watchdog_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Drain first, the old engine leaves the pool while the watchdog still holds its supervisor:
    the watchdog skips it, and still kills an engine that hangs."""
    monkeypatch.setattr(EngineReplacer, "_room", classmethod(lambda cls, old, resource: False))
    monkeypatch.setattr(replace, "check_owner", lambda *_: None)
    old_url, hung_url, new_url = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
    settings = Settings(engine={"port": free_port()}, _env_file=None)

    async def go() -> tuple[StandInSupervisor, StandInSupervisor, StandInSupervisor, list[Any]]:
        pool = EnginePool([old_url, hung_url], "m", request_timeout_s=1, client=GatedClient())
        for e in pool.engines:
            e.ready = True
        pool.engines[1].inflight_since[1] = time.monotonic() - 3600  # a call an hour old
        ready = asyncio.Event()
        old, hung = StandInSupervisor(old_url), StandInSupervisor(hung_url)
        new = StandInSupervisor(new_url, ready)
        gates: list[Any] = []

        async def warmed(url: str) -> tuple[int, float]:
            return 512, 0.1

        replacer = EngineReplacer(
            settings, pool, [old, hung], lambda index, port: new, warmed,  # type: ignore[list-item, arg-type, return-value]
            gates.append, lambda: gates.append("open"), lambda reason: None, spare_ports=(free_port(), 1),
        )
        watchdog = asyncio.create_task(watch_hung([(replacer.supervisors, pool)], hang_after_s=0.04))
        replacing = asyncio.create_task(replacer.replace(Due(0, "test")))
        await new.starting.wait()
        assert pool.by_url(old_url) is None and replacer.supervisors[0] is old  # the window
        while not hung.killed:  # noqa: ASYNC110  (rounds of the watchdog, the old engine among them)
            await asyncio.sleep(0.01)
        assert not watchdog.done()
        ready.set()
        await replacing
        watchdog.cancel()
        return old, hung, new, gates

    old, hung, new, gates = asyncio.run(go())
    assert old.stopped and old.killed == [] and hung.killed and not new.stopped
    assert gates == ["replacing an engine", "open"]


# -- the real stack, CPU engine --------------------------------------------------------------


def engine_pids(proc: subprocess.Popen[bytes]) -> set[int]:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for p in children:
        try:
            if "embedserve.engines.cpu" in " ".join(p.cmdline()):
                found.add(p.pid)
        except psutil.Error:
            continue
    return found


def watch_engines(proc: subprocess.Popen[bytes], until: Any, timeout: float) -> set[int]:
    """Every engine pid seen under ``proc`` until ``until()``."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until():
        seen |= engine_pids(proc)
        time.sleep(0.02)
    assert until(), "condition not met in time"
    return seen | engine_pids(proc)


@pytest.mark.slow
def test_up_stops_when_its_engine_is_killed_mid_warm_up_and_leaves_no_engine(tmp_path: Path) -> None:
    """A warm-up of 128 calls' worth of 512 tokens on one thread takes seconds; the engine is
    killed once it computes after answering /health (the warm-up under way): `up` says so and
    exits 1."""
    env = {
        "EMBEDSERVE_GATEWAY__MAX_TOKENS_PER_ENGINE_CALL": str(128 * 512),
        "EMBEDSERVE_ENGINE__CPU_THREADS": "1",
        "EMBEDSERVE_ENGINE__RESTART_BACKOFF_S": "0.5",
    }
    s = start_stack(BUNDLED_MODEL, tmp_path, env=env, wait=False)
    try:
        seen = watch_engines(s.proc, lambda: _answers(s.engine_url + "/health"), 120)
        (engine,) = seen
        wait_until(lambda: computing(engine), timeout=30, interval=0)  # loaded and idle until the warm-up
        assert "embedserve is up" not in s.log_text()
        os.kill(engine, signal.SIGKILL)
        seen |= watch_engines(s.proc, lambda: s.proc.poll() is not None, STOPS_WITHIN_S + 30)
        left = [p for p in seen if alive(p)]
    finally:
        s.stop()
    log = s.log_text()
    assert s.proc.returncode == 1, log[-3000:]
    assert left == []
    assert "warm-up of" in log and "embedserve is up" not in log


@pytest.mark.slow
def test_sigterm_during_a_replacement_leaves_no_engine(tmp_path: Path) -> None:
    """A leak drill makes a replacement due soon after the start; SIGTERM lands once the new
    engine serves and the old one drains; every engine `up` started is gone when it exits."""
    env = {
        "EMBEDSERVE_HEALTH__SAMPLE_INTERVAL_S": "0.25",
        "EMBEDSERVE_HEALTH__WARMUP_S": "1",
        "EMBEDSERVE_HEALTH__MIN_SPAN_S": "2",
        "EMBEDSERVE_HEALTH__MIN_SAMPLES": "4",
        "EMBEDSERVE_HEALTH__HOST_MEMORY_LIMIT_BYTES": str(4 * 10**9),
        "EMBEDSERVE_HEALTH__REPLACE_BELOW_HOURS": "1000",  # any forecast: replace
        "EMBEDSERVE_HEALTH__REPLACE_MIN_AGE_S": "1",
        "EMBEDSERVE_GATEWAY__GRACEFUL_SHUTDOWN_S": "5",
    }
    s = start_stack(BUNDLED_MODEL, tmp_path, env=env, args=("--drill-leak", "30MB/s"))
    try:
        seen = watch_engines(s.proc, lambda: "old engine draining" in s.log_text(), 120)
        s.proc.send_signal(signal.SIGTERM)
        seen |= watch_engines(s.proc, lambda: s.proc.poll() is not None, 60)
        left = [p for p in seen if alive(p)]
    finally:
        s.stop()
    log = s.log_text()
    assert s.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert len(seen) >= 2, seen  # the old engine and its replacement
    assert left == []


def computing(pid: int, window_s: float = 0.5) -> bool:
    """Whether the process used a tenth of a core or more over ``window_s`` (an idle engine
    uses next to nothing; one computing on a machine shared with other work, more)."""
    proc = psutil.Process(pid)
    before = sum(proc.cpu_times()[:2])
    time.sleep(window_s)
    return sum(proc.cpu_times()[:2]) - before > window_s / 10


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
