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
Scorers with a counted form (:data:`~gx_ray.analysis.cases.Counted`) score every replicate at once, the same numbers;
out of bag only the chosen configuration is scored. :func:`selection_estimate` reads a sweep's trials (finalize) and
:func:`task_winners` each searched task's winner (the report).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gx_ray.analysis.cases import CaseScorer, Counted

if TYPE_CHECKING:
    import pandas as pd

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


def _counts(rows: np.ndarray, n_patients: int) -> np.ndarray:
    """How often each replicate draws each patient: ``(replicates, patients)``."""
    offsets = rows + n_patients * np.arange(len(rows))[:, None]
    return np.bincount(offsets.ravel(), minlength=len(rows) * n_patients).reshape(len(rows), n_patients).astype(float)


def _in_bag(scores: Scores, rows: np.ndarray, counts: np.ndarray, configurations: int) -> np.ndarray:
    """Every configuration's score on every replicate ``(replicates, configurations)``: at once where ``scores`` can
    (:meth:`ConfigurationScores.counted`), else replicate by replicate."""
    at_once = [_counted(scores, k, counts) for k in range(configurations)]
    if all(column is not None for column in at_once):
        return np.column_stack(at_once)
    return np.array([_vector(scores, row, configurations) for row in rows])


def _counted(scores: Scores, k: int, counts: np.ndarray) -> np.ndarray | None:
    return scores.counted(k, counts) if isinstance(scores, ConfigurationScores) else None


def _out_of_bag(scores: Scores, drawn: np.ndarray, in_bag: np.ndarray, sign: float) -> np.ndarray:
    """The out-of-bag score of each replicate's in-bag choice, only the chosen configuration scored; NaN where none is
    chosen or it cannot be scored."""
    out = np.full(len(drawn), np.nan)
    live = np.flatnonzero(~np.isnan(in_bag).all(axis=1) & ~drawn.all(axis=1))
    choices = np.nanargmax(sign * in_bag[live], axis=1)  # NaN is never a winner
    for k in np.unique(choices):
        replicates = live[choices == k]
        at_once = _counted(scores, int(k), (~drawn[replicates]).astype(float))
        if at_once is not None:
            out[replicates] = at_once
            continue
        for b in replicates:
            patients = np.flatnonzero(~drawn[b])
            if isinstance(scores, ConfigurationScores):
                out[b] = scores.one(int(k), patients)
            else:
                out[b] = _vector(scores, patients, in_bag.shape[1])[k]
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
    counts = _counts(rows, n_patients)
    in_bag = _in_bag(scores, rows, counts, len(full))
    out = _out_of_bag(scores, counts > 0, in_bag, sign)
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
    ``case_ids``) on the same patients; ``counted``: the same scorers' :data:`~gx_ray.analysis.cases.Counted` forms
    (None where a seed's scorer has none), which score every replicate at once."""

    case_ids: list[str]
    configurations: list[list[Callable[[np.ndarray], float]]]
    counted_forms: list[list[Counted | None]] | None = None

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        return np.array([self.one(k, indices) for k in range(len(self.configurations))])

    def one(self, k: int, indices: np.ndarray) -> float:
        """Configuration ``k``'s score on the patients ``indices``."""
        return np.mean([seed(indices) for seed in self.configurations[k]])

    def counted(self, k: int, counts: np.ndarray) -> np.ndarray | None:
        """Configuration ``k``'s score on each row's resample (``counts``: ``(replicates, patients)`` draws), the same
        numbers as :meth:`one`; None where a seed's scorer has no counted form."""
        forms = self.counted_forms[k] if self.counted_forms else [None]
        if any(form is None for form in forms):
            return None
        return np.mean([form(counts) for form in forms], axis=0)


def scores_from_scorers(configs: list[list[CaseScorer]]) -> ConfigurationScores:
    """:data:`Scores` from each configuration's per-seed :class:`~gx_ray.analysis.cases.CaseScorer` (of
    ``predictions/val.json``; for ``"bbc-cv"`` one scorer per seed over its fold runs' records pooled), on the patients
    every scorer scored (sorted case ids: ``len(result.case_ids)`` is ``n_patients``)."""
    if not configs or any(not seeds for seeds in configs):
        raise ValueError("need at least one configuration, each with at least one seed's scorer")
    common = sorted(set.intersection(*(set(s.case_ids) for seeds in configs for s in seeds)))
    if len(common) < 2:
        raise ValueError(f"the scorers share {len(common)} patients: need at least 2")
    return ConfigurationScores(common, [[s.aligned(common) for s in seeds] for seeds in configs],
                               [[s.aligned_counted(common) for s in seeds] for seeds in configs])  # fmt: skip


# --- from a sweep's trials: what finalize and the report read ---------------------------------------------------

NO_VALIDATION_PREDICTIONS = "no selection-corrected estimate: the trials logged no validation predictions"
RecordsOf = Callable[[str], "list[dict[str, Any]] | None"]
"""``records_of(run_id)``: a trial's ``predictions/val.json`` records, or None where it logged none
(:func:`~gx_ray.analysis.runs.test_records` with ``split="val"``)."""


def describe(key: str, base: dict[str, Any] | None = None) -> str:
    """A configuration (its settings as a JSON key) in a line: the settings that differ from ``base`` (all of them
    without one)."""
    settings = json.loads(key)
    shown = {k: v for k, v in settings.items() if base is None or base.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or "the only configuration"


def shared_settings(keys: Sequence[str]) -> dict[str, Any]:
    """The settings every configuration shares (what a description need not repeat); none for a single one."""
    parsed = [json.loads(k) for k in keys]
    return {k: v for k, v in parsed[0].items() if all(p.get(k) == v for p in parsed)} if len(parsed) > 1 else {}


def validation_scorers(records_of: RecordsOf, candidates: pd.DataFrame,
                       keys: list[str]) -> tuple[list[list[CaseScorer]], str]:  # fmt: skip
    """Per configuration (in ``keys``' order) a case scorer per seed over its trials' validation records (a
    cross-validated seed's fold runs pooled: every training patient once), or none and why. ``candidates``: one row
    per trial with ``key``, ``seed``, ``fold``, ``run_id``, ``label`` (the task) and ``metric``."""
    from gx_ray.analysis.cases import case_scorer
    from gx_ray.tasks import task_of

    label, metric = candidates["label"].iloc[0], candidates["metric"].iloc[0]
    configs = []
    for key in keys:
        seeds = []
        for _, trials in candidates[candidates["key"] == key].groupby("seed", dropna=False):
            records: list[dict[str, Any]] = []
            for run_id in trials.sort_values("fold")["run_id"]:
                logged = records_of(run_id)
                if logged is None:
                    return [], NO_VALIDATION_PREDICTIONS
                records += logged
            try:
                scorer = case_scorer(task_of(label), records, metric) if records else None
            except ValueError as err:  # broken records (a diverged trial's NaN probabilities): no estimate, no crash
                return [], f"no selection-corrected estimate: {err}"
            if scorer is None:
                return [], f"no selection-corrected estimate: {label}'s validation predictions give no {metric}"
            seeds.append(scorer)
        configs.append(seeds)
    return configs, ""


def selection_estimate(records_of: RecordsOf, candidates: pd.DataFrame, keys: list[str],
                       n_resamples: int) -> tuple[SelectionEstimate | None, str]:  # fmt: skip
    """The best configuration's validation score corrected for its selection among ``keys`` (BBC-CV over a
    cross-validated sweep's out-of-fold predictions, else the select-then-score bootstrap over the validation
    patients), on the patients every configuration predicted; or None and why."""
    from gx_ray.analysis.runs import higher_is_better

    scorers, why = validation_scorers(records_of, candidates, keys)
    if not scorers:
        return None, why
    common = set.intersection(*(set(s.case_ids) for seeds in scorers for s in seeds))
    if len(common) < 2:
        return None, f"no selection-corrected estimate: the configurations share {len(common)} validation patients"
    method = "bbc-cv" if candidates["fold"].notna().any() else "select-then-score"
    try:
        estimate = selection_corrected(scores_from_scorers(scorers), len(common), method=method,
                                       higher_is_better=higher_is_better(candidates["metric"].iloc[0]),
                                       n_resamples=n_resamples)  # fmt: skip
    except ValueError as err:  # e.g. an AUC undefined on most resamples of few patients
        return None, f"no selection-corrected estimate: {err}"
    return estimate, ""


CONFIGURATION_COLUMNS = ("schema", "model", "fusion")
"""The runs table's columns that, with its searched parameters, make a configuration (seeds and folds repeat one)."""


def task_winners(runs: pd.DataFrame, records_of: RecordsOf, n_resamples: int = 1000) -> pd.DataFrame:
    """For each task that searched parameters (:func:`~gx_ray.analysis.search_views.searched_tasks`), one row: its
    configurations' count, the best one, the naive best validation score beside the selection-corrected estimate with
    its interval and the configurations indistinguishable from the best (:func:`selection_estimate` over the finished
    trials' validation predictions); or in ``note`` why there is no estimate, the best and ``naive`` then by the
    logged validation score (mean over seeds of a seed's folds' mean). Empty for a sweep that searched nothing."""
    import pandas as pd

    from gx_ray.analysis.runs import headline_metric, higher_is_better
    from gx_ray.analysis.search_views import searched_tasks

    searched = list(runs.attrs.get("searched", []))
    rows = []
    for task in searched_tasks(runs):
        metric = headline_metric(task)
        val = runs[(runs["task"] == task) & (runs["split"] == "val") & (runs["metric"] == metric)]
        val = val[val["status"] == "FINISHED"].drop_duplicates("run_id")
        if val.empty:
            continue
        settings = val[[*CONFIGURATION_COLUMNS, *searched]].astype(object)
        settings = settings.where(settings.notna(), None).to_dict("records")  # a parameter a trial did not use: null
        candidates = val.assign(label=task, key=[json.dumps(s, sort_keys=True, default=str) for s in settings])
        score = candidates.groupby(["key", "seed"])["value"].mean().groupby("key").mean().dropna()
        keys = list(score.sort_values(ascending=not higher_is_better(metric), kind="stable").index)
        if not keys:  # every trial's validation score undefined (NaN): nothing was chosen
            continue
        estimate, note = selection_estimate(records_of, candidates[candidates["key"].isin(keys)], keys, n_resamples)
        rows.append(_winner(task, metric, keys, float(score[keys[0]]), estimate, note))
    return pd.DataFrame(rows)


def _winner(task: str, metric: str, keys: list[str], logged: float, estimate: SelectionEstimate | None,
            note: str) -> dict[str, Any]:  # fmt: skip
    """:func:`task_winners`' row: the configurations by their descriptions, the estimate's figures or NaN and why."""
    shared = shared_settings(keys)
    figures = ("naive", "corrected", "low", "high", "method", "patients", "resamples")
    row = {"task": task, "metric": metric, "configurations": len(keys)}
    if estimate is None:
        return {**row, "best": describe(keys[0], shared), **dict.fromkeys(figures, math.nan), "naive": logged,
                "indistinguishable": math.nan, "indistinguishable_configurations": "", "note": note}  # fmt: skip
    same = [describe(keys[i], shared) for i in estimate.indistinguishable]
    figured = {k: getattr(estimate, k) for k in figures}
    return {**row, "best": describe(keys[estimate.chosen], shared), **figured, "indistinguishable": len(same),
            "indistinguishable_configurations": "; ".join(same), "note": ""}  # fmt: skip
