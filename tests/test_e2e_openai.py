"""The whole path over real HTTP with the official OpenAI client as the caller, checked
against sentence-transformers (a reference nobody here wrote).

The tests that take ``served`` run against the stack they start, and against the gateway at
``$EMBEDSERVE_E2E_URL`` when it is set (the CPU profile's containers in CI)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer

from tests.conftest import MINILM_DIR, TINY_QWEN_MAX_SEQ, RunningStack, Served, metric, wait_until

LONG = " ".join(f"word{i} memory model embeddings" for i in range(400))  # >> 256 tokens
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "向量检索需要高质量的文本嵌入模型。",
    "Deploy 🚀 and relax 😀, the pod restarts before it runs out of memory 🧠",
    "def embed(texts: list[str]) -> np.ndarray:\n    return model.encode(texts)",
    "  leading and trailing spaces  ",
    "a",
    LONG,
]


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def client(stack: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def minilm_ref() -> SentenceTransformer:
    return SentenceTransformer(str(MINILM_DIR), device="cpu", local_files_only=True)


def test_minilm_matches_sentence_transformers(served: Served, minilm_ref: SentenceTransformer) -> None:
    ref = minilm_ref.encode(TEXTS, normalize_embeddings=True)
    # The SDK asks for base64 when no format is named and decodes it itself.
    resp = client(served).embeddings.create(model=served.model_name, input=TEXTS)
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    for i, d in enumerate(resp.data):
        assert len(d.embedding) == 384
        assert cos(np.array(d.embedding), ref[i]) >= 0.9999, TEXTS[i][:40]
    expected_tokens = sum(min(len(minilm_ref.tokenizer(t)["input_ids"]), 256) for t in TEXTS)
    assert resp.usage.prompt_tokens == expected_tokens
    extra = resp.model_extra or {}
    truncated = extra["truncated_inputs"]
    assert [t["index"] for t in truncated] == [len(TEXTS) - 1]
    assert truncated[0]["kept_tokens"] == 256
    assert truncated[0]["original_tokens"] > 256


def test_float_and_base64_carry_the_same_vectors(served: Served) -> None:
    body = {"model": served.model_name, "input": TEXTS[:3]}
    f = httpx.post(served.url + "/v1/embeddings", json={**body, "encoding_format": "float"})
    b = httpx.post(served.url + "/v1/embeddings", json={**body, "encoding_format": "base64"})
    assert f.status_code == b.status_code == 200
    for fd, bd in zip(f.json()["data"], b.json()["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(bd["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, np.array(fd["embedding"], dtype=np.float32), rtol=1e-6)


def test_token_id_input_matches_text_when_accepted(qwen_stack: RunningStack, tiny_qwen_dir: Path) -> None:
    """A stack with ``accept_token_ids`` embeds the model's own ids as it embeds the text."""
    ids = Tokenizer.from_file(str(tiny_qwen_dir / "tokenizer.json")).encode(TEXTS[0]).ids
    c = client(qwen_stack)
    by_ids = c.embeddings.create(model=qwen_stack.model_name, input=[ids, ids[:5]], encoding_format="float")
    by_text = c.embeddings.create(model=qwen_stack.model_name, input=TEXTS[0], encoding_format="float")
    assert cos(np.array(by_ids.data[0].embedding), np.array(by_text.data[0].embedding)) > 0.99999
    assert by_ids.usage.prompt_tokens == len(ids) + 5


def test_token_ids_are_refused_by_default(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(served).embeddings.create(model=served.model_name, input=[[101, 7592, 102]])
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "token_ids_not_accepted"
    assert "check_embedding_ctx_length=False" in body["message"]


def test_dimensions_keep_prefix_and_renormalise(served: Served) -> None:
    c = client(served)
    full = np.array(
        c.embeddings.create(model=served.model_name, input=TEXTS[0], encoding_format="float")
        .data[0]
        .embedding
    )
    short = np.array(
        c.embeddings.create(model=served.model_name, input=TEXTS[0], dimensions=64).data[0].embedding
    )
    assert short.shape == (64,)
    assert abs(np.linalg.norm(short) - 1) < 1e-5
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"input": "   "}, 400, "input"),
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
        ({"input": "hi", "dimensions": 385}, 400, "dimensions"),
        ({"input": [[5, 999999]]}, 400, "input"),
        ({"input": LONG, "extra_body": {"truncate": False}}, 400, "input"),
    ],
)
def test_bad_requests_get_openai_errors(
    served: Served, kwargs: dict[str, object], status: int, param: str
) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        client(served).embeddings.create(model=served.model_name, **kwargs)  # type: ignore[arg-type]
    assert err.value.status_code == status
    body = err.value.response.json()["error"]
    assert body["param"] == param and body["message"] and body["type"] == "invalid_request_error"


def test_unknown_model_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client(served).embeddings.create(model="text-embedding-3-small", input="hi")
    assert err.value.response.json()["error"]["code"] == "model_not_found"


def test_models_and_metrics(served: Served) -> None:
    models = client(served).models.list()
    assert models.data[0].id == served.model_name  # then its aliases, if it has any
    client(served).embeddings.create(model=served.model_name, input=LONG)
    text = httpx.get(served.url + "/metrics").text
    assert metric(text, "embedserve_inputs_truncated_total") >= 1
    assert metric(text, "embedserve_stage_seconds_count", stage="tokenize") >= 1
    assert metric(text, "embedserve_requests_total", status="200") >= 1
    # the autoscaling signal: a ready pod reports its load
    assert metric(text, "embedserve_load") >= 0
    assert metric(text, "embedserve_offered_tokens_per_second") > 0


def test_probes_and_the_memory_report(served: Served) -> None:
    """The probes answer, and /health/memory reads the engine: its process (in containers,
    through the engine's PID namespace) and its allocator statistics (the shared folder)."""
    assert httpx.get(served.url + "/health/live", timeout=10).status_code == 200
    assert httpx.get(served.url + "/health/ready", timeout=10).status_code == 200

    def report() -> dict[str, Any]:
        r = httpx.get(served.url + "/health/memory", timeout=10)
        assert r.status_code == 200
        return dict(r.json())

    wait_until(lambda: report().get("allocator") and report().get("sampler"), timeout=30)
    doc = report()
    assert doc["status"] in ("ok", "unknown"), doc["reason"]
    assert not doc["recommends_restart"]
    assert doc["engines"] and all(e["ready"] for e in doc["engines"]), doc["engines"]
    engine_pids = {a["pid"] for a in doc["allocator"]}
    found = {p["pid"]: p for name, p in doc["processes"].items() if name.startswith("engine")}
    assert engine_pids <= set(found), (doc["processes"], doc["processes_missing"])
    assert all(found[pid]["rss_bytes"] > 0 for pid in engine_pids)
    assert not doc["processes_missing"], doc["processes_missing"]
    assert doc["resources"]["host"]["used_bytes"] > 0


# -- a Qwen3-Embedding-style model: last-token pooling, EOS appended by the tokenizer ------


def test_qwen_last_token_pooling_and_truncation_match_reference(
    qwen_stack: RunningStack, tiny_qwen_dir: object
) -> None:
    ref_model = SentenceTransformer(str(tiny_qwen_dir), device="cpu", local_files_only=True)
    assert ref_model.max_seq_length == TINY_QWEN_MAX_SEQ
    texts = [*TEXTS[:4], LONG]
    ref = ref_model.encode(texts, normalize_embeddings=True)
    resp = client(qwen_stack).embeddings.create(model=qwen_stack.model_name, input=texts)
    for i, d in enumerate(resp.data):
        assert cos(np.array(d.embedding), ref[i]) >= 0.9999, texts[i][:40]
    truncated = (resp.model_extra or {})["truncated_inputs"]
    assert [t["index"] for t in truncated] == [4]
    assert truncated[0]["kept_tokens"] == TINY_QWEN_MAX_SEQ


def test_qwen_query_instruction_matches_model_prompt(qwen_stack: RunningStack, tiny_qwen_dir: object) -> None:
    ref_model = SentenceTransformer(str(tiny_qwen_dir), device="cpu", local_files_only=True)
    query = "how do pods avoid running out of memory"
    ref = ref_model.encode([query], prompt_name="query", normalize_embeddings=True)[0]
    plain = ref_model.encode([query], normalize_embeddings=True)[0]
    resp = client(qwen_stack).embeddings.create(
        model=qwen_stack.model_name, input=query, extra_body={"input_type": "query"}
    )
    got = np.array(resp.data[0].embedding)
    assert cos(got, ref) >= 0.9999
    assert cos(got, plain) < 0.999  # the instruction really changed the input
