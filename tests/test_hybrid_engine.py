"""Sparse and ColBERT outputs on the CPU engine, on tiny random-weight checkpoints (``synth_hybrid``):
each output against its reference formula written here in plain torch on the same checkpoint, run
on each input alone (FlagEmbedding's BGE-M3 heads, sentence-transformers' SPLADE pooling), to
1e-4 absolute (fp32, ONNX Runtime or torch on padded micro-batches against torch unpadded); the
export's check; the engine's HTTP answers (``contracts/hybrid.py``) and its refusals; which
outputs a model folder has."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from embedserve.config import ModelSettings, Settings
from embedserve.contracts import hybrid
from embedserve.contracts.onnx_export import M3_OUTPUTS, META_FILE, MODEL_FILE, SPLADE_OUTPUTS
from embedserve.engines import hybrid_modules
from embedserve.engines.cpu import CpuEmbedder, create_engine_app
from embedserve.engines.export_cache import read_export
from embedserve.engines.export_check import ExportMismatch, refuse_mismatch
from embedserve.engines.onnx_export import Exporter
from embedserve.engines.ort_session import open_session
from embedserve.engines.sglang import LaunchConfigError, build_launch
from embedserve.model_info import ModelInfo

from .conftest import MINILM_DIR

ATOL = 1e-4
TEXTS = ["the cat sat on the mat, the cat", "hello", "a b c d e f g h", "sparse and dense retrieval"]


def settings(model: Path, export_dir: Path, **engine: object) -> Settings:
    return Settings(_env_file=None, model={"path": str(model)},
                    engine={"cpu_export_dir": str(export_dir), **engine})


def inputs(folder: Path) -> list[list[int]]:
    """Texts as the folder's tokenizer frames them, ids repeated, the unknown token inside an
    input, one token alone, and random ids of mixed lengths (padded micro-batches)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rng = np.random.default_rng(7)
    texts = [tok.encode(t).ids for t in TEXTS]
    random = [[101, *rng.integers(1000, 30000, n).tolist(), 102] for n in (0, 5, 40, 61, 17)]
    return [*texts, [101, 100, 2000, 100, 2000, 102], [2000], *random]


# -- the reference formulas, on one input, unpadded ---------------------------------------------


@functools.cache
def m3_reference_model(folder: Path) -> tuple[Any, Any, torch.nn.Linear, torch.nn.Linear]:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    heads = []
    for name in ("sparse_linear", "colbert_linear"):
        state = torch.load(folder / f"{name}.pt", weights_only=True)
        head = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
        head.load_state_dict(state)
        heads.append(head)
    return model, AutoTokenizer.from_pretrained(str(folder)), heads[0], heads[1]


def m3_reference(folder: Path, ids: list[int]) -> tuple[np.ndarray, dict[int, float], np.ndarray]:
    """FlagEmbedding's BGE-M3: dense = the CLS token's last hidden state, normalised; sparse =
    relu(sparse_linear(h)) per token, each id's largest, cls/eos/pad/unk and zeros dropped
    (``_process_token_weights``); colbert = colbert_linear(h[:, 1:]), masked, normalised."""
    model, tokenizer, sparse_linear, colbert_linear = m3_reference_model(folder)
    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    with torch.no_grad():
        h = model(input_ids=x, attention_mask=mask).last_hidden_state
        dense = torch.nn.functional.normalize(h[:, 0], dim=-1)[0].numpy()
        weights = torch.relu(sparse_linear(h)).squeeze(-1)[0].tolist()
        colbert = colbert_linear(h[:, 1:]) * mask[:, 1:][:, :, None].float()
        colbert = torch.nn.functional.normalize(colbert, dim=-1)[0].numpy()
    named = tokenizer.special_tokens_map
    unused = {tokenizer.convert_tokens_to_ids(named[t])
              for t in ("cls_token", "eos_token", "pad_token", "unk_token") if t in named}
    lexical: dict[int, float] = {}
    for w, i in zip(weights, ids, strict=True):
        if i not in unused and w > 0 and w > lexical.get(i, 0.0):
            lexical[i] = w
    return dense, lexical, colbert


@functools.cache
def mlm(folder: Path) -> Any:
    from transformers import AutoModelForMaskedLM

    return AutoModelForMaskedLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def splade_reference(folder: Path, ids: list[int]) -> dict[int, float]:
    """SPLADE pooling: log(1 + relu(MLM logits)), max over the positions; its nonzero weights."""
    with torch.no_grad():
        logits = mlm(folder)(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits
        vector = torch.log1p(torch.relu(logits)).amax(dim=1)[0]
    return {int(i): float(vector[i]) for i in torch.nonzero(vector).flatten()}


def assert_sparse_close(got: hybrid.Sparse, want: dict[int, float]) -> None:
    """Ids ascending, weights > 0, and each id's weight within ATOL of the reference's (an id one
    side keeps and the other does not must then be within ATOL of 0)."""
    assert (np.diff(got.indices) > 0).all() and (got.values > 0).all()
    mine = dict(zip(got.indices.tolist(), got.values.tolist(), strict=True))
    worst = max((abs(mine.get(i, 0.0) - want.get(i, 0.0)) for i in {*mine, *want}), default=0.0)
    assert worst <= ATOL, worst


# -- the engine's outputs against the references --------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx")


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_bge_m3_outputs_are_flagembeddings_formulas(tiny_m3_dir: Path, cache: Path, backend: str) -> None:
    e = CpuEmbedder(settings(tiny_m3_dir, cache, cpu_backend=backend, batch_token_budget=64))
    batch = inputs(tiny_m3_dir)
    got = e.hybrid(batch, ["dense", "sparse", "colbert"])
    assert got.dense is not None and got.sparse is not None and got.colbert is not None
    for i, ids in enumerate(batch):
        dense, lexical, colbert = m3_reference(tiny_m3_dir, ids)
        np.testing.assert_allclose(got.dense[i], dense, atol=ATOL)
        assert_sparse_close(got.sparse[i], lexical)
        assert got.colbert[i].shape == (len(ids) - 1, 32)  # the first token dropped
        np.testing.assert_allclose(got.colbert[i], colbert, atol=ATOL)
    assert not {i for s in got.sparse for i in s.indices.tolist()} & {100, 101, 102}  # unk, cls, eos
    repeated = [i for s, ids in zip(got.sparse, batch, strict=True) for i in s.indices if ids.count(i) > 1]
    assert repeated  # an id kept once for several tokens: the max per id is checked
    plain = e.embed(batch)  # a request without outputs: the same dense vectors
    np.testing.assert_allclose(plain, got.dense, atol=1e-6)


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_splade_outputs_are_splade_pooling(tiny_splade_dir: Path, cache: Path, backend: str) -> None:
    e = CpuEmbedder(settings(tiny_splade_dir, cache, cpu_backend=backend, batch_token_budget=64))
    batch = inputs(tiny_splade_dir)
    got = e.hybrid(batch, ["sparse"])
    assert got.dense is None and got.colbert is None and got.sparse is not None
    for i, ids in enumerate(batch):
        assert_sparse_close(got.sparse[i], splade_reference(tiny_splade_dir, ids))
    assert sum(len(s.indices) for s in got.sparse) > len(batch)  # the check is not on empty vectors


# -- the export -----------------------------------------------------------------------------------


def test_the_export_gives_the_heads_and_checks_them_against_torch(
    tiny_m3_dir: Path, tiny_splade_dir: Path, cache: Path
) -> None:
    for folder, names in ((tiny_m3_dir, M3_OUTPUTS), (tiny_splade_dir, SPLADE_OUTPUTS)):
        built, meta = Exporter(settings(folder, cache)).build("none")
        assert tuple(o.name for o in open_session(built / MODEL_FILE).get_outputs()) == names
        assert read_export(built) == meta and (built / META_FILE).exists()
        assert meta.max_sparse_diff_vs_torch is not None and meta.max_sparse_diff_vs_torch <= 1e-3
        if folder == tiny_m3_dir:  # vectors, token states and ColBERT vectors
            assert meta.min_cosine_vs_torch is not None and meta.min_cosine_vs_torch >= 0.9999
        else:
            assert meta.min_cosine_vs_torch is None and meta.dimension == meta.vocab_size == 30522


def test_a_head_whose_graph_is_not_torchs_is_refused(
    tiny_m3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token weight that counts the padding: the graph on padded batches differs from torch on
    each input alone, so the export is refused and nothing is cached."""
    right = hybrid_modules.M3Heads.forward

    def padded_weights(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        vectors, states, weights, colbert = right(self, input_ids, attention_mask)
        return vectors, states, weights + (1 - attention_mask).sum(dim=1, keepdim=True), colbert

    monkeypatch.setattr(hybrid_modules.M3Heads, "forward", padded_weights)
    with pytest.raises(ExportMismatch, match=r"sparse weights differ from torch's"):
        Exporter(settings(tiny_m3_dir, tmp_path)).build("none")
    assert list(tmp_path.iterdir()) == []


def test_refusals_name_the_output_that_differs() -> None:
    with pytest.raises(ExportMismatch, match=r"sparse weights differ .*by up to 0\.01 > 0\.001"):
        refuse_mismatch(min_cosine_vs_torch=1.0, max_sparse_diff_vs_torch=0.01)
    refuse_mismatch(min_cosine_vs_torch=0.99995, max_sparse_diff_vs_torch=1e-6)


# -- the engine's HTTP answers --------------------------------------------------------------------


def post(c: TestClient, batch: list[list[int]], outputs: list[Any] | None) -> Any:
    plain = orjson.dumps({"input": batch})
    body = hybrid.encode_request("m", batch, outputs) if outputs is not None else plain
    return c.post("/v1/embeddings", content=body)


def test_the_engine_answers_what_is_asked_and_refuses_what_the_model_has_not(
    tiny_m3_dir: Path, tiny_splade_dir: Path, cache: Path
) -> None:
    batch = [[101, 2000, 3000, 2000, 102], [101, 4000, 102], [101]]
    with TestClient(create_engine_app(settings(tiny_m3_dir, cache))) as c:
        assert c.get("/get_model_info").json()["outputs"] == ["dense", "sparse", "colbert"]
        cases: list[list[hybrid.Output]] = [["dense"], ["sparse"], ["colbert"], ["sparse", "dense"],
                                            ["dense", "sparse", "colbert"]]
        for asked in cases:
            r = post(c, batch, asked)
            assert r.status_code == 200, r.text
            got = hybrid.decode_response(r.content, len(batch), asked)
            assert [x is not None for x in (got.dense, got.sparse, got.colbert)] == [
                o in asked for o in hybrid.OUTPUTS]
            data = r.json()["data"]
            assert all(("sparse" in d) == ("sparse" in asked) and ("colbert" in d) == ("colbert" in asked)
                       for d in data)
            if got.colbert is not None:
                assert [m.shape[0] for m in got.colbert] == [4, 2, 0]
        plain = post(c, batch, None)
        assert plain.status_code == 200 and len(plain.json()["data"]) == 3
        for bad, why in (([], "at least one of dense, sparse, colbert"), (["lexical"], "expected")):
            r = post(c, batch, bad)
            assert r.status_code == 400 and why in r.json()["message"]
        chunked = orjson.dumps({"input": batch[:1], "outputs": ["dense"], "chunks": [[[0, 2]]]})
        r = c.post("/v1/embeddings", content=chunked)
        assert r.status_code == 400 and "does not go with 'outputs'" in r.json()["message"]
    with TestClient(create_engine_app(settings(tiny_splade_dir, cache))) as c:
        assert c.get("/get_model_info").json()["outputs"] == ["sparse"]
        r = post(c, batch, ["sparse", "colbert"])
        assert r.status_code == 400
        assert r.json()["message"] == "this model has no colbert output: this model's outputs are sparse"
        r = post(c, batch, None)  # a plain request asks for the dense vector
        assert r.status_code == 400 and "this model's outputs are sparse" in r.json()["message"]
        assert post(c, batch, ["sparse"]).status_code == 200


def test_a_dense_model_answers_outputs_dense_and_refuses_the_others(cache: Path) -> None:
    s = Settings(_env_file=None, engine={"cpu_backend": "torch"})
    batch = [[101, 7592, 2088, 102], [101, 2088, 102]]
    with TestClient(create_engine_app(s)) as c:
        assert c.get("/get_model_info").json()["outputs"] == ["dense"]
        r = post(c, batch, ["dense"])
        got = hybrid.decode_response(r.content, 2, ["dense"])
        plain = post(c, batch, None).json()["data"]
        assert got.dense is not None
        np.testing.assert_allclose(got.dense, np.array([d["embedding"] for d in plain]), atol=1e-6)
        r = post(c, batch, ["dense", "sparse"])
        assert r.status_code == 400
        assert r.json()["message"] == "this model has no sparse output: this model's outputs are dense"


# -- which outputs a folder has; SGLang ------------------------------------------------------------


def folder_with(tmp_path: Path, name: str, config: dict[str, Any], files: dict[str, str]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 8, **config}))
    for path, text in files.items():
        (d / path).parent.mkdir(parents=True, exist_ok=True)
        (d / path).write_text(text)
    return d


def test_model_folders_say_their_outputs(
    tiny_m3_dir: Path, tiny_splade_dir: Path, tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    def outputs(folder: Path) -> tuple[str, ...]:
        return ModelInfo.load(ModelSettings(path=str(folder))).outputs

    assert outputs(tiny_m3_dir) == ("dense", "sparse", "colbert")
    assert outputs(tiny_splade_dir) == ("sparse",)
    assert outputs(MINILM_DIR) == outputs(tiny_qwen_dir) == ("dense",)
    mlm_arch = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 30522}
    assert outputs(folder_with(tmp_path, "bare-mlm", mlm_arch, {})) == ("sparse",)
    mpnet = {"model_type": "mpnet", "architectures": ["MPNetForMaskedLM"]}  # all-mpnet-base-v2's config
    pooled = {"1_Pooling/config.json": '{"word_embedding_dimension": 8}'}
    assert outputs(folder_with(tmp_path, "mpnet", mpnet, pooled)) == ("dense",)
    one_head = {"model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"]}
    assert outputs(folder_with(tmp_path, "m3-half", one_head, {"sparse_linear.pt": ""})) == ("dense",)
    assert ModelInfo.load(ModelSettings(path=str(tiny_splade_dir))).dimension == 30522


def test_sglang_refuses_a_model_without_a_dense_vector(tiny_m3_dir: Path, tiny_splade_dir: Path) -> None:
    with pytest.raises(LaunchConfigError, match=r"sparse vectors only.*engine\.kind=cpu"):
        build_launch(Settings(_env_file=None, model={"path": str(tiny_splade_dir)}), gpu_capability=(9, 0))
    m3 = Settings(_env_file=None, model={"path": str(tiny_m3_dir)})
    argv = build_launch(m3, gpu_capability=(9, 0)).argv
    assert "--is-embedding" in argv  # BGE-M3 runs there for its dense vector


def test_synth_model_builds_both_kinds(tmp_path: Path) -> None:
    from embedserve.runtime.synth_model import main

    assert main(["tiny", str(tmp_path / "s"), "--kind", "splade"]) == 0
    assert ModelInfo.load(ModelSettings(path=str(tmp_path / "s"))).outputs == ("sparse",)
    with pytest.raises(SystemExit):
        main(["bge-m3", str(tmp_path / "x"), "--kind", "splade"])  # a shape of the other kind
