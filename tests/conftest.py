"""Shared fixtures: the bundled MiniLM, a tiny Qwen3-Embedding-style model built here, and
the real stack (``embedserve up`` in a subprocess, real HTTP)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

import httpx
import pytest

from embedserve.config import BUNDLED_MODEL, resolve_model_path

MINILM_DIR = resolve_model_path(BUNDLED_MODEL)


def tool_missing(what: str) -> NoReturn:
    """A test's outside tool is absent: skip on a developer's machine, fail under CI
    (``.ci/run`` installs it, so a missing tool there is a broken install, not a skip)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing; .ci/run installs it", pytrace=False)
    pytest.skip(f"{what} is not installed")
TINY_QWEN_MAX_SEQ = 64


#: Tests that time what they check (a ramp's gauge, a leak's forecast, deadlines, timeouts,
#: latencies): ``python -m tests`` runs them alone, one after another, before the rest run on two
#: workers, where the other worker's load would move their clocks. Files or single tests.
SERIAL = (
    "tests/test_container_stop.py",
    "tests/test_drill.py::test_a_leaking_engine_is_replaced_before_the_limit_with_no_request_lost",
    "tests/test_fairness.py",
    "tests/test_faults.py",
    "tests/test_health_sampler.py::test_sampler_times_a_real_leak_within_twenty_percent",
    "tests/test_keep_alive.py",
    "tests/test_load_signal.py::test_the_gauge_rises_with_the_load_and_crosses_one_where_429s_begin",
    "tests/test_loadtest_e2e.py::test_closed_loop_rate_excludes_the_drain",
    "tests/test_loadtest_e2e.py::test_open_loop_ids_with_errors_and_429",
    "tests/test_loadtest_e2e.py::test_retry_after_pauses_sending",
    "tests/test_slow_clients.py",
    "tests/test_stack_failures.py::test_up_stops_when_its_engine_is_killed_mid_warm_up_and_leaves_no_engine",
    "tests/test_stack_failures.py::test_sigterm_during_a_replacement_leaves_no_engine",
    "tests/test_startup.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests of ``SERIAL`` ``serial``."""
    for item in items:
        nodeid = item.nodeid.split("[")[0]
        if any(nodeid == s or nodeid.startswith(s + "::") for s in SERIAL):
            item.add_marker(pytest.mark.serial)


def free_port(consecutive: int = 1) -> int:
    """A free port; with ``consecutive`` > 1, the first of that many free ports in a row
    (local engine replicas listen on port, port+1, ...)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = int(s.getsockname()[1])
        try:
            for port in range(first + 1, first + consecutive):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


@dataclass
class RunningStack:
    url: str
    engine_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stats_dir: Path
    model_name: str

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return int(self.proc.returncode)


def start_stack(
    model: Path | str,
    workdir: Path,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    wait: bool = True,
    args: tuple[str, ...] = (),
) -> RunningStack:
    """``embedserve up`` in a subprocess; ``wait``: until it says it is up."""
    engine_port = free_port(consecutive=4)
    gw_port = free_port()
    while engine_port <= gw_port < engine_port + 4:
        gw_port = free_port()
    stats = workdir / "stats"
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "EMBEDSERVE_MODEL__PATH": str(model),
        "EMBEDSERVE_ENGINE__KIND": "cpu",
        "EMBEDSERVE_GATEWAY__PORT": str(gw_port),
        "EMBEDSERVE_ENGINE__PORT": str(engine_port),
        "EMBEDSERVE_ENGINE__STATS_DIR": str(stats),
        "EMBEDSERVE_ENGINE__STATS_INTERVAL_S": "0.5",
        "EMBEDSERVE_HEALTH__SAMPLE_INTERVAL_S": "0.5",
        **(env or {}),
    }
    log_path = workdir / "stack.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "embedserve.runtime.cli", "up", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    name = full_env.get("EMBEDSERVE_MODEL__NAME") or (
        "all-MiniLM-L6-v2" if str(model) == BUNDLED_MODEL else Path(model).name
    )
    stack = RunningStack(
        f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{engine_port}", proc, log_path, stats, name
    )
    deadline = time.monotonic() + timeout
    while wait and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stack exited early:\n{stack.log_text()[-3000:]}")
        if "embedserve is up" in stack.log_text():
            return stack
        time.sleep(0.2)
    if not wait:
        return stack
    stack.stop()
    raise RuntimeError(f"stack not up after {timeout} s:\n{stack.log_text()[-3000:]}")


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from embedserve.runtime.synth_model import build_model

    return build_model(
        tmp_path_factory.mktemp("tiny-qwen") / "tiny-qwen3-embedding",
        "tiny",
        max_seq_length=TINY_QWEN_MAX_SEQ,
    )


#: The tiny rerankers' folders, and so the names ``models_stack`` serves them under.
CROSS_ENCODER, QWEN3_RERANKER = "tiny-cross-encoder", "tiny-qwen3-reranker"


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight BertForSequenceClassification with the bundled model's tokenizer."""
    from embedserve.runtime.synth_rerank import build_cross_encoder

    return build_cross_encoder(tmp_path_factory.mktemp("tiny-ce") / CROSS_ENCODER)


@pytest.fixture(scope="session")
def tiny_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen3 causal LM with Qwen3's tokenizer, as Qwen3-Reranker ships."""
    from embedserve.runtime.synth_model import build_qwen3_reranker

    return build_qwen3_reranker(tmp_path_factory.mktemp("tiny-rr") / QWEN3_RERANKER)


@pytest.fixture(scope="session")
def tiny_m3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight XLM-R with BGE-M3's sparse and ColBERT heads beside it (dense, sparse, colbert)."""
    from embedserve.runtime.synth_hybrid import build_bge_m3

    return build_bge_m3(tmp_path_factory.mktemp("tiny-m3") / "tiny-bge-m3")


@pytest.fixture(scope="session")
def tiny_splade_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight BERT masked LM with SPLADE pooling (sparse only)."""
    from embedserve.runtime.synth_hybrid import build_splade

    return build_splade(tmp_path_factory.mktemp("tiny-splade") / "tiny-splade")


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding Qwen3-Embedding's tokenizer (tokenizer.json and its config)."""
    from embedserve.runtime.synth_model import write_tokenizer_files

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="session")
def minilm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    # The alias: LlamaIndex's CohereEmbedding takes Cohere's model names only (README's snippet).
    env = {"EMBEDSERVE_MODEL__ALIASES": '["embed-english-v3.0"]'}
    stack = start_stack(BUNDLED_MODEL, tmp_path_factory.mktemp("minilm-stack"), env=env)
    yield stack
    stack.stop()


#: The gateway of a stack started elsewhere, e.g. the CPU profile's containers
#: (deploy/docker/ci-containers.sh). The end-to-end tests that take ``served`` run against it
#: too, marked ``external_stack``; with the variable unset those runs are skipped.
E2E_URL = "EMBEDSERVE_E2E_URL"


class Served(Protocol):
    """A gateway serving the bundled model, called over HTTP."""

    @property
    def url(self) -> str: ...

    @property
    def model_name(self) -> str: ...


@dataclass(frozen=True)
class ExternalStack:
    url: str
    model_name: str


@pytest.fixture(scope="session")
def external_stack() -> ExternalStack:
    url = os.environ.get(E2E_URL, "").rstrip("/")
    if not url:
        pytest.skip(f"{E2E_URL} is not set")
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return ExternalStack(url, models[0]["id"])


@pytest.fixture(
    scope="session",
    params=["local", pytest.param("external", marks=pytest.mark.external_stack)],
)
def served(request: pytest.FixtureRequest) -> Served:
    """The gateway an end-to-end test calls: the stack the tests start (``minilm_stack``),
    then the one at ``$EMBEDSERVE_E2E_URL``."""
    stack: Served = request.getfixturevalue("minilm_stack" if request.param == "local" else "external_stack")
    return stack


@pytest.fixture(scope="session")
def qwen_stack(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    # Accepts token ids (the MiniLM stack keeps the default, which refuses them): the load
    # generator and the id tests tokenise with the model's own tokenizer.
    env = {"EMBEDSERVE_GATEWAY__ACCEPT_TOKEN_IDS": "true"}
    stack = start_stack(tiny_qwen_dir, tmp_path_factory.mktemp("qwen-stack"), env=env)
    yield stack
    stack.stop()


def wait_until(predicate: object, timeout: float = 30, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def get_json(url: str) -> dict[str, object]:
    return httpx.get(url, timeout=10).json()


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """A Prometheus exposition, parsed by prometheus_client: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value; fails if the exposition has no such sample."""
    samples = metric_samples(text)
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels or ''} not in the exposition"
    return samples[key]


#: CI's real-text corpus: 200 sections of python3-doc's HOWTOs, passages cut at 64 words
#: (the full corpus takes every section, at 200), so the CPU stack embeds it in seconds
HOWTO_RULES = {"max_passages": 200, "max_passage_words": 64}


def python3_doc_howto() -> Path:
    """python3-doc's HOWTO pages (.ci/run installs the package)."""
    from embedserve.loadtest.quality.corpus import DEFAULT_HTML

    howto = DEFAULT_HTML / "howto"
    if not howto.is_dir():
        tool_missing(f"{howto} (Debian package python3-doc)")
    return howto


@pytest.fixture(scope="session")
def howto_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CI's small real-text corpus, built by the command as a user would."""
    from embedserve.loadtest.quality.corpus import main

    out = tmp_path_factory.mktemp("corpus") / "howto.json"
    flags = [x for name, value in HOWTO_RULES.items() for x in (f"--{name.replace('_', '-')}", str(value))]
    assert main(["--html", str(python3_doc_howto()), "--out", str(out), *flags]) == 0
    return out
