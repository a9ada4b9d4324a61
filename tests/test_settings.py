"""The one config object: derived defaults that several components share."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from embedserve.config import Settings
from embedserve.model_info import ModelInfo
from embedserve.runtime import identify
from embedserve.runtime.supervisor import EngineStartError


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


def test_engines_elsewhere_take_the_defaults_of_the_kind_they_said() -> None:
    """In front of engines it did not start the gateway derives its limits as `up` does for
    engines of the kind they said; until they say, SGLang's."""
    for kind in ("cpu", "sglang"):
        told = settings(engine={"kind": "external", "urls": ["http://e"], "external_kind": kind})
        assert told.gateway_limits("external") == settings().gateway_limits(kind)
    assert settings().gateway_limits("external").max_tokens_in_flight == 262_144
    cpu = settings(engine={"external_kind": "cpu"}).gateway_limits("external")
    assert (cpu.engine_kind, cpu.engine_calls_per_engine, cpu.max_tokens_per_engine_call) == ("cpu", 1, 512)
    assert (cpu.max_tokens_in_flight, cpu.inline_tokenize_chars) == (32_768, 2048)


def _engine(*answers: httpx.Response | type[Exception]) -> httpx.MockTransport:
    """An engine whose GET /get_model_info answers these in turn (an exception class: no answer)."""
    left = list(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/get_model_info"
        answer = left.pop(0) if len(left) > 1 else left[0]
        if isinstance(answer, type):
            raise answer("refused", request=request)  # type: ignore[call-arg]
        return answer

    return httpx.MockTransport(handle)


@pytest.mark.parametrize(("answer", "kind"), [
    (httpx.Response(200, json={"model_path": "/m", "engine": "cpu", "hidden_size": 384}), "cpu"),
    (httpx.Response(200, json={"model_path": "/m", "is_generation": False, "weight_version": "1"}), "sglang"),
    (httpx.Response(404), "sglang"),  # up, but not one that says
])
def test_an_engine_says_what_it_is(answer: httpx.Response, kind: str) -> None:
    assert asyncio.run(identify.ask_engine_kind(["http://e"], 0, transport=_engine(answer))) == kind


def test_the_gateway_waits_for_a_starting_engine_then_gives_up_naming_the_setting() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    starting = _engine(httpx.ConnectError, httpx.Response(503),
                       httpx.Response(200, json={"model_path": "/m", "engine": "cpu"}))
    told = identify.ask_engine_kind(["http://e"], 10, poll_s=0, clock=clock, transport=starting)
    assert asyncio.run(told) == "cpu"
    with pytest.raises(EngineStartError, match="EMBEDSERVE_ENGINE__EXTERNAL_KIND"):
        asyncio.run(identify.ask_engine_kind(["http://e"], 3, poll_s=0, clock=clock,
                                             transport=_engine(httpx.ConnectError)))


def test_only_engines_elsewhere_that_did_not_say_are_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[str]] = []

    async def ask(urls: list[str], wait_s: float) -> str:
        asked.append(urls)
        return "cpu"

    monkeypatch.setattr(identify, "ask_engine_kind", ask)
    s = settings(engine={"kind": "external", "urls": ["http://e"]})
    assert asyncio.run(identify.identify_engines(s)).engine.external_kind == "cpu" and asked == [["http://e"]]
    for known in (settings(engine={"kind": "external", "urls": ["http://e"], "external_kind": "sglang"}),
                  settings(engine={"kind": "cpu"})):
        assert asyncio.run(identify.identify_engines(known)) == known
    assert asked == [["http://e"]]
