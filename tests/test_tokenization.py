"""Truncation keeps the model's special tokens, exactly as Hugging Face truncates."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from embedserve.core.tokenize import ModelTokenizer, UnknownTokens
from tests.conftest import MINILM_DIR

TEXTS = ["short", "数据 模型 😀 " * 300, "word " * 1000, "x"]


@pytest.mark.parametrize("max_len", [8, 64, 256])
def test_minilm_truncation_matches_hf(max_len: int) -> None:
    hf = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    ours = ModelTokenizer(MINILM_DIR, max_len)
    for text, got in zip(TEXTS, ours.encode_texts(TEXTS), strict=True):
        want = hf(text, truncation=True, max_length=max_len)["input_ids"]
        assert got.ids == want
        assert got.ids[0] == hf.cls_token_id and got.ids[-1] == hf.sep_token_id
        assert got.truncated == (len(hf(text)["input_ids"]) > max_len)


def test_qwen_keeps_eos_last(tiny_qwen_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(tiny_qwen_dir))
    ours = ModelTokenizer(tiny_qwen_dir, 16)
    for text, got in zip(TEXTS, ours.encode_texts(TEXTS), strict=True):
        assert got.ids[-1] == hf.eos_token_id
        assert got.ids == hf(text, truncation=True, max_length=16)["input_ids"]
        assert len(got.ids) <= 16


def test_token_ids_keep_the_frame_when_cut() -> None:
    ours = ModelTokenizer(MINILM_DIR, 6)
    framed = [101, 5, 6, 7, 8, 9, 10, 102]
    assert ours.frame_token_ids(framed).ids == [101, 5, 6, 7, 8, 102]
    assert ours.frame_token_ids([5, 6, 7, 8, 9, 10, 11]).ids == [5, 6, 7, 8, 9, 10]
    short = ours.frame_token_ids([5, 6])
    assert short.ids == [5, 6] and not short.truncated


def test_eos_is_appended_when_tokenizer_forgets(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Early Qwen3-Embedding revisions shipped a tokenizer without the EOS post-processor."""
    import json
    import shutil

    shutil.copytree(tiny_qwen_dir, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    tj = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    tj["post_processor"] = None
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(tj))
    ours = ModelTokenizer(tmp_path / "m", 16)
    eos = ModelTokenizer(tiny_qwen_dir, 16).suffix
    assert ours.suffix == eos and ours.encode_texts(["hello"])[0].ids[-1] == eos[0]


class CountingTokenizer:
    """A ``tokenizers.Tokenizer`` that counts the texts it encodes with offsets (the second look)."""

    def __init__(self, tok: object) -> None:
        self.tok, self.encodes, self.fast = tok, 0, 0

    def encode(self, *args: object, **kwargs: object) -> object:
        self.encodes += 1
        return self.tok.encode(*args, **kwargs)  # type: ignore[attr-defined]

    def encode_batch(self, texts: list[str], **kwargs: object) -> object:
        self.encodes += len(texts)
        return self.tok.encode_batch(texts, **kwargs)  # type: ignore[attr-defined]

    def encode_batch_fast(self, texts: list[str], **kwargs: object) -> object:
        self.fast += len(texts)
        return self.tok.encode_batch_fast(texts, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.tok, name)


def test_text_the_tokenizer_cannot_spell_is_counted_as_unknown() -> None:
    """MiniLM's WordPiece turns a word over 100 characters, or one with a character outside
    its vocabulary, into one [UNK]: the model sees none of those characters. Only inputs that
    hold [UNK] are tokenised a second time; only the [UNK]s that are embedded count."""
    ours = ModelTokenizer(MINILM_DIR, 256)
    counting = CountingTokenizer(ours._tok)
    ours.unknowns._tok = counting  # type: ignore[assignment]
    texts = ["plain English text, 日本語 and café", "a" * 200_000, "hello 😀 world",
             ("x" * 150 + " ") * 1000]
    plain, blob, emoji, long_words = ours.encode_texts(texts)
    assert plain.unknown is None and counting.encodes == 3  # the plain text: one look only
    assert blob.unknown == UnknownTokens(tokens=1, chars=200_000) and len(blob.ids) == 3
    assert emoji.unknown == UnknownTokens(tokens=1, chars=1)
    assert long_words.truncated and long_words.unknown == UnknownTokens(tokens=254, chars=254 * 150)


def test_where_most_texts_hold_unknown_tokens_they_are_encoded_once_with_offsets() -> None:
    """Chinese sent to an English WordPiece model: every such text would be encoded twice; after
    a few batches of them, the one encoding has offsets. The answers are the same either way, and
    plain English brings the fast encoding back."""
    ours = ModelTokenizer(MINILM_DIR, 16)
    counting = CountingTokenizer(ours._tok)
    ours.unknowns._tok = counting  # type: ignore[assignment]
    mixed = [f"query {i}: 向量 检索 and 😀 " + "word " * i for i in range(32)]
    first = ours.encode_texts(mixed)
    assert (counting.fast, counting.encodes) == (32, 32)  # the fast encoding, then again with offsets
    assert first[0].unknown == UnknownTokens(tokens=5, chars=5)
    assert first[31].truncated and first[31].unknown == UnknownTokens(tokens=5, chars=5)
    counting.fast = counting.encodes = 0
    assert ours.encode_texts(mixed) == first
    assert (counting.fast, counting.encodes) == (0, 32)  # once each, with offsets
    ours.encode_texts([f"plain text {i}" for i in range(300)])
    counting.fast = counting.encodes = 0
    assert ours.encode_texts(["plain again"])[0].unknown is None
    assert (counting.fast, counting.encodes) == (1, 0)


def test_a_byte_level_tokenizer_has_no_unknown_token(tiny_qwen_dir: Path) -> None:
    ours = ModelTokenizer(tiny_qwen_dir, 64)
    assert ours.unknowns.unknown_id is None
    assert all(x.unknown is None for x in ours.encode_texts(["a" * 5000, "hello 😀 world"]))
