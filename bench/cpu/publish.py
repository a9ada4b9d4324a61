"""What the CPU benchmarks share: the machine line, and printing plus writing a result."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def machine() -> dict[str, str]:
    """``machine`` and ``when`` for a result document."""
    return {"machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def publish(res: dict[str, Any], md: str, out: Path | None) -> None:
    """Print the Markdown; with ``out``, write results.json and results.md there."""
    print(md)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "results.md").write_text(md)
