"""A search's winner corrected for its selection: the score the chosen configuration would get on new patients, not the
best of many noisy scores (which is optimistic by about the expected maximum of their noise).

:func:`selection_corrected` is the bootstrap bias-corrected estimate of Tsamardinos, Greasidou and Borboudakis
(*Machine Learning* 107, 2018): draw the patients with replacement, choose the best configuration on the in-bag
patients, score THAT configuration on the out-of-bag patients (which played no part in the choice); the mean of those
out-of-bag scores is the estimate, their percentiles its interval. Two sources of the per-patient scores:

- ``"bbc-cv"``: a cross-validated sweep's out-of-fold predictions pooled over the folds, so every patient has one
  prediction per configuration (and seed), from the fold model that did not train on it;
- ``"select-then-score"``: one validation split's predictions (the tested model's ``predictions/val.json``).

Both correct the choice among the configurations the search tried (fixed before the bootstrap), not the search's
adaptive path, and assume the patients exchangeable. :func:`one_standard_error` is the one-standard-error rule.
NumPy only, like :mod:`gx_ray.analysis.study`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gx_ray.analysis.cases import CaseScorer

METHODS = ("bbc-cv", "select-then-score")
KEPT_FRACTION = 0.5
"""At least this share of the replicates must survive dropping (an out-of-bag set empty, or its score NaN): the estimate
is conditional on the kept ones, and when most are lost that condition is the answer, not the patients."""

Scores = Callable[[np.ndarray], np.ndarray]
"""``scores(indices)``: each configuration's score on the patients ``indices`` (repeats allowed); NaN: undefined."""


@dataclass(frozen=True)
class SelectionEstimate:
    """:func:`selection_corrected`'s answer. ``chosen`` and ``naive``: the configuration best on all patients and its
    (optimistic) score; ``corrected`` with ``low``/``high``: the mean and percentile interval of the out-of-bag scores
    of the in-bag choice; ``indistinguishable``: configurations whose paired bootstrap difference to ``chosen`` has an
    interval holding 0 (``chosen`` included); ``standard_errors``: each configuration's bootstrap standard error (NaN
    where it has fewer than 2 scores); ``resamples``: the replicates kept."""

    method: str
    chosen: int
    naive: float
    corrected: float
    low: float
    high: float
    indistinguishable: tuple[int, ...]
    standard_errors: tuple[float, ...]
    patients: int
    configurations: int
    resamples: int

    def to_dict(self) -> dict:
        """JSON-able: the fields by name, tuples as lists, NaN as None."""
        return {k: [_json(x) for x in v] if isinstance(v, tuple) else _json(v) for k, v in vars(self).items()}


def _json(value: object) -> object:
    return None if isinstance(value, float) and math.isnan(value) else value


def _vector(scores: Scores, indices: np.ndarray, configurations: int | None = None) -> np.ndarray:
    values = np.asarray(scores(indices), dtype=float)
    if values.ndim != 1 or (configurations is not None and len(values) != configurations):
        raise ValueError(f"scores must return one score per configuration ({configurations}), got shape {values.shape}")
    return values


def _enough(kept: int, n_resamples: int, confidence: float, what: str) -> None:
    needed = max(KEPT_FRACTION * n_resamples, 2 / (1 - confidence))
    if kept < needed:
        raise ValueError(
            f"too few bootstrap replicates left: {kept} of {n_resamples} gave {what} (need {math.ceil(needed)}); "
            "the metric is undefined on most resamples (e.g. an AUC with a rare class): more patients or resamples"
        )


def _out_of_bag(scores: Scores, rows: np.ndarray, in_bag: np.ndarray, sign: float) -> np.ndarray:
    """The out-of-bag score of each replicate's in-bag choice; NaN where none is chosen or it cannot be scored."""
    n_resamples, n_patients = rows.shape
    drawn = np.zeros(rows.shape, dtype=bool)
    drawn[np.arange(n_resamples)[:, None], rows] = True
    out = np.full(n_resamples, np.nan)
    for b in np.flatnonzero(~np.isnan(in_bag).all(axis=1) & ~drawn.all(axis=1)):
        choice = int(np.nanargmax(sign * in_bag[b]))  # NaN is never a winner
        out[b] = _vector(scores, np.flatnonzero(~drawn[b]), in_bag.shape[1])[choice]
    return out


def _indistinguishable(in_bag: np.ndarray, chosen: int, confidence: float, n_resamples: int) -> tuple[int, ...]:
    """Configurations whose paired in-bag difference to ``chosen`` has a percentile interval holding 0."""
    differences = in_bag - in_bag[:, [chosen]]
    tail, kept = (1 - confidence) / 2, (~np.isnan(differences)).sum(axis=0)
    same = []
    for k in np.flatnonzero(kept >= max(KEPT_FRACTION * n_resamples, 2 / (1 - confidence))):
        low, high = np.quantile(differences[~np.isnan(differences[:, k]), k], [tail, 1 - tail])
        if low <= 0 <= high:
            same.append(int(k))
    return tuple(sorted({*same, chosen}))


def selection_corrected(
    scores: Scores,
    n_patients: int,
    *,
    higher_is_better: bool = True,
    method: str = "bbc-cv",
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> SelectionEstimate:
    """The chosen configuration's score corrected for its selection (see the module). ``scores(indices)`` returns each
    configuration's score on the patients ``indices`` (an int array into ``n_patients`` patients every configuration
    scored, repeats allowed), NaN where a configuration cannot be scored on that sample. Seeds enter through
    ``scores``: a configuration's score is the mean over its seeds of each seed's score on the same ``indices``
    (:func:`scores_from_scorers`), so the choice is of a configuration, not of a lucky seed. Folds enter through the
    predictions (``"bbc-cv"``: each patient's out-of-fold prediction). A replicate whose out-of-bag set is empty or
    whose choice scores NaN there is dropped; ValueError when fewer than half (or 2 / (1 - confidence)) remain."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if n_patients < 2 or n_resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"need >= 2 patients, >= 1 resample, 0 < confidence < 1; got {n_patients}, {n_resamples}, "
                         f"{confidence}")  # fmt: skip
    sign = 1.0 if higher_is_better else -1.0
    full = _vector(scores, np.arange(n_patients))
    if np.isnan(full).all():
        raise ValueError("every configuration scores NaN on all patients: nothing to choose")
    chosen = int(np.nanargmax(sign * full))
    rows = np.random.default_rng(seed).integers(0, n_patients, size=(n_resamples, n_patients))
    in_bag = np.array([_vector(scores, row, len(full)) for row in rows])
    out = _out_of_bag(scores, rows, in_bag, sign)
    out = out[~np.isnan(out)]
    _enough(len(out), n_resamples, confidence, "an out-of-bag score")
    tail = (1 - confidence) / 2
    low, high = (float(q) for q in np.quantile(out, [tail, 1 - tail]))
    valid = (~np.isnan(in_bag)).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        errors = np.where(valid >= 2, np.nanstd(np.where(valid >= 2, in_bag, 0.0), axis=0, ddof=1), np.nan)
    return SelectionEstimate(
        method=method, chosen=chosen, naive=float(full[chosen]), corrected=float(out.mean()), low=low, high=high,
        indistinguishable=_indistinguishable(in_bag, chosen, confidence, n_resamples),
        standard_errors=tuple(float(e) for e in errors), patients=n_patients, configurations=len(full),
        resamples=len(out),
    )  # fmt: skip


def one_standard_error(
    means: Sequence[float], standard_errors: Sequence[float], costs: Sequence[float], *, higher_is_better: bool = True
) -> int:
    """Hastie, Tibshirani and Friedman's one-standard-error rule: the cheapest configuration (``costs``: trial seconds,
    parameters) whose mean is within one standard error (the best's) of the best mean; ties in cost go to the better
    mean. NaN means are never chosen."""
    means, errors, costs = (np.asarray(v, dtype=float) for v in (means, standard_errors, costs))
    if not len(means) == len(errors) == len(costs) or np.isnan(means).all():
        raise ValueError(f"need as many means, standard errors and costs, not all means NaN; got {len(means)}, "
                         f"{len(errors)}, {len(costs)}")  # fmt: skip
    oriented = means if higher_is_better else -means
    best = int(np.nanargmax(oriented))
    if not np.isfinite(errors[best]):
        raise ValueError(f"the best configuration ({best}) has no standard error ({errors[best]})")
    within = np.flatnonzero(oriented >= oriented[best] - errors[best])
    return int(min(within, key=lambda k: (costs[k], -oriented[k])))


@dataclass(frozen=True, eq=False)
class ConfigurationScores:
    """:data:`Scores` over ``case_ids``: each configuration's mean over its seeds' scorers (each aligned to
    ``case_ids``) on the same patients."""

    case_ids: list[str]
    configurations: list[list[Callable[[np.ndarray], float]]]

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        return np.array([np.mean([seed(indices) for seed in seeds]) for seeds in self.configurations])


def scores_from_scorers(configs: list[list[CaseScorer]]) -> ConfigurationScores:
    """:data:`Scores` from each configuration's per-seed :class:`~gx_ray.analysis.cases.CaseScorer` (of
    ``predictions/val.json``; for ``"bbc-cv"`` one scorer per seed over its fold runs' records pooled), on the patients
    every scorer scored (sorted case ids: ``len(result.case_ids)`` is ``n_patients``)."""
    if not configs or any(not seeds for seeds in configs):
        raise ValueError("need at least one configuration, each with at least one seed's scorer")
    common = sorted(set.intersection(*(set(s.case_ids) for seeds in configs for s in seeds)))
    if len(common) < 2:
        raise ValueError(f"the scorers share {len(common)} patients: need at least 2")
    return ConfigurationScores(common, [[s.aligned(common) for s in seeds] for seeds in configs])
