"""gateway.event_loop: the gateway runs on the loop asked for, and on asyncio's own (with a
warning) where uvloop is not installed."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from embedserve.runtime.event_loop import loop_factory, run_on


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_runs_on_asyncios_own_loop() -> None:
    assert loop_factory("asyncio") is None
    assert run_on("asyncio", _loop_module()).startswith("asyncio")


def test_uvloop_runs_on_uvloop_when_installed() -> None:
    pytest.importorskip("uvloop")
    assert run_on("uvloop", _loop_module()).startswith("uvloop")


def test_uvloop_missing_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    with caplog.at_level(logging.WARNING, logger="embedserve.runtime.event_loop"):
        assert loop_factory("uvloop") is None
    assert [r.message for r in caplog.records] == ["event_loop_fallback"]
    assert run_on("uvloop", _loop_module()).startswith("asyncio")
