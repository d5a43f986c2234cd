"""Cross-modal retrieval metrics (Table 4): Recall@K, median and mean rank of the first positive, mAP.

Ties are broken pessimistically: a gallery item that scores the same as a positive is ranked before it
unless it is itself a positive, so a constant similarity matrix gives chance-level (worst-case) numbers
rather than perfect ones.
"""

from __future__ import annotations

import numpy as np

RETRIEVAL_METRICS: tuple[str, ...] = ("recall_at_1", "recall_at_5", "recall_at_10", "median_rank", "mean_rank", "map")


def retrieval_metrics(similarity: np.ndarray, positives: np.ndarray | None = None) -> dict[str, float]:
    """Rank metrics of ``Q`` queries against ``G`` gallery items: ``similarity`` ``(Q, G)`` (higher = more similar;
    text→image: the transpose) and ``positives`` ``(Q, G)`` bool (None: the diagonal, ``Q == G``). Returns
    ``recall_at_{1,5,10}`` (% of queries whose first positive is in the top K); ``median_rank``, ``mean_rank`` of the
    first positive (1-based); ``map`` (%, mean average precision: with one positive per query, the mean reciprocal
    rank). Queries without a positive are left out; ValueError if no query has one.
    """
    similarity = np.asarray(similarity, dtype=np.float64)
    if similarity.ndim != 2:
        raise ValueError(f"similarity must be (Q, G), got shape {similarity.shape}")
    if np.isnan(similarity).any():
        raise ValueError("similarity contains NaN")
    if positives is None:
        if similarity.shape[0] != similarity.shape[1]:
            raise ValueError(f"positives=None means the diagonal, which needs Q == G; got {similarity.shape}")
        positives = np.eye(similarity.shape[0], dtype=bool)
    positives = np.asarray(positives, dtype=bool)
    if positives.shape != similarity.shape:
        raise ValueError(f"positives {positives.shape} and similarity {similarity.shape} differ in shape")
    answerable = positives.any(axis=1)
    if not answerable.any():
        raise ValueError("no query has a positive")
    similarity, positives = similarity[answerable], positives[answerable]

    # Sort by descending similarity; among equal similarities negatives come first (keys: last is primary).
    order = np.lexsort((positives, -similarity), axis=-1)
    hits = np.take_along_axis(positives, order, axis=-1)
    first_rank = hits.argmax(axis=1) + 1
    precision_at_hit = np.cumsum(hits, axis=1) / np.arange(1, hits.shape[1] + 1)
    average_precision = (precision_at_hit * hits).sum(axis=1) / hits.sum(axis=1)
    return {
        **{f"recall_at_{k}": 100.0 * float(np.mean(first_rank <= k)) for k in (1, 5, 10)},
        "median_rank": float(np.median(first_rank)),
        "mean_rank": float(np.mean(first_rank)),
        "map": 100.0 * float(np.mean(average_precision)),
    }
