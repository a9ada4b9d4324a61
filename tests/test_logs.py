"""Log lines: JSON for collectors, readable text on a terminal; neither carries terminal
colour codes (uvicorn adds its message again, coloured, as ``color_message``)."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from embedserve.logs import JsonFormatter, TextFormatter


@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter()], ids=["json", "text"])
def test_lines_carry_no_ansi_colour(formatter: logging.Formatter) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:  # as uvicorn logs its start-up and shutdown lines
        logger.warning("Started server process [%d]", 42,
                       extra={"color_message": "Started server process [\x1b[36m%d\x1b[0m]"})
    finally:
        logger.removeHandler(handler)
    line = out.getvalue().strip()
    assert "\x1b" not in line and "color_message" not in line
    assert "Started server process [42]" in line
    if isinstance(formatter, JsonFormatter) and not isinstance(formatter, TextFormatter):
        assert json.loads(line)["msg"] == "Started server process [42]"


def test_lines_go_to_the_current_stderr_after_the_old_one_is_closed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Logging set up while sys.stderr was a stream that is closed since (pytest's capture of
    an earlier test) printed "--- Logging error --- ... I/O operation on closed file" for
    every line, the access log's included, instead of writing the line."""
    import sys

    from embedserve.logs import setup_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        earlier = io.StringIO()
        with monkeypatch.context() as m:
            m.setattr(sys, "stderr", earlier)
            setup_logging("INFO", "json")
        earlier.close()
        logging.getLogger("embedserve.access").info("request", extra={"status": 200})
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "closed file" not in err
    assert json.loads(err.strip().splitlines()[-1])["msg"] == "request"


# -- the gateway's access lines -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["errors", "all"])
def test_access_lines_leave_out_warming_up_polls_and_probes_unless_all(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client polling a starting stack got an info line per 503 (60 lines in 13 s), and every
    probe and scrape one more; by default only the answers an operator acts on are logged."""
    import httpx
    from fastapi.testclient import TestClient

    from embedserve.config import Settings
    from embedserve.gateway.app import create_app
    from tests.fake_engine import FakeEngine, HttpxEngineClient
    from tests.test_gateway_unit import MODEL, wait_ready

    engine = FakeEngine()
    settings = Settings(engine={"kind": "external", "urls": ["http://fake-engine"]},
                        gateway={"accept_token_ids": True}, health={"sample_interval_s": 60},
                        log_access=mode, _env_file=None)
    app = create_app(settings, engine_client=HttpxEngineClient(httpx.ASGITransport(app=engine.app())),
                     starting=True)
    body = {"model": MODEL, "input": [[1, 2]]}
    with TestClient(app) as c, caplog.at_level(logging.INFO, logger="embedserve.access"):
        wait_ready(c)
        sent = [c.post("/v1/embeddings", json=body).status_code for _ in range(5)]  # polls: warming up
        sent += [c.get("/health/ready").status_code]
        app.state.gate.open()
        sent += [c.post("/v1/embeddings", json=body).status_code, c.get("/health/live").status_code,
                 c.get("/metrics").status_code, c.post("/v1/embeddings", json={"input": 3}).status_code]
        engine.fail_status = 500
        sent += [c.post("/v1/embeddings", json=body).status_code]
    assert sent == [503] * 6 + [200, 200, 200, 400, 503]
    lines = [(r.levelname, r.__dict__["status"], r.__dict__["path"])
             for r in caplog.records if r.name == "embedserve.access"]
    failed = [("INFO", 400, "/v1/embeddings"), ("WARNING", 503, "/v1/embeddings")]
    if mode == "errors":
        assert lines == failed
    else:
        assert [s for _, s, _ in lines] == sent and lines[-2:] == failed


# -- ONNX Runtime's own output ---------------------------------------------------------------------


def test_onnx_runtime_errors_reach_us_as_exceptions_not_as_its_own_stderr_lines(tmp_path: Path) -> None:
    """A failing run printed ONNX Runtime's own line (``\\x1b[1;31m2026-... [E:onnxruntime:, ...]``)
    among the JSON lines, besides raising the same message; now only the exception remains."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "reshape3",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [helper.make_tensor("shape", TensorProto.INT64, [1], [3])],
    )
    path = tmp_path / "reshape3.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    script = (
        "import sys, numpy as np\n"
        "from embedserve.engines.cpu_backends import session_options\n"
        "from embedserve.engines.ort_session import open_session\n"
        "s = open_session(sys.argv[1], session_options(1))\n"
        "print(s.run(None, {'x': np.ones(3, np.float32)})[0].tolist())\n"
        "try:\n"
        "    s.run(None, {'x': np.ones(5, np.float32)})\n"
        "except Exception as exc:\n"
        "    print('raised:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.startswith("[1.0, 1.0, 1.0]\nraised:") and "Reshape" in done.stdout
    assert "onnxruntime" not in done.stderr and "\x1b" not in done.stderr, done.stderr


# -- progress while a long start step runs ---------------------------------------------------------


class _Clock:
    """Seconds that pass only when the code under test waits."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _progress(caplog: pytest.LogCaptureFixture, msg: str) -> list[int]:
    return [r.__dict__["elapsed_s"] for r in caplog.records if r.getMessage() == msg]


def test_the_onnx_export_says_it_is_still_running_every_10_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first start printed nothing for the export's 10 s (minutes on a busy machine)."""
    from embedserve.config import Settings
    from embedserve.engines import onnx_export

    clock = _Clock()

    class Child:  # the export child: runs 35 s, then fails (so no export is read back)
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.done_at = clock.now + 35

        def wait(self, timeout: float) -> int:
            if clock.now >= self.done_at:
                return 1
            clock.now += timeout
            raise subprocess.TimeoutExpired("export", timeout)

        def kill(self) -> None:
            raise AssertionError("killed")

    monkeypatch.setattr(onnx_export.subprocess, "Popen", Child)
    settings = Settings(engine={"cpu_export_dir": str(tmp_path)}, _env_file=None)
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="ONNX export"):
        onnx_export.ensure_export(settings, clock=clock)
    assert _progress(caplog, "still exporting the model to ONNX") == [10, 20, 30]


def test_an_engine_start_says_it_is_still_starting_every_10_s(caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's first start compiles FlashInfer's kernels for minutes; the CPU engine may export."""
    import asyncio
    import socket

    from embedserve.contracts.launch import LaunchSpec
    from embedserve.runtime.supervisor import EngineStartError, ProcessSupervisor

    with socket.socket() as s:  # a port nothing listens on: every readiness check fails at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clock = _Clock()

    def ticking() -> float:
        clock.now += 2.5
        return clock.now

    sup = ProcessSupervisor("sglang-0", LaunchSpec(["true"]), f"http://127.0.0.1:{port}/health",
                            startup_timeout_s=30, backoff_s=1, backoff_max_s=1, clock=ticking)
    with caplog.at_level(logging.INFO), pytest.raises(EngineStartError, match="not ready after 30 s"):
        asyncio.run(sup.wait_ready())
    lines = [r for r in caplog.records if r.getMessage() == "engine still starting"]
    assert [r.__dict__["elapsed_s"] for r in lines] == [10, 20] and lines[0].__dict__["engine"] == "sglang-0"
