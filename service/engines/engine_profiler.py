"""``POST /start_profile`` and ``POST /stop_profile`` on embedserve's own engine (``cpu.py`` with the
torch backend: the engine kind ``torch``, or ``cpu_backend=torch``), taking the body SGLang's engines
take, so that one tool profiles all of them: torch.profiler over the engine's forwards, one gzipped
Chrome trace per engine and profile (the benchmarks' kernel step, bench/kernel_profile.py).

Off unless ``engine.profile_dir`` is set, and a trace is written under that folder only: the
routes write files on the engine's host. The profiler starts and stops on the thread that runs the
forwards (the engine's one executor thread), so their CPU side is in the trace beside the kernels.
"""

from __future__ import annotations

import gzip
import os
import shutil
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import Response

from embedserve.contracts import wire


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
        self.running: Any = None
        self.folder = self.root

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
        self.running = profile(activities=wanted or [ProfilerActivity.CPU], with_stack=req.with_stack,
                               record_shapes=req.record_shapes)
        self.running.start()
        self.folder = folder
        return None

    def stop(self) -> Path | str:
        """The trace written, or why none was."""
        if self.running is None:
            return "no profile is running"
        running, self.running = self.running, None
        running.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        raw = self.folder / f"{time.time():.6f}-{os.getpid()}.trace.json"
        running.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        return Path(f"{raw}.gz")


def add_profile_routes(app: FastAPI, profiler: EngineProfiler, executor: Executor) -> None:
    """The two routes, each run on ``executor`` (the forwards' thread)."""
    import asyncio

    def answer(status: int, text: str) -> Response:
        if status == 200:
            return Response(text, media_type="text/plain")
        return Response(wire.error_body(status, text), status_code=status, media_type="application/json")

    @app.post("/start_profile")
    async def start_profile(request: Request) -> Response:
        try:
            req = ProfileStart.model_validate_json((await request.body()) or b"{}")
        except ValidationError as exc:
            return answer(400, f"a /start_profile body is SGLang's: {exc.errors()[0]['msg']}")
        why_not = await asyncio.get_running_loop().run_in_executor(executor, profiler.start, req)
        return answer(400, why_not) if why_not else answer(200, "profiling started")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        done = await asyncio.get_running_loop().run_in_executor(executor, profiler.stop)
        return answer(200, f"trace written: {done}") if isinstance(done, Path) else answer(400, done)
