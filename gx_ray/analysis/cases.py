"""A trial's test metric as a function of which test patients are scored: what a paired bootstrap resamples.

:func:`case_scorer` turns a trial's ``predictions/test.json`` (one record per case, per question for VQA) back into
the task's metric, with the task's own metric functions, on any multiset of its test patients. Means over cases are
scored from per-case values computed once; corpus metrics (BLEU, AUC, AP) are recomputed per resample. Retrieval
resamples queries against the whole gallery (a resampled one would hold indistinguishable duplicates). Detection boxes
and scores are stored rounded, so recomputed values can differ in the last digits from the logged metric.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gx_ray.schema import STAGE_GROUPS

Records = Sequence[dict[str, Any]]


Counted = Callable[[np.ndarray], np.ndarray]
"""``counted(counts)``: the metric of many resamples at once, each row of ``counts`` ``(resamples, cases)`` how often
each case is drawn; the same numbers, to the last bit, as ``score`` on the cases so repeated."""


@dataclass
class CaseScorer:
    """``score(indices)``: the metric on the cases ``[case_ids[i] for i in indices]`` (repeats allowed);
    ``one_answer``: the model gave every patient the same answer (:func:`one_answer`); ``counted``: the metric of
    many resamples at once (:data:`Counted`), where the metric has such a form (stage AUC and accuracy, VQA accuracy;
    None: rescored resample by resample)."""

    case_ids: list[str]
    score: Callable[[np.ndarray], float]
    one_answer: bool = False
    counted: Counted | None = None

    def _positions(self, case_ids: Sequence[str], partial: bool = False) -> np.ndarray:
        position = {case_id: i for i, case_id in enumerate(self.case_ids)}
        return np.array([position.get(c, -1) if partial else position[c] for c in case_ids], dtype=np.int64)

    def aligned(self, case_ids: Sequence[str], partial: bool = False) -> Callable[[np.ndarray], float]:
        """The scorer over another ordering of (a subset of) this trial's cases: what pairs two trials. With
        ``partial``, ``case_ids`` may hold cases this trial did not score (a cross-validation fold's scorer over every
        fold's patients), which it is never asked about."""
        own = self._positions(case_ids, partial)
        return lambda indices: self.score(own[np.asarray(indices, dtype=np.int64)])

    def aligned_counted(self, case_ids: Sequence[str]) -> Counted | None:
        """:attr:`counted` over another ordering of (a subset of) this trial's cases, or None without one."""
        if self.counted is None:
            return None
        own, counted = self._positions(case_ids), self.counted

        def aligned(counts: np.ndarray) -> np.ndarray:
            mine = np.zeros((len(counts), len(self.case_ids)))
            mine[:, own] = counts
            return counted(mine)

        return aligned


def one_answer(records: Records) -> bool:
    """Whether a model gave every patient one answer: the same ``prediction`` (a stage, a report, a retrieved case,
    boxes) to every patient asked the same question (VQA's per question), with two patients or more per question. Its
    metric still varies with the references, so a smallest detectable difference would read as a number: the report
    says "degenerate" instead. False where records carry no ``prediction``."""
    answers: dict[str, set[str]] = {}
    patients: dict[str, set[str]] = {}
    for record in records:
        if "prediction" not in record:
            return False
        question = str(record.get("question"))
        answers.setdefault(question, set()).add(json.dumps(record["prediction"], sort_keys=True, default=str))
        patients.setdefault(question, set()).add(str(record.get("case_id")))
    return bool(answers) and all(len(answers[q]) == 1 and len(patients[q]) >= 2 for q in answers)


def _nan_on_error(compute: Callable[[], float]) -> float:
    try:
        value = float(compute())
    except ValueError:  # e.g. AUC of a resample with one class: undefined, dropped by the bootstrap
        return float("nan")
    return value


def _stage(records: Records, metric: str) -> CaseScorer | None:
    from gx_ray.metrics.classification import CLASSIFICATION_METRICS, classification_metrics

    known = [r for r in records if r.get("target") is not None]
    if not known or metric not in CLASSIFICATION_METRICS:
        return None
    probabilities = np.array([r["probabilities"] for r in known], dtype=np.float64)
    labels = np.array([STAGE_GROUPS.index(r["target"]) for r in known])
    classification_metrics(probabilities, labels)  # broken records (NaN probabilities) fail here, not as NaN resamples

    def score(indices: np.ndarray) -> float:
        return _nan_on_error(lambda: classification_metrics(probabilities[indices], labels[indices])[metric])

    return CaseScorer([r["case_id"] for r in known], score, counted=_stage_counted(probabilities, labels, metric))


def _stage_counted(probabilities: np.ndarray, labels: np.ndarray, metric: str) -> Counted | None:
    """:func:`~gx_ray.metrics.classification.classification_metrics`' macro ``auc`` or ``accuracy`` of many resamples
    at once (:data:`Counted`), by the same operations on the same exact numbers: a class's rank sum over a resample is
    a sum of half-integers, whatever the order it is added in; None for the other metrics."""
    if metric not in ("auc", "accuracy"):
        return None
    one_hot = (labels[:, None] == np.arange(probabilities.shape[1])).astype(np.float64)
    correct = (probabilities.argmax(axis=1) == labels).astype(np.float64)

    def counted(counts: np.ndarray) -> np.ndarray:
        counts = np.asarray(counts, dtype=np.float64)
        total = counts.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            if metric == "accuracy":
                return np.where(total > 0, 100.0 * (counts @ correct / total), np.nan)
            auc = np.column_stack([_counted_auc(probabilities[:, k], one_hot[:, k], counts, total)
                                   for k in range(one_hot.shape[1])])  # fmt: skip
            present = counts @ one_hot > 0
            weights = present / present.sum(axis=1, keepdims=True)
            auc_weights = weights * ~np.isnan(auc)
            value = 100.0 * (np.nansum(auc * auc_weights, axis=1) / auc_weights.sum(axis=1))
        return np.where((total > 0) & (auc_weights.sum(axis=1) > 0), value, np.nan)

    return counted


def _counted_auc(scores: np.ndarray, positive: np.ndarray, counts: np.ndarray, total: np.ndarray) -> np.ndarray:
    """One class's one-vs-rest AUC (Mann-Whitney U, ties one half) on each row's resample: each tie group's average
    rank from the counts drawn below it and in it, as ``scipy.stats.rankdata`` ranks the repeated cases."""
    order = np.argsort(scores, kind="stable")
    ordered, drawn = scores[order], counts[:, order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    group = np.cumsum(np.r_[True, ordered[1:] != ordered[:-1]]) - 1
    below = np.cumsum(drawn, axis=1)
    before = np.where(starts > 0, below[:, starts - 1], 0.0)
    within = below[:, np.r_[starts[1:] - 1, len(ordered) - 1]] - before
    ranks = before + (within + 1) / 2
    positives = drawn @ positive[order]
    rank_sum = (drawn * positive[order] * ranks[:, group]).sum(axis=1)
    pairs = positives * (total - positives)
    return np.where(pairs > 0, (rank_sum - positives * (positives + 1) / 2) / pairs, np.nan)


def _vqa(records: Records, metric: str) -> CaseScorer | None:
    # predictions are answers, not probabilities: accuracy (overall and per category) is what they give
    if metric != "accuracy" and not metric.startswith("accuracy_"):
        return None
    category = metric.removeprefix("accuracy_") if metric != "accuracy" else None
    chosen = [r for r in records if category is None or r["category"] == category]
    case_ids = sorted({r["case_id"] for r in chosen})
    position = {c: i for i, c in enumerate(case_ids)}
    correct = np.zeros(len(case_ids))
    asked = np.zeros(len(case_ids))
    for record in chosen:
        asked[position[record["case_id"]]] += 1
        # a written answer carries the cascade's verdict (a VLM's: "Yes." can be right); a chosen one is its text
        correct[position[record["case_id"]]] += record.get("correct", record["prediction"] == record["target"])

    def score(indices: np.ndarray) -> float:
        total = asked[indices].sum()
        return 100.0 * correct[indices].sum() / total if total else float("nan")

    def counted(counts: np.ndarray) -> np.ndarray:  # sums of whole numbers: exact in any order
        total = counts @ asked
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, 100.0 * (counts @ correct) / total, np.nan)

    return CaseScorer(case_ids, score, counted=counted)


MEAN_TEXT_METRICS = ("rouge_l", "meteor", "bertscore_f1")
"""Report metrics that are a mean of per-report scores (BLEU-4 is a corpus statistic)."""


def _report(records: Records, metric: str, language: str) -> CaseScorer | None:
    from gx_ray.metrics.text import TEXT_METRICS, text_generation_metrics

    known = [r for r in records if r.get("target")]
    if not known or metric not in TEXT_METRICS:
        return None
    generated = [r["prediction"] for r in known]
    references = [r["target"] for r in known]
    if metric in MEAN_TEXT_METRICS:
        per_case = np.array(
            [
                text_generation_metrics([g], [r], language, [metric])[metric]
                for g, r in zip(generated, references, strict=True)
            ]
        )
        return CaseScorer([r["case_id"] for r in known], lambda indices: float(per_case[indices].mean()))

    def score(indices: np.ndarray) -> float:
        picked = [generated[i] for i in indices], [references[i] for i in indices]
        return text_generation_metrics(*picked, language, [metric])[metric]

    return CaseScorer([r["case_id"] for r in known], score)


def _retrieval(records: Records, metric: str) -> CaseScorer | None:
    from gx_ray.metrics.retrieval import RETRIEVAL_METRICS, retrieval_metrics

    direction, _, name = metric.partition("_to_")
    name = name.removeprefix("text_" if direction == "image" else "image_")
    if direction not in ("image", "text") or name not in RETRIEVAL_METRICS:
        return None
    if not records or "image_embedding" not in records[0]:
        return None
    image = np.array([r["image_embedding"] for r in records], dtype=np.float64)
    text = np.array([r["text_embedding"] for r in records], dtype=np.float64)
    similarity = image @ text.T if direction == "image" else text @ image.T
    positives = np.eye(len(records), dtype=bool)

    def score(indices: np.ndarray) -> float:
        return retrieval_metrics(similarity[indices], positives[indices])[name]

    return CaseScorer([r["case_id"] for r in records], score)


def _detection(records: Records, metric: str) -> CaseScorer | None:
    from gx_ray.metrics.detection import (
        AP_IOU_THRESHOLDS,
        DETECTION_METRICS,
        average_precision_of_matches,
        match_detections,
        summarise_matches,
    )

    known = [r for r in records if r.get("target") is not None]
    if not known or metric not in DETECTION_METRICS:
        return None
    predictions = [
        {"boxes": np.array(r["prediction"]["boxes"]).reshape(-1, 6), "scores": np.array(r["prediction"]["scores"])}
        for r in known
    ]
    targets = [{"boxes": np.array(r["target"], dtype=np.float64).reshape(1, 6)} for r in known]

    matches = match_detections(predictions, targets)  # once: a resample of cases only re-accumulates

    def score(indices: np.ndarray) -> float:
        if metric in AP_IOU_THRESHOLDS:  # the headline: one IoU threshold's accumulation, not all ten
            return average_precision_of_matches([matches[i] for i in indices], AP_IOU_THRESHOLDS[metric])
        return summarise_matches([matches[i] for i in indices])[metric]

    return CaseScorer([r["case_id"] for r in known], score)


def case_scorer(task: str, records: Records, metric: str, language: str = "en") -> CaseScorer | None:
    """The trial's ``metric`` as a function of its test patients, or None where the records cannot give it.
    ``records``: ``predictions/test.json``; ``language``: of the generated reports. A plug-in task is scored by its
    ``record_metrics``; a task without a scorer gives None (the report then falls back to t and Wilcoxon over seeds
    rather than guess how a metric it does not know is computed)."""
    from gx_ray.tasks import Task, task_class, task_of

    task = task_of(task)
    if task == "stage_classification":
        scorer = _stage(records, metric)
    elif task in ("vqa", "lesion_qa"):  # both: one chosen answer against the right one per question
        scorer = _vqa(records, metric)
    elif task == "report_generation":
        scorer = _report(records, metric, language)
    elif task == "retrieval":
        scorer = _retrieval(records, metric)
    elif task == "lesion_detection":
        scorer = _detection(records, metric)
    else:
        cls = task_class(task)  # a name that is no task at all is an error (naming the valid ones), not a missing one
        own = getattr(cls.record_metrics, "__func__", None) is not Task.record_metrics.__func__
        scorer = _from_task(cls, records, metric) if own else None
    if scorer is not None:
        scorer.one_answer = one_answer(records)
    return scorer


def _from_task(cls: Any, records: Records, metric: str) -> CaseScorer | None:
    """A task's own :meth:`~gx_ray.tasks.base.Task.record_metrics` on resampled records (a plug-in task's)."""
    known = [r for r in records if r.get("target") is not None]
    if not known or metric not in cls.record_metrics(known):
        return None

    def score(indices: np.ndarray) -> float:
        return _nan_on_error(lambda: cls.record_metrics([known[i] for i in indices])[metric])

    return CaseScorer([r["case_id"] for r in known], score)


@dataclass(frozen=True)
class BootstrapJob:
    """One bootstrap of the report: arm A (and B, for a comparison) with one unit per seed, the equivalence margin
    (None: not tested), the metric's direction and its Holm family's size (for the smallest detectable difference).
    A unit is a trial's :class:`CaseScorer`, or a seed's fold models' scorers, whose mean is the seed's score on the
    test patients; None where a trial logged no predictions."""

    arms: list[list[CaseScorer | list[CaseScorer | None] | None]]
    margin: float | None = None
    higher_is_better: bool = True
    family: int = 1
    out_of_fold: bool = False
    """Each unit is a seed's fold models scored on their own folds' patients (out-of-fold predictions): the patients are
    every fold's, resampled within their fold, and a seed's score weighs its folds by their size."""


def _scorers(unit: Any) -> list[CaseScorer | None]:
    return list(unit) if isinstance(unit, list | tuple) else [unit]


def _aligned(unit: Any, common: list[str]) -> Callable[[np.ndarray], float]:
    parts = [s.aligned(common) for s in _scorers(unit)]
    if len(parts) == 1:
        return parts[0]
    return lambda indices: float(np.mean([part(indices) for part in parts]))


POWER, ALPHA = 0.8, 0.05


def bootstrap_job(job: BootstrapJob, n_resamples: int) -> dict | None:
    """:func:`~gx_ray.analysis.study.two_level_bootstrap` of a cell or of arm A against arm B on the test patients
    every trial scored; None without predictions or patients. A comparison adds its TOST ``equivalence`` (one-sided at
    0.025, as the 95 % intervals) and ``mde``: the smallest difference detected with 80 % power after Holm over its
    family, (z(1 - 0.05 / 2m) + z(0.8)) x the difference's standard error (both levels), a normal approximation; NaN
    with ``mde_note`` saying why (:func:`mde_note`) where the scores do not vary or a model gave one answer for all."""
    from scipy.stats import norm

    from gx_ray.analysis.study import Resampling, equivalence, two_level_bootstrap

    scorers = [s for arm in job.arms for unit in arm for s in _scorers(unit)]
    if not scorers or any(s is None for s in scorers):
        return None
    if job.out_of_fold:
        if len({len(_scorers(unit)) for arm in job.arms for unit in arm}) > 1:
            return None  # a seed without all its folds (an unfinished trial)
        fold_of = {c: k for arm in job.arms for unit in arm for k, s in enumerate(_scorers(unit)) for c in s.case_ids}
        common, folds = sorted(fold_of), [fold_of[c] for c in sorted(fold_of)]
        arms = [[[s.aligned(common, partial=True) for s in _scorers(unit)] for unit in arm] for arm in job.arms]
    else:
        common, folds = sorted(set.intersection(*(set(s.case_ids) for s in scorers))), None
        arms = [[_aligned(unit, common) for unit in arm] for arm in job.arms]
    if len(common) < 2:
        return None
    score_a, score_b = arms[0], arms[1] if len(arms) > 1 else None
    options = Resampling(n_resamples=n_resamples, keep_replicates=True)
    boot = two_level_bootstrap(score_a, score_b, len(common), folds, options)
    row = {k: v for k, v in boot.to_dict().items() if k != "replicates"}  # TOST's input, not a column
    if score_b is None:
        return row
    tost = equivalence(boot.replicates, job.margin, alpha=ALPHA / 2, higher_is_better=job.higher_is_better)
    mde = (norm.ppf(1 - ALPHA / (2 * job.family)) + norm.ppf(POWER)) * math.hypot(boot.se_patients, boot.se_seeds)
    tested = {"p_noninferior": tost.p_noninferior, "p_equivalence": tost.p_equivalence} if job.margin else {}
    note = mde_note(boot.replicates, job.arms)
    mde = {"mde": math.nan, "mde_note": note} if note else {"mde": float(mde)}
    return {**row, "equivalence": tost.verdict, "margin": job.margin, **tested, **mde}


NO_VARIATION, ONE_ANSWER = "undefined: no variation", "degenerate: one answer for all"


def mde_note(replicates: np.ndarray, arms: Sequence[Sequence[Any]]) -> str | None:
    """Why a comparison has no smallest detectable difference, or None: its difference never varies over the
    replicates (e.g. every patient's AP is 0 in both arms: the standard error, and so the number, would be 0), or
    every trial of one arm gave every patient one answer (:func:`one_answer`; a report model writing one report for
    all still varies with the references, and its number would describe nothing the model learnt)."""
    finite = replicates[np.isfinite(replicates)]
    if not len(finite) or np.ptp(finite) <= 1e-12 * max(1.0, float(np.abs(finite).max())):
        return NO_VARIATION
    if any(all(s is not None and s.one_answer for unit in arm for s in _scorers(unit)) for arm in arms):
        return ONE_ANSWER
    return None


PROCESS_START_S = 2.0
"""About what starting joblib's loky processes costs before they score anything: each imports the scorers' modules
(0.5 s for two on a 2-core machine since :mod:`gx_ray.analysis.study` needs NumPy and SciPy only; 5-8 s when the workers
imported MLflow, SciPy and pandas with it), more where a scorer's first call imports its metric's library. The
report spreads its comparisons over processes only when they would take longer than this in one."""


def estimated_seconds(job: BootstrapJob, n_resamples: int) -> float:
    """What :func:`bootstrap_job` will take: one scoring of every trial's whole test split, timed, times the
    replicates (each scores every trial once more)."""
    scorers = [s for arm in job.arms for unit in arm for s in _scorers(unit)]
    if any(s is None for s in scorers):
        return 0.0  # no bootstrap: a comparison without predictions is None at once
    started = time.perf_counter()
    for scorer in scorers:
        scorer.score(np.arange(len(scorer.case_ids)))
    return (time.perf_counter() - started) * n_resamples


def bootstrap_jobs(
    jobs: list[BootstrapJob], n_resamples: int, process_start_s: float = PROCESS_START_S
) -> list[dict | None]:
    """:func:`bootstrap_job` of every job, in order. Rescoring is the report's longest part (a 60-trial demo sweep's 15
    comparisons: 80 s of 105 in one process; detection's comparison on 255 test patients ~5 s on 2 cores), so when the
    estimated time (:func:`estimated_seconds`) exceeds starting processes, jobs go to joblib's loky processes, longest
    first (closures only cloudpickle carries); each is seeded, so results do not depend on the process."""
    workers = min(len(jobs), os.cpu_count() or 1)
    estimates = [estimated_seconds(job, n_resamples) for job in jobs] if workers > 1 else []
    if workers <= 1 or sum(estimates) <= process_start_s:
        return [bootstrap_job(job, n_resamples) for job in jobs]
    from joblib import Parallel, delayed

    order = sorted(range(len(jobs)), key=lambda i: -estimates[i])
    results = Parallel(n_jobs=workers)(delayed(bootstrap_job)(jobs[i], n_resamples) for i in order)
    by_job = dict(zip(order, results, strict=True))
    return [by_job[i] for i in range(len(jobs))]
