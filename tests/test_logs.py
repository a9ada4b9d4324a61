"""Log lines: JSON for collectors, readable text on a terminal; neither carries terminal
colour codes (uvicorn adds its message again, coloured, as ``color_message``)."""

from __future__ import annotations

import io
import json
import logging

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

