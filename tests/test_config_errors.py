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
         "EMBEDSERVE_ENGINE__KIND (--engine-kind) must be one of 'auto', 'cpu', 'sglang', 'torch', "
         "'external', got 'gpu'"),
        ({"EMBEDSERVE_LOG_FORMAT": "xml"}, {},
         "EMBEDSERVE_LOG_FORMAT must be one of 'auto', 'json', 'text', got 'xml'"),
        ({"EMBEDSERVE_ENGINE__QUANTIZATION": "int4"}, {}, "EMBEDSERVE_ENGINE__QUANTIZATION must be one of"),
        ({"EMBEDSERVE_GATEWAY__EVENT_LOOP": "trio"}, {},
         "EMBEDSERVE_GATEWAY__EVENT_LOOP must be one of 'asyncio', 'uvloop', got 'trio'"),
        ({"EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S": "-1"}, {},
         "EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S must be a number above 0, got '-1'"),
        ({}, {"model": {"max_seq_len": "4"}},
         "EMBEDSERVE_MODEL__MAX_SEQ_LEN (--max-seq-len) must be a whole number at least 8, got '4'"),
        ({"EMBEDSERVE_GATEWAY__API_KEYS": "sk-1,sk-2"}, {},  # a secret is never repeated
         "EMBEDSERVE_GATEWAY__API_KEYS must be JSON, e.g. '[\"a\", \"b\"]', got a 9-character value (hidden"),
        ({"EMBEDSERVE_LOG_LEVEL": "LOUD"}, {},
         "EMBEDSERVE_LOG_LEVEL must be one of 'DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL', got 'LOUD'"),
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
    assert "sk-" not in message


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


# -- the keys file: authentication is never off because of a file's content ------------------


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("", "holds no key"),
        ("# only a comment\n\n   \n  # indented comment\n", "holds no key"),
        (None, "does not exist"),
        ("folder", "cannot be read"),
    ],
)
def test_a_keys_file_that_holds_no_key_or_cannot_be_read_refuses_to_start(
    tmp_path: Path, content: str | None, says: str
) -> None:
    keys = tmp_path / "keys.txt"
    if content == "folder":
        keys.mkdir()
    elif content is not None:
        keys.write_text(content)
    line = _one_sentence(_embedserve("up", EMBEDSERVE_GATEWAY__API_KEYS_FILE=str(keys)),
                         "EMBEDSERVE_GATEWAY__API_KEYS_FILE", says, "one a line")
    assert str(keys) in line


def test_the_gateway_alone_checks_the_keys_file_too(tmp_path: Path) -> None:
    _one_sentence(_embedserve("gateway", "--engine-url", "http://127.0.0.1:9",
                              EMBEDSERVE_GATEWAY__API_KEYS_FILE=str(tmp_path / "nowhere")),
                  "EMBEDSERVE_GATEWAY__API_KEYS_FILE", "does not exist")


# -- the model's limit -------------------------------------------------------------------------


def test_a_max_seq_len_beyond_the_models_positions_is_refused_before_anything_starts() -> None:
    for command in ("up", "config"):
        line = _one_sentence(_embedserve(command, "--max-seq-len", "513"),
                             "EMBEDSERVE_MODEL__MAX_SEQ_LEN (--max-seq-len)", "at most 512", "got 513")
        assert "max_position_embeddings" in line
    _one_sentence(_embedserve("config", "--max-seq-len", "100000"), "at most 512")


# -- served.models: each mistake names its entry's field ---------------------------------------

SERVED = "EMBEDSERVE_SERVED__MODELS"


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        ('[{"path": "x"}]', f"{SERVED}: served.models[0].kind is required: one of 'embed', 'rerank'"),
        ('[{"kind": "embed", "path": "x"}, {"kind": "banana", "path": "y"}]',
         f"{SERVED}: served.models[1].kind must be one of 'embed', 'rerank', got 'banana'"),
        ('[{"kind": "embed", "path": "x", "max_seq_len": 2}]',
         f"{SERVED}: served.models[0].max_seq_len must be a whole number at least 8, got 2"),
        ('{"kind": "embed", "path": "x"}',
         f"{SERVED} must be a JSON list of objects, each with kind and path, got {{'kind': 'embed'"),
        ('[{"kind": "embed", "patth": "x"}]',  # two mistakes, one sentence
         f"{SERVED}: served.models[0].path is required: its folder"),
        ('[{"kind": "embed", "path": "x", "colour": 1}]',
         f"{SERVED}: served.models[0].colour is not a field; one of kind, path, name, aliases,"),
        ('[{"kind": "embed", "path": "x", "engine": {"prot": 31000}}]',
         f"{SERVED}: served.models[0].engine has no setting 'prot'; it takes engine.* settings "
         "(did you mean port?)"),
    ],
)
def test_served_models_mistakes_name_the_entrys_field(
    monkeypatch: pytest.MonkeyPatch, models: str, expected: str
) -> None:
    monkeypatch.chdir(Path(__file__).parent)
    monkeypatch.setenv(SERVED, models)
    with pytest.raises(ConfigError) as err:
        load_settings({}, FLAG_OF)
    message = str(err.value)
    assert expected in message, message
    assert "\n" not in message and "must be JSON, e.g." not in message


def test_a_served_models_folder_that_is_not_there_names_the_entry(tmp_path: Path) -> None:
    models = f'[{{"kind": "embed", "path": "{tmp_path / "nowhere"}"}}]'
    _one_sentence(_embedserve("up", EMBEDSERVE_SERVED__MODELS=models),
                  f"{SERVED}: served.models[0].path", "does not exist")


# -- limits that would make every request fail ---------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "accepts"),
    [
        ("EMBEDSERVE_GATEWAY__MAX_INPUTS", "0", "a whole number at least 1"),
        ("EMBEDSERVE_GATEWAY__MAX_TOKENS_PER_REQUEST", "0", "a whole number at least 1"),
        ("EMBEDSERVE_GATEWAY__MAX_STRING_CHARS", "0", "a whole number at least 1"),
        ("EMBEDSERVE_GATEWAY__MAX_BODY_BYTES", "10", "a whole number at least 64"),
    ],
)
def test_a_limit_no_request_could_meet_is_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, accepts: str
) -> None:
    monkeypatch.chdir(Path(__file__).parent)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"^{variable} must be {accepts}, got '{value}'$"):
        load_settings({}, FLAG_OF)


# -- unknown EMBEDSERVE_* names --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "nearest"),
    [
        ("EMBEDSERVE_MODEL__PATHH", "EMBEDSERVE_MODEL__PATH"),
        ("EMBEDSERVE_ENGINE_PORT", "EMBEDSERVE_ENGINE__PORT"),
        ("EMBEDSERVE_LOGLEVEL", "EMBEDSERVE_LOG_LEVEL"),
        ("EMBEDSERVE_ENGINE__CACHE_CLEAR__EVERY_N_BATCH", "EMBEDSERVE_ENGINE__CACHE_CLEAR__EVERY_N_BATCHES"),
    ],
)
def test_an_unknown_variable_is_refused_with_the_nearest_setting(name: str, nearest: str) -> None:
    _one_sentence(_embedserve("up", **{name: "/x"}), f"{name} is not a setting (did you mean {nearest}?)")


def test_an_unknown_name_in_dotenv_or_a_sections_json_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("EMBEDSERVE_GATEWAY__PROT=8001\n")
    with pytest.raises(ConfigError, match=r"^EMBEDSERVE_GATEWAY__PROT \(in \.env\) is not a setting "
                                          r"\(did you mean EMBEDSERVE_GATEWAY__PORT\?\)"):
        load_settings()
    (tmp_path / ".env").unlink()
    monkeypatch.setenv("EMBEDSERVE_ENGINE", '{"prot": 31000}')
    with pytest.raises(ConfigError, match=r"EMBEDSERVE_ENGINE__PROT is not a setting \(did you mean "):
        load_settings()


def test_the_variables_compose_and_the_scripts_use_start_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A shell that exported compose's EMBEDSERVE_TAG can still run ``up``; it is told the name
    sets nothing. Every such name compose.yaml and the scripts use is one of them."""
    from embedserve.config import NOT_SETTINGS, OWN_CHILD_VARIABLES, Settings, tolerated_variables
    from embedserve.settings_errors import setting_variables
    from tests.test_docs import _other_variables

    monkeypatch.chdir(tmp_path)
    assert _other_variables() - setting_variables(Settings) - OWN_CHILD_VARIABLES <= set(NOT_SETTINGS)
    monkeypatch.setenv("EMBEDSERVE_PORT", "8001")
    assert load_settings().gateway.port == 8000
    (note,) = tolerated_variables(os.environ)
    assert note.startswith("EMBEDSERVE_PORT is not a setting") and "EMBEDSERVE_GATEWAY__PORT" in note


# -- the docs say what the code does ---------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _paragraph(text: str, start: str) -> str:
    at = text.index(start)
    return text[at:text.find("\n\n", at)]


def test_deploy_names_every_field_of_a_served_model() -> None:
    from embedserve.config.served import ServedModel

    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    section = _paragraph(deploy, "`served.models` (`EMBEDSERVE_SERVED__MODELS`")
    assert [f for f in ServedModel.model_fields if f"`{f}`" not in section] == []


def test_the_readme_contract_states_the_limits_and_the_capacity_413() -> None:
    from embedserve.config import GatewaySettings

    contract = " ".join(_paragraph((ROOT / "README.md").read_text(), "The OpenAI contract:").split())
    g = GatewaySettings()
    assert (f"up to {g.max_inputs} inputs of at most {g.max_string_chars:,} characters each, "
            f"{g.max_tokens_per_request:,} tokens in all") in contract
    assert "413 `request_exceeds_capacity`" in contract and "`gateway.request_timeout_s`" in contract
