"""The quality gate's documents: the retrieval corpus (written by ``embedserve
quality-corpus``, read by ``embedserve quality``) and the gate's report (read by the
benchmarks and by anyone deciding whether a configuration may become a default)."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Passage(BaseModel):
    """A document of the search space: a section's own text, its heading taken out."""

    id: str
    text: str


class Query(BaseModel):
    """A question with its ground truth: the ids of the passages that answer it."""

    id: str
    text: str
    relevant: list[str] = Field(min_length=1)


class CorpusInfo(BaseModel):
    """Where a corpus came from and how it was cut, so a result names what it ran on."""

    source: str
    source_title: str = ""
    builder: dict[str, int | str] = Field(default_factory=dict)
    pages: int = 0
    sections_seen: int = 0
    dropped: dict[str, int] = Field(default_factory=dict)
    passage_words_median: float = 0.0
    query_words_median: float = 0.0
    queries_verbatim_in_passage: int = 0


class Corpus(BaseModel):
    """Passages, queries with their relevant passages, and how it was built."""

    info: CorpusInfo
    passages: list[Passage] = Field(min_length=2)  # a 10th and an 11th neighbour need a few
    queries: list[Query] = Field(min_length=1)

    @model_validator(mode="after")
    def _relevant_passages_exist(self) -> Corpus:
        ids = {p.id for p in self.passages}
        if len(ids) != len(self.passages):
            raise ValueError("passage ids are not unique")
        for q in self.queries:
            missing = [r for r in q.relevant if r not in ids]
            if missing:
                raise ValueError(f"query {q.id!r} names passages that are not in the corpus: {missing[:3]}")
        return self

    def fingerprint(self) -> str:
        """SHA-256 (first 16 hex digits) of the texts and the ground truth: two results with
        the same fingerprint ran on the same corpus."""
        h = hashlib.sha256()
        for p in self.passages:
            h.update(f"p\0{p.id}\0{p.text}\0".encode())
        for q in self.queries:
            h.update(f"q\0{q.id}\0{q.text}\0{','.join(q.relevant)}\0".encode())
        return h.hexdigest()[:16]


class CosineStats(BaseModel):
    """Per-input cosine between the two endpoints' vectors of the same text."""

    median: float
    p1: float
    min: float


class Retrieval(BaseModel):
    """One endpoint's retrieval quality against the corpus's ground truth."""

    recall_at_10: float
    ndcg_at_10: float


class Boundary(BaseModel):
    """How near the top-10 boundary is to a tie: the baseline's median gap between its
    10th and 11th score, and the median change the candidate makes to the baseline's
    top-10 scores. A change larger than the gap swaps neighbours without any loss."""

    gap_k_to_next_median: float
    score_change_median: float


class Traffic(BaseModel):
    """What it took to embed the corpus on one endpoint."""

    requests: int = 0
    texts: int = 0
    retried: int = 0  # answers 429, 503 or 504, or failed connections, sent again
    batch_splits: int = 0
    batch_inputs_final: int = 0
    seconds: float = 0.0


class TypeQuality(BaseModel):
    """One output type (``embedding_type``) of the candidate against the baseline's float vectors:
    retrieval as it ranks, decoded (int8 as is, uint8 less 128, packed bits as +-1 a bit)."""

    bytes_per_vector: int
    retrieval: Retrieval
    recall_at_10_drop: float  # the baseline's recall@10 minus this type's
    ndcg_at_10_drop: float
    top10_overlap: float
    median_cosine: float


class QualityReport(BaseModel):
    """``embedserve quality``'s result (quality.json)."""

    model_config = ConfigDict(extra="forbid")

    baseline: str
    candidate: str
    model: str
    candidate_model: str
    corpus: str
    corpus_fingerprint: str
    corpus_info: CorpusInfo
    passages: int
    queries: int
    texts: int
    cosine: CosineStats
    top10_overlap: float
    top10_boundary: Boundary
    retrieval: dict[str, Retrieval]  # "baseline", "candidate"
    measured: dict[str, float]
    thresholds: dict[str, float]
    missed: dict[str, float]
    passed: bool
    traffic: dict[str, Traffic]
    types: dict[str, TypeQuality] = Field(default_factory=dict)  # --types; not in the verdict
