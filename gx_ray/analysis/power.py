"""Power planning from a pilot: :func:`plan_power` resamples a pilot's per-patient paired differences into
simulated future studies of seeds x patients x folds and applies the report's test (the two-level bootstrap of
:mod:`gx_ray.analysis.study`, its p-value rule and floor) to each; :func:`power_curve` draws it against seeds and
patients; :func:`family_resamples` sizes a Holm family's bootstrap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Pilot:
    """A pilot's per-patient paired differences (seeds x patients), split by two-way ANOVA into what a future study
    resamples: patient effects (centred, shrunk to the patients' variance without the pilot's seed noise), patient x
    seed residuals (rescaled to the noise variance; none with one pilot seed) and the SD of the seed main effect."""

    patient_effects: np.ndarray
    residuals: np.ndarray
    seed_sd: float
    mean: float


def pilot_components(differences: np.ndarray, seed_sd: float | None = None) -> Pilot:
    """:class:`Pilot` of ``differences`` ``(S0, n0)`` (one row per pilot seed; a 1-D array is one seed). ``seed_sd``:
    the SD over seeds of a seed's mean difference; None estimates it from the pilot's seed means less their patient x
    seed noise, which needs two pilot seeds or more and is rough with few (give an upper bound)."""
    d = np.atleast_2d(np.asarray(differences, dtype=float))
    seeds, n = d.shape
    if d.ndim != 2 or n < 2 or not np.isfinite(d).all():
        raise ValueError(f"differences: need finite (seeds, patients) values with 2 patients or more, got {d.shape}")
    if seed_sd is None and seeds < 2:
        raise ValueError("a pilot of one seed cannot estimate the seed SD: give seed_sd (e.g. from another study)")
    grand, seed_means, patient_means = d.mean(), d.mean(axis=1), d.mean(axis=0)
    residuals = d - seed_means[:, None] - patient_means[None, :] + grand
    noise_var = float((residuals**2).sum() / ((n - 1) * (seeds - 1))) if seeds > 1 else 0.0
    spread = float(patient_means.var(ddof=1))
    shrink = math.sqrt(max(0.0, spread - noise_var / seeds) / spread) if spread > 0 else 0.0
    if seed_sd is None:
        seed_sd = math.sqrt(max(0.0, float(seed_means.var(ddof=1)) - noise_var / n))
    rescale = math.sqrt(n * seeds / ((n - 1) * (seeds - 1))) if seeds > 1 else 0.0
    return Pilot(shrink * (patient_means - grand), rescale * residuals.T, float(seed_sd), float(grand))


def family_resamples(comparisons: int, at_least: int = 1000, alpha: float = 0.05) -> int:
    """Bootstrap replicates for a family of ``comparisons`` Holm-corrected at ``alpha``: at least ``at_least``, and
    enough that the smallest p-value a bootstrap can give, ``2 / (B + 1)``, is at most ``alpha / (2 m)``. With fewer, a
    large family can never show a difference: at 1,000 replicates the floor is 0.002, and Holm multiplies it by m, so
    from m = 25 comparisons on (five tasks x six schemas against a baseline) nothing would ever be significant."""
    if comparisons < 0 or at_least < 1 or not 0 < alpha < 1:
        raise ValueError(f"need comparisons >= 0, at_least >= 1 and 0 < alpha < 1: {comparisons}, {at_least}, {alpha}")
    return max(at_least, math.ceil(4 * comparisons / alpha) - 1)


def _fold_of(n_patients: int, n_folds: int) -> np.ndarray:
    return np.repeat(np.arange(n_folds), [len(b) for b in np.array_split(np.arange(n_patients), n_folds)])


def _study_levels(x: np.ndarray, fold_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(estimate, var_patients, var_seeds)`` per simulated study ``x`` ``(K, n, S)``: what :func:`_levels` finds on
    the bootstrap's replicates, in closed form for a mean of cases (patients resampled within folds)."""
    k, n, seeds = x.shape
    folds = int(fold_of.max()) + 1
    inflation = (n / folds) / (n / folds - 1)
    seed_means = x.mean(axis=1)
    patient_means = x.mean(axis=2)
    var_patients, interaction = np.zeros(k), np.zeros(k)
    for f in range(folds):
        cols = fold_of == f
        share = cols.sum() / n
        var_patients += share**2 * patient_means[:, cols].var(axis=1) / cols.sum()
        if seeds > 1:
            y = x[:, cols] - patient_means[:, cols, None]
            squares = ((y - y.mean(axis=1, keepdims=True)) ** 2).sum(axis=(1, 2))
            interaction += share**2 * squares / cols.sum() ** 2 / (seeds - 1)
    if seeds < 2:
        return seed_means.mean(axis=1), inflation * var_patients, np.zeros(k)
    # the interaction counted with the seeds, as two_level_bootstrap counts it
    var_patients = np.maximum(0.0, inflation * var_patients - inflation * interaction / seeds)
    return seed_means.mean(axis=1), var_patients, seed_means.var(axis=1, ddof=1) / seeds


def _critical(
    var_patients: np.ndarray, var_seeds: np.ndarray, seeds: int, n_resamples: int, level: float, rng
) -> tuple[np.ndarray, np.ndarray]:
    """Per study, the estimates beyond which the report's test rejects at ``level``: ``(above, below)``. The report's
    test on B replicates ``estimate + noise``: p = 2 (min tail count + 1) / (B + 1), so it
    rejects "A better" when at most k of the B noise draws lie below -estimate. The noise is drawn as the two-level
    bootstrap draws it, the patient level normal (a mean of many patients) rather than resampled."""
    allowed = math.floor(level * (n_resamples + 1) / 2 - 1)  # tail count
    if allowed < 0:  # below the bootstrap's floor: nothing can be significant
        return np.full(len(var_patients), np.inf), np.full(len(var_patients), -np.inf)
    noise = np.sqrt(var_patients)[:, None] * rng.standard_normal((len(var_patients), n_resamples))
    if seeds > 1:
        noise += np.sqrt(var_seeds)[:, None] * rng.standard_t(seeds - 1, (len(var_patients), n_resamples))
    low = np.partition(noise, allowed, axis=1)[:, allowed]
    high = np.partition(noise, n_resamples - 1 - allowed, axis=1)[:, n_resamples - 1 - allowed]
    return -low, -high


@dataclass(frozen=True)
class Design:
    seeds: int
    patients: int
    folds: int = 1


@dataclass(frozen=True, kw_only=True)
class PowerSettings:
    """A power plan's settings, shared by :func:`plan_power`, :func:`design_power`, :func:`power_curve` and
    :func:`~gx_ray.analysis.simulation.power_check`: the designs tried, a Holm family of ``comparisons`` at ``alpha``,
    the ``target`` power, the seed SD (None: the pilot's), ``n_resamples`` (None: :func:`family_resamples`)."""

    seeds: Sequence[int] = (3, 5, 10)
    patients: Sequence[int] = (64, 128, 255)
    folds: Sequence[int] = (1,)
    comparisons: int = 1
    alpha: float = 0.05
    target: float = 0.8
    seed_sd: float | None = None
    fold_sd: float = 0.0
    n_resamples: int | None = None
    studies: int = 2000
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class DesignPower(Design):
    """A design's ``power`` with its Monte-Carlo error, and ``mde``: the smallest effect found at the target power."""

    power: float
    mc_error: float
    mde: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PowerPlan:
    """:func:`plan_power`'s answer: every design, the ``smallest`` reaching the target (or None), the seed SD used."""

    designs: list[DesignPower]
    smallest: DesignPower | None
    seed_sd: float
    method: str

    def to_dict(self) -> dict:
        return asdict(self)


def _simulate(pilot: Pilot, design: Design, fold_sd: float, studies: int, rng, chunk: int = 250):
    """``(estimate at no effect, var_patients, var_seeds)`` of ``studies`` future studies of ``design``: patients
    resampled from the pilot, each seed's patient x seed noise drawn from the patient's own pilot residuals, a seed
    effect N(0, seed_sd) per seed, a fold effect N(0, fold_sd) per fold and seed."""
    n0, pilot_seeds = pilot.residuals.shape
    fold_of = _fold_of(design.patients, design.folds)
    parts = []
    for start in range(0, studies, chunk):
        k = min(chunk, studies - start)
        who = rng.integers(0, n0, (k, design.patients))
        x = np.repeat(pilot.patient_effects[who][:, :, None], design.seeds, axis=2)
        if pilot_seeds > 1:
            x += pilot.residuals[who[:, :, None], rng.integers(0, pilot_seeds, (k, design.patients, design.seeds))]
        x += rng.normal(0.0, pilot.seed_sd, (k, 1, design.seeds))
        if design.folds > 1 and fold_sd > 0:
            x += rng.normal(0.0, fold_sd, (k, design.folds, design.seeds))[:, fold_of, :]
        parts.append(_study_levels(x, fold_of))
    return tuple(np.concatenate(p) for p in zip(*parts, strict=True))


def design_power(pilot: Pilot, design: Design, effect: float, settings: PowerSettings = PowerSettings()) -> DesignPower:
    """Power of one ``design`` to find a true difference ``effect`` significant in its direction, one comparison of a
    Holm family of ``comparisons`` (Holm's first threshold alpha / m: exact when the others are null, conservative
    otherwise), with its Monte-Carlo error; and ``mde``, the smallest effect found with probability ``target``."""
    if design.seeds < 1 or design.patients < 2 * design.folds or design.folds < 1:
        raise ValueError(f"design: need seeds >= 1, folds >= 1 and 2 patients per fold, got {design}")
    rng = np.random.default_rng([settings.seed, design.seeds, design.patients, design.folds])
    replicates = settings.n_resamples or family_resamples(settings.comparisons, alpha=settings.alpha)
    estimate, var_patients, var_seeds = _simulate(pilot, design, settings.fold_sd, settings.studies, rng)
    level = settings.alpha / settings.comparisons
    above, below = _critical(var_patients, var_seeds, design.seeds, replicates, level, rng)
    found = estimate + effect > above if effect >= 0 else estimate + effect < below
    power = float(found.mean())
    needed = np.sort(above - estimate)[math.ceil(settings.target * settings.studies) - 1]  # the effect `target` find
    error = math.sqrt(power * (1 - power) / settings.studies)
    return DesignPower(**asdict(design), power=power, mc_error=error, mde=float(max(needed, 0.0)))


def plan_power(differences: np.ndarray, effect: float, settings: PowerSettings = PowerSettings()) -> PowerPlan:
    """Power of every design of ``settings``' seeds x patients x folds to find ``effect`` (A - B, the metric's units)
    significant after Holm over its ``comparisons``, from a pilot's per-patient paired ``differences``
    ``(seeds, patients)``. Each simulated study resamples the pilot's patients (centred, shifted by ``effect``), draws
    its seeds' effects N(0, ``seed_sd``) and applies the report's test (:func:`_critical`). The ``smallest`` design
    reaching ``target`` has the fewest trainings (seeds x folds), then patients."""
    pilot = pilot_components(differences, settings.seed_sd)
    grid = itertools.product(settings.seeds, settings.patients, settings.folds)
    rows = [design_power(pilot, Design(*design), effect, settings) for design in grid]
    reaching = [r for r in rows if r.power >= settings.target]
    smallest = min(reaching, key=lambda r: (r.seeds * r.folds, r.patients), default=None)
    method = "simulated studies resampling the pilot's patients, the two-level bootstrap's test (normal patient level)"
    return PowerPlan(rows, smallest, pilot.seed_sd, method)


def power_curve(
    differences: np.ndarray,
    effect: float,
    settings: PowerSettings = PowerSettings(),
    seeds: Sequence[int] = (2, 3, 4, 5, 7, 10),
    patients: Sequence[int] = (32, 64, 128, 255, 512),
    at_seeds: int = 5,
    at_patients: int = 255,
) -> dict:
    """Power against seeds (at ``at_patients`` patients) and against patients (at ``at_seeds`` seeds), for a figure
    (:func:`gx_ray.analysis.plots.power_curve_plot`); ``settings`` as :func:`plan_power`'s, but these designs."""
    axes = {"against_seeds": (seeds, (at_patients,)), "against_patients": ((at_seeds,), patients)}
    return {"effect": effect} | {
        axis: plan_power(differences, effect, replace(settings, seeds=s, patients=n)).to_dict()["designs"]
        for axis, (s, n) in axes.items()
    }
