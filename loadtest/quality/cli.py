"""``embedserve quality``: may a candidate configuration replace the baseline? Both are
OpenAI-compatible endpoints serving the same model (two gateways: torch and ONNX, bf16 and
FP8); both embed the same corpus, and the candidate must keep the baseline's quality.

    embedserve quality-corpus --out python-docs.json          # once (apt-get install python3-doc)
    embedserve quality --baseline http://127.0.0.1:8000 --candidate http://127.0.0.1:8001 \\
        --corpus python-docs.json --out quality-result --max-recall-drop 0.01

    embedserve quality ... --types int8,uint8,binary,ubinary     # embedserve's output types too

It reports:

- **per-input cosine** between the two endpoints' vectors of every text of the corpus
  (passages and queries): median, 1st percentile, minimum;
- **top-10 overlap**: for each query, the share of the baseline's 10 nearest passages that
  the candidate's 10 nearest also hold, with the baseline's median gap between its 10th and
  11th score (where neighbours score alike, a tiny change swaps them);
- **retrieval against ground truth**: recall@10 and nDCG@10 of each endpoint (each query's
  relevant passages are in the corpus), and how much the candidate drops;
- with ``--types``, the same retrieval of each output type the candidate serves (int8, uint8,
  binary, ubinary; asked for with the float vectors through embedserve's ``/v2/embed``, all
  types from one embedding), ranked by cosine of the decoded values
  (packed bits as +-1, which ranks as Hamming distance does), against the baseline's float
  vectors: recall@10 and its drop, top-10 overlap, bytes a vector. These figures inform; the
  exit status is the float candidate's.

Exit status: 0 when every threshold holds, 1 when one is missed (the summary names it), 2 on a
bad flag or corpus, or endpoints whose vectors cannot be compared, 3 when an endpoint fails.
Writes quality.json (embedserve.contracts.quality.QualityReport) and summary.md to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import numpy as np

from embedserve.contracts.quality import Boundary, Corpus, CosineStats, QualityReport, Retrieval, TypeQuality
from embedserve.loadtest.quality import metrics
from embedserve.loadtest.quality.client import Embedder, EndpointError, Limits, served_model
from embedserve.loadtest.quality.corpus import describe, load_corpus
from embedserve.loadtest.quality.flags import FlagError, OneLineParser, at_least, fraction, parse
from embedserve.loadtest.quality.report import Thresholds, missed, summary

PROG = "embedserve quality"
K = 10
TYPES = ("int8", "uint8", "binary", "ubinary")


def output_types(value: str) -> list[str]:
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    bad = [k for k in kinds if k not in TYPES]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"takes {', '.join(TYPES)} (comma-separated), got {value!r}")
    return list(dict.fromkeys(kinds))


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="base URL of the endpoint to keep up with")
    ap.add_argument("--candidate", required=True, help="base URL of the configuration on trial")
    ap.add_argument("--corpus", type=Path, required=True, help="a file from embedserve quality-corpus")
    ap.add_argument("--out", type=Path, help="write quality.json and summary.md here")
    ap.add_argument("--model", help="model id to send to both (default: each endpoint's first)")
    ap.add_argument("--candidate-model", help="model id for the candidate (default: --model)")
    ap.add_argument("--api-key", help="sent to both as Authorization: Bearer KEY")
    ap.add_argument("--types", type=output_types, default=[],
                    help="also fetch the candidate's vectors as these embedserve output types "
                         "(through its /v2/embed) "
                         f"(comma-separated: {','.join(TYPES)}) and report each one's retrieval")
    ap.add_argument("--query-instruction", action="store_true",
                    help="send the queries with input_type 'query' (the model's query instruction, "
                         "e.g. Qwen3-Embedding's; embedserve's extension of the OpenAI API)")
    lim = ap.add_argument_group("the servers' limits")
    lim.add_argument("--batch-inputs", type=at_least(1), default=Limits.batch_inputs,
                     help="texts per request (embedserve takes up to 2048)")
    lim.add_argument("--max-request-tokens", type=at_least(1), default=Limits.max_request_tokens,
                     help="tokens per request, counting each text at the model's max_seq_len "
                          "(embedserve's gateway.max_tokens_per_request)")
    lim.add_argument("--retries", type=at_least(0), default=Limits.retries,
                     help="times a batch is sent again after a 429/503 or a failed connection")
    lim.add_argument("--max-retry-after", type=at_least(0.0, float), default=Limits.max_retry_after_s,
                     help="longest Retry-After wait honoured, s")
    lim.add_argument("--timeout", type=at_least(1.0, float), default=Limits.timeout_s,
                     help="per-request timeout, s")
    th = ap.add_argument_group("thresholds (the exit status)")
    d = Thresholds()
    th.add_argument("--min-median-cosine", type=fraction, default=d.min_median_cosine)
    th.add_argument("--min-p1-cosine", type=fraction, default=d.min_p1_cosine)
    th.add_argument("--min-top10-overlap", type=fraction, default=d.min_top10_overlap)
    th.add_argument("--max-recall-drop", type=fraction, default=d.max_recall_drop,
                    help="recall@10 of the baseline minus the candidate's, at most")
    th.add_argument("--max-ndcg-drop", type=fraction, default=d.max_ndcg_drop,
                    help="nDCG@10 of the baseline minus the candidate's, at most")
    return ap


def thresholds_of(a: argparse.Namespace) -> Thresholds:
    return Thresholds(a.min_median_cosine, a.min_p1_cosine, a.min_top10_overlap,
                      a.max_recall_drop, a.max_ndcg_drop)


def evaluate(corpus: Corpus, base: tuple[metrics.Vectors, metrics.Vectors],
             cand: tuple[metrics.Vectors, metrics.Vectors], thresholds: Thresholds) -> dict[str, object]:
    """The report's figures from each side's (passage, query) vectors."""
    (bp, bq), (cp, cq) = base, cand
    if bp.shape[1] != cp.shape[1]:
        raise FlagError(f"the baseline answers {bp.shape[1]}-dimensional vectors and the candidate "
                        f"{cp.shape[1]}-dimensional ones: they do not serve the same model "
                        "(check --candidate and --candidate-model)")
    position = {p.id: i for i, p in enumerate(corpus.passages)}
    relevant = [{position[r] for r in q.relevant} for q in corpus.queries]
    base_nn = metrics.nearest(bq, bp, K + 1)
    cand_top = metrics.nearest(cq, cp, K).index
    retrieval = {name: Retrieval(recall_at_10=metrics.recall_at_k(top, relevant, K),
                                 ndcg_at_10=metrics.ndcg_at_k(top, relevant, K))
                 for name, top in (("baseline", base_nn.index), ("candidate", cand_top))}
    cosine = CosineStats(**metrics.cosine_stats(np.concatenate([bp, bq]), np.concatenate([cp, cq])))
    overlap = metrics.overlap(base_nn.index, cand_top, K)
    measured = {
        "median_cosine": cosine.median, "p1_cosine": cosine.p1, "top10_overlap": overlap,
        "recall_at_10_drop": retrieval["baseline"].recall_at_10 - retrieval["candidate"].recall_at_10,
        "ndcg_at_10_drop": retrieval["baseline"].ndcg_at_10 - retrieval["candidate"].ndcg_at_10,
    }
    gone = missed(measured, thresholds)
    return {"cosine": cosine, "top10_overlap": overlap,
            "top10_boundary": Boundary(**metrics.boundary(base_nn, cq, cp, K)),
            "retrieval": retrieval, "measured": measured, "thresholds": thresholds.as_dict(),
            "missed": gone, "passed": not gone}


def type_quality(corpus: Corpus, base: tuple[metrics.Vectors, metrics.Vectors],
                 typed: tuple[metrics.Vectors, metrics.Vectors], packed_bits: bool) -> TypeQuality:
    """One output type's (passage, query) vectors, decoded, against the baseline's float ones."""
    (bp, bq), (tp, tq) = base, typed
    nbytes = tp.shape[1] // 8 if packed_bits else tp.shape[1]
    tp, tq = tp[:, :bp.shape[1]], tq[:, :bp.shape[1]]  # packed bits pad the last byte with zeros
    position = {p.id: i for i, p in enumerate(corpus.passages)}
    relevant = [{position[r] for r in q.relevant} for q in corpus.queries]
    base_top, top = metrics.top_k(bq, bp, K), metrics.top_k(tq, tp, K)
    base_recall = metrics.recall_at_k(base_top, relevant, K)
    base_ndcg = metrics.ndcg_at_k(base_top, relevant, K)
    retrieval = Retrieval(recall_at_10=metrics.recall_at_k(top, relevant, K),
                          ndcg_at_10=metrics.ndcg_at_k(top, relevant, K))
    cosine = metrics.cosine_stats(np.concatenate([bp, bq]), np.concatenate([tp, tq]))
    return TypeQuality(bytes_per_vector=nbytes, retrieval=retrieval,
                       recall_at_10_drop=base_recall - retrieval.recall_at_10,
                       ndcg_at_10_drop=base_ndcg - retrieval.ndcg_at_10,
                       top10_overlap=metrics.overlap(base_top, top, K), median_cosine=cosine["median"])


def run(a: argparse.Namespace, corpus: Corpus) -> QualityReport:
    limits = Limits(a.batch_inputs, a.max_request_tokens, a.retries, a.max_retry_after, a.timeout)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    passages = [p.text for p in corpus.passages]
    queries = [q.text for q in corpus.queries]
    vectors, traffic, models = {}, {}, {}
    with httpx.Client(timeout=limits.timeout_s, headers=headers) as client:
        for side, url, wanted in (("baseline", a.baseline, a.model),
                                  ("candidate", a.candidate, a.candidate_model or a.model)):
            model = served_model(client, url, wanted)
            embedder = Embedder(client, url, model, limits)
            types = tuple(a.types) if side == "candidate" else ()
            query_type = "query" if a.query_instruction else None
            by_passage = embedder.embed_types(passages, None, types)
            by_query = embedder.embed_types(queries, query_type, types)
            for kind in ("float", *types):
                vectors[side if kind == "float" else kind] = (by_passage[kind], by_query[kind])
            print(f"{side}: {embedder.traffic.texts} texts in {embedder.traffic.seconds:.1f} s, "
                  f"{embedder.traffic.requests} requests", file=sys.stderr)
            traffic[side], models[side] = embedder.traffic, model.id
    figures = evaluate(corpus, vectors["baseline"], vectors["candidate"], thresholds_of(a))
    base = vectors["baseline"]
    figures["types"] = {kind: type_quality(corpus, base, vectors[kind], kind.endswith("binary"))
                        for kind in a.types}
    return QualityReport.model_validate({
        "baseline": a.baseline, "candidate": a.candidate, "model": models["baseline"],
        "candidate_model": models["candidate"], "corpus": str(a.corpus),
        "corpus_fingerprint": corpus.fingerprint(), "corpus_info": corpus.info,
        "passages": len(passages), "queries": len(queries), "texts": len(passages) + len(queries),
        "traffic": traffic, **figures})


def main(argv: list[str] | None = None) -> int:
    a = parse(build_parser(), argv)
    if isinstance(a, int):
        return a
    try:
        corpus = load_corpus(a.corpus)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    print(f"corpus: {describe(corpus)}", file=sys.stderr)
    try:
        report = run(a, corpus)
    except EndpointError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 3
    except FlagError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    text = summary(report)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "quality.json").write_text(report.model_dump_json(indent=1) + "\n")
        (a.out / "summary.md").write_text(text)
    print(text, end="")
    return 0 if report.passed else 1
