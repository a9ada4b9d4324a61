"""Truncation from the start (Cohere's ``truncate: "START"``, TEI's ``truncation_direction: "left"``)
keeps the model's special tokens and the text's end, exactly as Hugging Face's left truncation."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from embedserve.core.tokenize import ModelTokenizer
from tests.conftest import MINILM_DIR
from tests.test_tokenization import TEXTS


@pytest.mark.parametrize("max_len", [8, 64])
def test_minilm_left_truncation_matches_hf(max_len: int) -> None:
    hf = AutoTokenizer.from_pretrained(str(MINILM_DIR), truncation_side="left")
    ours = ModelTokenizer(MINILM_DIR, max_len)
    for text, got in zip(TEXTS, ours.encode_texts(TEXTS, from_start=True), strict=True):
        assert got.ids == hf(text, truncation=True, max_length=max_len)["input_ids"]


def test_qwen_left_truncation_keeps_eos_last(tiny_qwen_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(tiny_qwen_dir), truncation_side="left")
    ours = ModelTokenizer(tiny_qwen_dir, 16)
    for text, got in zip(TEXTS, ours.encode_texts(TEXTS, from_start=True), strict=True):
        assert got.ids == hf(text, truncation=True, max_length=16)["input_ids"]
        assert got.ids[-1] == hf.eos_token_id


def test_keep_head_keeps_the_first_tokens_and_counts_unknowns_where_kept() -> None:
    ours = ModelTokenizer(MINILM_DIR, 12)
    text = "instruction words here " + "filler " * 40 + "😀" * 3 + " end"
    whole = ModelTokenizer(MINILM_DIR, 512).encode_texts([text])[0].ids
    (got,) = ours.encode_texts([text], from_start=True, keep_head=3)
    assert got.ids == whole[:4] + whole[-8:]  # [CLS], 3 kept, the last 7 and [SEP]
    assert got.unknown is not None and got.unknown.tokens == 1  # the emoji at the end: one [UNK]
    (head,) = ours.encode_texts([text])
    assert head.unknown is None  # cut at the end, the emoji are gone


def test_token_ids_cut_from_the_start_keep_the_frame() -> None:
    ours = ModelTokenizer(MINILM_DIR, 6)
    assert ours.frame_token_ids([101, 5, 6, 7, 8, 9, 10, 102], from_start=True).ids == [101, 7, 8, 9, 10, 102]
