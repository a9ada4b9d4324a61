"""The default CPU stack (the bundled all-MiniLM-L6-v2) answers all three score routes, with the
cosines sentence-transformers computes, and ranks real passages (the quality gate's python3-doc
corpus) at least as well as embedding retrieval alone. The tests that take ``served`` also run
against the gateway at ``$EMBEDSERVE_E2E_URL`` when it is set (the containers in CI)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from embedserve.contracts.quality import Corpus
from embedserve.loadtest.quality.metrics import ndcg_at_k, recall_at_k, top_k
from tests.conftest import MINILM_DIR, RunningStack, Served

QUERY = "How do I sort a list in place?"
DOCS = [
    "list.sort() sorts the list in place and returns None.",
    "The Moon circles the Earth every 27 days.",
    "sorted() builds a new sorted list from any iterable.",
    "Espresso is brewed by forcing hot water through finely ground coffee.",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """sentence-transformers' cosine of the query with each document."""
    st = SentenceTransformer(str(MINILM_DIR), device="cpu", local_files_only=True)
    q, *d = st.encode([QUERY, *DOCS], normalize_embeddings=True)
    return np.asarray([float(np.dot(q, x)) for x in d])


def test_the_cpu_stack_answers_every_score_route(served: Served, reference: np.ndarray) -> None:
    best_first = np.argsort(-reference, kind="stable").tolist()
    with httpx.Client(base_url=served.url, timeout=60) as c:
        cohere = c.post("/v1/rerank", json={"model": served.model_name, "query": QUERY, "documents": DOCS})
        tei = c.post("/rerank", json={"query": QUERY, "texts": DOCS})
        v2 = c.post("/v2/rerank", json={"model": served.model_name, "query": QUERY, "documents": DOCS})
        vllm = c.post("/v1/score", json={"model": served.model_name, "text_1": QUERY, "text_2": DOCS})
    for r in (cohere, tei, v2, vllm):
        assert r.status_code == 200, r.text
    for results in (cohere.json()["results"], v2.json()["results"]):
        assert [x["index"] for x in results] == best_first
        np.testing.assert_allclose([x["relevance_score"] for x in results], reference[best_first], atol=1e-5)
    assert [x["index"] for x in tei.json()] == best_first
    np.testing.assert_allclose([d["score"] for d in vllm.json()["data"]], reference, atol=1e-5)
    assert cohere.headers["x-embedserve-score"] == "cosine"


def _embed(c: httpx.Client, model: str, texts: list[str]) -> np.ndarray:
    out = []
    for start in range(0, len(texts), 64):
        r = c.post("/v1/embeddings", json={"model": model, "input": texts[start : start + 64]})
        r.raise_for_status()
        out += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    return np.asarray(out, dtype=np.float64)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 60 queries x 15 passages of up to 64 words on two busy cores
def test_reranking_real_passages_is_at_least_as_good_as_embedding_retrieval(
    minilm_stack: RunningStack, howto_corpus: Path
) -> None:
    """The quality gate's metric (nDCG@10, recall@10 against the corpus' ground truth) for the
    top 10 of embedding retrieval alone, and for the top 15 reranked through /v1/rerank."""
    corpus = Corpus.model_validate_json(howto_corpus.read_text())
    queries = corpus.queries[:60]
    position = {p.id: i for i, p in enumerate(corpus.passages)}
    relevant = [{position[r] for r in q.relevant} for q in queries]
    with httpx.Client(base_url=minilm_stack.url, timeout=300) as c:
        model = minilm_stack.model_name
        passages = _embed(c, model, [p.text for p in corpus.passages])
        retrieved = top_k(_embed(c, model, [q.text for q in queries]), passages, 15)
        reranked = []
        for q, candidates in zip(queries, retrieved, strict=True):
            docs = [corpus.passages[i].text for i in candidates]
            r = c.post("/v1/rerank", json={"model": model, "query": q.text, "documents": docs, "top_n": 10})
            assert r.status_code == 200, r.text
            reranked.append([int(candidates[x["index"]]) for x in r.json()["results"]])
    ranked = np.asarray(reranked)
    alone = {"ndcg": ndcg_at_k(retrieved, relevant), "recall": recall_at_k(retrieved, relevant)}
    rerank = {"ndcg": ndcg_at_k(ranked, relevant), "recall": recall_at_k(ranked, relevant)}
    print(f"embedding retrieval alone: {alone}; reranked: {rerank}")
    assert alone["recall"] > 0.5  # a corpus whose queries missed their passages would score ~0.05
    assert rerank["ndcg"] >= alone["ndcg"] - 1e-9 and rerank["recall"] >= alone["recall"] - 1e-9
