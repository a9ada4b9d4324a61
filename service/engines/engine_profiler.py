"""What embedserve's own engine (``cpu.py`` with the torch backend: the engine kind ``torch``, or
``cpu_backend=torch``) does for SGLang's ``POST /start_profile`` and ``POST /stop_profile``, so that
one tool profiles all the engines: torch.profiler over the engine's forwards, one gzipped Chrome
trace per engine and profile (the benchmarks' kernel step, bench/kernel_profile.py).

Off unless ``engine.profile_dir`` is set, and a trace is written under that folder only: the
routes write files on the engine's host. ``cpu.py`` starts and stops the profiler on the thread
that runs the forwards (the engine's one executor thread), so their CPU side is in the trace
beside the kernels.
"""

from __future__ import annotations

import gzip
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict


class ProfileStart(BaseModel):
    """SGLang's ``/start_profile`` body, the fields this engine reads (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    output_dir: str | None = None
    activities: list[str] = ["CPU", "GPU"]
    with_stack: bool = False
    record_shapes: bool = False


class EngineProfiler:
    """One profile at a time, its traces under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.running: tuple[Any, Path] | None = None  # the profiler and where its trace goes

    def start(self, req: ProfileStart) -> str | None:
        """None once the profiler runs, else why it does not."""
        if self.running is not None:
            return "a profile is already running: stop it first"
        folder = (self.root / req.output_dir).resolve() if req.output_dir else self.root
        if not folder.is_relative_to(self.root):
            return f"output_dir must be inside engine.profile_dir ({self.root})"
        import torch
        from torch.profiler import ProfilerActivity, profile

        kinds = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}
        gpu = torch.cuda.is_available()
        wanted = [kinds[a] for a in req.activities if a in kinds and (a != "GPU" or gpu)]
        running = profile(activities=wanted or [ProfilerActivity.CPU], with_stack=req.with_stack,
                          record_shapes=req.record_shapes)
        running.start()
        self.running = running, folder
        return None

    def stop(self) -> Path | str:
        """The trace written, or why none was."""
        if self.running is None:
            return "no profile is running"
        (running, folder), self.running = self.running, None
        running.stop()
        folder.mkdir(parents=True, exist_ok=True)
        raw = folder / f"{time.time():.6f}-{os.getpid()}.trace.json"
        running.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        return Path(f"{raw}.gz")

