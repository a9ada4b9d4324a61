"""The running sampler watches a real process that leaks at a known rate."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from embedserve.config import HealthSettings, Settings
from embedserve.health import EngineView, create_health
from embedserve.health.history import History
from embedserve.health.reading import SourceConfig

RATE = 16 * 2**20  # bytes per second
HEADROOM = 1536 * 2**20

LEAKER = f"""
import sys, time
rate, chunk = {RATE}, 2**20
held, t0 = [], time.monotonic()
print("ready", flush=True)
while True:
    due = int(rate * (time.monotonic() - t0) / chunk)
    while len(held) < due:
        held.append(b"x" * chunk)  # touched pages: resident, not just reserved
    time.sleep(0.02)
"""


@pytest.mark.slow
def test_sampler_times_a_real_leak_within_twenty_percent(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", LEAKER], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        base_rss = psutil.Process(child.pid).memory_info().rss
        limit = base_rss + HEADROOM
        health = HealthSettings(
            sample_interval_s=0.25,
            warmup_s=1.0,
            min_span_s=8.0,
            min_samples=20,
            window_s=600.0,
            host_memory_limit_bytes=limit,
            persist_path=str(tmp_path / "history.json"),
        )
        components = create_health(
            Settings(health=health),
            CollectorRegistry(),
            lambda: EngineView(ready=True, alive=True, started=True),
            lambda: {"engine": child.pid},
            source_config=SourceConfig(stats_dir=str(tmp_path / "stats"), host_limit_bytes=limit),
        )

        async def watch() -> None:
            await components.start()
            try:
                deadline = time.monotonic() + 40
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                    st = components.state
                    host = st.forecasts["host"] if st else None
                    if host and host.status == "growing" and host.window_s >= 12.0:
                        return
            finally:
                await components.stop()

        asyncio.run(watch())
        state = components.state
        assert state is not None
        f = state.forecasts["host"]
        assert f.status == "growing", f.reason
        rss_now = f.used_bytes
        assert rss_now is not None
        truth_h = (limit - rss_now) / RATE / 3600
        assert f.slope_bytes_per_hour == pytest.approx(RATE * 3600, rel=0.20), f.reason
        assert f.estimated_hours_until_oom == pytest.approx(truth_h, rel=0.20), f.reason
        assert state.advice.binding_resource == "host"
        assert state.advice.recommends_restart is True  # minutes left, warning at 6 h
        # the history was persisted on stop and reloads
        assert len(History.load(tmp_path / "history.json", 1000)) >= f.samples
    finally:
        child.kill()
        child.wait()


def test_metrics_after_a_tick(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    components = create_health(
        Settings(),
        registry,
        lambda: EngineView(ready=True, alive=True, started=True),
        lambda: {"gateway": psutil.Process().pid},
        source_config=SourceConfig(stats_dir=str(tmp_path)),
    )
    components.monitor.tick()
    text = generate_latest(registry).decode()
    for name in (
        "embedserve_memory_used_bytes",
        "embedserve_memory_limit_bytes",
        "embedserve_hours_until_oom",
        "embedserve_memory_recommends_restart",
        "embedserve_host_memory_rss_bytes",
    ):
        assert name in text
