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
