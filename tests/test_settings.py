"""The one config object: derived defaults that several components share."""

from __future__ import annotations

import json
from pathlib import Path

from embedserve.config import Settings
from embedserve.model_info import ModelInfo


def settings(**kw: object) -> Settings:
    return Settings(_env_file=None, **kw)  # type: ignore[arg-type]


def test_admission_default_follows_the_engine_kind() -> None:
    s = settings()
    assert s.tokens_in_flight_limit("cpu") == 32_768
    assert s.tokens_in_flight_limit("sglang") == s.tokens_in_flight_limit("external") == 262_144
    explicit = settings(gateway={"max_tokens_in_flight": 1000})
    assert explicit.tokens_in_flight_limit("cpu") == explicit.tokens_in_flight_limit("sglang") == 1000


def test_inline_tokenising_default_follows_the_engine_kind() -> None:
    """In front of SGLang every text goes to the tokenizer threads, keeping the one event
    loop free; the CPU engine keeps short texts on the loop."""
    s = settings()
    assert s.inline_tokenize_limit("sglang") == s.inline_tokenize_limit("external") == 0
    assert s.inline_tokenize_limit("cpu") == 2048
    explicit = settings(gateway={"inline_tokenize_chars": 512})
    assert explicit.inline_tokenize_limit("cpu") == explicit.inline_tokenize_limit("sglang") == 512


def test_one_sequence_cap(tmp_path: Path) -> None:
    """sentence-transformers' max_seq_length wins; else positions, capped at 8192."""
    assert ModelInfo.load(settings().model).max_seq_len == 256  # bundled MiniLM
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768, "hidden_size": 8}))
    assert ModelInfo.load(settings(model={"path": str(tmp_path)}).model).max_seq_len == 8192
    explicit = settings(model={"path": str(tmp_path), "max_seq_len": 1000})
    assert ModelInfo.load(explicit.model).max_seq_len == 1000


def test_replicas_get_consecutive_ports() -> None:
    s = settings(engine={"port": 31000, "replicas": 3})
    assert s.engine_urls() == [f"http://127.0.0.1:{p}" for p in (31000, 31001, 31002)]
    assert s.for_replica(2).engine.port == 31002
    assert s.hang_after_s() == 4 * s.gateway.request_timeout_s
