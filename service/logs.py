"""Structured logs: one JSON object per line (or, on a terminal, one readable line), with the
current request id when there is one. Request text is never logged here; callers pass only
sizes and ids."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Record attributes that are not fields of a line; uvicorn's ``color_message`` is its message
# again with ANSI colour escapes, which belong in no log collector.
_STD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime", "taskName", "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid:
            out["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(JsonFormatter):
    """``12:00:01 info  embedserve.x: message key=value ...`` for a person at a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        fields = json.loads(super().format(record))
        head = time.strftime("%H:%M:%S", time.localtime(fields.pop("ts")))
        level, name, msg = fields.pop("level"), fields.pop("logger"), fields.pop("msg")
        exc = fields.pop("exc", None)
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        line = f"{head} {level:<7} {name}: {msg}" + (f"  {extra}" if extra else "")
        return line + (f"\n{exc}" if exc else "")


class StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a line is logged, not as it was at set-up (as
    logging's own last-resort handler does): a stream put in its place for a while (pytest's
    capture, a redirect) may be closed by the next line, which logging then reports with a
    traceback (``ValueError: I/O operation on closed file``) instead of the line."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _: TextIO) -> None:
        """Ignored: the stream is always the current ``sys.stderr``."""


class Progress:
    """A line every ``every_s`` while a long step runs (the ONNX export, an engine's start and,
    on a GPU, its first kernel compile), with the seconds it has taken so far: a start that is
    slow is not taken for one that hangs. Call ``tick`` from the loop that waits."""

    def __init__(
        self,
        logger: logging.Logger,
        msg: str,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        **fields: object,
    ) -> None:
        self.logger = logger
        self.msg = msg
        self.every_s = every_s
        self.clock = clock
        self.fields = fields
        self.start = clock()
        self.next = self.start + every_s

    def tick(self) -> None:
        now = self.clock()
        if now >= self.next:
            self.logger.info(self.msg, extra={**self.fields, "elapsed_s": round(now - self.start)})
            self.next = now + self.every_s


def resolve_format(fmt: str) -> str:
    """``auto``: readable lines on a terminal, JSON lines for log collectors."""
    if fmt != "auto":
        return fmt
    return "text" if sys.stderr.isatty() else "json"


def setup_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = StderrHandler()
    handler.setFormatter(TextFormatter() if resolve_format(fmt) == "text" else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)  # we log access ourselves
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.Formatter.converter = time.gmtime
