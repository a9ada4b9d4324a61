"""Late chunking (``late_chunking`` on /v1/embeddings): through the gateway and the real CPU engine
(ONNX Runtime) on the bundled model, each chunk's vector against one computed by hand with
transformers (the token states of one forward, their mean over the chunk's tokens, normalised);
its spans; what one pass holds; and every bad request a 400 naming the parameter, including a model
whose engine (SGLang) or pooling (last token) cannot serve it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from embedserve.config import BUNDLED_MODEL, Settings, resolve_model_path
from embedserve.core.tokenize import ModelTokenizer
from embedserve.engines.cpu import CpuEmbedder, create_engine_app
from embedserve.engines.cpu_backends import OnnxForward
from embedserve.gateway.app import create_app
from tests.fake_engine import FakeEngine, HttpxEngineClient
from tests.test_gateway_unit import wait_ready

MODEL = "all-MiniLM-L6-v2"
CAP = 256  # the bundled model's max_seq_len
TOKENIZER = ModelTokenizer(resolve_model_path(BUNDLED_MODEL), CAP)
TEXT = (
    "Berlin is the capital and largest city of Germany, both by area and by population. "
    "Its more than 3.85 million inhabitants make it the European Union's most populous city. "
    "The city is also one of the states of Germany, and the third smallest state in the country by area."
)


def sentences(text: str) -> list[tuple[int, int]]:
    """Each sentence's characters, its trailing space left out."""
    spans, start = [], 0
    while start < len(text):
        end = text.find(". ", start)
        end = len(text) if end < 0 else end + 1
        spans.append((start, end))
        start = end + 1
    return spans


class EngineTransport(httpx.AsyncBaseTransport):
    """The gateway's calls to an engine app that runs (lifespan included) in a TestClient."""

    def __init__(self, engine: TestClient) -> None:
        self.engine = engine

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        r = await asyncio.to_thread(
            self.engine.request, request.method, request.url.path, content=body, headers=request.headers
        )
        return httpx.Response(r.status_code, content=r.content, headers=r.headers)


def gateway_settings(model: str = BUNDLED_MODEL, **gateway: object) -> Settings:
    return Settings(
        engine={"kind": "external", "urls": ["http://engine"]},
        gateway={"request_timeout_s": 60.0, "accept_token_ids": True, **gateway},
        model={"path": model},
        health={"sample_interval_s": 60},
        _env_file=None,
    )


def fake_gateway(model: str, engine_kind: str, dim: int = 384) -> TestClient:
    """The gateway in front of a fake engine, serving ``model`` on engines of ``engine_kind``."""
    transport = httpx.ASGITransport(app=FakeEngine(dim=dim).app())
    return TestClient(create_app(gateway_settings(model), engine_client=HttpxEngineClient(transport),
                                 engine_kind=engine_kind))


@pytest.fixture(scope="module")
def embedder() -> CpuEmbedder:
    """The CPU engine's default backend, its export in the user's cache (made here when missing)."""
    e = CpuEmbedder(Settings(_env_file=None))
    assert isinstance(e.forward, OnnxForward)
    return e


@pytest.fixture(scope="module")
def engine(embedder: CpuEmbedder) -> Iterator[TestClient]:
    with TestClient(create_engine_app(Settings(_env_file=None, engine={"stats_dir": None}),
                                      embedder=embedder)) as c:
        yield c


@pytest.fixture(scope="module")
def client(engine: TestClient) -> Iterator[TestClient]:
    app = create_app(gateway_settings(max_tokens_per_request=600),
                     engine_client=HttpxEngineClient(EngineTransport(engine)), engine_kind="cpu")
    with TestClient(app) as c:
        wait_ready(c)
        yield c


@pytest.fixture(scope="module")
def reference() -> Any:
    """The bundled model on transformers: ``(text, spans) -> one unit vector per span``."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = resolve_model_path(BUNDLED_MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()

    def late_chunks(text: str, spans: list[tuple[int, int]]) -> np.ndarray:
        enc = tok(text, return_offsets_mapping=True, return_special_tokens_mask=True,
                  truncation=True, max_length=CAP, return_tensors="pt")
        with torch.no_grad():
            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        states = out.last_hidden_state[0]
        offsets, special = enc["offset_mapping"][0].tolist(), enc["special_tokens_mask"][0].tolist()
        rows = []
        for start, end in spans:
            tokens = [t for t, ((a, _), s) in enumerate(zip(offsets, special, strict=True))
                      if not s and start <= a < end]
            mean = states[tokens].mean(0).numpy()
            rows.append(mean / np.linalg.norm(mean))
        return np.stack(rows)

    return late_chunks


def embed(client: TestClient, body: dict[str, Any]) -> Any:
    return client.post("/v1/embeddings", json={"model": MODEL, **body})


def vectors(answer: dict[str, Any], index: int | None = None) -> np.ndarray:
    return np.asarray([d["embedding"] for d in answer["data"] if index is None or d["input_index"] == index])


def test_each_chunk_is_the_mean_of_its_tokens_states_in_one_pass(client: TestClient, reference: Any) -> None:
    spans = sentences(TEXT)
    assert len(spans) == 3
    other = "A short second input, embedded in the same request."
    body = {"input": [TEXT, other], "late_chunking": {"chunks": [spans, [[0, 7], [8, len(other)]]]}}
    r = embed(client, body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [(d["index"], d["input_index"], d["span"]) for d in answer["data"]] == [
        (0, 0, list(spans[0])), (1, 0, list(spans[1])), (2, 0, list(spans[2])),
        (3, 1, [0, 7]), (4, 1, [8, len(other)]),
    ]
    np.testing.assert_allclose(vectors(answer, 0), reference(TEXT, spans), atol=2e-5)
    np.testing.assert_allclose(vectors(answer, 1), reference(other, [(0, 7), (8, len(other))]), atol=2e-5)
    assert r.headers["x-embedserve-late-chunks"] == "5"
    # the whole inputs' tokens, once each, as one pass apiece
    assert answer["usage"]["prompt_tokens"] == sum(len(x.ids) for x in TOKENIZER.encode_texts([TEXT, other]))
    # not what each sentence gives alone: the chunk saw the rest of the text
    alone = embed(client, {"input": [TEXT[s:e] for s, e in spans]}).json()
    cos = (vectors(alone) * vectors(answer, 0)).sum(1)
    assert cos.max() < 0.999


def test_chunks_of_n_tokens_and_their_spans(client: TestClient, reference: Any) -> None:
    r = embed(client, {"input": TEXT, "late_chunking": {"chunk_tokens": 16}, "dimensions": 384})
    assert r.status_code == 200, r.text
    offsets = TOKENIZER.offsets([TEXT])[0]
    runs = [offsets[a : a + 16] for a in range(0, len(offsets), 16)]
    spans = [(run[0][0], run[-1][1]) for run in runs]
    assert [tuple(d["span"]) for d in r.json()["data"]] == spans
    assert spans[0][0] == 0 and spans[-1][1] == len(TEXT)
    np.testing.assert_allclose(vectors(r.json()), reference(TEXT, spans), atol=2e-5)


def test_an_input_longer_than_one_pass(client: TestClient, reference: Any) -> None:
    words = ["alpha", "river", "stone", "cloud", "paper", "light", "green", "music", "table", "house"]
    text = " ".join(words[i % 10] for i in range(400))  # one token a word: 400 content tokens
    cut = embed(client, {"input": text, "late_chunking": {"chunk_tokens": 100}})
    assert cut.status_code == 200, cut.text
    answer = cut.json()
    kept = CAP - 2
    assert answer["truncated_inputs"] == [{"index": 0, "original_tokens": 402, "kept_tokens": CAP}]
    spans = [tuple(d["span"]) for d in answer["data"]]
    assert len(spans) == 3 and spans[-1][1] == len(" ".join(words[i % 10] for i in range(kept)))
    np.testing.assert_allclose(vectors(answer), reference(text, spans), atol=2e-5)
    # cut at its start instead: the pass holds the last 254 words, the chunks run to the end
    body = {"input": text, "late_chunking": {"chunk_tokens": 100}, "truncation_direction": "left"}
    left = embed(client, body)
    kept_text = " ".join(words[i % 10] for i in range(400 - kept, 400))
    offset = len(text) - len(kept_text)
    spans = [tuple(d["span"]) for d in left.json()["data"]]
    assert spans[0][0] == offset and spans[-1][1] == len(text)
    shifted = [(start - offset, end - offset) for start, end in spans]
    np.testing.assert_allclose(vectors(left.json()), reference(kept_text, shifted), atol=2e-5)
    # a chunk past the pass, or an input the request will not have cut: refused, never clipped
    past = embed(client, {"input": text, "late_chunking": {"chunks": [[0, 10], [1500, 1600]]}})
    assert_400(past, "late_chunking", "context_length_exceeded", "reaches past the 254 tokens")
    whole = embed(client, {"input": text, "truncate": False, "late_chunking": {"chunk_tokens": 100}})
    assert_400(whole, "input", "context_length_exceeded", "402 tokens")


def assert_400(r: Any, param: str, code: str, text: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert text in error["message"], error["message"]


@pytest.mark.parametrize(("late", "extra", "param", "text"), [
    ({"chunks": [[0, 10], [5, 20]]}, {}, "late_chunking", "overlaps"),
    ({"chunks": [[20, 30], [0, 10]]}, {}, "late_chunking", "overlaps or precedes"),
    ({"chunks": [[0, 10_000]]}, {}, "late_chunking", f"0 <= start < end <= {len(TEXT)}"),
    ({"chunks": [[-1, 10]]}, {}, "late_chunking", "0 <= start < end"),
    ({"chunks": [[10, 10]]}, {}, "late_chunking", "0 <= start < end"),
    ({"chunks": [[6, 7]]}, {}, "late_chunking", "holds no token"),  # the space after "Berlin"
    ({"chunks": [[]]}, {}, "late_chunking", "input[0] has no chunks"),
    ({"chunks": []}, {}, "late_chunking", "spans for 0 inputs; the request has 1"),
    ({"chunks": [[[0, 10]], [[0, 5]]]}, {}, "late_chunking", "spans for 2 inputs; the request has 1"),
    ({"chunks": [[0, 10]], "chunk_tokens": 4}, {}, "late_chunking", "either chunk_tokens or chunks"),
    ({}, {}, "late_chunking", "either chunk_tokens or chunks"),
    ({"chunks": [[0, 10, 20]]}, {}, "late_chunking.chunks.0", "at most 2 items"),
    ({"chunk_tokens": 0}, {}, "late_chunking.chunk_tokens", "greater than or equal to 1"),
    ({"chunk_tokens": 8, "size": 3}, {}, "late_chunking.size", "Extra inputs"),
    ({"chunk_tokens": 8}, {"input": [101, 2000, 102]}, "late_chunking", "spans of text"),
    ({"chunk_tokens": 8}, {"input_type": "query"}, "late_chunking", "embeds documents"),
    ({"chunk_tokens": 8}, {"truncate": "chunk"}, "late_chunking", 'truncate "chunk"'),
])
def test_bad_late_chunking_is_a_400_naming_it(
    client: TestClient, late: dict[str, Any], extra: dict[str, Any], param: str, text: str
) -> None:
    r = embed(client, {"input": TEXT, "late_chunking": late, **extra})
    assert_400(r, param, "invalid_value", text)


def test_on_sglang_it_is_a_400_that_names_the_model_and_the_cpu_engine() -> None:
    with fake_gateway(BUNDLED_MODEL, "sglang") as c:
        wait_ready(c)
        r = embed(c, {"input": TEXT, "late_chunking": {"chunk_tokens": 8}})
        assert embed(c, {"input": TEXT}).status_code == 200
    assert_400(r, "late_chunking", "late_chunking_unsupported", f"the model '{MODEL}' is served by SGLang")
    assert "needs the CPU engine" in r.json()["error"]["message"]


def test_a_model_that_pools_by_its_last_token_is_refused(tiny_qwen_dir: Path) -> None:
    with fake_gateway(str(tiny_qwen_dir), "cpu", dim=64) as c:
        wait_ready(c)
        name = c.get("/v1/models").json()["data"][0]["id"]
        body = {"model": name, "input": TEXT, "late_chunking": {"chunk_tokens": 8}}
        r = c.post("/v1/embeddings", json=body)
    assert_400(r, "late_chunking", "late_chunking_unsupported", "pools by lasttoken")


def test_the_whole_input_counts_against_the_request_limit(client: TestClient) -> None:
    """Admission and the limits count each input's tokens once, whole, however it is chunked."""
    text = " ".join(["alpha river stone"] * 80)  # 240 content tokens, 242 framed
    body = {"input": [text, text, text], "late_chunking": {"chunk_tokens": 4}}
    r = embed(client, body)
    assert_400(r, "input", "max_tokens_per_request", "726 tokens")  # 3 x 242 > 600
    ok = embed(client, {**body, "input": [text, text]})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 484
    assert len(ok.json()["data"]) == 2 * 60


def test_the_engine_pools_spans_beside_plain_inputs_in_one_call(
    embedder: CpuEmbedder, engine: TestClient
) -> None:
    """One engine call mixing late-chunked inputs and plain ones: each its rows, in input order,
    the same on either backend; spans outside an input are a 400."""
    rng = np.random.default_rng(0)
    batch = [[101, *rng.integers(1000, 30000, n).tolist(), 102] for n in (40, 7, 90)]
    plain = embedder.embed(batch)
    spans = [[(1, 11), (11, 41)], None, [(5, 6)]]
    rows = embedder.embed(batch, spans=spans)
    assert rows.shape == (4, 384)
    np.testing.assert_allclose(rows[2], plain[1], atol=1e-5)
    _, states = embedder.forward.with_tokens(np.asarray([batch[0]]), np.ones((1, 42), dtype=np.int64))
    want = states[0, 11:41].mean(0)
    np.testing.assert_allclose(rows[1], want / np.linalg.norm(want), atol=1e-5)
    on_torch = CpuEmbedder(Settings(_env_file=None, engine={"cpu_backend": "torch"}))
    np.testing.assert_allclose(on_torch.embed(batch, spans=spans), rows, atol=1e-5)
    bad = engine.post("/v1/embeddings", json={"input": batch[:1], "chunks": [[[0, 43]]]})
    assert bad.status_code == 400 and "outside input 0's 42 tokens" in bad.json()["message"]
    empty = engine.post("/v1/embeddings", json={"input": batch[:1], "chunks": [[]]})
    assert empty.status_code == 400 and "chunks[0] is empty" in empty.json()["message"]
