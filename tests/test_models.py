"""Several models behind one gateway (``served.models``): the catalog and its mistakes, routing by
``model`` over fake engines, each model's own admission, metrics and /health/memory per model
and engine, the GPU sizing of all the models together. ``embedserve up`` serving the bundled embedding model
beside two rerankers on the CPU engine: tests/test_rerankers.py, whose stack it is."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from embedserve.catalog import served_models
from embedserve.config import BUNDLED_MODEL, Settings
from embedserve.engines.sglang import LaunchConfigError
from embedserve.gateway.app import create_app
from embedserve.model_info import ModelInfo
from embedserve.runtime.model_plan import PlannedModel, check_shared_gpus, plan_models
from embedserve.runtime.synth_model import SHAPES
from embedserve.settings_errors import ConfigError
from tests.conftest import metric, wait_until
from tests.fake_engine import FakeEngine, HttpxEngineClient, fake_score
from tests.test_gateway_unit import assert_error

EMBED = "all-MiniLM-L6-v2"


def two_models(reranker: Path, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "kind": "embed",
            "path": BUNDLED_MODEL,
            "engine": {"kind": "external", "urls": ["http://embed-engine"]},
        },
        {
            "kind": "rerank",
            "path": str(reranker),
            "name": "tiny-reranker",
            "aliases": ["rr"],
            "engine": {"kind": "external", "urls": ["http://rerank-engine"]},
            **extra,
        },
    ]


def client(models: list[dict[str, Any]], engine: FakeEngine, **gateway: Any) -> TestClient:
    settings = Settings(
        _env_file=None,
        served={"models": models},
        health={"sample_interval_s": 60},
        gateway={"request_timeout_s": 10.0, "accept_token_ids": True, **gateway},
    )
    transport = httpx.ASGITransport(app=engine.app())  # both pools reach the one fake engine
    return TestClient(create_app(settings, engine_client=HttpxEngineClient(transport)))


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def pair(engine: FakeEngine, tiny_cross_encoder_dir: Path) -> Iterator[TestClient]:
    with client(two_models(tiny_cross_encoder_dir), engine) as c:
        state = c.app.state  # type: ignore[attr-defined]
        # every engine ready, and the first memory sample taken: /health/memory names the
        # engines from then on (before it, it says it is still collecting)
        wait_until(lambda: all(r.pool.any_ready for r in state.runtimes) and state.health.state, timeout=10)
        yield c


def test_requests_go_to_the_model_they_name(pair: TestClient, engine: FakeEngine) -> None:
    models = pair.get("/v1/models").json()["data"]
    assert [(m["id"], m["kind"]) for m in models] == [
        (EMBED, "embed"),
        ("tiny-reranker", "rerank"),
        ("rr", "rerank"),
    ]
    assert pair.post("/v1/embeddings", json={"model": EMBED, "input": "a text"}).status_code == 200
    refused = assert_error(pair.post("/v1/embeddings", json={"model": "rr", "input": "a"}), 400, "model")
    assert refused["code"] == "model_not_embedding"
    # no model: the reranker; the embedding model by name, by cosine
    r = pair.post("/v1/rerank", json={"query": "q", "documents": ["first", "second"]})
    assert r.status_code == 200 and r.headers["x-embedserve-score"] == "logit"
    assert r.json()["model"] == "tiny-reranker"
    sent = engine.calls[-1]
    want = sorted(range(2), key=lambda i: -fake_score(sent[i]))
    assert [x["index"] for x in r.json()["results"]] == want  # the engine's logits, best first
    cosine = pair.post("/v1/score", json={"model": EMBED, "text_1": "q", "text_2": ["a"]})
    assert cosine.headers["x-embedserve-score"] == "cosine"
    err = assert_error(pair.post("/v1/rerank", json={"model": "bge", "query": "q", "documents": ["a"]}), 404)
    assert f"'{EMBED}', 'tiny-reranker'" in str(err["message"])


def test_metrics_and_health_name_each_model_and_engine(pair: TestClient) -> None:
    pair.post("/v1/embeddings", json={"model": EMBED, "input": "a text"})
    pair.post("/v1/rerank", json={"model": "rr", "query": "q", "documents": ["a", "b"]})
    text = pair.get("/metrics").text
    assert metric(text, "embedserve_engine_model", engine="http://embed-engine", model=EMBED) == 1
    assert metric(text, "embedserve_engine_model", engine="http://rerank-engine", model="tiny-reranker") == 1
    assert metric(text, "embedserve_model_requests_total", model=EMBED, route="embeddings") == 1
    assert metric(text, "embedserve_model_requests_total", model="tiny-reranker", route="rerank") == 1
    assert metric(text, "embedserve_model_tokens_total", model="tiny-reranker") > 0
    assert {("embedserve_model_load", m) for m in (EMBED, "tiny-reranker")} <= {
        (name, dict(labels).get("model")) for name, labels in _samples(text)
    }
    engines = pair.get("/health/memory").json()["engines"]
    assert {(e["url"], e["model"]) for e in engines} == {
        ("http://embed-engine", EMBED),
        ("http://rerank-engine", "tiny-reranker"),
    }
    assert pair.get("/health/ready").status_code == 200


def _samples(text: str) -> list[tuple[str, frozenset[tuple[str, str]]]]:
    from tests.conftest import metric_samples

    return list(metric_samples(text))


def test_each_model_waits_in_its_own_admission(tiny_cross_encoder_dir: Path) -> None:
    """Embeddings holding their model's bound do not make reranking a 429."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    models = two_models(tiny_cross_encoder_dir)
    models[0]["max_tokens_in_flight"] = 10
    with client(models, engine) as c:
        wait_until(lambda: all(r.pool.any_ready for r in c.app.state.runtimes), timeout=10)  # type: ignore[attr-defined]
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(c.post, "/v1/embeddings", json={"model": EMBED, "input": [[7] * 10]})
            wait_until(lambda: len(engine.calls) == 1, timeout=30, interval=0.01)
            assert_error(c.post("/v1/embeddings", json={"model": EMBED, "input": [[8] * 5]}), 429)
            rerank = pool.submit(c.post, "/v1/rerank", json={"query": "q", "documents": ["a"]})
            wait_until(lambda: len(engine.calls) == 2, timeout=30, interval=0.01)  # admitted, in the engine
            gate.set()
            assert held.result(timeout=60).status_code == 200 and rerank.result(timeout=60).status_code == 200


def test_the_catalog_gives_each_model_its_ports_and_states_mistakes_in_one_sentence(
    tiny_cross_encoder_dir: Path,
) -> None:
    models: list[dict[str, Any]] = [
        {"kind": "embed", "path": BUNDLED_MODEL, "engine": {"replicas": 2}},
        {"kind": "rerank", "path": str(tiny_cross_encoder_dir)},
        {"kind": "rerank", "path": str(tiny_cross_encoder_dir), "name": "other", "engine": {"port": 31000}},
    ]
    entries = served_models(Settings(_env_file=None, engine={"port": 30000}, served={"models": models}))
    assert [e.settings.engine_urls() for e in entries] == [
        ["http://127.0.0.1:30000", "http://127.0.0.1:30001"],
        ["http://127.0.0.1:30002"],
        ["http://127.0.0.1:31000"],
    ]
    assert [e.name for e in entries] == [EMBED, "tiny-cross-encoder", "other"]
    cases = [
        ([models[1], models[1]], "two models answer to 'tiny-cross-encoder'"),
        (
            [{**models[1], "engine": {"port": "x"}}],
            "EMBEDSERVE_SERVED__MODELS: served.models[0].engine.port must be a whole number from 1 to "
            "65535, got 'x'",
        ),
        ([{**models[1], "kind": "embed"}], "has kind 'embed', but"),
    ]
    for listed, says in cases:
        settings = Settings(_env_file=None, served={"models": listed})
        with pytest.raises(ConfigError, match=None) as raised:
            plan_models(settings)
        assert says in str(raised.value) and "\n" not in str(raised.value)


def _qwen3(tmp_path: Path, name: str, shape: str, extra: dict[str, Any]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "vocab_size": 151669, **SHAPES[shape], **extra})
    )
    return d


def test_the_models_sglang_engines_must_fit_one_gpu_together(tmp_path: Path) -> None:
    embedding = _qwen3(tmp_path, "Qwen3-Embedding-4B", "4b", {"architectures": ["Qwen3ForCausalLM"]})
    (embedding / "modules.json").write_text("[]")
    reranker = _qwen3(tmp_path, "Qwen3-Reranker-4B", "4b", {"architectures": ["Qwen3ForCausalLM"]})
    sglang = {"kind": "sglang"}
    models = [
        {"kind": "embed", "path": str(embedding), "engine": sglang},
        {"kind": "rerank", "path": str(reranker), "engine": sglang},
    ]
    settings = Settings(_env_file=None, served={"models": models})
    # SGLang itself is not needed to size its engines: the plan as `up` makes it on a GPU host
    planned = [
        PlannedModel(e.settings, ModelInfo.load(e.settings.model), "sglang") for e in served_models(settings)
    ]
    assert [p.info.scoring for p in planned] == ["cosine", "qwen3-reranker"]
    check_shared_gpus(planned, 141_000_000_000)  # one H200: both fit
    with pytest.raises(LaunchConfigError) as refused:
        check_shared_gpus(planned, 24_000_000_000)  # a 24 GB card: refused before anything starts
    said = str(refused.value)
    found = re.search(
        r"need ([\d.]+) GB on GPU 0 \(Qwen3-Embedding-4B ([\d.]+) GB, Qwen3-Reranker-4B ([\d.]+) GB\)", said
    )
    assert found, said
    total, first, second = map(float, found.groups())
    assert abs(total - first - second) < 0.15 and 14 < first == second < 16  # the 4B: 14.48 GB measured
    assert "more than mem_fraction_static 0.85 of its 24.0 GB (20.4 GB)" in said and "\n" not in said
