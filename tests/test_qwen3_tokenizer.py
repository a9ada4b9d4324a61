"""Qwen3's own vocabulary (`embedserve synth-model`'s tokenizer): the same ids as tiktoken on
Qwen's ranks, the same as Hugging Face loads from the folder, and through the gateway:
instruction formatting, truncation with EOS kept last and ``usage`` counted in those ids."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiktoken
from fastapi.testclient import TestClient
from tiktoken.load import load_tiktoken_bpe
from transformers import AutoTokenizer

from embedserve.config import Settings
from embedserve.gateway.app import create_app
from embedserve.runtime.synth_model import (
    ADDED_TOKENS,
    EOS,
    PATTERN,
    QUERY_PROMPT,
    VOCAB_SIZES,
    build_tokenizer,
    ranks_file,
)
from tests.conftest import TINY_QWEN_MAX_SEQ
from tests.fake_engine import FakeEngine, HttpxEngineClient

N_TEXTS = 3000
EOS_ID = 151643  # Qwen3-Embedding's config.json: eos_token_id


def _ranges(*spans: tuple[int, int]) -> list[str]:
    return [chr(c) for lo, hi in spans for c in range(lo, hi + 1)]


# Scripts and symbols by code point: Latin with accents, Greek, Cyrillic, Hebrew, Arabic,
# Devanagari, Thai, Hangul, kana, CJK, emoji and symbols, maths, combining marks.
_CHARS = _ranges((0x20, 0x7E), (0xC0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x5D0, 0x5EA),
                 (0x620, 0x64A), (0x900, 0x97F), (0xE01, 0xE5B), (0xAC00, 0xAC80), (0x3041, 0x30FF),
                 (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x2200, 0x22FF), (0x300, 0x36F))
_PIECES = [
    "Hello", "world", "I'm", "DON'T", "they'LL", "we've", "it's", "'s", "naïve", "café", "Zürich",
    "e\u0301", "A\u030a", "\ufb01", "\uff11\uff12\uff13", "3.14159", "1,000,000", "2026-12-01", "0x1F",
    "v1.2.3",
    "数据", "模型", "向量检索", "こんにちは", "안녕하세요", "Привет", "مرحبا", "שלום", "नमस्ते",
    "😀", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "❤️", "def f(x):\n    return x**2", "{\"a\": [1, 2]}",
    "<div class='x'>", "SELECT * FROM t;", "http://example.com/a?b=c", "   ", "\t", "\n", "\r\n",
    "\n\n\n", " \n ", "\u00a0", "\u3000", "...", "!!!", "--", "—", "“quoted”", "$100", "#tag", "@user",
]


def varied_texts(n: int, seed: int = 0) -> list[str]:
    """Texts that exercise the split pattern: words, numbers, code, whitespace runs, many
    scripts, decomposed accents (NFC matters), emoji sequences, random code points."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 30)):
            kind = rng.random()
            if kind < 0.6:
                parts.append(rng.choice(_PIECES))
            elif kind < 0.9:
                parts.append("".join(rng.choice(_CHARS) for _ in range(rng.randint(1, 8))))
            else:
                parts.append(str(rng.randint(0, 10**rng.randint(1, 12))))
            parts.append(rng.choice(["", " ", " ", " ", "\n", "  "]))
        texts.append("".join(parts))
    return texts


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return build_tokenizer()


def test_ids_match_tiktoken_on_qwens_ranks(qwen3: Any) -> None:
    """The reference: tiktoken with the ranks, split pattern and added tokens, on NFC text as
    Qwen's own tokenizer normalises it."""
    ref = tiktoken.Encoding(
        "qwen3",
        pat_str=PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(ranks_file())),
        special_tokens={t: EOS_ID + i for i, t in enumerate(ADDED_TOKENS)},
    )
    texts = varied_texts(N_TEXTS)
    texts += [f"{EOS} a<|im_start|>b<think>c</think>", "<|im_end|>"]
    ours = [e.ids for e in qwen3.encode_batch(texts, add_special_tokens=False)]
    want = [ref.encode(unicodedata.normalize("NFC", t), allowed_special="all") for t in texts]
    bad = [(t, o, w) for t, o, w in zip(texts, ours, want, strict=True) if o != w]
    assert not bad, f"{len(bad)} of {len(texts)} differ, first: {bad[0]!r}"
    assert sum(map(len, ours)) > 50 * N_TEXTS  # long enough to mean something


def test_special_tokens_and_eos_are_qwen3_embeddings(qwen3: Any) -> None:
    assert qwen3.get_vocab_size(with_added_tokens=False) == EOS_ID  # 151,643 ranks
    assert qwen3.get_vocab_size() == 151669
    assert [qwen3.token_to_id(t) for t in (EOS, "<|im_start|>", "<|im_end|>", "</think>")] == [
        151643, 151644, 151645, 151668,
    ]
    ids = qwen3.encode("Hello world").ids
    assert ids[-1] == EOS_ID and qwen3.decode(ids[:-1]) == "Hello world"


def test_hugging_face_loads_the_folder_with_the_same_ids(tok_dir: Path, qwen3: Any) -> None:
    """sentence-transformers (the CPU engine's reference) loads the folder through
    AutoTokenizer: it must frame and count as the gateway's `tokenizers` does."""
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    assert (hf.eos_token, hf.eos_token_id, hf.pad_token_id) == (EOS, EOS_ID, EOS_ID)
    assert hf.padding_side == "left" and hf.bos_token is None
    texts = varied_texts(300, seed=1)
    assert hf(texts)["input_ids"] == [e.ids for e in qwen3.encode_batch(texts)]
    assert all(ids[-1] == EOS_ID for ids in hf(texts)["input_ids"])


# -- through the gateway: what the engine receives and what `usage` says --------------------


@contextlib.contextmanager
def _gateway_over(model: Path, engine: FakeEngine) -> Iterator[TestClient]:
    settings = Settings(
        model={"path": str(model)},
        engine={"kind": "external", "urls": ["http://fake-engine"]},
        gateway={"request_timeout_s": 10.0},
        health={"sample_interval_s": 60},
        _env_file=None,
    )
    transport = httpx.ASGITransport(app=engine.app())
    with TestClient(create_app(settings, engine_client=HttpxEngineClient(transport))) as c:
        deadline = time.monotonic() + 10
        while not c.app.state.pool.any_ready:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "fake engine never became ready"
            time.sleep(0.01)
        yield c


@pytest.fixture(scope="module")
def gateway(tiny_qwen_dir: Path) -> Iterator[tuple[TestClient, FakeEngine]]:
    engine = FakeEngine(dim=64)
    with _gateway_over(tiny_qwen_dir, engine) as c:
        yield c, engine


@pytest.fixture(scope="module")
def hf(tiny_qwen_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_qwen_dir))


def _embed(gateway: tuple[TestClient, FakeEngine], **body: object) -> tuple[dict[str, Any], list[list[int]]]:
    c, engine = gateway
    engine.calls.clear()
    r = c.post("/v1/embeddings", json={"model": "tiny-qwen3-embedding", **body})
    assert r.status_code == 200, r.text
    return r.json(), [ids for call in engine.calls for ids in call]


def test_query_instruction_is_tokenised_as_one_text(gateway: Any, hf: Any) -> None:
    """The prompt and the query are one string before tokenising, as sentence-transformers'
    prompt_name does: tokens may merge across the seam ("Query:" then "how")."""
    query = "how do pods avoid running out of memory"
    doc, sent = _embed(gateway, input=query, input_type="query")
    want = hf(QUERY_PROMPT + query)["input_ids"]
    assert sent == [want] and want[-1] == EOS_ID
    assert doc["usage"]["prompt_tokens"] == len(want)
    task = "Find the config setting"
    _, sent = _embed(gateway, input=query, input_type="query", instruction=task)
    assert sent == [hf(f"Instruct: {task}\nQuery:{query}")["input_ids"]]


def test_truncation_keeps_eos_last_and_usage_counts_what_was_embedded(gateway: Any, hf: Any) -> None:
    texts = ["短い", "数据 模型 😀 " * 40, "word " * 500, "x"]
    doc, sent = _embed(gateway, input=texts)
    want = [hf(t, truncation=True, max_length=TINY_QWEN_MAX_SEQ)["input_ids"] for t in texts]
    assert sent == want
    assert all(ids[-1] == EOS_ID and len(ids) <= TINY_QWEN_MAX_SEQ for ids in sent)
    assert [len(ids) for ids in sent][1:3] == [TINY_QWEN_MAX_SEQ, TINY_QWEN_MAX_SEQ]
    assert doc["usage"]["prompt_tokens"] == doc["usage"]["total_tokens"] == sum(map(len, want))
    query = "memory " * 300
    doc, sent = _embed(gateway, input=query, input_type="query")
    assert sent == [hf(QUERY_PROMPT + query, truncation=True, max_length=TINY_QWEN_MAX_SEQ)["input_ids"]]
    assert sent[0][-1] == EOS_ID and doc["usage"]["prompt_tokens"] == TINY_QWEN_MAX_SEQ


def test_a_token_past_the_models_embedding_rows_is_a_400(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Qwen3-Embedding-4B's embedding has 151,665 rows, its tokenizer 151,669 tokens: a text
    that spells `</think>` would index past the matrix (an IndexError on CPU, a device-side
    assert that kills a GPU engine). The gateway refuses it and names the token."""
    model = tmp_path / "qwen3-4b-vocab"
    shutil.copytree(tiny_qwen_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB_SIZES["4b"]}))
    engine = FakeEngine(dim=64)
    with _gateway_over(model, engine) as c:
        r = c.post("/v1/embeddings", json={"model": model.name, "input": ["fine", "a </think> b"]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "input" and err["code"] == "invalid_token_id"
        assert "input[1]" in err["message"] and "</think>" in err["message"] and "151668" in err["message"]
        assert not engine.calls
        ok = c.post("/v1/embeddings", json={"model": model.name, "input": "<|im_end|> is embedded"})
        assert ok.status_code == 200 and engine.calls[0][0][0] == 151645
