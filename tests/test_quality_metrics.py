"""The quality gate's arithmetic on vectors whose answers are known: cosines, neighbours,
their overlap, the top-10 boundary, and recall and nDCG on a hand-made corpus."""

from __future__ import annotations

import numpy as np
import pytest

from embedserve.loadtest.quality import metrics
from embedserve.loadtest.quality.report import Thresholds, missed


def on_circle(degrees: list[float]) -> metrics.Vectors:
    rad = np.radians(degrees)
    return np.stack([np.cos(rad), np.sin(rad)], axis=1)


def test_identical_vectors_have_cosine_one_and_full_overlap() -> None:
    rng = np.random.default_rng(0)
    q, p = rng.normal(size=(20, 16)), rng.normal(size=(200, 16))
    assert metrics.cosine_stats(p, p * 3.0) == pytest.approx({"median": 1.0, "p1": 1.0, "min": 1.0})
    assert metrics.top_k_overlap(q, p, q, p) == 1.0


def test_cosine_stats_of_known_angles() -> None:
    base = np.array([[1.0, 0.0]] * 100)
    angles = np.linspace(0.0, np.pi / 2, 100)  # cosines from 1 down to 0
    cand = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    stats = metrics.cosine_stats(base, cand)
    assert stats["min"] == pytest.approx(0.0, abs=1e-12)
    assert stats["median"] == pytest.approx(np.median(np.cos(angles)))
    assert stats["p1"] == pytest.approx(np.percentile(np.cos(angles), 1))


def test_top_k_overlap_counts_shared_neighbours() -> None:
    # one query on the x axis; passages at increasing angles: neighbours 0..9 under the baseline
    angles = np.linspace(0.0, np.pi, 20)
    passages = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    query = np.array([[1.0, 0.0]])
    assert list(metrics.top_k(query, passages, 3)[0]) == [0, 1, 2]
    flipped = np.array([[-1.0, 0.0]])  # the candidate's query points the other way: neighbours 10..19
    assert metrics.top_k_overlap(query, passages, flipped, passages) == 0.0
    turned = np.array([[np.cos(angles[10]), np.sin(angles[10])]])  # its ten nearest: 5..14 (ties aside)
    overlap = metrics.top_k_overlap(query, passages, turned, passages)
    assert overlap == pytest.approx(len(set(range(10)) & set(metrics.top_k(turned, passages, 10)[0])) / 10)
    assert 0.4 <= overlap <= 0.6


def test_neighbours_are_the_same_computed_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    q, p = rng.normal(size=(50, 8)), rng.normal(size=(300, 8))
    whole = metrics.nearest(q, p, 11)
    monkeypatch.setattr(metrics, "BLOCK", 7)
    blocks = metrics.nearest(q, p, 11)
    assert (whole.index == blocks.index).all() and np.allclose(whole.score, blocks.score)
    full = metrics.normalised(q) @ metrics.normalised(p).T
    assert np.allclose(whole.score, -np.sort(-full, axis=1)[:, :11])


def test_boundary_shows_a_near_tie_at_the_tenth_neighbour() -> None:
    # eleven passages at nearly the same angle from the query, then the rest far away
    angles = np.concatenate([np.linspace(0.0, 0.001, 11), np.linspace(1.0, 3.0, 9)])
    passages = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    query = np.array([[1.0, 0.0]])
    nudged = np.array([[np.cos(-0.01), np.sin(-0.01)]])  # turns the query by 0.01 rad
    b = metrics.boundary(metrics.nearest(query, passages, 11), nudged, passages)
    assert b["gap_k_to_next_median"] < 1e-6  # the 10th and 11th score alike
    assert b["score_change_median"] > b["gap_k_to_next_median"]  # the change is larger than the gap
    # by hand: each top-10 passage at angle a scores cos(a) and, nudged, cos(a + 0.01)
    top = np.linspace(0.0, 0.001, 11)[:10]
    assert b["score_change_median"] == pytest.approx(np.median(np.cos(top) - np.cos(top + 0.01)))


def test_a_corpus_smaller_than_k_overlaps_fully_with_itself() -> None:
    rng = np.random.default_rng(1)
    q, p = rng.normal(size=(3, 8)), rng.normal(size=(4, 8))
    assert metrics.top_k_overlap(q, p, q, p, k=10) == 1.0


# A hand-made corpus: six passages on the unit circle, three queries with known relevant ones.
PASSAGES = on_circle([0, 15, 40, 70, 120, 180])
QUERIES = on_circle([5, 100, 62])
RELEVANT = [{1}, {5, 0}, {2, 4}]
# ranks by angular distance, worked out by hand:
#   q0 at 5:   p0 (5), p1 (10), p2 (35), p3, p4, p5       relevant p1 at rank 2
#   q1 at 100: p4 (20), p3 (30), p2 (60), p5 (80), p1 (85), p0 (100)   p5 rank 4, p0 rank 6
#   q2 at 62:  p3 (8), p2 (22), p1 (47), p4 (58), p0 (62), p5 (118)    p2 rank 2, p4 rank 4
LOG2 = {r: float(np.log2(r + 1)) for r in range(1, 7)}


def test_the_hand_made_corpus_ranks_as_worked_out() -> None:
    ranked = metrics.top_k(QUERIES, PASSAGES, 6)
    assert ranked.tolist() == [[0, 1, 2, 3, 4, 5], [4, 3, 2, 5, 1, 0], [3, 2, 1, 4, 0, 5]]


def test_recall_and_ndcg_at_3_by_hand() -> None:
    ranked = metrics.top_k(QUERIES, PASSAGES, 3)
    # recall@3: q0 1/1, q1 0/2, q2 1/2
    assert metrics.recall_at_k(ranked, RELEVANT, 3) == pytest.approx((1 + 0 + 0.5) / 3)
    # nDCG@3: q0 (1/log2 3) / 1; q1 0; q2 (1/log2 3) / (1 + 1/log2 3)
    q0 = (1 / LOG2[2]) / 1
    q2 = (1 / LOG2[2]) / (1 / LOG2[1] + 1 / LOG2[2])
    assert metrics.ndcg_at_k(ranked, RELEVANT, 3) == pytest.approx((q0 + 0 + q2) / 3)
    assert metrics.ndcg_at_k(ranked, RELEVANT, 3) == pytest.approx(0.33927, abs=1e-5)


def test_recall_and_ndcg_at_10_by_hand() -> None:
    ranked = metrics.top_k(QUERIES, PASSAGES, 10)  # all six passages
    assert metrics.recall_at_k(ranked, RELEVANT, 10) == 1.0
    ideal2 = 1 / LOG2[1] + 1 / LOG2[2]
    q0 = 1 / LOG2[2]
    q1 = (1 / LOG2[4] + 1 / LOG2[6]) / ideal2
    q2 = (1 / LOG2[2] + 1 / LOG2[4]) / ideal2
    assert metrics.ndcg_at_k(ranked, RELEVANT, 10) == pytest.approx((q0 + q1 + q2) / 3)


def test_perfect_retrieval_scores_one() -> None:
    ranked = np.array([[2, 0, 1], [1, 0, 2]])
    assert metrics.ndcg_at_k(ranked, [{2, 0}, {1}], 10) == pytest.approx(1.0)
    assert metrics.recall_at_k(ranked, [{2, 0}, {1}], 1) == pytest.approx((0.5 + 1) / 2)


def test_thresholds_name_what_missed() -> None:
    good = {"median_cosine": 0.995, "p1_cosine": 0.985, "top10_overlap": 0.95,
            "recall_at_10_drop": 0.005, "ndcg_at_10_drop": -0.01}
    assert missed(good, Thresholds()) == {}
    bad = good | {"p1_cosine": 0.97, "recall_at_10_drop": 0.02}
    assert missed(bad, Thresholds()) == {"p1_cosine": 0.97, "recall_at_10_drop": 0.02}
    assert missed(bad, Thresholds(min_p1_cosine=0.9, max_recall_drop=0.05)) == {}
    # at the threshold itself, the figure holds
    assert missed(good | {"recall_at_10_drop": 0.01}, Thresholds()) == {}
