"""The report's statistics: a two-level bootstrap over test patients and seeds, equivalence and non-inferiority
(TOST with a margin), and p-values shown with the bootstrap's resolution floor (:func:`format_p`). NumPy and SciPy
only, like :mod:`gx_ray.analysis.bootstrap`, for the report's workers.

**Two-level bootstrap** (:func:`two_level_bootstrap`). A cell is the mean over S seeds of a metric on n test patients;
it moves with the patients, the seeds and their interaction. Patients and seeds are *crossed* (every seed's model
scores every patient), so one replicate draws ONE multiset of patients, shared by every seed and both arms, and ONE
seed-level deviation shared by both arms (seed s of A and of B share data order and initialisation); drawing seeds per
patient (nested) would average the seed effect away.

- Patient level: n patients with replacement (within each fold, where there are folds), deviations scaled by
  sqrt(k / (k - 1)) for k patients per fold, the bootstrap's own small-sample bias (exact for means).
- Seed level: NOT resampled (with 3 seeds a resample spans their min and max, which hold the mean 75 % of the time).
  Student's t with S - 1 degrees of freedom times the seeds' standard error on the whole test set (their variance
  over S). That spread holds the patient x seed interaction as well as the seed main effect, so the interaction's
  share (measured on the patient replicates) is taken out of the patient level instead, where hundreds of patients
  estimate it well; with 3 seeds, taking it out of the seeds' 2-degree-of-freedom variance set the seed level to 0 in
  up to a fifth of seed-heavy studies, whose intervals then covered 58-69 %. The seed level is never 0 unless the
  seeds agree exactly, and its t is the seeds' own t (a chi-squared variance with S - 1 degrees of freedom under
  normal seeds). With one seed there is none.
- Folds: patients are resampled within their fold; a seed's fold models are one unit of the seed level. The fold
  assignment must be the same for every seed.

Assumptions: patients and seeds exchangeable; the seed main effect roughly normal; the metric smooth enough in the
patients for a percentile interval (about 20 patients or more). :func:`~gx_ray.analysis.simulation.coverage`
measures the coverage on simulated studies with a known truth.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

Scorer = Callable[[np.ndarray], float]
Arm = Sequence[Scorer | Sequence[Scorer]]
"""Per seed: one scorer over the shared patient list, or one per fold (each scored on its fold's patients)."""

METHOD = "two-level bootstrap: patients × seeds"
SEED_LEVELS = ("t", "resample", "none")


# --- scorers that score a whole batch of replicates at once ---------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CaseMeans:
    """``scale * sum(numerator[i]) / sum(denominator[i])`` over the scored cases ``i``; ``denominator`` None weighs
    every case 1 (VQA pools questions per patient). :meth:`batch` scores every replicate with one matrix product."""

    numerator: np.ndarray
    denominator: np.ndarray | None = None
    scale: float = 1.0

    def __call__(self, indices: np.ndarray) -> float:
        return float(self.batch(np.bincount(indices, minlength=len(self.numerator))[None])[0])

    def batch(self, counts: np.ndarray) -> np.ndarray:
        """The metric of each row of ``counts`` (replicates x cases: how often each case is drawn)."""
        total = counts @ (np.ones(len(self.numerator)) if self.denominator is None else self.denominator)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(total > 0, self.scale * (counts @ self.numerator) / total, np.nan)


PAIR_MATRIX_MAX = 4_000_000
"""Up to this many (negative, positive) pairs :class:`CaseAUC` counts with one matrix product; above, by sorting."""


@dataclass(frozen=True, eq=False)
class CaseAUC:
    """Binary AUC (ties count one half) of ``scores`` against 0/1 ``labels``, recomputed on every resample: a corpus
    metric, not a mean of cases. NaN on a resample with one class. :meth:`batch` is a weighted Mann-Whitney count."""

    labels: np.ndarray
    scores: np.ndarray
    scale: float = 1.0
    _positive: np.ndarray = field(init=False, repr=False)
    _wins: np.ndarray | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        labels, scores = np.asarray(self.labels), np.asarray(self.scores, dtype=float)
        if labels.shape != scores.shape or not np.isin(labels, (0, 1)).all():
            raise ValueError(f"CaseAUC: need 0/1 labels and scores of one shape, got {labels.shape}, {scores.shape}")
        positive = labels == 1
        object.__setattr__(self, "_positive", positive)
        wins = None
        if positive.sum() * (~positive).sum() <= PAIR_MATRIX_MAX:  # negative j below positive i: 1, tied: 1/2
            neg, pos = scores[~positive][:, None], scores[positive][None, :]
            wins = (neg < pos) + 0.5 * (neg == pos)
        object.__setattr__(self, "_wins", wins)

    def __call__(self, indices: np.ndarray) -> float:
        return float(self.batch(np.bincount(indices, minlength=len(self.labels))[None])[0])

    def batch(self, counts: np.ndarray) -> np.ndarray:
        """The AUC of each row of ``counts`` (replicates x cases)."""
        pos, neg = counts[:, self._positive].astype(float), counts[:, ~self._positive].astype(float)
        if self._wins is not None:
            won = ((neg @ self._wins) * pos).sum(axis=1)
        else:
            won = np.array([self._won(p, q) for p, q in zip(pos, neg, strict=True)])
        pairs = pos.sum(axis=1) * neg.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(pairs > 0, self.scale * won / pairs, np.nan)

    def _won(self, pos: np.ndarray, neg: np.ndarray) -> float:
        """Weighted pairs won by positives, by sorting (large test sets): negatives below plus half the tied."""
        scores = np.asarray(self.scores, dtype=float)
        ranked = np.sort(scores[~self._positive])
        order = np.argsort(scores[~self._positive], kind="stable")
        below = np.r_[0.0, np.cumsum(neg[order])]
        lo = np.searchsorted(ranked, scores[self._positive], side="left")
        hi = np.searchsorted(ranked, scores[self._positive], side="right")
        return float(pos @ (below[lo] + 0.5 * (below[hi] - below[lo])))


# --- the two-level bootstrap ----------------------------------------------------------------------------------------


def _fold_blocks(n_cases: int, folds: Sequence[int] | np.ndarray | None) -> list[np.ndarray]:
    """The patients' positions, one block per fold (one block without folds)."""
    if n_cases < 2:
        raise ValueError(f"need at least 2 patients, got n_cases={n_cases}")
    if folds is None:
        return [np.arange(n_cases)]
    folds = np.asarray(folds)
    if folds.shape != (n_cases,):
        raise ValueError(f"folds: need one fold per patient, shape ({n_cases},), got {folds.shape}")
    blocks = [np.flatnonzero(folds == f) for f in np.unique(folds)]
    small = [f for f, b in zip(np.unique(folds), blocks, strict=True) if len(b) < 2]
    if small:
        raise ValueError(f"folds {small} have fewer than 2 patients: nothing to resample within them")
    return blocks


def _per_fold(arm: Arm, n_folds: int, name: str) -> list[list[Scorer]]:
    out = []
    for s, scorers in enumerate(arm):
        scorers = [scorers] if callable(scorers) else list(scorers)
        if len(scorers) not in (1, n_folds):
            raise ValueError(f"arm {name}, seed {s}: {len(scorers)} scorers for {n_folds} folds (give 1 or {n_folds})")
        out.append(scorers)
    return out


class _Draws:
    """Patient draws (replicates x draws, fold block after fold block) and, computed once for every scorer of every
    seed and arm, how often each patient is drawn in a range of columns."""

    def __init__(self, rows: np.ndarray, n_cases: int) -> None:
        self.rows, self.n_cases, self._counts = rows, n_cases, {}

    def counts(self, lo: int, hi: int) -> np.ndarray:
        if (lo, hi) not in self._counts:
            rows = self.rows[:, lo:hi]
            flat = (np.arange(len(rows))[:, None] * self.n_cases + rows).ravel()
            self._counts[lo, hi] = np.bincount(flat, minlength=len(rows) * self.n_cases).reshape(len(rows), -1)
        return self._counts[lo, hi]

    def score(self, scorer: Scorer, lo: int, hi: int) -> np.ndarray:
        batch = getattr(scorer, "batch", None)
        if batch is not None:  # vectorised: a mean of cases or a rank statistic, from counts
            return np.asarray(batch(self.counts(lo, hi)), dtype=float)
        return np.array([scorer(row) for row in self.rows[:, lo:hi]], dtype=float)


def _seed_scores(scorers: list[Scorer], draws: _Draws, blocks: list[np.ndarray]) -> np.ndarray:
    """One seed's metric on each row of draws: its one scorer on the whole row, or its fold scorers each on its fold's
    columns, weighted by fold size."""
    if len(scorers) == 1:
        return draws.score(scorers[0], 0, draws.n_cases)
    edges = np.cumsum([0, *(len(b) for b in blocks)])
    return sum(
        len(b) / draws.n_cases * draws.score(f, lo, hi)
        for f, b, lo, hi in zip(scorers, blocks, edges[:-1], edges[1:], strict=True)
    )


def _arm_matrix(arm: list[list[Scorer]], draws: _Draws, blocks: list[np.ndarray], name: str):
    """``(observed, replicates)``: each seed's metric on every patient ``(S,)`` and on each draw ``(B, S)``."""
    everyone = _Draws(np.concatenate(blocks)[None], draws.n_cases)
    observed = np.array([_seed_scores(s, everyone, blocks)[0] for s in arm])
    bad = np.flatnonzero(~np.isfinite(observed))
    if len(bad):
        raise ValueError(f"arm {name}: seeds {bad.tolist()} score NaN on the whole test set; nothing to resample")
    return observed, np.column_stack([_seed_scores(s, draws, blocks) for s in arm])


@dataclass(frozen=True)
class Levels:
    """The variance of the estimate by source: patients (without the patient x seed interaction, where there are
    seeds to carry it), and seeds (their standard error on the whole test set, the interaction included); ``shrink``
    scales the patient replicates' deviations to ``var_patients``."""

    inflation: float
    var_patients: float
    var_seeds: float
    shrink: float = 1.0


def _levels(observed: np.ndarray, replicates: np.ndarray, blocks: list[np.ndarray]) -> Levels:
    """Variance components from the per-seed scores on all patients ``(S,)`` and on the kept draws ``(B, S)``."""
    k = sum(len(b) for b in blocks) / len(blocks)
    inflation = math.sqrt(k / (k - 1))
    seeds = len(observed)
    pooled = replicates.mean(axis=1)
    var_patients = float(inflation**2 * pooled.var(ddof=1)) if len(pooled) > 1 else 0.0
    if seeds < 2 or len(replicates) < 2:
        return Levels(inflation, var_patients, 0.0)
    # the interaction is in both the patient replicates and the seeds' spread: counted once, with the seeds, whose
    # variance then has S - 1 degrees of freedom of its own and is never clamped to 0 (the module says why)
    interaction = inflation**2 * float(np.mean((replicates - observed).var(axis=1, ddof=1))) / seeds
    patients = max(0.0, var_patients - interaction)
    shrink = math.sqrt(patients / var_patients) if var_patients > 0 else 1.0
    return Levels(inflation, patients, float(observed.var(ddof=1)) / seeds, shrink)


def _replicates(
    observed: np.ndarray, replicates: np.ndarray, levels: Levels, seed_level: str, rng: np.random.Generator
) -> np.ndarray:
    """The bootstrap distribution of the seed-averaged estimate from the kept per-seed replicates ``(B, S)``."""
    estimate, seeds = float(observed.mean()), len(observed)
    if seed_level == "none":  # patients only: the paired bootstrap as it was
        return replicates.mean(axis=1)
    if seed_level == "resample":  # seeds resampled with the patients (Owen's pigeonhole bootstrap), no correction
        weights = rng.multinomial(seeds, np.full(seeds, 1 / seeds), size=len(replicates)) / seeds
        return (weights * replicates).sum(axis=1)
    patients = estimate + levels.inflation * levels.shrink * (replicates.mean(axis=1) - estimate)
    if seeds < 2:
        return patients
    return patients + math.sqrt(levels.var_seeds) * rng.standard_t(seeds - 1, size=len(replicates))


def _method(seeds: int, n_folds: int, seed_level: str) -> str:
    within = f" (within {n_folds} folds)" if n_folds > 1 else ""
    if seed_level == "none":
        return f"bootstrap over patients{within}"
    if seed_level == "resample":
        return f"bootstrap: patients{within} × seeds resampled"
    if seeds < 2:
        return f"bootstrap over patients{within} (one seed: training randomness not counted)"
    return METHOD if not within else f"two-level bootstrap: patients{within} × seeds"


@dataclass(frozen=True, kw_only=True)
class Resampling:
    """How :func:`two_level_bootstrap` resamples: ``n_resamples`` from ``seed``, a ``confidence`` interval, p against
    ``null`` (0 for a difference; a chance level for a cell), ``seed_level`` ``"t"`` (this module's), or for comparison
    ``"resample"`` (under-covers with few seeds) or ``"none"`` (patients only); ``keep_replicates`` in the result."""

    n_resamples: int = 2000
    confidence: float = 0.95
    seed: int = 0
    null: float = 0.0
    seed_level: str = "t"
    keep_replicates: bool = False


@dataclass(frozen=True, kw_only=True)
class BootstrapResult:
    """:func:`two_level_bootstrap`'s answer: ``estimate`` (``diff`` too, for a comparison), percentile ``ci_low``/
    ``ci_high``, two-sided ``p_value`` (+1 correction), ``n_resamples`` (kept), ``dropped`` (a NaN score, e.g. an AUC
    of one class), each level's standard error ``se_patients``/``se_seeds``, and ``replicates`` where kept."""

    estimate: float
    ci_low: float
    ci_high: float
    p_value: float
    diff: float | None = None
    n_seeds: int
    n_cases: int
    n_folds: int
    n_resamples: int
    dropped: int
    se_patients: float
    se_seeds: float
    method: str
    replicates: np.ndarray | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        """The report's row: every field in order, without ``diff`` for a cell and ``replicates`` where not kept."""
        return {k: v for k, v in vars(self).items() if v is not None}


def two_level_bootstrap(
    score_a: Arm,
    score_b: Arm | None,
    n_cases: int,
    folds: Sequence[int] | np.ndarray | None = None,
    options: Resampling = Resampling(),
) -> BootstrapResult:
    """One cell (``score_b`` None) or schema A minus schema B, over test patients AND seeds (see the module).
    ``score_a[s](indices)``: seed ``s``'s metric on the cases ``indices`` (repeats allowed) of ``n_cases`` patients;
    with ``folds`` (each patient's fold), one scorer per fold. Scorers with ``batch(counts)`` score all at once."""
    if options.seed_level not in SEED_LEVELS:
        raise ValueError(f"seed_level must be one of {SEED_LEVELS}, got {options.seed_level!r}")
    if score_b is not None and len(score_a) != len(score_b):
        raise ValueError(f"need the same seeds in both arms, got {len(score_a)} and {len(score_b)}")
    if not len(score_a) or options.n_resamples < 1:
        raise ValueError(f"need at least one seed and one replicate, got {len(score_a)} seeds, {options.n_resamples}")
    blocks = _fold_blocks(n_cases, folds)
    rng = np.random.default_rng(options.seed)
    rows = np.concatenate([b[rng.integers(0, len(b), size=(options.n_resamples, len(b)))] for b in blocks], axis=1)
    draws = _Draws(rows, n_cases)
    observed, replicates = _arm_matrix(_per_fold(score_a, len(blocks), "A"), draws, blocks, "A")
    if score_b is not None:
        observed_b, replicates_b = _arm_matrix(_per_fold(score_b, len(blocks), "B"), draws, blocks, "B")
        observed, replicates = observed - observed_b, replicates - replicates_b
    kept = replicates[~np.isnan(replicates).any(axis=1)]
    levels = _levels(observed, kept, blocks)
    theta = _replicates(observed, kept, levels, options.seed_level, rng)
    estimate, seeds, tail = float(observed.mean()), len(observed), (1 - options.confidence) / 2
    ci_low, ci_high = (float(q) for q in np.quantile(theta, [tail, 1 - tail])) if len(theta) else (math.nan, math.nan)
    below = min(np.sum(theta <= options.null), np.sum(theta >= options.null))  # the p-value's tail, +1 corrected
    p_value = float(min(1.0, 2 * (below + 1) / (len(theta) + 1))) if len(theta) else math.nan
    return BootstrapResult(
        estimate=estimate, ci_low=ci_low, ci_high=ci_high, p_value=p_value,
        diff=estimate if score_b is not None else None, n_seeds=seeds, n_cases=n_cases, n_folds=len(blocks),
        n_resamples=len(kept), dropped=options.n_resamples - len(kept), se_patients=math.sqrt(levels.var_patients),
        se_seeds=math.sqrt(levels.var_seeds), method=_method(seeds, len(blocks), options.seed_level),
        replicates=theta if options.keep_replicates else None,
    )  # fmt: skip


# --- equivalence and non-inferiority --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Equivalence:
    """:func:`equivalence`'s answer: the ``verdict``, the interval ``ci_low``/``ci_high`` of A - B (1 - 2 alpha, as
    given), ``p_equivalence`` (the larger TOST p), ``p_noninferior`` and ``p_worse`` (NaN when given an interval)."""

    margin: float | None
    alpha: float
    ci_low: float
    ci_high: float
    p_equivalence: float
    p_noninferior: float
    p_worse: float
    beyond_margin: bool
    verdict: str

    def to_dict(self) -> dict:
        return dict(vars(self))


def equivalence(
    differences: np.ndarray | Sequence[float] | tuple[float, float],
    margin: float | None,
    alpha: float = 0.05,
    higher_is_better: bool = True,
) -> Equivalence:
    """TOST equivalence and non-inferiority of schema A against schema B within ``margin`` (the metric's units).
    ``differences``: bootstrap replicates of A - B, or ``(low, high)``, their 1 - 2 alpha interval. Each test is
    one-sided at ``alpha`` (on replicates p = ``(count + 1) / (B + 1)``), with d = A - B oriented so positive is better:
    ``"equivalent within ±m"`` (d > -m and d < m shown), ``"non-inferior (margin m)"`` (d > -m shown, d < m not),
    ``"worse"`` (non-inferiority not shown, d < 0 shown; ``beyond_margin``: d < -m shown too), ``"not shown"`` (the data
    cannot tell; NOT that the schemas are alike), ``"equivalence not tested"`` (no margin). One-sided at 0.05 is
    two-sided at 0.10: pass alpha = 0.025 for the report's 95 % intervals, alpha / m for m claims."""
    if margin is not None and not margin > 0:
        raise ValueError(f"margin must be positive (the metric's units), got {margin}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    sign = 1.0 if higher_is_better else -1.0
    p = {"p_equivalence": math.nan, "p_noninferior": math.nan, "p_worse": math.nan}
    if isinstance(differences, tuple):
        if len(differences) != 2 or not differences[0] <= differences[1]:
            raise ValueError(f"an interval is (low, high) with low <= high, got {differences}")
        low, high = (float(v) for v in differences)
    else:
        low, high, p = _one_sided_tests(np.asarray(differences, dtype=float), margin, alpha, sign)
    worst, best = sorted((sign * low, sign * high))  # the interval, positive = A better
    if isinstance(differences, tuple):
        noninferior = margin is not None and worst > -margin
        within, worse = noninferior and best < margin, best < 0
    else:  # the p-values decide; the interval agrees with them up to the +1 correction
        noninferior, within = p["p_noninferior"] <= alpha, p["p_equivalence"] <= alpha
        worse = p["p_worse"] <= alpha
    if margin is None:
        verdict = "equivalence not tested"
    elif within or noninferior:
        verdict = f"equivalent within ±{margin:g}" if within else f"non-inferior (margin {margin:g})"
    else:
        verdict = "worse" if worse else "not shown"
    beyond = bool(margin is not None and best < -margin)
    return Equivalence(margin=margin, alpha=alpha, ci_low=low, ci_high=high, **p, beyond_margin=beyond, verdict=verdict)


def _one_sided_tests(d: np.ndarray, margin: float | None, alpha: float, sign: float) -> tuple[float, float, dict]:
    """``(low, high, p-values)`` of :func:`equivalence` on replicates ``d`` of A - B: the 1 - 2 alpha interval and each
    one-sided test's ``(count + 1) / (B + 1)``, on ``sign * d`` (positive = A better)."""
    d = d[~np.isnan(d)]
    if len(d) + 1 < 1 / alpha:
        raise ValueError(f"{len(d)} replicates cannot test at alpha {alpha}: the smallest p is 1 / (B + 1)")
    low, high = (float(q) for q in np.quantile(d, [alpha, 1 - alpha]))
    oriented, size = sign * d, len(d) + 1
    p_noninferior = float((np.sum(oriented <= -margin) + 1) / size) if margin else math.nan
    upper = float((np.sum(oriented >= margin) + 1) / size) if margin else math.nan
    p_worse = float((np.sum(oriented >= 0) + 1) / size)
    return low, high, {"p_equivalence": max(p_noninferior, upper), "p_noninferior": p_noninferior, "p_worse": p_worse}


# --- p-values at the bootstrap's floor ------------------------------------------------------------------------------


def p_floor(replicates: int, comparisons: int = 1) -> float:
    """The smallest p-value a bootstrap of ``replicates`` kept replicates can give, ``2 / (B + 1)``, and after Holm
    over ``comparisons``: ``m * 2 / (B + 1)`` (capped at 1). Holm multiplies the smallest p by m and keeps the
    adjusted p-values monotone, so no comparison's Holm p can be below m times the raw floor."""
    if replicates < 1 or comparisons < 1:
        raise ValueError(f"need replicates >= 1 and comparisons >= 1, got {replicates}, {comparisons}")
    return min(1.0, comparisons * 2 / (replicates + 1))


def _round_up(value: float, digits: int = 2) -> str:
    """``value`` to ``digits`` significant digits, rounded up (a bound "≤ x" stays true)."""
    decimals = max(0, digits - 1 - math.floor(math.log10(value)))
    return f"{math.ceil(value * 10**decimals - 1e-9) / 10**decimals:.{decimals}f}"


def format_p(p: float | None, replicates: int, comparisons: int = 1) -> str:
    """A bootstrap p-value for a reader: ``"≤ 0.025 (floor of 1,199 replicates)"`` at the floor (:func:`p_floor`;
    ``comparisons`` = m for a Holm p), where "0.025" would read as borderline; else 3 significant digits, or ``"—"``."""
    if p is None or math.isnan(p):
        return "—"
    floor = p_floor(replicates, comparisons)
    if p <= floor * (1 + 1e-9):
        return f"≤ {_round_up(floor)} (floor of {replicates:,} replicates)"
    return f"{p:.3g}"
