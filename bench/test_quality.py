"""The quality gate's arithmetic on vectors whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest
import quality


def test_identical_vectors_have_cosine_one_and_full_overlap() -> None:
    rng = np.random.default_rng(0)
    q, p = rng.normal(size=(20, 16)), rng.normal(size=(200, 16))
    assert quality.cosine_stats(p, p * 3.0) == pytest.approx({"median": 1.0, "p1": 1.0, "min": 1.0})
    assert quality.top_k_overlap(q, p, q, p) == 1.0


def test_cosine_stats_of_known_angles() -> None:
    base = np.array([[1.0, 0.0]] * 100)
    angles = np.linspace(0.0, np.pi / 2, 100)  # cosines from 1 down to 0
    cand = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    stats = quality.cosine_stats(base, cand)
    assert stats["min"] == pytest.approx(0.0, abs=1e-12)
    assert stats["median"] == pytest.approx(np.median(np.cos(angles)))
    assert stats["p1"] == pytest.approx(np.percentile(np.cos(angles), 1))


def test_top_k_overlap_counts_shared_neighbours() -> None:
    # one query on the x axis; passages at increasing angles: neighbours 0..9 under the baseline
    angles = np.linspace(0.0, np.pi, 20)
    passages = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    query = np.array([[1.0, 0.0]])
    assert list(quality.top_k(query, passages, 3)[0]) == [0, 1, 2]
    flipped = np.array([[-1.0, 0.0]])  # the candidate's query points the other way: neighbours 10..19
    assert quality.top_k_overlap(query, passages, flipped, passages) == 0.0
    turned = np.array([[np.cos(angles[10]), np.sin(angles[10])]])  # its ten nearest: 5..14 (ties aside)
    overlap = quality.top_k_overlap(query, passages, turned, passages)
    assert overlap == pytest.approx(len(set(range(10)) & set(quality.top_k(turned, passages, 10)[0])) / 10)
    assert 0.4 <= overlap <= 0.6


def test_verdict_names_what_missed() -> None:
    v = quality.verdict({"median": 0.995, "p1": 0.97, "min": 0.9}, overlap=0.95)
    assert not v["passed"] and set(v["missed"]) == {"p1_cosine"}
    assert quality.verdict({"median": 0.995, "p1": 0.985, "min": 0.9}, overlap=0.95)["passed"]


def test_boundary_shows_a_near_tie_at_the_tenth_neighbour() -> None:
    # eleven passages at nearly the same angle from the query, then the rest far away
    angles = np.concatenate([np.linspace(0.0, 0.001, 11), np.linspace(1.0, 3.0, 9)])
    passages = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    query = np.array([[1.0, 0.0]])
    nudged = np.array([[np.cos(-0.01), np.sin(-0.01)]])  # turns the query by 0.01 rad
    b = quality.boundary(query, passages, nudged, passages)
    assert b["gap_k_to_next_median"] < 1e-6  # the 10th and 11th score alike
    assert b["score_change_median"] > b["gap_k_to_next_median"]  # the change is larger than the gap


def test_a_corpus_smaller_than_k_overlaps_fully_with_itself() -> None:
    rng = np.random.default_rng(1)
    q, p = rng.normal(size=(3, 8)), rng.normal(size=(4, 8))
    assert quality.top_k_overlap(q, p, q, p, k=10) == 1.0
