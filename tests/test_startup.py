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

from embedserve.config import BUNDLED_MODEL, Settings
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


MISTAKES = [  # a newcomer's start-up commands, and the setting each sentence must name
    (("up", "--port", "{port}", "--engine-port", "{port}"), "EMBEDSERVE_GATEWAY__PORT (--port) and"),
    (("up", "--host", "999.1.1.1"), "EMBEDSERVE_GATEWAY__HOST (--host)"),
    (("up", "--host", "nosuchhost.invalid"), "EMBEDSERVE_GATEWAY__HOST (--host)"),
    (("up", "--host", "10.255.255.1"), "not one of its addresses"),
    (("up", "--engine-kind", "sglang"), "EMBEDSERVE_ENGINE__KIND (--engine-kind) is 'sglang'"),
    (("up", "--engine-kind", "external"), "EMBEDSERVE_ENGINE__URLS (--engine-url)"),
    (("gateway",), "EMBEDSERVE_ENGINE__URLS (--engine-url)"),
    (("up", "--drill-leak", "-5MB/s"), "--drill-leak must be a rate above zero: '-5MB/s'"),
]


@pytest.mark.parametrize(("argv", "names"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_start_up_mistakes_exit_2_with_one_sentence(
    argv: tuple[str, ...], names: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before anything starts: exit 2, one line naming the setting, no traceback, no URL."""
    from embedserve.runtime.cli import main

    for name in [k for k in os.environ if k.startswith("EMBEDSERVE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("EMBEDSERVE_GATEWAY__PORT", str(free_port()))
    monkeypatch.setenv("EMBEDSERVE_ENGINE__PORT", str(free_port()))
    port = str(free_port())
    code = main([a.format(port=port) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("embedserve: ") and names in lines[0], err
    assert "embedserve is up" not in out


def test_engine_ports_must_fit_below_65536() -> None:
    from embedserve.runtime.preflight import check_ports
    from embedserve.settings_errors import ConfigError

    settings = Settings(engine={"port": 65535, "replicas": 2}, _env_file=None)
    with pytest.raises(ConfigError, match="must leave room for 2 engines below 65536"):
        check_ports(settings, local_engines=True)


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
        ready = c.get("/health/ready")
        assert ready.status_code == 503
        # the engines answer: the probe says why the gateway waits, not "engine not ready: ... ready"
        assert ready.json()["reason"].startswith("not serving yet: warming up"), ready.json()
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


def test_ctrl_c_while_starting_exits_fast_with_130(tmp_path: Path) -> None:
    """An interrupted start exits 130 (128 + SIGINT) whenever it comes, while Python loads or
    once the gateway answers 503 "warming up"; only a stack that was up stops with 0."""
    for moment in ("loading", "answering"):
        (tmp_path / moment).mkdir()
        stack = start_stack(BUNDLED_MODEL, tmp_path / moment, wait=False)
        if moment == "loading":
            time.sleep(0.5)
        else:
            wait_until(lambda s=stack: _answers(s.url), timeout=60, interval=0.05)
        was_up = "embedserve is up" in stack.log_text()
        t0 = time.monotonic()
        stack.proc.send_signal(signal.SIGINT)
        stack.proc.wait(30)
        took = time.monotonic() - t0
        print(f"{moment}: stopped {took:.2f} s after Ctrl-C, exit {stack.proc.returncode}")
        assert took < NO_HANG_S
        # while Python still loads, a Ctrl-C may end the process by the signal itself: the shell
        # reports that as 130 too (128 + SIGINT), which is what a user sees
        expected = {0} if was_up else {130, -signal.SIGINT} if moment == "loading" else {130}
        assert stack.proc.returncode in expected, stack.log_text()[-2000:]
        assert "Traceback" not in stack.log_text()


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
