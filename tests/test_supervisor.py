"""The supervisor restarts an engine that dies, with doubling backoff up to a cap, and
fails loudly (no restart loop) when the engine dies before it ever served."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import pytest

from service.supervisor import EngineStartError, LaunchSpec, ProcessSupervisor
from tests.conftest import free_port

# Serves GET /health, then exits with status 3 after LIFE_S: a crash after a good start.
ENGINE = """
import http.server, sys, threading, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
threading.Timer(float(sys.argv[2]), lambda: os._exit(3)).start()
"""


def _supervisor(port: int, life_s: float) -> ProcessSupervisor:
    spec = LaunchSpec([sys.executable, "-c", ENGINE, str(port), str(life_s)])
    return ProcessSupervisor(
        "fake",
        spec,
        f"http://127.0.0.1:{port}/health",
        startup_timeout_s=10,
        backoff_s=0.2,
        backoff_max_s=0.8,
    )


def test_restarts_with_doubling_backoff() -> None:
    async def run() -> tuple[list[float], list[int]]:
        sup = _supervisor(free_port(), life_s=0.3)
        await sup.start()
        await sup.wait_ready()
        spawns, pids = [time.monotonic()], [sup.pid or 0]
        deadline = time.monotonic() + 8
        while sup.restarts < 4 and time.monotonic() < deadline:
            if sup.pid != pids[-1]:
                spawns.append(time.monotonic())
                pids.append(sup.pid or 0)
            await asyncio.sleep(0.01)
        await sup.stop(2)
        assert not sup.alive and sup.last_exit is not None
        return spawns, pids

    spawns, pids = asyncio.run(run())
    assert len(set(pids)) >= 4, pids
    # gap = life (0.3 s) + backoff 0.2, 0.4, 0.8, 0.8 (+ process start)
    gaps = [b - a for a, b in itertools.pairwise(spawns)]
    backoffs = [g - 0.3 for g in gaps]
    assert backoffs[0] == pytest.approx(0.2, abs=0.25)
    assert backoffs[1] > backoffs[0] + 0.1 and backoffs[2] > backoffs[1] + 0.2, gaps
    assert all(b < 0.8 + 0.5 for b in backoffs), gaps  # capped


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
