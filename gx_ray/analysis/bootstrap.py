"""The paired bootstrap over test patients, in a module of its own with nothing but NumPy: the report's worker
processes (:func:`gx_ray.analysis.cases.paired_bootstraps`) import it, and each pays its imports before scoring
anything (:mod:`gx_ray.analysis.stats`, with MLflow, SciPy and pandas, took 2.6 s of that on a 2-core machine)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def paired_bootstrap(
    score_a: Sequence[Callable[[np.ndarray], float]],
    score_b: Sequence[Callable[[np.ndarray], float]],
    n_cases: int,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Paired bootstrap over test patients of schema A minus schema B, averaged over seeds. ``score_a[s](indices)``:
    seed ``s``'s model A's metric on the test cases ``indices`` (an int array, repeats allowed, into ``n_cases`` cases
    shared by every model), likewise ``score_b``. Each replicate scores both arms of every seed on the same indices, so
    patient difficulty cancels. Returns ``diff`` (all cases), its percentile ``ci_low``/``ci_high``, ``p_value`` = ``2 *
    min(P(d <= 0), P(d >= 0))`` (+1 correction, capped at 1), ``n_seeds``, ``n_cases``, ``n_resamples`` (kept) and
    ``dropped``: replicates with a NaN score (an AUC of one class), left out."""
    if len(score_a) != len(score_b) or not score_a:
        raise ValueError(f"need the same seeds for both arms, got {len(score_a)} and {len(score_b)}")

    def diff(indices: np.ndarray) -> float:
        return float(np.mean([a(indices) - b(indices) for a, b in zip(score_a, score_b, strict=True)]))

    # numpy rather than scipy.stats.bootstrap: scipy would fold NaN replicates into a NaN interval (with a
    # misleading BCa warning) and gives no p-value, so only its resampling would be used
    observed = diff(np.arange(n_cases))
    rng = np.random.default_rng(seed)
    d = np.array([diff(rng.integers(0, n_cases, size=n_cases)) for _ in range(n_resamples)])
    kept = d[~np.isnan(d)]
    out = {
        "diff": observed,
        "ci_low": float("nan"),
        "ci_high": float("nan"),
        "p_value": float("nan"),
        "n_seeds": len(score_a),
        "n_cases": n_cases,
        "n_resamples": len(kept),
        "dropped": n_resamples - len(kept),
        "method": "paired bootstrap over patients",
    }
    if len(kept):
        alpha = 1 - confidence
        out["ci_low"], out["ci_high"] = (float(q) for q in np.quantile(kept, [alpha / 2, 1 - alpha / 2]))
        tail = min(np.sum(kept <= 0), np.sum(kept >= 0))
        out["p_value"] = float(min(1.0, 2 * (tail + 1) / (len(kept) + 1)))
    return out
