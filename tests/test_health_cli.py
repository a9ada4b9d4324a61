"""``embedserve health`` renders the forecast and says by its exit status what to do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from embedserve.config import Settings
from embedserve.contracts.memory import MemoryReport
from embedserve.health import EngineView, cli, create_health
from embedserve.health.reading import SourceConfig


def _document(tmp_path: Path) -> MemoryReport:
    components = create_health(
        Settings(),
        CollectorRegistry(),
        lambda: EngineView(ready=True, alive=True, started=True),
        lambda: {"gateway": os.getpid()},
        source_config=SourceConfig(stats_dir=str(tmp_path)),
    )
    return components.monitor.tick().report


def test_cli_prints_the_forecast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _document(tmp_path)
    monkeypatch.setattr(cli, "fetch", lambda url, key, timeout: doc)
    assert cli.main(["--url", "http://gw:8000"]) == 0
    out = capsys.readouterr().out
    assert "http://gw:8000" in out and "host" in out and "restart advised: no" in out

    doc = doc.model_copy(update={"recommends_restart": True, "estimated_hours_until_oom": 2.5})
    monkeypatch.setattr(cli, "fetch", lambda url, key, timeout: doc)
    assert cli.main([]) == 2
    assert "restart advised: YES" in capsys.readouterr().out


def test_cli_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--url", "http://127.0.0.1:9", "--timeout", "0.5"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_a_process_with_children_is_shown_alone_and_with_them() -> None:
    """Under ``up`` the gateway's tree holds the engines: its own figure must not be the tree's."""
    from embedserve.contracts.memory import ProcessMemory

    gib = 2**30
    gateway = ProcessMemory(name="gateway", pid=10, rss_bytes=gib * 61 // 100, own_rss_bytes=gib // 10,
                            pids=[10, 11, 12])
    line = cli.process_line("gateway", gateway)
    assert line == "process gateway (pid 10): RSS 0.10 GiB itself, 0.61 GiB with its 2 child processes"
    alone = ProcessMemory(name="engine", pid=11, rss_bytes=gib // 2, own_rss_bytes=gib // 2, pids=[11])
    assert cli.process_line("engine", alone) == "process engine (pid 11): RSS 0.50 GiB"


def test_the_process_reader_reports_the_process_alone() -> None:
    import subprocess
    import sys

    from embedserve.health.sources.processes import read_processes

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found, _ = read_processes({"me": os.getpid()})
        me = found["me"]
        assert child.pid in me.pids
        assert me.own_rss_bytes is not None and 0 < me.own_rss_bytes < me.rss_bytes
    finally:
        child.kill()
        child.wait()
