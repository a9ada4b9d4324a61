"""Quality gate: what an engine configuration (FP8, another attention backend) costs in
embedding quality against a baseline (bf16), on the same inputs.

- **Per-input cosine** between the two configurations' vectors for the same text, over texts
  drawn from the seed length mix: median, 1st percentile, minimum.
- **Retrieval agreement**: for each query, the overlap of the top-10 nearest passages
  (cosine) under the candidate with those under the baseline, averaged over the queries.

    python3 bench/quality.py --baseline http://127.0.0.1:8000 --candidate http://127.0.0.1:8001 \\
        --tokenizer MODEL_DIR --texts 1000 --queries 500 --passages 5000 --out DIR

Both URLs are gateways (or anything OpenAI-compatible) serving the same model. Targets for
FP8 against bf16: median cosine >= 0.99, 1st percentile >= 0.98, top-10 overlap >= 0.9.

The overlap depends on the corpus as much as on the candidate: where the 10th and 11th
neighbours score alike, a tiny change swaps them. The report therefore gives the baseline's
score gap between its 10th and 11th neighbour next to how much the candidate moves the
scores of the baseline's top 10. Without ``--corpus`` the texts are synthetic (every passage
alike); with your own passages (``--corpus FILE``, one per line, and ``--queries-file``) the
figure is the one to decide on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from embedserve.loadtest.mixes import BucketMix, parse_mix
from embedserve.loadtest.textbuild import TextBuilder, load_tokenizer

Vectors = npt.NDArray[np.float64]
TARGETS = {"median_cosine": 0.99, "p1_cosine": 0.98, "top10_overlap": 0.9}


def normalised(v: Vectors) -> Vectors:
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def cosine_stats(a: Vectors, b: Vectors) -> dict[str, float]:
    """Row by row cosine between two embeddings of the same inputs."""
    cos = np.sum(normalised(a) * normalised(b), axis=1)
    return {"median": float(np.median(cos)), "p1": float(np.percentile(cos, 1)), "min": float(cos.min())}


def cosines(queries: Vectors, passages: Vectors) -> Vectors:
    """Every query's cosine with every passage."""
    return normalised(queries) @ normalised(passages).T


def ranking(scores: Vectors) -> npt.NDArray[np.int64]:
    """Each row's passages, best first (ties in passage order)."""
    return np.argsort(-scores, axis=1, kind="stable")


def top_k(queries: Vectors, passages: Vectors, k: int) -> npt.NDArray[np.int64]:
    """Each query's k nearest passages by cosine, best first."""
    return ranking(cosines(queries, passages))[:, :k]


def top_k_overlap(base_q: Vectors, base_p: Vectors, cand_q: Vectors, cand_p: Vectors, k: int = 10) -> float:
    """Mean share of the baseline's top-k passages that the candidate's top-k also holds."""
    k = min(k, len(base_p))
    base, cand = top_k(base_q, base_p, k), top_k(cand_q, cand_p, k)
    return float(np.mean([len(set(b) & set(c)) / k for b, c in zip(base, cand, strict=True)]))


def boundary(base_q: Vectors, base_p: Vectors, cand_q: Vectors, cand_p: Vectors,
             k: int = 10) -> dict[str, float]:
    """How close the top-k boundary is to a tie: the baseline's median gap between its k-th and
    (k+1)-th score, and the median change the candidate makes to the baseline's top-k scores."""
    base, cand = cosines(base_q, base_p), cosines(cand_q, cand_p)
    k = min(k, base.shape[1] - 1)
    order = ranking(base)
    ranked = np.take_along_axis(base, order[:, : k + 1], 1)
    moved = np.abs(np.take_along_axis(cand, order[:, :k], 1) - ranked[:, :k])
    return {"gap_k_to_next_median": float(np.median(ranked[:, k - 1] - ranked[:, k])),
            "score_change_median": float(np.median(moved))}


def verdict(cosine: dict[str, float], overlap: float) -> dict[str, Any]:
    got = {"median_cosine": cosine["median"], "p1_cosine": cosine["p1"], "top10_overlap": overlap}
    missed = {k: v for k, v in got.items() if v < TARGETS[k]}
    return {"passed": not missed, "measured": got, "targets": TARGETS, "missed": missed}


def embed(url: str, model: str, texts: list[str], batch: int = 64) -> Vectors:
    out: list[list[float]] = []
    with httpx.Client(timeout=600) as c:
        for i in range(0, len(texts), batch):
            r = c.post(url.rstrip("/") + "/v1/embeddings",
                       json={"model": model, "input": texts[i:i + batch], "encoding_format": "float"})
            r.raise_for_status()
            out += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    return np.asarray(out, dtype=np.float64)


def lines(path: Path, n: int) -> list[str]:
    """The first ``n`` non-empty lines of a file: your own passages or queries."""
    out = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()][:n]
    if not out:
        raise SystemExit(f"{path}: no texts")
    return out


def texts(builder: TextBuilder, mix: str, n: int, rng: random.Random, cap: int) -> list[str]:
    lengths = parse_mix(mix)
    assert isinstance(lengths, BucketMix), "a length mix, not a file of texts"
    return [builder.text(min(lengths.sample(rng), cap), rng) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--candidate", required=True)
    ap.add_argument("--tokenizer", required=True, help="the served model's folder")
    ap.add_argument("--model", help="model id (default: the baseline's first)")
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--passages", type=int, default=5000)
    ap.add_argument("--cap", type=int, default=8191)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=Path, help="passages, one per line (default: synthetic)")
    ap.add_argument("--queries-file", type=Path, help="queries, one per line (default: synthetic)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    model = a.model or httpx.get(a.baseline.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng = random.Random(a.seed)
    builder = TextBuilder(load_tokenizer(a.tokenizer), seed=a.seed)
    sample = texts(builder, "seed", a.texts, rng, a.cap)
    queries = (lines(a.queries_file, a.queries) if a.queries_file
               else texts(builder, "uniform:8-48", a.queries, rng, a.cap))
    passages = lines(a.corpus, a.passages) if a.corpus else texts(builder, "seed", a.passages, rng, a.cap)
    cosine = cosine_stats(embed(a.baseline, model, sample), embed(a.candidate, model, sample))
    vectors = (embed(a.baseline, model, queries), embed(a.baseline, model, passages),
               embed(a.candidate, model, queries), embed(a.candidate, model, passages))
    overlap = top_k_overlap(*vectors)
    result = {"baseline": a.baseline, "candidate": a.candidate, "model": model, "texts": a.texts,
              "queries": len(queries), "passages": len(passages),
              "corpus": str(a.corpus) if a.corpus else "synthetic", "cosine": cosine,
              "top10_boundary": boundary(*vectors), **verdict(cosine, overlap)}
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "quality.json").write_text(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
