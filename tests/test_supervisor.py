"""The supervisor restarts an engine that dies, with doubling backoff up to a cap, and
fails loudly (no restart loop) when the engine dies before it ever served."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from pathlib import Path

import pytest

from embedserve.engines.launch import LaunchSpec
from embedserve.runtime.supervisor import EngineStartError, ProcessSupervisor
from tests.conftest import free_port

# Serves GET /health, then exits with status 3: a crash after a good start. The first run
# lives 2 s (so the supervisor sees it ready), restarts live 0.3 s.
ENGINE = """
import http.server, sys, threading, os
first = not os.path.exists(sys.argv[2])
open(sys.argv[2], "a").close()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
threading.Timer(2.0 if first else 0.3, lambda: os._exit(3)).start()
"""


def _supervisor(port: int, marker: Path) -> ProcessSupervisor:
    spec = LaunchSpec([sys.executable, "-c", ENGINE, str(port), str(marker)])
    return ProcessSupervisor(
        "fake",
        spec,
        f"http://127.0.0.1:{port}/health",
        startup_timeout_s=10,
        backoff_s=0.2,
        backoff_max_s=0.8,
    )


def test_restarts_with_doubling_backoff(tmp_path: Path) -> None:
    async def run() -> tuple[list[float], list[int]]:
        sup = _supervisor(free_port(), tmp_path / "started-once")
        await sup.start()
        await sup.wait_ready()
        spawns, pids = [time.monotonic()], [sup.pid or 0]
        deadline = time.monotonic() + 15
        while len(pids) < 5 and time.monotonic() < deadline:
            if sup.pid != pids[-1]:
                spawns.append(time.monotonic())
                pids.append(sup.pid or 0)
            await asyncio.sleep(0.01)
        await sup.stop(2)
        assert not sup.alive and sup.last_exit is not None
        return spawns, pids

    spawns, pids = asyncio.run(run())
    assert len(set(pids)) == 5, pids
    # between restarts: start-up + 0.3 s of life + backoff 0.2, 0.4, 0.8, then capped at 0.8
    g12, g23, g34 = (b - a for a, b in itertools.pairwise(spawns[1:]))
    assert 0.15 < g23 - g12 < 0.7, (g12, g23, g34)  # doubled (0.4 -> 0.8)
    assert abs(g34 - g23) < 0.3, (g12, g23, g34)  # capped, not 1.6


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
