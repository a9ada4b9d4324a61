"""A stack starts honestly: it refuses ports another process holds (exit 2, one sentence
naming the port and the flag), never adopts an engine it did not start, answers 503 with
Retry-After while it warms up, prints its URL once it can answer, and stops fast when
interrupted while starting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from embedserve.config import BUNDLED_MODEL
from embedserve.runtime.ports import PortInUse, check_free, check_owner
from tests.conftest import free_port, start_stack, wait_until
from tests.fake_engine import FakeEngine
from tests.test_gateway_unit import MODEL, make_client, wait_ready

# Loose bounds: they tell a hang from an answer on a shared 2-core machine; the figures
# themselves are printed by the tests and quoted in the docs.
NO_HANG_S = 5.0


@pytest.fixture()
def stranger() -> Iterator[int]:
    """Another process's HTTP server answering 200 on /health, like an engine would."""
    port = free_port()
    code = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(port)])
    wait_until(lambda: _answers(f"http://127.0.0.1:{port}", "/health"), timeout=10, interval=0.05)
    yield port
    proc.kill()
    proc.wait()


def up(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDSERVE_ENGINE__KIND": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "embedserve", "up", *flags],
        capture_output=True, text=True, env=env, timeout=60,
    )


def test_a_taken_engine_port_exits_2_naming_it(stranger: int) -> None:
    t0 = time.monotonic()
    done = up("--engine-port", str(stranger), "--port", str(free_port()))
    took = time.monotonic() - t0
    print(f"refused in {took:.2f} s")
    assert done.returncode == 2
    assert f"engine port {stranger}" in done.stderr and "--engine-port" in done.stderr
    assert "embedserve is up" not in done.stdout + done.stderr
    assert took < 30  # no engine was started, let alone waited for


def test_a_taken_gateway_port_exits_2_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = up("--port", str(port), "--engine-port", str(free_port()))
    assert done.returncode == 2
    assert f"gateway port {port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_engine_that_is_not_ours_is_never_adopted(stranger: int) -> None:
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # "our engine"
    try:
        with pytest.raises(PortInUse, match=f"engine port {stranger} answers, but not from the engine"):
            check_owner(stranger, ours.pid, "cpu-0")
    finally:
        ours.kill()
        ours.wait()
    with pytest.raises(PortInUse):
        check_free("127.0.0.1", stranger, "engine", "--engine-port", "EMBEDSERVE_ENGINE__PORT")


def test_our_own_listener_is_ours() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_owner(s.getsockname()[1], os.getpid(), "probe")


def test_warming_up_answers_503_with_retry_after() -> None:
    engine = FakeEngine()
    with make_client(engine) as c:
        wait_ready(c)
        c.app.state.gate.close("warming up")  # type: ignore[attr-defined]
        r = c.post("/v1/embeddings", json={"model": MODEL, "input": "hello"})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "warming_up" and "warming up" in r.json()["error"]["message"]
        assert c.get("/health/ready").status_code == 503
        assert engine.calls == []
        c.app.state.gate.open()  # type: ignore[attr-defined]
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": "hello"}).status_code == 200
        assert c.get("/health/ready").status_code == 200


def test_start_up_tells_the_truth(tmp_path: Path) -> None:
    """While the engine loads, requests get 503 + Retry-After at once; the URL is printed
    once, after the warm-up; nothing says the server runs before then; Ctrl-C is fast."""
    stack = start_stack(BUNDLED_MODEL, tmp_path, wait=False)
    try:
        wait_until(lambda: _answers(stack.url), timeout=60, interval=0.05)
        body = {"model": stack.model_name, "input": "x"}
        if "embedserve is up" not in stack.log_text():
            t0 = time.monotonic()
            r = httpx.post(stack.url + "/v1/embeddings", json=body, timeout=10)
            took = time.monotonic() - t0
            print(f"503 while starting, in {took * 1000:.0f} ms")
            assert r.status_code == 503 and "retry-after" in r.headers
            assert took < NO_HANG_S
        wait_until(lambda: "embedserve is up" in stack.log_text(), timeout=120)
        assert httpx.post(stack.url + "/v1/embeddings", json=body).status_code == 200
        log = stack.log_text()
        assert log.count("embedserve is up") == 1
        assert log.index(stack.url) > log.index("embedserve is up")  # no URL before it can answer
        assert "Uvicorn running on" not in log and "Loading weights" not in log
    finally:
        assert stack.stop() == 0


def test_ctrl_c_while_starting_exits_fast(tmp_path: Path) -> None:
    stack = start_stack(BUNDLED_MODEL, tmp_path, wait=False)
    wait_until(lambda: _answers(stack.url), timeout=60, interval=0.05)
    t0 = time.monotonic()
    stack.proc.send_signal(signal.SIGINT)
    stack.proc.wait(30)
    took = time.monotonic() - t0
    print(f"stopped {took:.2f} s after Ctrl-C")
    assert took < NO_HANG_S


def _answers(url: str, path: str = "/health/live") -> bool:
    try:
        httpx.get(url + path, timeout=1)
    except httpx.HTTPError:
        return False
    return True


def test_an_engine_loading_its_model_stops_at_once_on_sigterm() -> None:
    """``up`` stops a starting engine with SIGTERM; an engine that only noted the signal
    until its model had loaded made Ctrl-C wait for the load (or for up's 2 s grace)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDSERVE_")}
    env.update({"HF_HUB_OFFLINE": "1", "EMBEDSERVE_LOG_FORMAT": "json",
                "EMBEDSERVE_ENGINE__PORT": str(free_port())})
    proc = subprocess.Popen([sys.executable, "-m", "embedserve.engines.cpu"], stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # bounded: the engine logs "loading" first, then exits or is ready
        lines.append(line)
        if "cpu engine loading" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=NO_HANG_S)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, rest[-2000:])
    assert "cpu engine ready" not in "".join(lines) + rest  # it never finished loading
