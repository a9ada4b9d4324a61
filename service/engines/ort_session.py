"""An ONNX Runtime session on the CPU that writes nothing on stderr itself.

ONNX Runtime's Python package logs through its own C++ logger only (it takes no Python
logger), in colour and a format of its own, among our JSON lines; each error it logs it also
raises, with the same message, and our log records that exception in its format. So its logger
is left only fatal errors (severity 4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def open_session(graph: Path | str, options: Any = None) -> Any:
    """``graph`` on the CPU execution provider, with ``options`` (ONNX Runtime's defaults when None)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)
    options = options or ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
