"""embedserve's own engine answers SGLang's /start_profile and /stop_profile with the torch backend
when engine.profile_dir is set: a gzipped Chrome trace of its forwards under that folder, nowhere
else; without the setting, or on ONNX Runtime, the routes do not exist."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from embedserve.config import Settings
from embedserve.engines.cpu import create_engine_app


def engine(**settings: object) -> TestClient:
    return TestClient(create_engine_app(Settings(_env_file=None, engine={"stats_dir": None, **settings})))


def test_a_profile_of_the_forwards_is_written_where_it_was_asked(tmp_path: Path) -> None:
    with engine(cpu_backend="torch", profile_dir=str(tmp_path)) as c:
        assert c.post("/stop_profile").status_code == 400  # none running
        body = {"output_dir": str(tmp_path / "30000"), "activities": ["GPU"]}
        started = c.post("/start_profile", json=body)
        assert started.status_code == 200
        assert c.post("/start_profile", json={}).status_code == 400  # one at a time
        assert c.post("/v1/embeddings", json={"input": [[101, 2023, 102], [101, 102]]}).status_code == 200
        stopped = c.post("/stop_profile")
    assert stopped.status_code == 200, stopped.text
    (trace,) = (tmp_path / "30000").glob("*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)  # the forward's ops (no GPU here)


@pytest.mark.parametrize("elsewhere", ["/tmp", "../outside"])
def test_a_trace_goes_under_the_profile_dir_only(tmp_path: Path, elsewhere: str) -> None:
    root = tmp_path / "traces"
    with engine(cpu_backend="torch", profile_dir=str(root)) as c:
        r = c.post("/start_profile", json={"output_dir": elsewhere})
        assert r.status_code == 400 and "inside engine.profile_dir" in r.json()["message"]
        assert c.post("/start_profile", json={"activities": "CPU"}).status_code == 400  # not SGLang's shape
    assert not list(tmp_path.rglob("*.json*"))


@pytest.mark.parametrize("settings", [{"cpu_backend": "torch"},
                                      {"cpu_backend": "onnx", "profile_dir": "/tmp/x"}])
def test_no_profile_routes_without_the_setting_or_on_onnx_runtime(settings: dict[str, object]) -> None:
    with engine(**settings) as c:
        assert c.post("/start_profile", json={}).status_code == 404
