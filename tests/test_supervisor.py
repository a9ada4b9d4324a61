"""The supervisor restarts an engine that dies, with doubling backoff up to a cap, and
fails loudly (no restart loop) when the engine dies before it ever served."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from embedserve.contracts.launch import LaunchSpec
from embedserve.runtime.supervisor import EngineStartError, ProcessSupervisor
from tests.conftest import free_port

# The first run answers one GET /health (so the supervisor sees it ready), then exits with
# status 3: a crash after a good start. Every restart exits with 3 at once.
ENGINE = """
import http.server, os, sys, threading
if os.path.exists(sys.argv[2]):
    sys.exit(3)
open(sys.argv[2], "a").close()
answered = threading.Event()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
        answered.set()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
answered.wait()
os._exit(3)
"""


class RecordedSleep:
    """Stands in for asyncio.sleep in the restart loop: records each requested delay and
    returns at once; ``done`` is set after ``want`` delays."""

    def __init__(self, want: int) -> None:
        self.delays: list[float] = []
        self.want = want
        self.done = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if len(self.delays) >= self.want:
            self.done.set()
        await asyncio.sleep(0)


def _restart_delays(
    tmp_path: Path, want: int, stable_after_s: float
) -> tuple[list[float], ProcessSupervisor]:
    async def run() -> tuple[list[float], ProcessSupervisor]:
        port = free_port()
        sleep = RecordedSleep(want)
        sup = ProcessSupervisor(
            "fake",
            LaunchSpec([sys.executable, "-c", ENGINE, str(port), str(tmp_path / "started-once")]),
            f"http://127.0.0.1:{port}/health",
            startup_timeout_s=30,
            backoff_s=0.2,
            backoff_max_s=0.8,
            stable_after_s=stable_after_s,
            sleep=sleep,
        )
        await sup.start()
        await sup.wait_ready()
        await asyncio.wait_for(sleep.done.wait(), 60)
        await sup.stop(2)
        assert not sup.alive and sup.last_exit is not None
        return sleep.delays, sup

    return asyncio.run(run())


def test_restarts_with_doubling_backoff_up_to_the_cap(tmp_path: Path) -> None:
    delays, sup = _restart_delays(tmp_path, want=5, stable_after_s=3600)
    assert delays[:5] == [0.2, 0.4, 0.8, 0.8, 0.8]
    assert sup.restarts >= 4


def test_an_engine_that_ran_stably_restarts_after_the_base_delay(tmp_path: Path) -> None:
    # Every run counts as stable (longer than 0 s), so the backoff never grows.
    delays, _ = _restart_delays(tmp_path, want=4, stable_after_s=0.0)
    assert delays[:4] == [0.2, 0.2, 0.2, 0.2]


def test_crash_before_ready_fails_loudly() -> None:
    async def run() -> ProcessSupervisor:
        port = free_port()
        spec = LaunchSpec(
            [sys.executable, "-c", "import sys; print('bad weights', file=sys.stderr); sys.exit(7)"]
        )
        sup = ProcessSupervisor(
            "broken",
            spec,
            f"http://127.0.0.1:{port}/health",
            startup_timeout_s=10,
            backoff_s=0.1,
            backoff_max_s=1,
        )
        await sup.start()
        with pytest.raises(EngineStartError, match="bad weights"):
            await sup.wait_ready()
        await sup.stop(1)
        return sup

    sup = asyncio.run(run())
    assert sup.restarts == 0 and sup.last_exit == 7


def test_a_restart_that_cannot_spawn_is_logged_and_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault injection: the first restart's spawn fails (as with no file descriptors left). The
    watch does not end silently, leaving the engine dead: the crash is logged and it restarts."""

    async def run() -> list[float]:
        port = free_port()
        sleep = RecordedSleep(3)
        sup = ProcessSupervisor(
            "fake",
            LaunchSpec([sys.executable, "-c", ENGINE, str(port), str(tmp_path / "started-once")]),
            f"http://127.0.0.1:{port}/health",
            startup_timeout_s=30, backoff_s=0.05, backoff_max_s=0.05, sleep=sleep,
        )
        await sup.start()
        await sup.wait_ready()
        spawn = sup._spawn

        async def fails_once() -> None:
            sup._spawn = spawn  # type: ignore[method-assign]
            raise OSError(24, "injected: too many open files")

        sup._spawn = fails_once  # type: ignore[method-assign]
        await asyncio.wait_for(sleep.done.wait(), 30)
        await sup.stop(2)
        return sleep.delays

    with caplog.at_level(logging.ERROR):
        delays = asyncio.run(run())
    assert len(delays) >= 3
    (crash,) = [r for r in caplog.records if r.getMessage() == "background task crashed"]
    assert getattr(crash, "engine", None) == "fake"
    assert crash.exc_info and "injected" in str(crash.exc_info[1])
