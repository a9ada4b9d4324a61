"""The four endpoints, with a fake engine view: answers, status codes, and speed."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from embedserve import health
from embedserve.config import HealthSettings, Settings
from embedserve.health import EngineView, create_health, reading
from embedserve.health.reading import SourceConfig
from embedserve.health.sources.nvml import NvmlSource

GOOD = EngineView(ready=True, alive=True, started=True, last_success_age_s=0.5)


class _NoDriver:
    @staticmethod
    def nvmlInit() -> None:
        import pynvml

        raise pynvml.NVMLError_LibraryNotFound()


@pytest.fixture()
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave as on a machine without a driver, even on one that has it."""
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlInit", _NoDriver.nvmlInit)


def make(tmp_path: Any, view: dict[str, EngineView], **health_kw: Any) -> tuple[TestClient, Any]:
    settings = Settings(health=HealthSettings(**health_kw))
    registry = CollectorRegistry()
    components = create_health(
        settings,
        registry,
        lambda: view["v"],
        lambda: {"gateway": os.getpid()},
        source_config=SourceConfig(stats_dir=str(tmp_path / "stats")),
    )
    app = FastAPI()
    app.include_router(components.router)
    components.monitor.nvml = NvmlSource()
    return TestClient(app), (components, registry)


def test_memory_before_first_sample(tmp_path: Any) -> None:
    client, _ = make(tmp_path, {"v": GOOD})
    body = client.get("/health/memory").json()
    assert body["status"] == "unknown"
    assert body["recommends_restart"] is False


def test_memory_without_nvml_reports_gpu_null_with_reason(tmp_path: Any, no_nvml: None) -> None:
    client, (components, registry) = make(tmp_path, {"v": GOOD})
    components.monitor.tick()
    r = client.get("/health/memory")
    assert r.status_code == 200
    body = r.json()
    assert body["gpu"] is None
    assert "NVML" in body["gpu_reason"] and "LibraryNotFound" in body["gpu_reason"]
    assert "host" in body["resources"]
    for key in (
        "estimated_hours_until_oom",
        "hours_lower",
        "hours_upper",
        "binding_resource",
        "recommends_restart",
        "reason",
        "fragmentation",
        "num_alloc_retries",
        "num_ooms",
        "age_s",
    ):
        assert key in body
    host = body["resources"]["host"]
    for key in ("slope_bytes_per_hour", "window_s", "samples", "headroom_bytes", "limit_bytes"):
        assert key in host
    text = generate_latest(registry).decode()
    assert "embedserve_gpu_nvml_available 0.0" in text
    assert 'embedserve_host_memory_rss_bytes{process="gateway"}' in text


def test_probes_follow_engine_view(tmp_path: Any) -> None:
    view = {"v": GOOD}
    client, (components, _) = make(tmp_path, view)
    components.monitor.tick()
    assert client.get("/health/startup").status_code == 200
    assert client.get("/health/ready").status_code == 200
    assert client.get("/health/live").status_code == 200

    view["v"] = EngineView(ready=False, alive=True, started=False, detail="loading")
    assert client.get("/health/startup").status_code == 503
    r = client.get("/health/ready")
    assert r.status_code == 503 and "loading" in r.json()["reason"]
    assert client.get("/health/live").status_code == 200  # starting is not dead

    view["v"] = replace(GOOD, alive=False, ready=False, detail="exit code -9")
    r = client.get("/health/live")
    assert r.status_code == 503 and "dead" in r.json()["reason"]

    # hung: the oldest request waited past 4 x the 60 s deadline and nothing completed
    view["v"] = replace(GOOD, oldest_inflight_age_s=300.0, last_success_age_s=290.0)
    r = client.get("/health/live")
    assert r.status_code == 503 and "hung" in r.json()["reason"]
    # one slow request while others complete is not a hang
    view["v"] = replace(GOOD, oldest_inflight_age_s=300.0, last_success_age_s=0.1)
    assert client.get("/health/live").status_code == 200


def _force_hours(components: Any, hours: float) -> None:
    state = components.monitor.state
    report = state.report.model_copy(update={"estimated_hours_until_oom": hours, "recommends_restart": True})
    components.monitor.state = replace(state, report=report)


def test_forecast_drains_then_restarts(tmp_path: Any) -> None:
    client, (components, _) = make(tmp_path, {"v": GOOD})
    components.monitor.tick()
    _force_hours(components, 3.0)  # under warning (6 h), over critical (1 h)
    r = client.get("/health/ready")
    assert r.status_code == 503 and "6 h" in r.json()["reason"]
    assert client.get("/health/live").status_code == 200
    _force_hours(components, 0.5)
    assert client.get("/health/live").status_code == 503


def test_a_broken_engine_view_is_not_a_500(tmp_path: Any) -> None:
    def boom() -> EngineView:
        raise RuntimeError("gateway not wired yet")

    settings = Settings()
    components = health.create_health(
        settings, CollectorRegistry(), boom, dict, source_config=SourceConfig(str(tmp_path))
    )
    app = FastAPI()
    app.include_router(components.router)
    client = TestClient(app)
    assert client.get("/health/ready").status_code == 503
    assert client.get("/health/live").status_code == 200


def test_endpoints_do_no_io(tmp_path: Any, no_nvml: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Probes answer from the last sample: no source is read, no file opened, per request."""
    client, (components, _) = make(tmp_path, {"v": GOOD})
    components.monitor.tick()

    def no_io(*_: Any, **__: Any) -> None:
        raise AssertionError("a probe did I/O")

    monkeypatch.setattr(components.monitor, "tick", no_io)
    monkeypatch.setattr(reading, "take_reading", no_io)
    monkeypatch.setattr(reading, "read_cgroup", no_io)
    monkeypatch.setattr(reading, "read_processes", no_io)
    monkeypatch.setattr(reading, "read_allocator", no_io)
    monkeypatch.setattr(components.monitor.nvml, "read", no_io)
    for path in ["/health/memory", "/health/live", "/health/ready", "/health/startup"]:
        assert client.get(path).status_code in (200, 503)
