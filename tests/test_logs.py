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
