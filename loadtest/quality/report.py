"""The gate's verdict against its thresholds, and the report a person reads."""

from __future__ import annotations

from dataclasses import dataclass

from embedserve.contracts.quality import QualityReport


@dataclass(frozen=True)
class Thresholds:
    """What the candidate must keep. Cosines and overlap are floors; drops are ceilings on how
    much worse than the baseline the candidate may retrieve (baseline minus candidate)."""

    min_median_cosine: float = 0.99
    min_p1_cosine: float = 0.98
    min_top10_overlap: float = 0.9
    max_recall_drop: float = 0.01
    max_ndcg_drop: float = 0.01

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


EPSILON = 1e-12  # 0.72 - 0.71 is 0.0100000000000000009: a drop of exactly the limit holds
# measured figure -> (threshold field, True when the figure is a floor)
CHECKS = {
    "median_cosine": ("min_median_cosine", True),
    "p1_cosine": ("min_p1_cosine", True),
    "top10_overlap": ("min_top10_overlap", True),
    "recall_at_10_drop": ("max_recall_drop", False),
    "ndcg_at_10_drop": ("max_ndcg_drop", False),
}


def missed(measured: dict[str, float], thresholds: Thresholds) -> dict[str, float]:
    """The measured figures on the wrong side of their threshold."""
    limits = thresholds.as_dict()
    out = {}
    for name, (limit, floor) in CHECKS.items():
        value, bound = measured[name], limits[limit]
        if (value < bound - EPSILON) if floor else (value > bound + EPSILON):
            out[name] = value
    return out


def _f(v: float, digits: int = 4) -> str:
    return f"{v:.{digits}f}"


def summary(r: QualityReport) -> str:
    """The verdict and the figures, as Markdown that reads well on a terminal too."""
    b, c = r.retrieval["baseline"], r.retrieval["candidate"]
    rows = [
        ("recall@10", _f(b.recall_at_10), _f(c.recall_at_10),
         f"drop {_f(r.measured['recall_at_10_drop'])}", f"drop <= {r.thresholds['max_recall_drop']:g}"),
        ("nDCG@10", _f(b.ndcg_at_10), _f(c.ndcg_at_10),
         f"drop {_f(r.measured['ndcg_at_10_drop'])}", f"drop <= {r.thresholds['max_ndcg_drop']:g}"),
    ]
    t = r.thresholds
    checks = [
        ("median cosine", _f(r.cosine.median, 6), f">= {t['min_median_cosine']:g}", "median_cosine"),
        ("1st percentile cosine", _f(r.cosine.p1, 6), f">= {t['min_p1_cosine']:g}", "p1_cosine"),
        ("minimum cosine", _f(r.cosine.min, 6), "", ""),
        ("top-10 overlap", _f(r.top10_overlap), f">= {t['min_top10_overlap']:g}", "top10_overlap"),
    ]
    verdict = "PASS" if r.passed else "FAIL (" + ", ".join(sorted(r.missed)) + ")"
    lines = [
        f"# Quality gate: {verdict}", "",
        f"- baseline: {r.baseline} ({r.model})",
        f"- candidate: {r.candidate} ({r.candidate_model})",
        f"- corpus: {r.corpus}: {r.passages} passages, {r.queries} queries "
        f"(fingerprint {r.corpus_fingerprint}; {r.corpus_info.source_title or r.corpus_info.source})",
        "", "Retrieval against the corpus's ground truth:", "",
        "| | baseline | candidate | change | threshold |", "|---|---|---|---|---|",
        *[f"| {' | '.join(row)} |" for row in rows],
        "", f"Agreement with the baseline, same {r.texts} texts (passages and queries):", "",
        "| | measured | threshold | |", "|---|---|---|---|",
        *[f"| {name} | {value} | {limit} | {'' if not key else 'missed' if key in r.missed else 'ok'} |"
          for name, value, limit, key in checks],
        "",
        f"Top-10 boundary: the baseline's 10th and 11th scores differ by a median "
        f"{r.top10_boundary.gap_k_to_next_median:.4f}; the candidate moves the baseline's top-10 "
        f"scores by a median {r.top10_boundary.score_change_median:.4f}. Where the change is the "
        "larger, neighbours swap places without retrieval getting worse: the recall and nDCG "
        "drops say whether it did.",
    ]
    if r.types:
        lines += [
            "", "Output types of the candidate against the baseline's float vectors (decoded: uint8 "
            "less 128, packed bits as +-1; not part of the verdict):", "",
            "| type | bytes a vector | recall@10 | drop | nDCG@10 | drop | top-10 overlap | median cosine |",
            "|---|---|---|---|---|---|---|---|",
            *[f"| {kind} | {t.bytes_per_vector} | {_f(t.retrieval.recall_at_10)} | "
              f"{_f(t.recall_at_10_drop)} | {_f(t.retrieval.ndcg_at_10)} | {_f(t.ndcg_at_10_drop)} | "
              f"{_f(t.top10_overlap)} | {_f(t.median_cosine)} |" for kind, t in r.types.items()],
        ]
    return "\n".join(lines) + "\n"
