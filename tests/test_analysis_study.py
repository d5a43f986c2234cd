"""The study statistics (gx_ray.analysis.study, .power, .simulation): the two-level bootstrap over patients and
seeds, its coverage against a known truth, the power planner against closed forms and the real bootstrap, TOST, and
p-values at the floor."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from gx_ray.analysis import simulation, study
from gx_ray.analysis.bootstrap import paired_bootstrap
from gx_ray.analysis.power import (
    Design,
    DesignPower,
    PowerPlan,
    PowerSettings,
    design_power,
    pilot_components,
    plan_power,
    power_curve,
)
from gx_ray.analysis.simulation import StudyModel, coverage
from gx_ray.analysis.stats import holm, seed_summary
from gx_ray.analysis.study import (
    BootstrapResult,
    CaseAUC,
    CaseMeans,
    Equivalence,
    Resampling,
    equivalence,
    format_p,
    p_floor,
    two_level_bootstrap,
)


def plain(scorer):
    """The scorer without its batch method: the bootstrap calls it once per replicate."""
    return lambda indices: scorer(indices)


def arms(rng: np.random.Generator, n: int = 40, seeds: int = 3, seed_sd: float = 0.0, shift: float = 0.0):
    """Two arms of per-case values: a patient effect shared by the arms, a seed effect shared by the arms' seed s."""
    patient = rng.normal(60, 10, n)
    seed = rng.normal(0, seed_sd, seeds)
    a = [CaseMeans(patient + seed[s] + shift + rng.normal(0, 5, n)) for s in range(seeds)]
    b = [CaseMeans(patient + seed[s] + rng.normal(0, 5, n)) for s in range(seeds)]
    return a, b


def pairwise_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """AUC by its definition: the share of (positive, negative) pairs ranked right, ties counting one half."""
    pos, neg = scores[labels == 1][:, None], scores[labels == 0][None, :]
    return float(np.mean((pos > neg) + 0.5 * (pos == neg)))


# --- scorers ---------------------------------------------------------------------------------------------------------


def test_batch_scorers_agree_with_direct_computation_on_random_resamples():
    rng = np.random.default_rng(0)
    for case in range(30):
        n = int(rng.integers(5, 60))
        labels = (rng.random(n) < rng.uniform(0.2, 0.8)).astype(int)
        labels[:2] = [0, 1]
        scores = np.round(rng.normal(size=n) + labels, int(rng.integers(0, 3)))  # ties at coarse rounding
        right, asked = rng.integers(0, 4, n).astype(float), rng.integers(1, 5, n).astype(float)
        right = np.minimum(right, asked)
        auc, vqa = CaseAUC(labels, scores, scale=100.0), CaseMeans(right, asked, scale=100.0)
        rows = rng.integers(0, n, (20, n))
        counts = np.stack([np.bincount(r, minlength=n) for r in rows])
        for row, got_auc, got_vqa in zip(rows, auc.batch(counts), vqa.batch(counts), strict=True):
            assert got_vqa == pytest.approx(100 * right[row].sum() / asked[row].sum()), case
            if len(set(labels[row])) == 2:
                assert got_auc == pytest.approx(100 * pairwise_auc(labels[row], scores[row])), case
            else:
                assert np.isnan(got_auc)
            assert auc(row) == pytest.approx(got_auc, nan_ok=True)


def test_auc_by_sorting_agrees_with_the_pair_matrix(monkeypatch: pytest.MonkeyPatch):
    rng = np.random.default_rng(1)
    labels = (rng.random(80) < 0.4).astype(int)
    scores = np.round(rng.normal(size=80) + labels, 1)
    counts = np.stack([np.bincount(rng.integers(0, 80, 80), minlength=80) for _ in range(15)])
    by_matrix = CaseAUC(labels, scores).batch(counts)
    monkeypatch.setattr(study, "PAIR_MATRIX_MAX", 0)
    assert CaseAUC(labels, scores).batch(counts) == pytest.approx(by_matrix)


def test_case_auc_refuses_labels_that_are_not_binary():
    with pytest.raises(ValueError, match="0/1 labels"):
        CaseAUC(np.array([0, 1, 2]), np.array([0.1, 0.2, 0.3]))


# --- the two-level bootstrap -----------------------------------------------------------------------------------------


def test_patients_only_level_is_the_paired_bootstrap():
    """Same seed, same draws: the "none" level reproduces gx_ray.analysis.bootstrap.paired_bootstrap."""
    a, b = arms(np.random.default_rng(2), seeds=3, seed_sd=3.0)
    old = paired_bootstrap([plain(s) for s in a], [plain(s) for s in b], 40, n_resamples=300, seed=5)
    new = two_level_bootstrap(a, b, 40, options=Resampling(n_resamples=300, seed=5, seed_level="none"))
    for key in ("diff", "ci_low", "ci_high", "p_value", "n_resamples", "dropped"):
        assert getattr(new, key) == pytest.approx(old[key]), key


def test_batch_and_per_replicate_scoring_give_the_same_result():
    a, b = arms(np.random.default_rng(3), seeds=4, seed_sd=2.0, shift=1.0)
    options = Resampling(n_resamples=200, seed=1)
    fast = two_level_bootstrap(a, b, 40, options=options)
    slow = two_level_bootstrap([plain(s) for s in a], [plain(s) for s in b], 40, options=options)
    assert fast.to_dict() == pytest.approx(slow.to_dict())


def test_both_arms_share_patients_and_seed_draws():
    """A = B + 2 on every case of every seed: every replicate of the difference is exactly 2, whatever the seeds'
    and patients' spread, which only a shared patient draw and a shared seed level give."""
    rng = np.random.default_rng(4)
    base = [rng.normal(60 + 10 * s, 15, 50) for s in range(5)]
    options = Resampling(n_resamples=400, keep_replicates=True)
    result = two_level_bootstrap([CaseMeans(v + 2) for v in base], [CaseMeans(v) for v in base], 50, options=options)
    assert result.replicates == pytest.approx(np.full(400, 2.0))
    assert result.se_seeds == 0 and result.p_value == pytest.approx(2 / 401)
    assert result.method == "two-level bootstrap: patients × seeds"


def test_seed_effects_shared_by_the_arms_cancel_in_the_difference_but_not_in_a_cell():
    a, b = arms(np.random.default_rng(5), n=60, seeds=5, seed_sd=8.0, shift=3.0)
    cell = two_level_bootstrap(a, None, 60, options=Resampling(n_resamples=500))
    difference = two_level_bootstrap(a, b, 60, options=Resampling(n_resamples=500))
    assert cell.se_seeds > 2.0  # 8 / sqrt(5) = 3.6 expected
    assert difference.se_seeds < 0.5 * cell.se_seeds
    assert "diff" in difference.to_dict() and "diff" not in cell.to_dict()


def test_interaction_noise_is_counted_once_with_the_seeds():
    """No seed effect, only patient x seed noise: the seeds' spread on the test set is that noise, which the patient
    replicates carry too. It is counted once, at the seed level (the seeds' own standard error), and taken out of the
    patient level: se_patients is the patients' 10 / sqrt(50), not sqrt(100 + 400 / 4) / sqrt(50)."""
    rng = np.random.default_rng(20)
    patients = []
    for _ in range(20):
        patient = rng.normal(60, 10, 50)
        values = [patient + rng.normal(0, 20, 50) for _ in range(4)]
        result = two_level_bootstrap([CaseMeans(v) for v in values], None, 50, options=Resampling(n_resamples=300))
        assert result.se_seeds == pytest.approx(np.std([v.mean() for v in values], ddof=1) / 2)
        patients.append(result.se_patients**2)
    assert np.mean(patients) == pytest.approx(100 / 50, rel=0.25)  # counted twice: 4.0


def test_seed_level_is_never_zero_when_the_seeds_disagree():
    """Three seeds whose test-set means differ by less than their patient x seed noise: the seed level is their
    standard error, not 0 (subtracting the interaction from 2 degrees of freedom set it to 0, and such studies'
    intervals covered about 60 %); only seeds that agree exactly have none."""
    rng = np.random.default_rng(21)
    patient = rng.normal(60, 10, 80)
    noise = rng.normal(0, 20, (3, 80))
    values = patient + noise - noise.mean(axis=1, keepdims=True) + np.array([[0.0], [0.1], [0.3]])
    result = two_level_bootstrap([CaseMeans(v) for v in values], None, 80, options=Resampling(n_resamples=400))
    assert result.se_seeds == pytest.approx(np.std(values.mean(axis=1), ddof=1) / math.sqrt(3))
    assert result.se_seeds > 0
    same = two_level_bootstrap([CaseMeans(values[0])] * 3, None, 80, options=Resampling(n_resamples=400))
    assert same.se_seeds == 0


def test_seed_level_alone_gives_the_t_interval_over_seeds():
    """Every patient scores the same within a seed: no patient variance, and the interval is Student's t over the
    seeds (seed_summary), which a resample of three seeds (their range at most) cannot reach."""
    values = np.array([61.0, 64.0, 70.0])
    scorers = [CaseMeans(np.full(30, v)) for v in values]
    t_level = two_level_bootstrap(scorers, None, 30, options=Resampling(n_resamples=20000, seed=0))
    expected = seed_summary(values)
    width = expected["ci_high"] - expected["ci_low"]
    assert t_level.ci_low == pytest.approx(expected["ci_low"], abs=0.03 * width)
    assert t_level.ci_high == pytest.approx(expected["ci_high"], abs=0.03 * width)
    resampled = two_level_bootstrap(scorers, None, 30, options=Resampling(n_resamples=2000, seed_level="resample"))
    assert values.min() <= resampled.ci_low and resampled.ci_high <= values.max()
    assert t_level.se_patients == 0


def test_one_seed_has_no_seed_level_and_says_so():
    a, b = arms(np.random.default_rng(6), seeds=1)
    result = two_level_bootstrap(a, b, 40, options=Resampling(n_resamples=200))
    assert result.se_seeds == 0 and "one seed" in result.method


def test_nan_replicates_are_dropped_and_counted():
    labels = np.zeros(12, dtype=int)
    labels[0] = 1  # one positive in 12: a resample often misses it and the AUC is undefined
    scorers = [CaseAUC(labels, np.random.default_rng(s).normal(size=12)) for s in range(3)]
    result = two_level_bootstrap(scorers, None, 12, options=Resampling(n_resamples=500))
    expected_missing = (11 / 12) ** 12  # P(a resample has no positive)
    assert result.dropped + result.n_resamples == 500
    assert result.dropped / 500 == pytest.approx(expected_missing, abs=0.06)


def test_folds_resample_patients_within_their_fold():
    """Per-fold scorers are called on their own fold's patients only, as many as the fold holds; their weighted
    mean is the pooled metric, so the per-fold and the pooled forms give the same answer on the same draws."""
    rng = np.random.default_rng(7)
    n, folds = 30, np.repeat([0, 1, 2], [8, 10, 12])
    values = [rng.normal(50, 10, n) for _ in range(3)]
    seen = []

    def fold_scorer(v: np.ndarray, fold: int):
        def score(indices: np.ndarray) -> float:
            seen.append((fold, indices.copy()))
            return float(v[indices].mean())

        return score

    per_fold = [[fold_scorer(v, f) for f in range(3)] for v in values]
    options = Resampling(n_resamples=100, seed=3)
    pooled = two_level_bootstrap([CaseMeans(v) for v in values], None, n, folds=folds, options=options)
    split = two_level_bootstrap(per_fold, None, n, folds=folds, options=options)
    assert split.to_dict() == pytest.approx(pooled.to_dict())
    for fold, indices in seen:
        assert (folds[indices] == fold).all() and len(indices) == (folds == fold).sum()
    assert split.n_folds == 3 and "within 3 folds" in split.method


def test_fold_models_spread_counts_at_the_seed_level():
    """Each seed trains one model per fold; a model's effect on its fold's patients moves the seed's score, and the
    seed level carries it."""
    rng = np.random.default_rng(8)
    n, folds = 60, np.repeat(np.arange(5), 12)
    patient = rng.normal(60, 5, n)
    quiet = [CaseMeans(patient + rng.normal(0, 1, n)) for _ in range(4)]
    loud = [CaseMeans(patient + rng.normal(0, 12, 5)[folds] + rng.normal(0, 1, n)) for _ in range(4)]
    assert two_level_bootstrap(loud, None, n, folds=folds).se_seeds > 4 * max(
        two_level_bootstrap(quiet, None, n, folds=folds).se_seeds, 0.1
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"score_b": [CaseMeans(np.ones(5))] * 2}, "same seeds"),
        ({"folds": np.zeros(4)}, "one fold per patient"),
        ({"folds": np.array([0, 0, 0, 0, 1])}, "fewer than 2 patients"),
        ({"options": Resampling(seed_level="bca")}, "seed_level"),
        ({"score_a": [CaseMeans(np.ones(5)), [CaseMeans(np.ones(5))] * 3], "folds": [0, 0, 1, 1, 1]}, "seed 1"),
    ],
)
def test_bad_input_is_refused_by_name(kwargs: dict, message: str):
    call = {"score_a": [CaseMeans(np.ones(5))] * 3, "score_b": None, "n_cases": 5, **kwargs}
    with pytest.raises(ValueError, match=message):
        two_level_bootstrap(**call)


def test_a_seed_undefined_on_the_whole_test_set_is_refused():
    with pytest.raises(ValueError, match="seeds \\[1\\] score NaN"):
        two_level_bootstrap([CaseMeans(np.ones(6)), lambda indices: math.nan], None, 6)


# --- coverage against a known truth ----------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["accuracy", "mean", "auc"])
def test_truth_is_the_mean_over_seeds_of_the_population_metric(metric: str):
    model = StudyModel(metric=metric, seed_sd=0.3)
    a, b, labels = model.draw(20000, 60, np.random.default_rng(9))
    scorers = model.scorers(np.concatenate([a, b]), labels)
    everyone = np.arange(20000)
    got = np.array([s(everyone) for s in scorers]).reshape(2, 60).mean(axis=1)
    assert got == pytest.approx(model.truth(), abs=1.0)  # 60 seeds of SD ~8 points: SE ~1


@pytest.mark.parametrize("metric", ["accuracy", "auc"])
def test_two_level_intervals_cover_where_patients_only_do_not(metric: str):
    """Seeds moving the score as much as the patients or more, 3 seeds: the two-level interval holds the truth about
    95 % of the time; the patients-only interval (the paired bootstrap as it was) much less."""
    seed_sd = 0.3 if metric == "accuracy" else 0.8
    model = dataclasses.replace(simulation.MIXES["seed-heavy"], metric=metric, seed_sd=seed_sd)
    rows = {(r["target"], r["seed_level"]): r for r in coverage(model, 64, 3, studies=120, n_resamples=299, seed=1)}
    for target in ("cell", "difference"):
        assert rows[target, "t"]["coverage"] >= 0.88, rows[target, "t"]
        assert rows[target, "none"]["coverage"] < rows[target, "t"]["coverage"] - 0.07, rows[target, "none"]
        assert rows[target, "t"]["mc_error"] == pytest.approx(
            math.sqrt(rows[target, "t"]["coverage"] * (1 - rows[target, "t"]["coverage"]) / 120)
        )


@pytest.mark.parametrize("metric", ["accuracy", "mean"])
def test_three_seeds_cover_where_their_spread_often_falls_below_the_noise(metric: str):
    """Issue 47's independent check: 255 patients x 3 seeds, seeds moving a difference by ~7 points and patient x seed
    noise that 3 seeds' spread often falls below. The seed level is never 0 (it was in ~17 % of these studies, which
    then covered ~60 %), and the intervals cover at least the documented 93 % less 1.5 points (600 studies: a
    simulation SE of ~0.9 point; 299 replicates, which cost coverage a little)."""
    model = dataclasses.replace(simulation.MIXES["seed-heavy, noisy"], metric=metric)
    rows = [r for r in coverage(model, 255, 3, studies=600, n_resamples=299, seed=3) if r["seed_level"] == "t"]
    for row in rows:
        assert row["seed_level_zero"] <= 0.005, row  # exact ties of 3 seeds' accuracy only
        assert row["coverage"] >= 0.93 - 0.015, row


# --- power planning --------------------------------------------------------------------------------------------------


def test_pilot_components_recover_known_variances():
    rng = np.random.default_rng(10)
    seeds, n = 8, 3000
    d = rng.normal(0, 4, n)[None] + rng.normal(0, 2, (seeds, 1)) + rng.normal(0, 3, (seeds, n)) + 1.5
    pilot = pilot_components(d)
    assert pilot.patient_effects.std() == pytest.approx(4, rel=0.05)
    assert pilot.residuals.std() == pytest.approx(3, rel=0.05)
    assert pilot.seed_sd == pytest.approx(2, rel=0.6)  # eight seeds: a rough estimate
    assert pilot.mean == pytest.approx(d.mean())
    with pytest.raises(ValueError, match="one seed cannot estimate"):
        pilot_components(d[0])


@pytest.mark.parametrize(("comparisons", "effect"), [(1, 1.6), (5, 2.0)])
def test_power_of_normal_differences_is_the_paired_t_tests(comparisons: int, effect: float):
    """No seed effect, normal per-patient differences (SD 10), 255 patients: the planner's power is the closed form
    of a paired t-test at alpha / m (noncentral t), within simulation error."""
    differences = np.random.default_rng(11).normal(0, 10, 20000)
    n = 255
    closed = stats.nct.sf(stats.t.ppf(1 - 0.05 / (2 * comparisons), n - 1), n - 1, effect * math.sqrt(n) / 10)
    for seeds in (1, 3):
        settings = PowerSettings(seeds=(seeds,), patients=(n,), comparisons=comparisons, seed_sd=0.0, studies=3000)
        got = plan_power(differences, effect, dataclasses.replace(settings, seed=seeds)).designs[0]
        assert abs(got.power - closed) <= 3.5 * got.mc_error + 0.005, (seeds, got, closed)


def test_planned_power_matches_the_real_two_level_bootstrap():
    """Studies simulated from a model and analysed by the real two-level bootstrap find the effect as often as the
    planner predicts, within 5 points."""
    settings = PowerSettings(comparisons=1, studies=600)
    check = simulation.power_check(simulation.MIXES["balanced"], Design(seeds=5, patients=64), settings)
    assert abs(check.predicted - check.measured) <= 0.05, check
    assert 0.1 < check.measured < 0.9  # a design where power can be wrong both ways


def test_planner_design_choice_and_minimum_detectable_effect():
    rng = np.random.default_rng(12)
    differences = rng.normal(2, 12, (3, 400)) + rng.normal(0, 2, (3, 1))
    settings = PowerSettings(seeds=(2, 3, 5), patients=(64, 128, 255), seed_sd=0.5, studies=600)
    plan = plan_power(differences, 3.0, settings)
    designs = {(d.seeds, d.patients): d for d in plan.designs}
    for s in (3, 5):  # more patients, more power (a small seed SD: see the docs for a large one)
        assert designs[s, 64].power < designs[s, 128].power < designs[s, 255].power
    for n in (64, 128, 255):  # more seeds, more power (the seed level's t has more degrees of freedom, too)
        assert designs[2, n].power < designs[3, n].power < designs[5, n].power
    smallest = plan.smallest
    assert smallest.power >= 0.8
    assert not any(d.power >= 0.8 and d.seeds < smallest.seeds for d in plan.designs)
    assert not any(
        d.power >= 0.8 and d.seeds == smallest.seeds and d.patients < smallest.patients for d in plan.designs
    )
    pilot = pilot_components(differences, 0.5)
    for design in (Design(3, 128), Design(5, 255)):
        mde = design_power(pilot, design, 1.0, PowerSettings(studies=600)).mde
        at_mde = design_power(pilot, design, mde, PowerSettings(studies=600))
        assert at_mde.power == pytest.approx(0.8, abs=0.005)
    assert designs[5, 255].mde < designs[3, 128].mde < designs[2, 64].mde


def test_power_is_zero_below_the_bootstrap_floor():
    """199 replicates cannot give p < 0.01, so a family of 10 at alpha 0.05 never finds anything."""
    pilot = pilot_components(np.random.default_rng(13).normal(0, 1, 500), seed_sd=0.0)
    result = design_power(pilot, Design(1, 255), 5.0, PowerSettings(comparisons=10, n_resamples=199, studies=200))
    assert result.power == 0 and result.mde == math.inf


def test_power_curve_has_both_axes():
    differences = np.random.default_rng(14).normal(3, 12, (3, 300))
    curve = power_curve(differences, 3.0, PowerSettings(seed_sd=1.0, studies=300), seeds=(2, 5), patients=(64, 255))
    assert [d["seeds"] for d in curve["against_seeds"]] == [2, 5]
    assert [d["patients"] for d in curve["against_patients"]] == [64, 255]
    assert all(d["patients"] == 255 for d in curve["against_seeds"])


# --- equivalence and non-inferiority ---------------------------------------------------------------------------------


def test_bootstrap_tost_agrees_with_the_t_based_tost_on_normal_differences():
    """Normal paired differences: the TOST of the two-level bootstrap's replicates (one seed) against scipy's t-based
    TOST, on many generated cases: the same p within Monte-Carlo error, the same verdict away from the boundary."""
    rng = np.random.default_rng(15)
    n, margin, alpha = 120, 2.0, 0.05
    for case in range(25):
        x = rng.normal(rng.uniform(-3, 3), rng.uniform(3, 9), n)
        base = rng.normal(60, 10, n)
        options = Resampling(n_resamples=4000, seed=case, keep_replicates=True)
        result = two_level_bootstrap([CaseMeans(base + x)], [CaseMeans(base)], n, options=options)
        got = equivalence(result.replicates, margin, alpha)
        se = x.std(ddof=1) / math.sqrt(n)
        lower = stats.t.sf((x.mean() + margin) / se, n - 1)  # H0: difference <= -margin
        upper = stats.t.cdf((x.mean() - margin) / se, n - 1)  # H0: difference >= margin
        closed = max(lower, upper)
        assert got.p_equivalence == pytest.approx(closed, abs=0.012 + 0.08 * closed), case
        assert got.p_noninferior == pytest.approx(lower, abs=0.012 + 0.08 * lower), case
        if abs(closed - alpha) > 0.015:
            assert got.verdict.startswith("equivalent") == (closed <= alpha), (case, got, closed)


@pytest.mark.parametrize(
    ("interval", "verdict", "beyond"),
    [
        ((-0.5, 0.8), "equivalent within ±1", False),
        ((-0.5, 2.5), "non-inferior (margin 1)", False),
        ((0.5, 2.5), "non-inferior (margin 1)", False),
        ((-3.0, -0.2), "worse", False),
        ((-3.0, -1.5), "worse", True),
        ((-1.5, 0.5), "not shown", False),
        ((-0.9, -0.2), "equivalent within ±1", False),  # a real loss, smaller than the margin
    ],
)
def test_verdicts_from_an_interval(interval: tuple, verdict: str, beyond: bool):
    got = equivalence(interval, 1.0)
    assert got.verdict == verdict and got.beyond_margin == beyond
    assert np.isnan(got.p_equivalence)


def test_lower_is_better_flips_the_direction_and_replicates_agree_with_intervals():
    rng = np.random.default_rng(16)
    for centre in (-4.0, -1.2, 0.0, 0.4, 1.5, 4.0):
        d = rng.normal(centre, 0.5, 3000)
        from_replicates = equivalence(d, 1.0, higher_is_better=False)
        assert from_replicates.verdict == equivalence(-d, 1.0).verdict
        interval = (from_replicates.ci_low, from_replicates.ci_high)
        assert equivalence(interval, 1.0, higher_is_better=False).verdict == from_replicates.verdict
    assert equivalence(rng.normal(3, 0.2, 500), 1.0, higher_is_better=False).verdict == "worse"


def test_without_a_margin_equivalence_is_not_tested_and_bad_input_is_refused():
    assert equivalence(np.zeros(100), None).verdict == "equivalence not tested"
    with pytest.raises(ValueError, match="margin must be positive"):
        equivalence(np.zeros(100), 0.0)
    with pytest.raises(ValueError, match="low <= high"):
        equivalence((1.0, -1.0), 1.0)
    with pytest.raises(ValueError, match="cannot test at alpha"):
        equivalence(np.zeros(10), 1.0)


# --- p-values at the floor -------------------------------------------------------------------------------------------


def test_format_p_shows_the_floor_as_a_bound():
    assert format_p(0.025, 1199, comparisons=15) == "≤ 0.025 (floor of 1,199 replicates)"  # the demo's Holm floor
    assert format_p(2 / 1200, 1199) == "≤ 0.0017 (floor of 1,199 replicates)"
    assert format_p(0.0312, 1199, comparisons=15) == "0.0312"
    assert format_p(0.5, 999) == "0.5"
    assert format_p(math.nan, 999) == format_p(None, 999) == "—"


def test_floor_bound_is_true_and_is_what_a_huge_effect_gives():
    rng = np.random.default_rng(17)
    for _ in range(200):
        replicates, m = int(rng.integers(10, 50000)), int(rng.integers(1, 40))
        floor = p_floor(replicates, m)
        shown = format_p(floor, replicates, m)
        assert float(shown.split()[1]) >= floor and float(shown.split()[1]) <= 1.1 * floor + 1e-12, shown
        assert not format_p(floor * 1.01 + 1e-9, replicates, m).startswith("≤")
    a, b = arms(np.random.default_rng(18), seeds=3, shift=40.0)
    result = two_level_bootstrap(a, b, 40, options=Resampling(n_resamples=1199))
    assert result.p_value == pytest.approx(p_floor(1199))
    others = np.r_[result.p_value, rng.uniform(p_floor(1199), 1, 14)]
    assert holm(others).min() == pytest.approx(p_floor(1199, 15))  # the demo's 0.025
    assert format_p(holm(others).min(), 1199, 15) == "≤ 0.025 (floor of 1,199 replicates)"


def test_power_curve_plot_draws_both_axes(tmp_path):
    import matplotlib.pyplot as plt

    from gx_ray.analysis.plots import power_curve_figure, power_curve_plot

    differences = np.random.default_rng(19).normal(3, 12, (3, 300))
    curve = power_curve(differences, 3.0, PowerSettings(seed_sd=1.0, studies=200), seeds=(2, 3, 5), patients=(64, 255))
    figure = power_curve_figure(curve)
    lines = {child.get_gid(): child for ax in figure.axes for child in ax.get_children() if child.get_gid()}
    plt.close(figure)
    assert {"power-seeds", "power-patients"} <= set(lines)
    assert [p.suffix for p in power_curve_plot(curve, tmp_path / "power")] == [".png", ".svg"]
    assert (tmp_path / "power.png").stat().st_size > 1000


# --- the typed results keep the dicts' shape -------------------------------------------------------------------------

BOOTSTRAP_KEYS = ["estimate", "ci_low", "ci_high", "p_value", "diff", "n_seeds", "n_cases", "n_folds", "n_resamples",
                  "dropped", "se_patients", "se_seeds", "method"]  # fmt: skip
EQUIVALENCE_KEYS = ["margin", "alpha", "ci_low", "ci_high", "p_equivalence", "p_noninferior", "p_worse",
                    "beyond_margin", "verdict"]  # fmt: skip
DESIGN_KEYS = ["seeds", "patients", "folds", "power", "mc_error", "mde"]
CHECK_KEYS = ["design", "comparisons", "effect", "predicted", "predicted_error", "measured", "measured_error"]
CELL_KEYS = ["task", "model", "fusion", "metric", "schema_a", "schema_b"]
PLANNED_KEYS = [*CELL_KEYS, "effect", "pilot_seeds", "pilot_patients", "pilot_folds", "observed", "designs", "smallest",
                "seed_sd", "method", "curve", "figure"]  # fmt: skip


def test_typed_results_round_trip_to_their_documented_keys():
    """MLflow params, sweep.json, plan.json and the report's files are written from to_dict(): the keys (and their
    order) the dicts had before the results were dataclasses, each value its field's."""
    from gx_ray.analysis.plan import PlannedComparison, StudyPlan

    a, b = arms(np.random.default_rng(21), seeds=3, seed_sd=1.0, shift=1.0)
    difference = two_level_bootstrap(a, b, 40, options=Resampling(n_resamples=200))
    assert list(difference.to_dict()) == BOOTSTRAP_KEYS
    assert BootstrapResult(**difference.to_dict()) == difference
    cell = two_level_bootstrap(a, None, 40, options=Resampling(n_resamples=200, keep_replicates=True))
    assert list(cell.to_dict()) == [k for k in BOOTSTRAP_KEYS if k != "diff"] + ["replicates"]
    assert cell.to_dict()["replicates"] is cell.replicates
    for tost in (equivalence(np.random.default_rng(22).normal(0, 0.3, 500), 1.0), equivalence((-0.5, 0.5), None)):
        assert list(tost.to_dict()) == EQUIVALENCE_KEYS and Equivalence(**tost.to_dict()) == tost
    settings = PowerSettings(seeds=(2, 3), patients=(64,), seed_sd=0.5, studies=200)
    plan = plan_power(np.random.default_rng(23).normal(2, 12, (3, 300)), 3.0, settings)
    for design in plan.designs:
        assert list(design.to_dict()) == DESIGN_KEYS and DesignPower(**design.to_dict()) == design
    as_dict = plan.to_dict()
    assert list(as_dict) == ["designs", "smallest", "seed_sd", "method"]
    assert as_dict["designs"] == [d.to_dict() for d in plan.designs]
    assert as_dict["smallest"] == (plan.smallest.to_dict() if plan.smallest else None)
    assert PowerPlan([DesignPower(**d) for d in as_dict["designs"]], plan.smallest, plan.seed_sd, plan.method) == plan
    check = simulation.PowerCheck(Design(5, 64), 1, 2.0, 0.5, 0.01, 0.52, 0.02)
    assert list(check.to_dict()) == CHECK_KEYS and check.to_dict()["design"] is check.design
    assert simulation.PowerCheck(**check.to_dict()) == check
    names = dict(zip(CELL_KEYS, ["t", "m", "f", "auc", "image_table", "image_only"], strict=True))
    planned = PlannedComparison(**names, effect=3.0, pilot_seeds=3, pilot_patients=300, pilot_folds=0, observed=2.1,
                                plan=plan, curve={"effect": 3.0}, figure="power_t.image_table.png")  # fmt: skip
    assert list(planned.to_dict()) == PLANNED_KEYS
    assert planned.to_dict() == {**names, "effect": 3.0, "pilot_seeds": 3, "pilot_patients": 300, "pilot_folds": 0,
                                 "observed": 2.1, **as_dict, "curve": {"effect": 3.0},
                                 "figure": "power_t.image_table.png"}  # fmt: skip
    study_plan = StudyPlan([planned], Path("plan"))
    assert study_plan.to_dict() == {"comparisons": [planned.to_dict()], "folder": Path("plan")}
