"""A configuration mistake is one sentence naming the setting (its variable and its flag)
and what it accepts, with exit status 2 and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedserve.config import load_settings
from embedserve.runtime.cli import FLAG_OF
from embedserve.settings_errors import ConfigError


@pytest.mark.parametrize(
    ("env", "overrides", "expected"),
    [
        ({"EMBEDSERVE_GATEWAY__PORT": "abc"}, {},
         "EMBEDSERVE_GATEWAY__PORT (--port) must be a whole number from 1 to 65535, got 'abc'"),
        ({}, {"engine": {"port": "70000"}},
         "EMBEDSERVE_ENGINE__PORT (--engine-port) must be a whole number from 1 to 65535, got '70000'"),
        ({"EMBEDSERVE_ENGINE__KIND": "gpu"}, {},
         "EMBEDSERVE_ENGINE__KIND (--engine-kind) must be one of 'auto', 'cpu', 'sglang', 'external', "
         "got 'gpu'"),
        ({"EMBEDSERVE_LOG_FORMAT": "xml"}, {},
         "EMBEDSERVE_LOG_FORMAT must be one of 'auto', 'json', 'text', got 'xml'"),
        ({"EMBEDSERVE_ENGINE__QUANTIZATION": "int4"}, {}, "EMBEDSERVE_ENGINE__QUANTIZATION must be one of"),
        ({"EMBEDSERVE_GATEWAY__EVENT_LOOP": "trio"}, {},
         "EMBEDSERVE_GATEWAY__EVENT_LOOP must be one of 'asyncio', 'uvloop', got 'trio'"),
        ({"EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "-1"}, {},
         "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S must be a number above 0, got '-1'"),
        ({}, {"model": {"max_seq_len": "4"}},
         "EMBEDSERVE_MODEL__MAX_SEQ_LEN (--max-seq-len) must be a whole number at least 8, got '4'"),
        ({"EMBEDSERVE_GATEWAY__API_KEYS": "k1,k2"}, {},
         "EMBEDSERVE_GATEWAY__API_KEYS must be JSON, e.g. '[\"a\", \"b\"]', got 'k1,k2'"),
        ({}, {"engine": {"engines_per_gpu": "two"}},  # a union: one sentence, not one per branch
         "EMBEDSERVE_ENGINE__ENGINES_PER_GPU (--engines-per-gpu) must be a whole number at least 1 or "
         "'auto', got 'two'"),
        ({"EMBEDSERVE_HEALTH__CRITICAL_HOURS": "8"}, {},
         "EMBEDSERVE_HEALTH__CRITICAL_HOURS (8) must be below EMBEDSERVE_HEALTH__WARNING_HOURS (6)"),
    ],
)
def test_each_mistake_is_one_sentence_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], overrides: dict[str, object], expected: str
) -> None:
    monkeypatch.chdir(Path(__file__).parent)  # no .env of the checkout
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_settings(overrides, FLAG_OF)
    message = str(err.value)
    assert message.startswith(expected), message
    assert "\n" not in message and "pydantic" not in message


def _embedserve(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDSERVE_")}
    full.update({"HF_HUB_OFFLINE": "1", "EMBEDSERVE_ENGINE__KIND": "cpu", **env})
    return subprocess.run([sys.executable, "-m", "embedserve", *args], capture_output=True, text=True,
                          env=full, timeout=60)


def _one_sentence(done: subprocess.CompletedProcess[str], *named: str) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for what in named:
        assert what in lines[0], lines[0]
    return lines[0]


def test_a_missing_model_folder(tmp_path: Path) -> None:
    line = _one_sentence(_embedserve("up", "--model", str(tmp_path / "nowhere")),
                         "EMBEDSERVE_MODEL__PATH", "--model", "does not exist")
    assert str(tmp_path / "nowhere") in line


def test_an_empty_model_folder(tmp_path: Path) -> None:
    _one_sentence(_embedserve("up", "--model", str(tmp_path)), "EMBEDSERVE_MODEL__PATH", "holds no model")


def test_the_engine_dry_run_says_the_same(tmp_path: Path) -> None:
    done = _embedserve("engine", "--dry-run", EMBEDSERVE_MODEL__PATH=str(tmp_path / "nowhere"))
    _one_sentence(done, "EMBEDSERVE_MODEL__PATH", "does not exist")


def test_a_bad_port_and_an_unknown_engine_kind() -> None:
    _one_sentence(_embedserve("up", EMBEDSERVE_GATEWAY__PORT="abc"),
                  "EMBEDSERVE_GATEWAY__PORT (--port)", "1 to 65535", "'abc'")
    _one_sentence(_embedserve("up", "--engine-kind", "tpu"),
                  "EMBEDSERVE_ENGINE__KIND (--engine-kind)", "'tpu'")
    _one_sentence(_embedserve("config", EMBEDSERVE_LOG_FORMAT="xml"), "EMBEDSERVE_LOG_FORMAT", "'json'")


def test_version_and_the_resolved_model_folder() -> None:
    from importlib.metadata import version

    done = _embedserve("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"embedserve {version('embedserve')}"
    import json

    from tests.conftest import MINILM_DIR

    shown = json.loads(_embedserve("config").stdout)
    assert shown["model"]["path"] == "bundled:all-MiniLM-L6-v2"
    assert Path(shown["model"]["folder"]) == MINILM_DIR.resolve()
