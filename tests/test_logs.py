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
