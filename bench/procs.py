"""Long-lived processes of a run, each in a process group of its own (setsid) so that it outlives
one command of a sliced run, recorded by pid in the work dir and stopped by that group."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def embedserve_cmd() -> list[str]:
    """How to call ``embedserve``: on PATH, else as a module (also where pip installed it into a
    target folder on PYTHONPATH, on a host with no package index)."""
    if found := shutil.which("embedserve"):
        return [found]
    if importlib.util.find_spec("embedserve") is not None:
        return [sys.executable, "-m", "embedserve"]
    raise RuntimeError("no `embedserve` command: pip install the project, or stage it (bench/README.md)")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


def alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap it when it is our own child
    try:
        os.killpg(pid, 0)
    except OSError:
        return False
    return True


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """Status and body (status 0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError):
        return 0, ""


def http_post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_bytes()[-chars:].decode(errors="replace")
    except OSError:
        return ""


class WorkDir:
    """The run's state: ``state.json`` (finished steps and live processes) and logs, so that
    ``--budget-s`` slices resume where the last one stopped."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / "state.json"
        self.state: dict[str, Any] = (json.loads(self.path.read_text()) if self.path.exists()
                                      else {"steps": {}, "procs": {}, "log": []})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, default=str))
        tmp.replace(self.path)

    def note(self, msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        self.state["log"].append(line)
        self.save()

    def start(self, tag: str, argv: list[str], env: dict[str, str], cwd: str | None = None) -> dict[str, Any]:
        """Start a process under ``tag`` (which must not be running already)."""
        old = self.state["procs"].get(tag)
        if old and alive(old["pid"]):
            raise RuntimeError(f"{tag} is still running (pid {old['pid']})")
        log = self.root / "logs" / f"{tag}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:  # a session of its own: its pid is its group's id
            pid = subprocess.Popen(argv, env=child_env(env), stdout=fh, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd).pid
        info = {"pid": pid, "argv": argv, "started_at": time.time(), "log": str(log)}
        self.state["procs"][tag] = info
        self.note(f"started {tag}: pid {pid}: {' '.join(argv[-6:])}")
        return info

    def running(self, tag: str) -> bool:
        info = self.state["procs"].get(tag)
        return bool(info) and alive(info["pid"])

    def stop(self, tag: str, wait_s: float = 90) -> bool | None:
        """SIGTERM the process group (``up`` drains and stops its engines), SIGKILL if it
        lingers; True when it ended on SIGTERM, None when ``tag`` was not running."""
        info = self.state["procs"].pop(tag, None)
        if not info:
            return None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(info["pid"], signal.SIGTERM)
        until = time.time() + wait_s
        while alive(info["pid"]) and time.time() < until:
            time.sleep(0.5)
        if not (clean := not alive(info["pid"])):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(info["pid"], signal.SIGKILL)
        self.note(f"stopped {tag} ({'clean' if clean else 'killed'})")
        return clean

    def stop_all(self) -> list[str]:
        tags = list(self.state["procs"])
        for tag in tags:
            self.stop(tag, 60)
        return tags
