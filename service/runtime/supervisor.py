"""Start an engine process, wait until it serves, restart it with backoff when it dies,
and stop it gracefully. What it knows (pid, alive, restarts, last words on stderr) feeds
the gateway's liveness and readiness."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable

import httpx

from embedserve.background import start_task, stop_tasks
from embedserve.contracts.launch import LaunchSpec
from embedserve.logs import Progress

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Runs in the child before exec: if the supervisor is killed outright (SIGKILL, OOM
    killer), the kernel sends the engine SIGTERM instead of leaving it orphaned."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineStartError(RuntimeError):
    pass


class ProcessSupervisor:
    def __init__(
        self,
        name: str,
        spec: LaunchSpec,
        ready_url: str,
        *,
        startup_timeout_s: float,
        backoff_s: float,
        backoff_max_s: float,
        stable_after_s: float = 60.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.spec = spec
        self.ready_url = ready_url
        self.startup_timeout_s = startup_timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.stable_after_s = stable_after_s
        self._sleep = sleep  # the restart backoff's wait (tests record the delays)
        self._clock = clock  # the start's deadline and progress lines
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.last_exit: int | None = None
        self.stderr_tail: deque[str] = deque(maxlen=50)
        self._started_at = 0.0
        self.ready_once = False
        self.failed: str | None = None
        self._stopping = False
        self._monitor: asyncio.Task[None] | None = None
        self._pumps: list[asyncio.Task[None]] = []

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> None:
        await self._spawn()
        # a crash of the watch (a restart that could not spawn) is logged; it watches again,
        # and restarts the engine, after the backoff
        self._monitor = start_task(f"supervise-{self.name}", self._watch, context={"engine": self.name},
                                   restart_after_s=self.backoff_s)

    async def _spawn(self) -> None:
        env = {**os.environ, **self.spec.env}
        self.proc = await asyncio.create_subprocess_exec(
            *self.spec.argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: we signal all its children
            preexec_fn=_die_with_parent,
        )
        self._started_at = time.monotonic()
        log.info("engine started", extra={"engine": self.name, "pid": self.proc.pid})
        assert self.proc.stdout and self.proc.stderr
        self._pumps = [asyncio.create_task(self._pump(s)) for s in (self.proc.stdout, self.proc.stderr)]

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        """Pass the engine's output through (operators read it) and keep its last lines."""
        while line := await stream.readline():
            text = line.decode("utf-8", "replace").rstrip()
            self.stderr_tail.append(text)
            print(text, file=sys.stderr, flush=True)

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until the engine answers 200, with a line every 10 s meanwhile (SGLang's first start
        compiles kernels for minutes); raises with its last output if it dies first."""
        deadline = self._clock() + (timeout_s or self.startup_timeout_s)
        progress = Progress(log, "engine still starting", clock=self._clock, engine=self.name)
        async with httpx.AsyncClient(timeout=5.0) as client:
            while self._clock() < deadline:
                progress.tick()
                if self._stopping:
                    raise EngineStartError(f"{self.name}: stopping")
                if self.failed:
                    raise EngineStartError(self.failed)
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.ready_url)).status_code == 200:
                        self.ready_once = True
                        return
                await asyncio.sleep(0.5)
        raise EngineStartError(f"{self.name}: not ready after {timeout_s or self.startup_timeout_s:.0f} s")

    def _death_note(self) -> str:
        tail = "\n".join(list(self.stderr_tail)[-15:])
        return f"{self.name} exited with {self.last_exit}; last output:\n{tail}"

    async def _watch(self) -> None:
        delay = self.backoff_s
        while True:
            assert self.proc is not None
            code = await self.proc.wait()
            await asyncio.gather(*self._pumps, return_exceptions=True)
            self.last_exit = code
            if self._stopping:
                return
            if not self.ready_once:  # a crash at start-up repeats: fail loudly, no loop
                self.failed = self._death_note()
                log.error("engine failed to start", extra={"engine": self.name, "exit_code": code})
                return
            ran = time.monotonic() - self._started_at
            if ran > self.stable_after_s:
                delay = self.backoff_s
            log.error(
                "engine died",
                extra={
                    "engine": self.name,
                    "exit_code": code,
                    "ran_s": round(ran, 1),
                    "restart_in_s": delay,
                    "last_output": list(self.stderr_tail)[-5:],
                },
            )
            await self._sleep(delay)
            if self._stopping:
                return
            delay = min(delay * 2, self.backoff_max_s)
            self.restarts += 1
            await self._spawn()

    def kill(self, why: str) -> None:
        """SIGKILL a hung engine's process group; the watch loop restarts it with backoff."""
        if self.proc and self.proc.returncode is None:
            log.error("killing hung engine", extra={"engine": self.name, "pid": self.proc.pid, "why": why})
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the whole group (SGLang has children), SIGKILL after ``grace_s``."""
        self._stopping = True
        if self.proc and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        await stop_tasks(self._monitor)
