"""Cohere's embed API (``/v2/embed``, ``/v1/embed``) over a fake engine: its response shapes,
``input_type`` on the model's instruction format, ``truncate``, ``output_dimension``, the same
numbers as /v1/embeddings, bad input in the envelope with Cohere's names, and the Cohere SDK's
own parsing of the answers."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import cohere
import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedserve.config import Settings
from embedserve.core.tokenize import ModelTokenizer
from embedserve.gateway.app import create_app
from embedserve.gateway.cohere_routes import TASKS
from tests import fake_engine
from tests.conftest import MINILM_DIR
from tests.fake_engine import FakeEngine, HttpxEngineClient
from tests.test_bad_input import JSON, assert_contract, json_any
from tests.test_gateway_unit import MODEL, assert_error, wait_ready
from tests.test_output_types import TEXTS, signed_vector, st_reference

TEMPLATE = "Instruct: {task}\nQuery:{text}"
TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


@pytest.fixture()
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    monkeypatch.setattr(fake_engine, "fake_vector", signed_vector)
    return FakeEngine()


@pytest.fixture()
def client(engine: FakeEngine) -> Iterator[TestClient]:
    """The bundled model with Qwen3-Embedding's instruction format, so input types differ."""
    config = Settings(
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        model={"query_template": TEMPLATE, "max_seq_len": 32},
        gateway={"request_timeout_s": 10.0},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    app = create_app(config, engine_client=HttpxEngineClient(httpx.ASGITransport(app=engine.app())))
    with TestClient(app) as c:
        wait_ready(c)
        yield c


def cohere_embed(c: TestClient, version: int = 2, **fields: Any) -> Any:
    r = c.post(f"/v{version}/embed", json={"model": MODEL, "texts": TEXTS, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def openai_embed(c: TestClient, **fields: Any) -> np.ndarray:
    r = c.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS, **fields})
    assert r.status_code == 200, r.text
    return np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_v2_answers_every_type_keyed_by_type_from_one_embedding(client: TestClient) -> None:
    body = cohere_embed(client, input_type="search_document", embedding_types=TYPES)
    assert set(body) >= {"id", "embeddings", "texts", "meta", "response_type"}
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == TEXTS
    assert list(body["embeddings"]) == TYPES
    floats = openai_embed(client)
    usage = client.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS}).json()["usage"]
    assert body["meta"]["billed_units"] == {"input_tokens": usage["prompt_tokens"]}
    assert np.array_equal(np.asarray(body["embeddings"]["float"], dtype=np.float32), floats)
    for kind in TYPES[1:-1]:
        assert np.array_equal(np.asarray(body["embeddings"][kind]), st_reference(floats, kind)), kind
    unpacked = [np.frombuffer(base64.b64decode(s), "<f4") for s in body["embeddings"]["base64"]]
    assert np.array_equal(np.stack(unpacked), floats)


def test_v1_answers_floats_without_embedding_types_and_by_type_with_them(client: TestClient) -> None:
    plain = cohere_embed(client, version=1)
    assert plain["response_type"] == "embeddings_floats"
    assert np.array_equal(np.asarray(plain["embeddings"], dtype=np.float32), openai_embed(client))
    assert plain["meta"]["api_version"] == {"version": "1"}
    typed = cohere_embed(client, version=1, embedding_types=["ubinary"])
    assert typed["response_type"] == "embeddings_by_type" and list(typed["embeddings"]) == ["ubinary"]
    assert len(typed["embeddings"]["ubinary"][0]) == 48


@pytest.mark.parametrize(
    ("input_type", "openai"),
    [
        ("search_query", {"input_type": "query"}),
        ("search_document", {}),
        ("classification", {"input_type": "query", "instruction": TASKS["classification"]}),
        ("clustering", {"input_type": "query", "instruction": TASKS["clustering"]}),
    ],
)
def test_input_type_applies_the_instruction_as_the_openai_route_does(
    client: TestClient, input_type: str, openai: dict[str, str]
) -> None:
    body = cohere_embed(client, input_type=input_type)
    want = openai_embed(client, **openai)
    assert np.array_equal(np.asarray(body["embeddings"]["float"], dtype=np.float32), want)
    others = {"search_query", "search_document", "classification", "clustering"} - {input_type}
    for other in others:  # each input type embeds differently on a model with an instruction format
        assert not np.array_equal(np.asarray(cohere_embed(client, input_type=other)["embeddings"]["float"]),
                                  np.asarray(body["embeddings"]["float"]))


def test_an_instruction_sets_the_task_of_a_query(client: TestClient) -> None:
    body = cohere_embed(client, input_type="search_query", instruction="Find the bug")
    want = openai_embed(client, input_type="query", instruction="Find the bug")
    assert np.array_equal(np.asarray(body["embeddings"]["float"], dtype=np.float32), want)


LONG = " ".join(f"w{i}" for i in range(200))
UNCUT = ModelTokenizer(MINILM_DIR, 4096)  # the whole text's tokens


def test_truncate_none_is_a_400_for_an_over_long_text(client: TestClient) -> None:
    r = client.post("/v2/embed", json={"model": MODEL, "texts": ["short", LONG], "truncate": "NONE"})
    err = assert_error(r, 400, "texts")
    assert err["code"] == "context_length_exceeded" and "texts[1]" in str(err["message"])
    assert '"truncate": "END" or "START"' in str(err["message"])


@pytest.mark.parametrize(("truncate", "keeps"), [("END", "head"), ("START", "tail"), (None, "head")])
def test_truncate_cuts_from_that_side(
    client: TestClient, engine: FakeEngine, truncate: str | None, keeps: str
) -> None:
    fields: dict[str, Any] = {"truncate": truncate} if truncate else {}
    body = cohere_embed(client, texts=[LONG], **fields)
    (sent,) = engine.calls[-1]
    assert len(sent) == 32 and sent[0] == 101 and sent[-1] == 102  # [CLS] ... [SEP] kept
    whole = UNCUT.encode_texts([LONG])[0].ids
    assert sent[1:-1] == (whole[1:31] if keeps == "head" else whole[-31:-1])
    assert body["truncated_inputs"] == [{"index": 0, "original_tokens": len(whole), "kept_tokens": 32}]


def test_start_keeps_a_querys_instruction(client: TestClient, engine: FakeEngine) -> None:
    cohere_embed(client, texts=[LONG], truncate="START", input_type="search_query")
    (sent,) = engine.calls[-1]
    task = client.app.state.info.default_task  # type: ignore[attr-defined]
    whole = UNCUT.encode_texts([TEMPLATE.format(task=task, text=LONG)])[0].ids
    head = UNCUT.count(TEMPLATE.split("{text}")[0].format(task=task))
    assert 0 < head < 30 and sent[: 1 + head] == whole[: 1 + head]  # the instruction, whole
    assert sent[1 + head : -1] == whole[-(31 - head) : -1]  # the text's end


def test_output_dimension_is_matryoshka_then_the_type(client: TestClient) -> None:
    body = cohere_embed(client, output_dimension=64, embedding_types=["float", "binary"])
    floats = openai_embed(client, dimensions=64)
    assert np.array_equal(np.asarray(body["embeddings"]["float"], dtype=np.float32), floats)
    assert np.array_equal(np.asarray(body["embeddings"]["binary"]), st_reference(floats, "binary"))


def test_model_may_be_left_out(client: TestClient) -> None:
    r = client.post("/v1/embed", json={"texts": ["hello"]})
    assert r.status_code == 200 and len(r.json()["embeddings"][0]) == 384


def test_null_fields_take_their_defaults(client: TestClient) -> None:
    """LangChain's CohereEmbeddings sends "truncate": null unless told a side."""
    body = cohere_embed(client, version=1, truncate=None, embedding_types=None, input_type=None)
    assert body["response_type"] == "embeddings_floats"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"embedding_types": ["float", "int4"]}, "embedding_types"),
        ({"embedding_types": "int8"}, "embedding_types"),
        ({"input_type": "search_queries"}, "input_type"),
        ({"input_type": "image"}, "input_type"),
        ({"truncate": "MIDDLE"}, "truncate"),
        ({"output_dimension": 1000}, "output_dimension"),
        ({"output_dimension": 0}, "output_dimension"),
        ({"texts": []}, "texts"),
        ({"texts": ["ok", 3]}, "texts"),
        ({"texts": ["ok", " "]}, "texts"),
        ({"texts": None}, "texts"),
        ({"images": ["data:image/png;base64,AAAA"], "texts": None}, "images"),
        ({"inputs": [{"content": [{"type": "text", "text": "x"}]}], "texts": None}, "inputs"),
        ({"max_tokens": 8}, "max_tokens"),
        ({"model": "embed-english-v3.0"}, "model"),
        ({"input_type": "search_document", "instruction": "x"}, "instruction"),
    ],
)
def test_bad_input_is_a_400_in_the_envelope_naming_cohere_s_field(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    full = {"model": MODEL, "texts": ["hello"], **body}
    r = client.post("/v2/embed", json={k: v for k, v in full.items() if v is not None})
    assert_error(r, 404 if param == "model" else 400, param)


def test_the_cohere_sdk_reads_the_answers(client: TestClient) -> None:
    """Both SDK clients parse what the routes answer (the README's snippet runs them over HTTP)."""
    # the SDK's annotation names its own httpx; a TestClient is an httpx.Client
    v2 = cohere.ClientV2(api_key="unused", base_url="http://testserver", httpx_client=client)  # type: ignore[arg-type]
    got = v2.embed(model=MODEL, texts=TEXTS, input_type="search_document", embedding_types=["float", "int8"])
    floats = openai_embed(client)
    assert got.embeddings.float_ is not None and got.embeddings.int8 is not None
    assert np.array_equal(np.asarray(got.embeddings.float_, dtype=np.float32), floats)
    assert np.array_equal(np.asarray(got.embeddings.int8), st_reference(floats, "int8"))
    assert got.meta is not None and got.meta.billed_units is not None and got.meta.billed_units.input_tokens
    v1 = cohere.Client(api_key="unused", base_url="http://testserver", httpx_client=client)  # type: ignore[arg-type]
    plain = v1.embed(model=MODEL, texts=TEXTS, input_type="search_query")
    assert plain.response_type == "embeddings_floats"
    query = openai_embed(client, input_type="query")
    assert np.array_equal(np.asarray(plain.embeddings, dtype=np.float32), query)
    with pytest.raises(cohere.BadRequestError):
        v2.embed(model=MODEL, texts=TEXTS, input_type="search_document", embedding_types=["int4"])


# -- fuzzing: whatever the body, an answer or a 4xx in the envelope ----------------------------

COHERE_FIELDS = {
    "model": st.sampled_from([MODEL, "", "embed-v4.0"]) | json_any,
    "texts": st.lists(st.text(max_size=12), max_size=4) | json_any,
    "input_type": st.sampled_from(["search_document", "search_query", "classification", "image"]) | json_any,
    "embedding_types": st.lists(st.sampled_from([*TYPES, "int4"]), max_size=4) | json_any,
    "truncate": st.sampled_from(["NONE", "START", "END", "end"]) | json_any,
    "output_dimension": st.integers(min_value=-2, max_value=400) | json_any,
    "instruction": st.text(max_size=10) | json_any,
    "images": json_any,
    "max_tokens": json_any,
}
OPENAI_TYPED = {
    "model": st.just(MODEL),
    "input": st.lists(st.text(max_size=12), max_size=4) | json_any,
    "embedding_type": st.sampled_from([*TYPES, "int4"]) | json_any,
    "encoding_format": st.sampled_from(["float", "base64"]) | json_any,
    "truncation_direction": st.sampled_from(["left", "right", "Left", "middle"]) | json_any,
    "dimensions": st.integers(min_value=-2, max_value=400) | json_any,
}


def test_fuzz_cohere_and_typed_bodies(client: TestClient) -> None:
    bodies = st.fixed_dictionaries({}, optional=dict(COHERE_FIELDS)) | json_any
    typed = st.fixed_dictionaries({}, optional=dict(OPENAI_TYPED))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies | typed, path=st.sampled_from(["/v1/embed", "/v2/embed", "/v1/embeddings"]))
    def fuzz(body: Any, path: str) -> None:
        assert_contract(client.post(path, content=json.dumps(body), headers=JSON))

    fuzz()
    cohere_embed(client)
