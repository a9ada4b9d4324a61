"""Qwen3-Reranker's score head on SGLang's embedding path (embedserve/engines/label_head.py), on CPU:
the pooler it puts in place of SGLang's gives, from a packed batch's hidden states, what a
transformers forward of the same checkpoint gives as ``logit(yes) - logit(no)`` after each prompt."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from embedserve.engines import label_head

FIXTURES = Path(__file__).resolve().parent / "fixtures"
YES, NO = 17, 230


@pytest.fixture(scope="module")
def tiny() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture
def pooler_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's ``EmbeddingPoolerOutput`` (a dataclass with ``embeddings``), without SGLang."""
    mod = types.ModuleType("sglang.srt.layers.pooler")
    mod.EmbeddingPoolerOutput = types.SimpleNamespace  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.layers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.pooler", mod)


@torch.no_grad()
def test_the_pooler_gives_the_label_logit_transformers_gives(
        tiny: Qwen3ForCausalLM, pooler_output: None) -> None:
    lens = [5, 1, 17, 9]
    seqs = [torch.randint(0, 300, (n,)) for n in lens]
    reference = torch.stack([tiny(input_ids=s[None]).logits[0, -1] for s in seqs])
    want = (reference[:, YES] - reference[:, NO]).tolist()
    packed = torch.cat([tiny.model(input_ids=s[None]).last_hidden_state[0] for s in seqs])  # after the norm
    model = types.SimpleNamespace(lm_head=tiny.lm_head, pooler=None)
    label_head.install(model, yes_id=YES, no_id=NO)
    out: Any = model.pooler(packed, types.SimpleNamespace(extend_seq_lens=torch.tensor(lens)))
    assert out.embeddings.shape == (4, 1) and out.embeddings.dtype == torch.float32
    assert out.embeddings[:, 0].tolist() == pytest.approx(want, abs=1e-5)
    assert len({round(x, 3) for x in want}) == 4  # the pairs' scores tell them apart
    swapped = types.SimpleNamespace(lm_head=tiny.lm_head, pooler=None)
    label_head.install(swapped, yes_id=NO, no_id=YES)
    flipped: Any = swapped.pooler(packed, types.SimpleNamespace(extend_seq_lens=torch.tensor(lens)))
    assert flipped.embeddings[:, 0].tolist() == pytest.approx([-x for x in want], abs=1e-5)


def test_a_head_split_across_gpus_or_too_small_stops_the_engine() -> None:
    split = types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=torch.zeros(300, 8), tp_size=2))
    with pytest.raises(RuntimeError, match="no whole LM head"):
        label_head.after_init(None, split, yes_id=YES, no_id=NO)
    small = types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=torch.zeros(100, 8)))
    with pytest.raises(RuntimeError, match="no whole LM head"):
        label_head.install(small, yes_id=YES, no_id=NO)
    with pytest.raises(RuntimeError, match="no whole LM head"):
        label_head.install(types.SimpleNamespace(), yes_id=YES, no_id=NO)


def test_the_hook_and_the_replaced_pooler_match_sglang_0_5_17() -> None:
    """An AFTER hook on the class SGLang builds Qwen3-Reranker as, whose ``__init__`` makes the
    ``pooler`` and ``lm_head`` that the head replaces and reads (recorded from the wheel)."""
    registered: list[tuple[str, Any, str]] = []
    registry = types.SimpleNamespace(register=lambda *hook: registered.append(hook))
    label_head.register(registry, types.SimpleNamespace(AFTER="after"), yes_id=YES, no_id=NO)
    assert [(t, k) for t, _, k in registered] == [(f"{label_head.MODEL_CLASS}.__init__", "after")]
    assert registered[0][1].keywords == {"yes_id": YES, "no_id": NO}
    fixture = json.loads((FIXTURES / "sglang_0.5.17_hooks.json").read_text())
    assert f"{label_head.MODEL_CLASS}.__init__" in fixture["methods"]
    assert fixture["methods"][f"{label_head.MODEL_CLASS}.forward"]["args"][:4] == [
        "self", "input_ids", "positions", "forward_batch"]
