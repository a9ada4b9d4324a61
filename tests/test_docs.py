"""What README.md and docs/ state, checked against the code where a test can: the variables
they name exist, the probes the manifests declare hit routes the right container serves,
image tags follow the package version, results/README.md lists every measurement, and the
README's Clients snippets run against the CPU stack."""

from __future__ import annotations

import os
import re
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from embedserve.config import CHILD_SETTINGS_ENV, NOT_SETTINGS, Settings
from embedserve.engines.drill import LEAK_ENV
from embedserve.settings_errors import setting_variables
from tests.conftest import E2E_URL, RunningStack

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _other_variables() -> set[str]:
    """Variables that are not settings: compose.yaml's and the image scripts' own, and the
    ones processes hand each other."""
    found = {CHILD_SETTINGS_ENV, LEAK_ENV, E2E_URL, *NOT_SETTINGS}
    for path in [ROOT / "compose.yaml", *(ROOT / "deploy" / "docker").glob("*.sh")]:
        found |= set(re.findall(r"\$\{(EMBEDSERVE_[A-Z0-9_]+)", path.read_text()))
    return found


def test_every_variable_the_docs_name_exists() -> None:
    known = setting_variables(Settings) | _other_variables()
    assert "EMBEDSERVE_GATEWAY__HEADER_TIMEOUT_S" in known  # the walk reaches nested fields
    unknown: dict[str, str] = {}
    for doc in DOCS:
        for name in re.findall(r"EMBEDSERVE_[A-Z0-9_]*", doc.read_text()):
            # `EMBEDSERVE_*`, `EMBEDSERVE_CONTROLLER__<FIELD>`: a prefix of real ones
            ok = any(k.startswith(name) for k in known) if name.endswith("_") else name in known
            if not ok:
                unknown.setdefault(name, doc.name)
    assert unknown == {}


# -- the manifests' probes ------------------------------------------------------------------


def _routes(app: Any) -> set[str]:
    """GET paths the app serves, as its OpenAPI schema lists them (included routers too)."""
    return {path for path, ops in app.openapi()["paths"].items() if "get" in ops}


def _gateway_routes() -> set[str]:
    from embedserve.gateway.app import create_app

    settings = Settings(engine={"kind": "external", "urls": ["http://127.0.0.1:9"]}, _env_file=None)
    return _routes(create_app(settings))


def _engine_routes() -> set[str]:
    """The CPU engine speaks SGLang's protocol (its health, model info and embeddings routes);
    the GPU pod's engine is SGLang itself."""
    from embedserve.engines.cpu import create_engine_app

    return _routes(create_engine_app(Settings(_env_file=None)))


def _pod_containers() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text()))
    deployment = next(d for d in docs if d and d["kind"] == "Deployment")
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def _listens_on(container: dict[str, Any]) -> int:
    (port,) = [p["containerPort"] for p in container["ports"]]
    return int(port)


def test_every_probe_hits_a_route_its_container_serves() -> None:
    served = {"gateway": _gateway_routes(), "engine": _engine_routes()}
    containers = _pod_containers()
    ports = {name: _listens_on(c) for name, c in containers.items()}
    checked = 0
    for name, container in containers.items():
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            checked += 1
            if "httpGet" in probe:
                path, port = probe["httpGet"]["path"], probe["httpGet"]["port"]
                assert port == ports[name], f"{name} {kind}: port {port}, but {name} listens on {ports[name]}"
                assert path in served[name], f"{name} {kind}: {path} is not a route of the {name}"
            elif "tcpSocket" in probe:
                assert probe["tcpSocket"]["port"] == ports[name], f"{name} {kind}"
            else:  # exec: the image's health check, whose role reads the other container's route
                command = probe["exec"]["command"]
                assert command[1] == "/usr/local/lib/embedserve/healthcheck.py"
                dockerfile = (ROOT / "deploy" / "docker" / f"Dockerfile.{name}-gpu").read_text()
                assert command[1] in dockerfile, f"the {name} image lacks {command[1]}"
                roles = _healthcheck_roles()
                variable, default, path = roles[command[2]]
                owner = "gateway" if "GATEWAY" in variable else "engine"
                assert int(default) == ports[owner] and path in served[owner], (name, kind, command)
    assert checked >= 5


def _healthcheck_roles() -> dict[str, tuple[str, str, str]]:
    import runpy

    roles = runpy.run_path(str(ROOT / "deploy" / "docker" / "healthcheck.py"))["ROLES"]
    return dict(roles)


def test_probe_advice_in_the_docs_matches_the_manifest() -> None:
    """HEALTH.md and DEPLOY.md name the engine's startup and liveness as the manifest does."""
    engine = _pod_containers()["engine"]
    startup = engine["startupProbe"]["httpGet"]
    for doc in ("HEALTH.md", "DEPLOY.md"):
        text = (ROOT / "docs" / doc).read_text()
        assert f":{startup['port']}{startup['path']}" in text, doc
        assert "engine-verdict" in text, doc


# -- versions and measurements -----------------------------------------------------------------

IMAGE_TAG = re.compile(r"embedserve[/-](?:gateway|engine-cpu|engine-gpu):([A-Za-z0-9._-]+)")
TAG_DEFAULT = re.compile(r"EMBEDSERVE_TAG:-([A-Za-z0-9._-]+)\}")


def test_image_tags_are_the_package_version() -> None:
    files = [ROOT / "compose.yaml", *DOCS, *(ROOT / "deploy").rglob("*")]
    tags: dict[str, set[str]] = {}
    for path in files:
        if path.is_file() and path.suffix in ("", ".yaml", ".md", ".py", ".sh", ".engine-cpu",
                                             ".engine-gpu", ".gateway"):
            text = path.read_text(errors="replace")
            for tag in IMAGE_TAG.findall(text) + TAG_DEFAULT.findall(text):
                if tag not in ("VERSION", "TAG"):
                    tags.setdefault(tag, set()).add(str(path.relative_to(ROOT)))
    kustomization = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())
    for image in kustomization["images"]:
        tags.setdefault(image["newTag"], set()).add("deploy/k8s/kustomization.yaml")
    assert set(tags) == {VERSION}, tags
    for script in ("build-images.sh", "ci-containers.sh"):  # derived, not written down
        assert "pyproject.toml" in (ROOT / "deploy" / "docker" / script).read_text().split("TAG=", 1)[1]


def test_results_readme_lists_every_measurement() -> None:
    listed = set(re.findall(r"^\| `([\w.-]+)/` \|", (ROOT / "results" / "README.md").read_text(), re.M))
    folders = {p.name for p in (ROOT / "results").iterdir() if p.is_dir()}
    assert listed == folders
    for folder in folders:
        assert {"README.md", "results.md"} & {p.name for p in (ROOT / "results" / folder).iterdir()}, folder


# -- docs/SGLANG.md's dry run ----------------------------------------------------------------------


def test_the_sglang_dry_run_sample_is_what_the_launcher_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sample's first line is run as written (its /models folder made here, no GPU);
    the output must equal the sample but for the JSON's ``...`` and the command's wrapping."""
    from embedserve.engines import sglang

    doc = (ROOT / "docs" / "SGLANG.md").read_text().split("\n## What the launcher emits", 1)[1]
    block = doc.split("```\n", 2)[1].split("\n```", 1)[0]
    first, *printed = block.replace(" \\\n  ", " ").splitlines()
    words = shlex.split(first.removeprefix("$ "))
    assert words[-3:] == ["embedserve", "engine", "--dry-run"]
    models = tmp_path / "models"
    model = models / "Qwen3-Embedding-4B"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen3", "max_position_embeddings": 32768, '
                                      '"hidden_size": 2560}')
    (model / "sentence_bert_config.json").write_text('{"max_seq_length": 8192}')
    for k in [k for k in os.environ if k.startswith("EMBEDSERVE_")]:
        monkeypatch.delenv(k)
    for name, value in (w.split("=", 1) for w in words[:-3]):
        monkeypatch.setenv(name, value.replace("/models/", f"{models}/"))
    monkeypatch.chdir(tmp_path)  # no stray .env
    monkeypatch.setattr(sglang, "gpu_compute_capability", lambda: None)
    assert sglang.main(["--dry-run"]) == 0
    got = capsys.readouterr().out.replace(str(models), "/models").replace(sys.executable, "/usr/bin/python3")
    got_lines = got.splitlines()
    assert len(got_lines) == len(printed)
    for want, line in zip(printed, got_lines, strict=True):
        assert re.fullmatch(re.escape(want).replace(re.escape("..."), ".*"), line), (want, line)


# -- the README's Clients snippets -------------------------------------------------------------


def _python_block(title: str) -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


@pytest.mark.parametrize("title", ["Clients", "Rerank clients", "Cohere embed clients"])
def test_the_clients_pip_command_installs_what_the_snippets_import(title: str) -> None:
    """Each module a section's snippets import comes from a package its pip command names:
    the installed distribution that provides it, or, for one not installed here (LlamaIndex),
    the package its dotted name spells (llama_index.embeddings.openai:
    llama-index-embeddings-openai; llama_index.core.schema: llama-index-core)."""
    import importlib.metadata

    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    pip = next(line for line in section.splitlines() if line.startswith("pip install "))
    named = set(pip.split()[2:])
    provides = importlib.metadata.packages_distributions()
    modules = re.findall(r"^(?:from|import) ([\w.]+)", _python_block(title), re.M)
    assert len(modules) >= 4
    for module in modules:
        installed = {d.lower() for d in provides.get(module.split(".")[0], [])}
        spelled = module.replace("_", "-").replace(".", "-")
        assert installed & named or any(spelled == n or spelled.startswith(n + "-") for n in named), (
            module, installed or spelled, pip)


def _run_paragraphs(code: str, title: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """Each paragraph as written; one whose client library is not installed (LlamaIndex) is
    reported, not failed."""
    namespace: dict[str, Any] = {}
    ran, missing = [], []
    for chunk in (c for c in code.split("\n\n") if c.strip()):
        first = chunk.strip().splitlines()[0]
        try:
            exec(compile(chunk, f"README {title}: {first}", "exec"), namespace)
        except ModuleNotFoundError as exc:
            assert exc.name and exc.name.split(".")[0] in ("llama_index",), exc
            missing.append(exc.name)
            continue
        ran.append(first)
    print(f"ran: {ran}; not installed: {missing}")
    return namespace, ran, missing


@pytest.mark.slow
def test_the_rerank_client_snippets_rank_as_the_server_does(minilm_stack: RunningStack) -> None:
    import httpx

    code = _python_block("Rerank clients").replace("http://127.0.0.1:8000", minilm_stack.url)
    namespace, ran, _ = _run_paragraphs(code, "Rerank clients")
    body = {"model": namespace["model"], "query": namespace["query"], "documents": namespace["docs"],
            "top_n": 2}
    server = [r["index"] for r in httpx.post(minilm_stack.url + "/v1/rerank", json=body).json()["results"]]
    orders = {k: v for k, v in namespace.items() if k.endswith("_order")}
    assert {"cohere_order", "langchain_order", "haystack_order"} <= orders.keys() and len(ran) >= 4
    assert all(order == server for order in orders.values()), (server, orders)


@pytest.mark.slow
def test_the_cohere_embed_client_snippets_get_the_servers_vectors(minilm_stack: RunningStack) -> None:
    """Every client's vectors are the ones /v2/embed answers for the same texts (the stack serves
    the model under the alias LlamaIndex's class needs), and the packed bits are their signs."""
    import httpx

    code = _python_block("Cohere embed clients").replace("http://127.0.0.1:8000", minilm_stack.url)
    namespace, ran, missing = _run_paragraphs(code, "Cohere embed clients")
    assert missing == [] and len(ran) == 4, (ran, missing)
    body = {"model": namespace["model"], "texts": namespace["docs"], "input_type": "search_document"}
    server = httpx.post(minilm_stack.url + "/v2/embed", json=body).json()["embeddings"]["float"]
    for name in ("cohere_v2", "cohere_v1", "langchain", "llamaindex"):
        assert np.array_equal(np.asarray(namespace[name]), np.asarray(server)), name
    signs = np.packbits(np.asarray(server) > 0, axis=-1)
    assert np.array_equal(np.asarray(namespace["packed"]), signs)


@pytest.mark.slow
def test_the_output_type_and_cohere_examples_answer_as_shown(minilm_stack: RunningStack) -> None:
    """The README's embedding_type example runs as written (but for the URL), and its curl of
    /v2/embed, sent as written, answers the fields and first numbers its comment shows."""
    import json
    import textwrap

    import httpx
    from openai import OpenAI

    readme = (ROOT / "README.md").read_text()
    bullet = readme.split("\n- `embedding_type`:", 1)[1].split("\n- ", 1)[0]
    code = textwrap.dedent(bullet.split("```python\n", 1)[1].split("```", 1)[0])
    namespace: dict[str, Any] = {"client": OpenAI(base_url=minilm_stack.url + "/v1", api_key="unused")}
    exec(compile(code, "README embedding_type", "exec"), namespace)
    packed = namespace["r"].data[0].embedding
    assert len(packed) == 48 and all(0 <= x <= 255 and x == int(x) for x in packed)

    section = readme.split("\n## Cohere's embed API\n", 1)[1].split("\n## ", 1)[0]
    curl = section.split("```bash\n", 1)[1].split("```", 1)[0]
    body = json.loads(re.search(r"-d '(\{.*?\})'", curl, re.S).group(1))  # type: ignore[union-attr]
    answer = httpx.post(minilm_stack.url + "/v2/embed", json=body).json()
    shown = "".join(line.lstrip("# ") for line in curl.splitlines() if line.startswith("#"))
    for key in answer:
        assert f'"{key}"' in shown, key
    for kind in ("float", "int8"):
        numbers = re.search(rf'"{kind}": \[\[([-\d.e, ]+), \.\.\.\]\]', shown).group(1)  # type: ignore[union-attr]
        first = [float(x) for x in numbers.split(",")]
        assert np.allclose(answer["embeddings"][kind][0][: len(first)], first, atol=1e-9), kind
    assert f'"input_tokens": {answer["meta"]["billed_units"]["input_tokens"]}' in shown


@pytest.mark.slow
def test_the_clients_snippets_run_against_the_cpu_stack(minilm_stack: RunningStack) -> None:
    """Each paragraph of the block runs as written, but for the URL."""
    code = _python_block("Clients").replace("http://127.0.0.1:8000", minilm_stack.url)
    namespace, ran, _ = _run_paragraphs(code, "Clients")
    assert namespace["model"] == minilm_stack.model_name  # taken from /v1/models
    assert len(ran) >= 4, ran


def test_the_readmes_first_screen_is_the_two_commands() -> None:
    """Before the GPU quick start: the title, the two set-up commands and a few lines on what they
    do; the detail (export timings, int8, Ctrl-C figures) lives in docs/, where a reader looks."""
    readme = (ROOT / "README.md").read_text()
    first = readme[: readme.index("## GPU quick start")]
    blocks = re.findall(r"```bash\n(.*?)```", first, re.S)
    assert [b.count("\n") for b in blocks] == [1, 1], blocks  # exactly two one-line commands
    assert "embedserve up" in blocks[0] and "python -m tests" in blocks[1]
    prose = [line for line in first.splitlines() if line.strip() and not line.startswith(("```", "#"))]
    assert len(prose) <= 24, f"{len(prose)} lines of prose before the GPU quick start"
