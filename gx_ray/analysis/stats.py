"""Statistics across seeds and paired significance between input schemas.

:func:`cell_statistics`: mean, SD and a t interval over seeds per cell of the runs table. Schemas are compared on the
trial pairs :func:`paired_arms` finds, by :func:`paired_bootstrap` over test patients (needs per-case predictions) or
else :func:`wilcoxon_over_seeds`; :func:`significance_table` Holm-corrects each family and says which schema is better.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from gx_ray.analysis.bootstrap import paired_bootstrap as paired_bootstrap  # its home is light: see there
from gx_ray.analysis.power import family_resamples as family_resamples  # light too: the planner uses it
from gx_ray.analysis.runs import headline_metric, higher_is_better

CELL_KEYS = ["task", "model", "fusion", "schema", "metric"]
COMPARISON_KEYS = ["task", "metric", "schema_a", "schema_b"]


def seed_summary(values: Sequence[float], confidence: float = 0.95) -> dict:
    """Mean, SD (ddof=1), n and Student's t interval of the mean of one cell's values over seeds; NaNs dropped, SD and
    interval NaN with n < 2. Not a bootstrap: with 3 seeds a percentile bootstrap gives back their min and max, which
    hold the mean of three normal draws 75 % of the time, not 95 (tested)."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    n = len(x)
    mean = float(x.mean()) if n else float("nan")
    out = {"mean": mean, "sd": float("nan"), "n": n, "ci_low": float("nan"), "ci_high": float("nan")}
    if n < 2:
        return out
    out["sd"] = float(x.std(ddof=1))
    if out["sd"] == 0:  # every seed the same: the interval is the point (scipy would give NaN for a zero scale)
        out["ci_low"] = out["ci_high"] = mean
        return out
    low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=out["sd"] / math.sqrt(n))
    out["ci_low"], out["ci_high"] = float(low), float(high)
    return out


def cell_statistics(runs: pd.DataFrame, split: str = "test") -> pd.DataFrame:
    """One row per (task, model, fusion, schema, metric) of ``runs`` on ``split``: :func:`seed_summary` over its
    trials (the seeds), plus ``higher_is_better``. Cells keep the order in which they first appear."""
    rows = []
    for key, group in runs[runs["split"] == split].groupby(CELL_KEYS, sort=False, dropna=False):
        rows.append({**dict(zip(CELL_KEYS, key, strict=True)), **seed_summary(per_seed(group)["value"].to_numpy())})
    columns = [*CELL_KEYS, "mean", "sd", "n", "ci_low", "ci_high"]
    table = pd.DataFrame(rows, columns=columns)
    table["higher_is_better"] = [higher_is_better(m) for m in table["metric"]]
    return table


def wilcoxon_over_seeds(a: Sequence[float], b: Sequence[float]) -> dict:
    """Wilcoxon signed-rank test (two-sided) of ``a`` against ``b`` paired by seed, NaN pairs dropped: ``diff`` =
    mean(a - b), ``p_value`` (1 for all-zero differences), ``n_seeds``, ``method``. Only the fallback without per-case
    predictions: with n <= 5 seeds the smallest p is 2 / 2**n >= 0.0625, never 0.05 however large the effect."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ok = ~(np.isnan(a) | np.isnan(b))
    d = a[ok] - b[ok]
    out = {"diff": float(d.mean()) if len(d) else float("nan"), "p_value": float("nan"), "n_seeds": len(d)}
    if len(d) and np.all(d == 0):
        out["p_value"] = 1.0
    elif len(d):
        out["p_value"] = float(stats.wilcoxon(d, alternative="two-sided").pvalue)
    return {**out, "method": "Wilcoxon signed-rank over seeds"}


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm-Bonferroni step-down adjusted p-values: monotone in p, capped at 1; NaN stays NaN and is not counted.
    (scipy's ``false_discovery_control`` only does BH/BY and statsmodels is not a dependency.)"""
    p = np.asarray(p_values, dtype=float)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m = len(order)
    # the i-th smallest of m is multiplied by (m - i); the running max keeps the step-down order monotone
    out[order] = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    return out


def families(schemas: Sequence[str], primary: Sequence[str] | None) -> tuple[list[str], list[int]]:
    """Each comparison's Holm family, by its schema, and that family's size: ``primary`` (the confirmatory family the
    space declared in ``analysis.primary``) or ``exploratory`` (every other); ``all`` where nothing was declared."""
    labels = ["all" if not primary else "primary" if s in primary else "exploratory" for s in schemas]
    return labels, [labels.count(label) for label in labels]


def significance_table(comparisons: list[dict], alpha: float = 0.05) -> pd.DataFrame:
    """The comparisons (task, metric, schema_a, schema_b and a test's keys) as a table, Holm-corrected within each
    ``family`` (:func:`families`), or across ALL of them as one family without that key, sorted by task then p-value.
    Adds ``p_holm``, ``significant`` (``p_holm < alpha``) and ``better``: the schema better by
    :func:`~gx_ray.analysis.runs.higher_is_better`, or ``""`` when not significant."""
    table = pd.DataFrame(comparisons)
    if table.empty:
        return pd.DataFrame(columns=[*COMPARISON_KEYS, "diff", "p_value", "p_holm", "significant", "better"])
    family = table["family"] if "family" in table else np.zeros(len(table))
    table["p_holm"] = table["p_value"].groupby(family).transform(holm)
    table["significant"] = table["p_holm"] < alpha
    a_wins = (table["diff"] > 0) == table["metric"].map(higher_is_better)
    table["better"] = np.where(table["significant"], np.where(a_wins, table["schema_a"], table["schema_b"]), "")
    rest = [c for c in table.columns if c not in COMPARISON_KEYS]
    return table[COMPARISON_KEYS + rest].sort_values(["task", "p_value"], kind="stable").reset_index(drop=True)


def per_seed(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per seed, indexed by seed: a trial's ``value`` and ``run_id``; under cross-validation (a ``fold``
    column), the mean ``value`` of the seed's fold models and their run ids as a list in fold order (one unit of the
    seed level; fold k is the k-th of every seed's and every schema's list). Empty where a seed has several trials that
    are not its folds (a search over other parameters)."""
    folded = "fold" in frame and frame["fold"].notna().any()
    keys = ["seed", "fold"] if folded else ["seed"]
    if frame.duplicated(keys).any():
        return frame.iloc[0:0].set_index("seed")
    if not folded:
        return frame.set_index("seed")
    grouped = frame.sort_values(keys).groupby("seed", sort=True)
    return pd.DataFrame({"value": grouped["value"].mean(), "run_id": grouped["run_id"].agg(list)})


def paired_arms(
    runs: pd.DataFrame, baseline: str = "image_only", split: str = "test", headline_only: bool = False
) -> Iterator[tuple[dict, pd.DataFrame, pd.DataFrame]]:
    """Every schema against ``baseline`` per task, model, fusion and metric: ``(cell, arm, baseline_arm)``, both arms'
    rows by seed (:func:`per_seed`) on the seeds both have. A schema with several non-fold trials on one seed (a search
    over other parameters) is not paired. ``headline_only`` keeps each task's primary metric (imports the tasks)."""
    keys = ["task", "model", "fusion", "metric"]
    for (task, model, fusion, metric), group in runs[runs["split"] == split].groupby(keys, dropna=False):
        if headline_only and metric != headline_metric(task):
            continue
        arms = {schema: per_seed(frame) for schema, frame in group.groupby("schema")}
        arms = {schema: frame for schema, frame in arms.items() if len(frame)}
        if baseline not in arms:
            continue
        for schema in sorted(set(arms) - {baseline}):
            seeds = sorted(set(arms[schema].index) & set(arms[baseline].index))
            if seeds:
                cell = {"task": task, "model": model, "fusion": fusion, "metric": metric}
                yield (
                    {**cell, "schema_a": schema, "schema_b": baseline},
                    arms[schema].loc[seeds],
                    arms[baseline].loc[seeds],
                )


def seed_comparisons(
    runs: pd.DataFrame, baseline: str = "image_only", split: str = "test", headline_only: bool = False
) -> list[dict]:
    """Every pair of :func:`paired_arms` compared with :func:`wilcoxon_over_seeds`: the fallback when per-case
    predictions are not available."""
    return [
        {**cell, **wilcoxon_over_seeds(arm["value"].to_numpy(), base["value"].to_numpy())}
        for cell, arm, base in paired_arms(runs, baseline, split, headline_only)
    ]
