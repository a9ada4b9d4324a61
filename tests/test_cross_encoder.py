"""The vectorised cross-encoder (``engine.vectorised_cross_encoder``) against SGLang 0.5.17's per-sequence
loops and transformers' forward of a tiny XLM-R cross-encoder. SGLang does not run without a GPU: its
loops are copied here from its wheel (``srt/models/roberta.py``, ``srt/layers/pooler.py``, their
code's digests checked against tests/fixtures/sglang_0.5.17_hooks.json), its modules played by
transformers' (the same attributes), its forward batch by a namespace with its fields."""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

from embedserve.engines import cross_encoder
from embedserve.runtime.synth_rerank import CROSS_ENCODER_SHAPES

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PAD = 1  # XLM-R's pad id (bge-reranker-v2-m3's)
#: the code of SGLang 0.5.17's methods the hooks stand in for, as the copies below were made from
SOURCES = {
    "sglang.srt.models.roberta.RobertaEmbedding.forward":
        "2db8858907e431186c44f1545e5f8def96c3eac5da3b9047181d697948d27b19",
    "sglang.srt.models.roberta.RobertaClassificationHead.forward":
        "a9133c8c7822b12f2f07d9ba333147e277fcb264d608371a39f8962ffe165f22",
    "sglang.srt.layers.pooler.CrossEncodingPooler.forward":
        "c21a408810e18e2cece9f8747391a3bee8b8d51f82510a740e2f9c0151a9c87a",
}


# -- SGLang 0.5.17's loops, as its wheel has them ----------------------------------------------------

def sglang_create_position_ids_from_input_ids(input_ids: torch.Tensor, padding_idx: int,
                                              past_key_values_length: int = 0) -> torch.Tensor:
    mask = input_ids.ne(padding_idx).int()
    incremental_indices = (torch.cumsum(mask, dim=0).type_as(mask) + past_key_values_length) * mask
    return incremental_indices.long() + padding_idx


def sglang_position_ids(input_ids: torch.Tensor, seq_lens: torch.Tensor, position_ids: torch.Tensor,
                        padding_idx: int) -> torch.Tensor:
    """``RobertaEmbedding.forward``'s loop."""
    pos_list, token_list, offset = [], [], 0
    for seq_len in seq_lens:
        pos_list.append(position_ids[offset: offset + seq_len])
        token_list.append(input_ids[offset: offset + seq_len])
        offset += seq_len
    new_pos_list = []
    for positions, tokens in zip(pos_list, token_list, strict=True):
        assert torch.equal(positions, torch.arange(positions.size()[0], dtype=torch.long))
        new_pos_list.append(sglang_create_position_ids_from_input_ids(tokens, padding_idx))
    return torch.cat(new_pos_list)


def sglang_head(head: Any, features: torch.Tensor) -> torch.Tensor:
    """``RobertaClassificationHead.forward``: the slice's first row."""
    return head.out_proj(torch.tanh(head.dense(features[0, :])))


def sglang_pooler(head: Any, hidden_states: torch.Tensor, forward_batch: Any) -> torch.Tensor:
    """``CrossEncodingPooler.forward`` without a pooler (XLM-R's), the identity activation (bge's)."""
    offset, pooled_data_lst = 0, []
    for prompt_len in forward_batch.extend_seq_lens:
        pooled_data_lst.append(sglang_head(head, hidden_states[offset: offset + prompt_len]))
        offset += prompt_len
    return torch.stack(pooled_data_lst).squeeze(-1)


# -- stand-ins ---------------------------------------------------------------------------------------

def batch(lens: list[int], seed: int, pad_share: float = 0.2) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Packed token ids (some of them the pad id, inside sequences too), SGLang's forward batch fields
    and its positions (0 .. n-1 per sequence)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    ids = torch.randint(3, 300, (total,), generator=g)
    ids[torch.rand(total, generator=g) < pad_share] = PAD
    fb = types.SimpleNamespace(seq_lens=torch.tensor(lens), extend_seq_lens=torch.tensor(lens),
                               token_type_ids=None)
    return ids, fb, torch.cat([torch.arange(n) for n in lens])


@pytest.fixture(scope="module")
def tiny() -> XLMRobertaForSequenceClassification:
    """synth-model's tiny-xlmr shape with XLM-R's pad id and a small vocabulary, in fp32."""
    torch.manual_seed(0)
    dims = {**CROSS_ENCODER_SHAPES["tiny-xlmr"], "vocab_size": 300, "pad_token_id": PAD, "num_labels": 1}
    model = XLMRobertaForSequenceClassification(XLMRobertaConfig(**dims)).eval()
    for name, p in model.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            torch.nn.init.normal_(p, std=dims["hidden_size"] ** -0.5)
    return model


def sglang_model(hf: Any) -> Any:
    """``XLMRobertaForSequenceClassification`` as SGLang 0.5.17 builds it: ``roberta.embeddings`` (with
    ``padding_idx``), ``classifier`` (dense, out_proj), ``pooler`` (a ``CrossEncodingPooler``)."""
    embeddings = hf.roberta.embeddings
    embeddings.padding_idx = hf.config.pad_token_id
    pooler: Any = torch.nn.Module()
    pooler.classifier, pooler.pooler, pooler.default_activation_function = (
        hf.classifier, None, torch.nn.Identity())
    model = types.SimpleNamespace(roberta=hf.roberta, classifier=hf.classifier, pooler=pooler)
    return model


# -- the tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_the_batch_position_ids_are_sglangs_per_sequence_ones(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    lens = torch.randint(1, 40, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
    lens[int(torch.randint(0, len(lens), (1,), generator=g))] = 1  # length-1 sequences among them
    ids, fb, positions = batch([1, *lens, 1], seed, pad_share=0.1 * (seed % 4))
    got = cross_encoder.batch_position_ids(ids, fb.seq_lens, PAD)
    assert got.dtype == torch.long
    assert torch.equal(got, sglang_position_ids(ids, fb.seq_lens, positions, PAD))


def test_the_position_ids_restart_with_each_sequence_and_skip_the_pad_id() -> None:
    ids = torch.tensor([5, 6, PAD, 7, 8, 9, PAD, 4])
    got = cross_encoder.batch_position_ids(ids, torch.tensor([4, 1, 3]), PAD)
    assert got.tolist() == [2, 3, PAD, 4, 2, 2, PAD, 3]
    assert cross_encoder.batch_position_ids(ids[:0], torch.tensor([], dtype=torch.long), PAD).numel() == 0


@torch.no_grad()
def test_the_embeddings_are_transformers_ones_sequence_by_sequence(tiny: Any) -> None:
    lens = [9, 1, 17, 4, 1]
    ids, fb, positions = batch(lens, 7)
    model = sglang_model(tiny)
    packed = cross_encoder.embedding_forward(model.roberta.embeddings, input_ids=ids, seq_lens=fb.seq_lens,
                                             position_ids=positions, forward_batch=fb)
    reference = torch.cat([tiny.roberta.embeddings(input_ids=s[None])[0] for s in ids.split(lens)])
    torch.testing.assert_close(packed, reference, rtol=0, atol=1e-6)


@torch.no_grad()
def test_the_head_once_per_batch_gives_the_per_sequence_logits(tiny: Any) -> None:
    lens = [5, 1, 23, 8, 1, 2]
    ids, fb, _ = batch(lens, 3)
    seqs = ids.split(lens)
    hidden = torch.cat([tiny.roberta(input_ids=s[None]).last_hidden_state[0] for s in seqs])
    model = sglang_model(tiny)
    output = types.SimpleNamespace
    scores = cross_encoder.pooler_forward(model.pooler, output, hidden, fb).embeddings
    assert scores.shape == (len(lens),)
    torch.testing.assert_close(scores, sglang_pooler(tiny.classifier, hidden, fb), rtol=0, atol=1e-6)
    transformers = torch.cat([tiny(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(scores, transformers, rtol=0, atol=1e-6)


@torch.no_grad()
def test_install_swaps_both_forwards_and_leaves_a_model_with_a_pooler_as_it_is(tiny: Any) -> None:
    lens = [3, 1, 12]
    ids, fb, positions = batch(lens, 11)
    hf = XLMRobertaForSequenceClassification(tiny.config).eval()
    hf.load_state_dict(tiny.state_dict())
    model = sglang_model(hf)
    assert cross_encoder.install(model, types.SimpleNamespace)
    embedded = model.roberta.embeddings(input_ids=ids, seq_lens=fb.seq_lens, position_ids=positions,
                                        forward_batch=fb)  # as XLMRobertaBaseModel.forward calls it
    hidden = torch.cat([model.roberta.encoder(e[None]).last_hidden_state[0] for e in embedded.split(lens)])
    scores = model.pooler(hidden, fb).embeddings
    reference = torch.cat([tiny(input_ids=s[None]).logits[0] for s in ids.split(lens)])
    torch.testing.assert_close(scores, reference, rtol=0, atol=1e-6)
    pooled = sglang_model(tiny)
    pooled.pooler.pooler = torch.nn.Identity()  # BERT's cross-encoders pool first: not this path's
    assert not cross_encoder.install(pooled, types.SimpleNamespace)
    assert "forward" not in vars(pooled.pooler)
    cross_encoder.after_init(None, object())  # no SGLang here: logged, not raised


def test_the_hooks_and_what_they_stand_in_for_match_sglang_0_5_17() -> None:
    """The hooked ``__init__``, the replaced methods' arguments (SGLang calls the embeddings with
    keywords), the attributes the hooks read, and the replaced code as the copies above have it."""
    registered: list[tuple[str, Any, str]] = []
    cross_encoder.register(types.SimpleNamespace(register=lambda *hook: registered.append(hook)),
                           types.SimpleNamespace(AFTER="after"))
    methods = json.loads((FIXTURES / "sglang_0.5.17_hooks.json").read_text())["methods"]
    assert [(t, k) for t, _, k in registered] == [(f"{cross_encoder.MODEL_CLASS}.__init__", "after")]
    assert registered[0][0] in methods
    model_init = methods[f"{cross_encoder.MODEL_CLASS}.__init__"]["self_attrs"]
    assert {"roberta", "classifier", "pooler"} <= set(model_init)
    embedding = "sglang.srt.models.roberta.RobertaEmbedding"
    assert list(inspect.signature(cross_encoder.embedding_forward).parameters)[1:] == \
        methods[f"{embedding}.forward"]["args"][1:]
    assert {"padding_idx", "word_embeddings", "position_embeddings", "token_type_embeddings",
            "LayerNorm"} <= set(methods[f"{embedding}.__init__"]["self_attrs"])
    pooler = "sglang.srt.layers.pooler.CrossEncodingPooler"
    assert list(inspect.signature(cross_encoder.pooler_forward).parameters)[2:] == \
        methods[f"{pooler}.forward"]["args"][1:]
    assert {"classifier", "pooler", "default_activation_function"} <= set(
        methods[f"{pooler}.__init__"]["self_attrs"])
    head = "sglang.srt.models.roberta.RobertaClassificationHead"
    assert {"dense", "out_proj"} <= set(methods[f"{head}.__init__"]["self_attrs"])
    assert methods["sglang.srt.models.roberta.XLMRobertaBaseModel.forward"]["args"][:4] == [
        "self", "input_ids", "positions", "forward_batch"]
    assert {t: methods[t]["source_sha256"] for t in SOURCES} == SOURCES
