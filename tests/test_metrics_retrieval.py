"""Retrieval metrics equal an explicit-loop computation (ties pessimistic) and scikit-learn's AP without ties."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from gx_ray.metrics import RETRIEVAL_METRICS, retrieval_metrics


def _brute_force(similarity: np.ndarray, positives: np.ndarray) -> dict[str, float]:
    """One query at a time: a negative that ties with a positive is ranked before it."""
    first_ranks, average_precisions = [], []
    for scores, is_positive in zip(similarity, positives, strict=True):
        positive_scores = sorted((s for s, p in zip(scores, is_positive, strict=True) if p), reverse=True)
        if not positive_scores:
            continue
        precisions = []
        for k, score in enumerate(positive_scores, start=1):
            negatives_before = sum(1 for s, p in zip(scores, is_positive, strict=True) if not p and s >= score)
            precisions.append(k / (k + negatives_before))  # the k-th positive sits at position k + negatives_before
            if k == 1:
                first_ranks.append(1 + negatives_before)
        average_precisions.append(sum(precisions) / len(precisions))
    return {
        "recall_at_1": 100 * np.mean([r <= 1 for r in first_ranks]),
        "recall_at_5": 100 * np.mean([r <= 5 for r in first_ranks]),
        "recall_at_10": 100 * np.mean([r <= 10 for r in first_ranks]),
        "median_rank": float(np.median(first_ranks)),
        "mean_rank": float(np.mean(first_ranks)),
        "map": 100 * np.mean(average_precisions),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_brute_force_with_ties_and_several_positives(seed):
    rng = np.random.default_rng(seed)
    similarity = rng.integers(0, 5, size=(30, 40)).astype(float)  # coarse: many ties
    positives = rng.random((30, 40)) < 0.08
    positives[3] = False  # a query without positives is left out
    ours = retrieval_metrics(similarity, positives)
    expected = _brute_force(similarity, positives)
    assert set(ours) == set(RETRIEVAL_METRICS)
    for name in RETRIEVAL_METRICS:
        assert ours[name] == pytest.approx(expected[name], abs=1e-9), name


def test_map_equals_sklearn_without_ties():
    rng = np.random.default_rng(5)
    similarity = rng.normal(size=(25, 25)) + 2 * np.eye(25)
    positives = np.eye(25, dtype=bool) | (rng.random((25, 25)) < 0.1)
    expected = np.mean([average_precision_score(p, s) for s, p in zip(similarity, positives, strict=True)])
    assert retrieval_metrics(similarity, positives)["map"] == pytest.approx(100 * expected)


def test_diagonal_default_and_transpose():
    rng = np.random.default_rng(6)
    similarity = rng.normal(size=(20, 20)) + 1.5 * np.eye(20)
    assert retrieval_metrics(similarity) == retrieval_metrics(similarity, np.eye(20, dtype=bool))
    text_to_image = retrieval_metrics(similarity.T)
    assert text_to_image == pytest.approx(_brute_force(similarity.T, np.eye(20, dtype=bool)))
    assert text_to_image != retrieval_metrics(similarity)  # the two directions rank different lists


def test_perfect_and_constant_similarity():
    perfect = retrieval_metrics(np.eye(12))
    assert perfect["recall_at_1"] == 100 and perfect["median_rank"] == 1 and perfect["map"] == 100
    constant = retrieval_metrics(np.zeros((12, 12)))  # pessimistic: every tie goes against the positive
    assert constant["recall_at_10"] == 0 and constant["median_rank"] == 12 and constant["mean_rank"] == 12


def test_rejects_malformed_input():
    with pytest.raises(ValueError, match="Q == G"):
        retrieval_metrics(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="no query has a positive"):
        retrieval_metrics(np.zeros((3, 4)), np.zeros((3, 4), dtype=bool))
    with pytest.raises(ValueError, match="NaN"):
        retrieval_metrics(np.full((2, 2), np.nan))
