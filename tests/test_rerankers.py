"""Rerankers: a cross-encoder (a tiny random-weight BertForSequenceClassification with the bundled
model's tokenizer) and Qwen3-Reranker (a tiny random-weight Qwen3 causal LM with Qwen3's
tokenizer), served by one CPU stack beside the bundled embedding model and compared with a plain
transformers forward of the same checkpoint; the pair framing and truncation against the
tokenizers library's; the SGLang side by its launch argv and its answers' shapes (no GPU here)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedserve.config import BUNDLED_MODEL, ModelSettings, Settings
from embedserve.contracts.wire import WireError
from embedserve.core.pairs import (
    QWEN3_RERANK_PREFIX,
    QWEN3_RERANK_SUFFIX,
    QWEN3_RERANK_TASK,
    QWEN3_RERANK_TEMPLATE,
    CrossEncoderPairs,
    YesNoPrompts,
    load_tokenizer,
    longest_first,
)
from embedserve.core.tokenize import UnknownTokens
from embedserve.engines.onnx_export import export_folder
from embedserve.engines.sglang import LaunchConfigError, build_launch
from embedserve.model_info import ModelInfo
from embedserve.settings_errors import ConfigError
from embedserve.upstream.protocols import ENCODE, protocol_for
from tests.conftest import CROSS_ENCODER, MINILM_DIR, QWEN3_RERANKER, RunningStack, start_stack, wait_until
from tests.test_models import EMBED

QUERY = "how do I sort a list in python"
DOCS = [
    "list.sort() sorts the list in place",
    "bananas are yellow " * 200,
    "sorted() returns a new list",
    "a document that spells [SEP] and <|im_end|> in its text",
]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# -- references: a plain transformers forward ---------------------------------------------


def cross_encoder_logits(model_dir: Path, query: str, docs: list[str], max_length: int) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    # special tokens in the text are text, as the service reads them (split_special_tokens)
    enc = tok(
        [query] * len(docs),
        docs,
        truncation=True,
        max_length=max_length,
        padding=True,
        return_tensors="pt",
        split_special_tokens=True,
    )
    with torch.no_grad():
        return model(**enc).logits[:, 0].double().numpy()


def qwen3_reranker_scores(model_dir: Path, query: str, docs: list[str], max_length: int) -> np.ndarray:
    """The model card's code: prefix + the formatted pair (cut to fit) + suffix; the last
    position's logits of "no" and "yes", softmax, the probability of "yes"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    prefix = tok.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    out = []
    for doc in docs:
        text = QWEN3_RERANK_TEMPLATE.format(instruction=QWEN3_RERANK_TASK, query=query, document=doc)
        middle = tok(
            text,
            add_special_tokens=False,
            truncation=True,
            split_special_tokens=True,
            max_length=max_length - len(prefix) - len(suffix),
        )["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prefix + middle + suffix])).logits[0, -1]
        out.append(torch.log_softmax(logits[[no, yes]].double(), dim=0)[1].exp().item())
    return np.asarray(out)


@pytest.fixture(scope="module")
def models_stack(
    tiny_cross_encoder_dir: Path, tiny_reranker_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    """One ``up`` serving the bundled model, a cross-encoder (on ONNX Runtime, the default) and
    Qwen3-Reranker (on torch, capped at 256 tokens): several models behind one gateway, and each
    reranker as the CPU stack serves it; one stack for all: starting engines is most of the cost."""
    models = [
        {"kind": "embed", "path": BUNDLED_MODEL},
        {"kind": "rerank", "path": str(tiny_cross_encoder_dir)},
        {"kind": "rerank", "path": str(tiny_reranker_dir), "max_seq_len": 256,
         "engine": {"cpu_backend": "torch"}},
    ]
    env = {"EMBEDSERVE_SERVED__MODELS": json.dumps(models)}
    stack = start_stack(BUNDLED_MODEL, tmp_path_factory.mktemp("models-stack"), env=env)
    yield stack
    assert stack.stop() == 0


@pytest.mark.slow
def test_up_serves_the_bundled_model_beside_two_rerankers(models_stack: RunningStack) -> None:
    """A cross-encoder and Qwen3-Reranker (the tests below check their scores); the
    stack ends with exit 0 (the fixture's teardown asserts it)."""
    served = [EMBED, CROSS_ENCODER, QWEN3_RERANKER]
    with httpx.Client(base_url=models_stack.url, timeout=60) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == served
        assert c.post("/v1/embeddings", json={"model": EMBED, "input": "hello"}).status_code == 200
        r = c.post("/v1/rerank", json={"query": "hello", "documents": ["hello world", "tea"]})
        assert r.status_code == 200 and r.json()["model"] == CROSS_ENCODER  # the first rerank model
        engines = c.get("/health/memory").json()["engines"]
        assert sorted(e["model"] for e in engines) == sorted(served)
        assert all(e["ready"] for e in engines)
        wait_until(lambda: len(c.get("/health/memory").json().get("allocator") or []) == 3, timeout=60)
        stats = c.get("/health/memory").json()["allocator"]
        assert sorted(s["model"] for s in stats) == sorted(served)
    banner = f"models '{EMBED}', '{CROSS_ENCODER}' (rerank), '{QWEN3_RERANKER}' (rerank)"
    assert banner in models_stack.log_text()


def rerank(stack: RunningStack, model: str, **extra: Any) -> dict[str, Any]:
    request = {"model": model, "query": QUERY, "documents": DOCS, **extra}
    r = httpx.post(stack.url + "/v1/rerank", json=request, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-embedserve-score"] == "logit"
    body: dict[str, Any] = r.json()
    return body


@pytest.mark.slow
def test_the_cpu_stack_serves_a_cross_encoder_as_transformers_scores_it(
    models_stack: RunningStack, tiny_cross_encoder_dir: Path
) -> None:
    """ONNX Runtime (the default backend) on the export, against torch through transformers.
    The routes that name no model take the first rerank model: this one."""
    want = cross_encoder_logits(tiny_cross_encoder_dir, QUERY, DOCS, 512)
    out = rerank(models_stack, CROSS_ENCODER)
    assert [x["index"] for x in out["results"]] == np.argsort(-want, kind="stable").tolist()
    got = {x["index"]: x["relevance_score"] for x in out["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], sigmoid(want), atol=1e-5)
    raw_results = rerank(models_stack, CROSS_ENCODER, raw_scores=True)["results"]
    raw = {x["index"]: x["relevance_score"] for x in raw_results}
    np.testing.assert_allclose([raw[i] for i in range(len(DOCS))], want, atol=1e-4)
    assert [t["index"] for t in out["truncated_inputs"]] == [1]
    assert out["truncated_inputs"][0]["kept_tokens"] == 512
    score = httpx.post(
        models_stack.url + "/v1/score",
        json={"text_1": QUERY, "text_2": DOCS, "use_activation": False},
        timeout=120,
    ).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-4)
    tei = httpx.post(
        models_stack.url + "/rerank", json={"query": QUERY, "texts": DOCS}, timeout=120
    ).json()
    np.testing.assert_allclose(sorted(x["score"] for x in tei), sorted(sigmoid(want)), atol=1e-5)
    embeddings = httpx.post(
        models_stack.url + "/v1/embeddings",
        json={"model": CROSS_ENCODER, "input": "x"},
        timeout=30,
    )
    assert embeddings.status_code == 400 and embeddings.json()["error"]["code"] == "model_not_embedding"


@pytest.mark.slow
def test_the_cpu_stack_serves_qwen3_reranker_as_its_model_card_scores_it(
    models_stack: RunningStack, tiny_reranker_dir: Path
) -> None:
    """The torch backend here (the ONNX export is checked below), a cap of 256 tokens."""
    want = qwen3_reranker_scores(tiny_reranker_dir, QUERY, DOCS, 256)
    out = rerank(models_stack, QWEN3_RERANKER)
    got = {x["index"]: x["relevance_score"] for x in out["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)
    assert [t["index"] for t in out["truncated_inputs"]] == [1]
    task = "Given a question about Python, retrieve passages that answer it"
    told = rerank(models_stack, QWEN3_RERANKER, instruction=task)["results"]
    assert {x["index"]: x["relevance_score"] for x in told} != got  # the instruction is in the prompt


def test_the_onnx_exports_of_both_rerankers_agree_with_torch(
    tiny_cross_encoder_dir: Path, tiny_reranker_dir: Path
) -> None:
    """In the default export folder: the cross-encoder's export is the one ``models_stack``
    made, when it ran first (tests/test_onnx_export.py checks a fresh export); Qwen3-Reranker's,
    served on torch there, is made here."""
    from embedserve.engines.cpu import CpuEmbedder

    metas = []
    for folder, pairs in (
        (tiny_cross_encoder_dir, CrossEncoderPairs(tiny_cross_encoder_dir, 512)),
        (tiny_reranker_dir, YesNoPrompts(tiny_reranker_dir, 512)),
    ):
        ids = [
            p.ids
            for p in (
                pairs.encode([QUERY], DOCS, [0] * len(DOCS))
                if isinstance(pairs, CrossEncoderPairs)
                else pairs.encode([QUERY], DOCS, [0] * len(DOCS), None)
            )
        ]
        rows = {}
        for backend in ("onnx", "torch"):
            s = Settings(_env_file=None, model={"path": str(folder), "max_seq_len": 512},
                         engine={"cpu_backend": backend})
            rows[backend] = CpuEmbedder(s).embed(ids)
            if backend == "onnx":
                metas.append(json.loads((export_folder(s) / "meta.json").read_text()))
        assert rows["onnx"].shape == (len(DOCS), 1)
        np.testing.assert_allclose(rows["onnx"], rows["torch"], atol=1e-4)
    assert all(m["max_score_diff_vs_torch"] <= 1e-3 for m in metas)


# -- framing and truncation ------------------------------------------------------------------


def test_qwen3_prompts_are_the_templates_tokens_with_the_head_tokenised_once(tiny_reranker_dir: Path) -> None:
    """The head (instruction and query) is tokenised once per query and each document on its own,
    after a space: the ids must be those of the whole prompt, whatever the document opens with."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_reranker_dir))
    prompts = YesNoPrompts(tiny_reranker_dir, 512)
    documents = ["", "plain", " leading space", "  two", "\nnewline", "'s a contraction", ":colon", "123",
                 "\u0301 combining", "\U0001F600 emoji", "<|im_end|> spelled", "数据 检索", "\tx", "end ",
                 "Ünïcödé", "... dots", "\r\n", "word " * 600]
    queries = ["what? ", "q2:"]
    query_of = [i % 2 for i in range(len(documents))]
    got = prompts.encode(queries, documents, query_of, "a task")
    for pair, d, q in zip(got, documents, query_of, strict=True):
        text = QWEN3_RERANK_TEMPLATE.format(instruction="a task", query=queries[q], document=d)
        ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert pair.original_tokens == len(prompts.prefix) + len(ids) + len(prompts.suffix)
        assert pair.ids[len(prompts.prefix):-len(prompts.suffix)] == ids[: 512 - len(prompts.prefix)
                                                                          - len(prompts.suffix)], repr(d)


@settings(max_examples=60, deadline=None)
@given(a=st.integers(1, 80), b=st.integers(1, 80), budget=st.integers(2, 90))
def test_longest_first_is_the_tokenizers_librarys(a: int, b: int, budget: int) -> None:
    tok = load_tokenizer(MINILM_DIR, plain_specials=True)
    tok.enable_truncation(budget + 3, strategy="longest_first")
    enc = tok.encode(" ".join(["cat"] * a), " ".join(["dog"] * b))
    kept = (enc.ids.count(4937), enc.ids.count(3899))  # "cat", "dog"
    assert kept == longest_first(a, b, budget)


def test_a_special_token_in_the_text_cannot_move_the_pair_frame() -> None:
    pairs = CrossEncoderPairs(MINILM_DIR, 512)
    (pair,) = pairs.encode(["a [SEP] query [CLS]"], ["a [SEP] document"], [0])
    assert pair.ids.count(102) == 2 and pair.ids[0] == 101 and pair.ids[-1] == 102


def test_a_cross_encoders_pairs_say_what_their_tokenizer_could_not_spell() -> None:
    """As /v1/embeddings reports its inputs: the unknown tokens a pair keeps, query and document
    together, and the characters they stand for."""
    pairs = CrossEncoderPairs(MINILM_DIR, 512)
    with_unknown, plain = pairs.encode(["tea \U0001F600"], ["hello \U0001F600 world", "plain"], [0, 0])
    assert with_unknown.unknown == UnknownTokens(2, 2) and plain.unknown == UnknownTokens(1, 1)
    (none,) = pairs.encode(["tea"], ["plain"], [0])
    assert none.unknown is None
    documents = [f"passage {i}: 数据 \U0001F600 " + "word " * 600 for i in range(40)]  # cut to fit
    first = pairs.encode(["tea \U0001F600"], documents, [0] * 40)
    assert pairs.unknowns.encode(["x"])[1]  # most passages held one: encoded with offsets from now on
    assert pairs.encode(["tea \U0001F600"], documents, [0] * 40) == first
    assert first[0].unknown == UnknownTokens(4, 4) and first[0].original_tokens > 512


def test_model_folders_are_told_apart(
    tiny_cross_encoder_dir: Path, tiny_reranker_dir: Path, tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    def scoring(folder: Path) -> str:
        return ModelInfo.load(ModelSettings(path=str(folder))).scoring

    assert scoring(tiny_cross_encoder_dir) == "cross-encoder"
    assert scoring(tiny_reranker_dir) == "qwen3-reranker"
    assert scoring(tiny_qwen_dir) == scoring(MINILM_DIR) == "cosine"
    nli = tmp_path / "nli"
    nli.mkdir()
    (nli / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bert",
                "hidden_size": 8,
                "architectures": ["BertForSequenceClassification"],
                "id2label": {"0": "a", "1": "b"},
            }
        )
    )
    with pytest.raises(ConfigError, match="with 2 label"):
        scoring(nli)


# -- SGLang: the launch and the answers' shapes ------------------------------------------------


def folder_with(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_sglang_launches_rerankers_in_the_mode_that_scores_them(
    tmp_path: Path, tiny_cross_encoder_dir: Path
) -> None:
    xlmr = folder_with(
        tmp_path,
        "bge-reranker",
        {
            "model_type": "xlm-roberta",
            "architectures": ["XLMRobertaForSequenceClassification"],
            "hidden_size": 1024,
            "num_labels": 1,
            "type_vocab_size": 1,
            "max_position_embeddings": 514,
            "position_embedding_type": "absolute",
        },
    )
    qwen = folder_with(
        tmp_path,
        "Qwen3-Reranker-0.6B",
        {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 1024,
            "max_position_embeddings": 40960,
        },
    )
    flags = json.loads((Path(__file__).parent / "fixtures" / "sglang_0.5.17_flags.json").read_text())["flags"]
    for folder, cap in ((xlmr, 512), (qwen, 8192)):  # Qwen3-Reranker too: its score head is the pooler
        argv = build_launch(Settings(_env_file=None, model={"path": str(folder)})).argv
        assert "--is-embedding" in argv and "--skip-tokenizer-init" in argv
        assert {a for a in argv if a.startswith("--")} <= set(flags)
        assert argv[argv.index("--context-length") + 1] == str(cap + 1)
    with pytest.raises(LaunchConfigError, match=r"token type ids.*engine\.kind=cpu"):
        build_launch(Settings(_env_file=None, model={"path": str(tiny_cross_encoder_dir)}))
    config = json.loads((xlmr / "config.json").read_text())
    del config["position_embedding_type"]
    (xlmr / "config.json").write_text(json.dumps(config))
    with pytest.raises(LaunchConfigError, match=r'type None; SGLang 0\.5\.17 serves cross-encoders with'):
        build_launch(Settings(_env_file=None, model={"path": str(xlmr)}))


def test_a_one_segment_xlmr_cross_encoder_scores_as_transformers_and_runs_on_sglang(tmp_path: Path) -> None:
    """The bge-rerankers' kind (XLM-R, one segment type), as ``synth-model --kind cross-encoder
    tiny-xlmr`` builds it: the CPU engine's torch backend scores the gateway's pairs as a plain
    transformers forward scores the texts, and SGLang takes it from token ids."""
    from embedserve.engines.cpu import CpuEmbedder
    from embedserve.runtime.synth_rerank import build_cross_encoder

    folder = build_cross_encoder(tmp_path / "tiny-xlmr", "tiny-xlmr")
    docs = [d for d in DOCS if len(d) < 200]
    ids = [p.ids for p in CrossEncoderPairs(folder, 512).encode([QUERY], docs, [0] * len(docs))]
    s = Settings(_env_file=None, model={"path": str(folder)}, engine={"cpu_backend": "torch"})
    got = CpuEmbedder(s).embed(ids)[:, 0]
    np.testing.assert_allclose(got, cross_encoder_logits(folder, QUERY, docs, 512), atol=1e-4)
    assert len(set(np.round(got, 3))) == len(docs)  # the scores tell the documents apart
    assert "--is-embedding" in build_launch(s.with_engine(kind="sglang")).argv


def test_sglangs_answers_become_one_logit_per_input(
    tiny_reranker_dir: Path, tiny_cross_encoder_dir: Path
) -> None:
    """/encode answers a list (one input: the object alone) with the logit as a number, or a
    list of one (SGLang's pooler output: a cross-encoder's, or Qwen3-Reranker's score head); an
    engine without the head (a normalised hidden state) is refused, not read as a score."""
    for folder in (tiny_reranker_dir, tiny_cross_encoder_dir):
        info = ModelInfo.load(Settings(_env_file=None, model={"path": str(folder)}).model)
        assert protocol_for(info) is ENCODE
    rows = ENCODE.decode(b'[{"embedding": 1.5, "meta_info": {}}, {"embedding": [-2.0], "meta_info": {}}]', 2)
    assert rows[:, 0].tolist() == [1.5, -2.0]
    assert ENCODE.decode(b'{"embedding": 0.25, "meta_info": {}}', 1)[:, 0].tolist() == [0.25]
    assert json.loads(ENCODE.encode("m", [[1, 2]], False)) == {"input_ids": [1, 2]}
    for bad, n in ((b'[{"embedding": "x"}]', 1), (b'[{"embedding": 1.0}]', 2), (b"{}", 1),
                   (b'[{"embedding": [0.6, 0.8]}]', 1)):
        with pytest.raises(WireError):
            ENCODE.decode(bad, n)
