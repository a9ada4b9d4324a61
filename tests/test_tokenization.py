"""Truncation keeps the model's special tokens, exactly as Hugging Face truncates."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from embedserve.gateway.tokenize import ModelTokenizer
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
