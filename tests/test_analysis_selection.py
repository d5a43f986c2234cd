"""A search's winner corrected for its selection (gx_ray.analysis.selection): the bootstrap bias-corrected estimate is
unbiased where the naive maximum is optimistic by the expected maximum of the noise, the one-standard-error rule and
the indistinguishable set on hand cases, NaN scores, and scores built from the trials' case scorers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import integrate, stats

from gx_ray.analysis.cases import case_scorer
from gx_ray.analysis.selection import one_standard_error, scores_from_scorers, selection_corrected
from gx_ray.schema import STAGE_GROUPS


def means_of(values: np.ndarray):
    """``scores`` of per-patient values ``(patients, configurations)``: each configuration's mean on the patients."""
    return lambda indices: values[indices].mean(axis=0)


def expected_maximum(k: int) -> float:
    """E[max of k independent standard normals]: the integral of x k phi(x) Phi(x)^(k-1)."""
    density = lambda x: x * k * stats.norm.pdf(x) * stats.norm.cdf(x) ** (k - 1)  # noqa: E731
    return integrate.quad(density, -np.inf, np.inf)[0]


def test_corrected_estimate_is_unbiased_where_the_naive_maximum_is_optimistic():
    """300 simulated studies of 30 configurations of EQUAL true performance (mean 0) on 200 patients, 150 resamples
    each: per-patient score = patient effect (sd 1, shared by the configurations) + configuration noise (sd 1), metric
    the mean. The naive winner's score is the maximum of 30 means whose independent parts have sd 1 / sqrt(200) =
    0.0707, so its bias is E[max of 30 normals] x 0.0707 = 2.043 x 0.0707 = 0.144. Measured (seeds 0..299): naive bias
    0.1465 (simulation SE 0.0045), corrected bias 0.0023 (simulation SE 0.0049). Asserted: the corrected bias within 3
    simulation SEs of 0 (|bias| < ~0.015) and the naive bias within 3 of its expectation (~32 SEs from 0)."""
    rng = np.random.default_rng(0)
    studies, patients, k = 300, 200, 30
    naive, corrected = np.empty(studies), np.empty(studies)
    for s in range(studies):
        values = rng.normal(0, 1, (patients, 1)) + rng.normal(0, 1, (patients, k))
        estimate = selection_corrected(means_of(values), patients, n_resamples=150, seed=s)
        naive[s], corrected[s] = estimate.naive, estimate.corrected
    expected = expected_maximum(k) / np.sqrt(patients)
    assert expected == pytest.approx(2.043 / np.sqrt(200), abs=1e-3)
    se_naive, se_corrected = (v.std(ddof=1) / np.sqrt(studies) for v in (naive, corrected))
    print(f"naive bias {naive.mean():.4f} (SE {se_naive:.4f}, expected {expected:.4f}); "
          f"corrected bias {corrected.mean():.4f} (SE {se_corrected:.4f})")  # fmt: skip
    assert abs(corrected.mean()) < 3 * se_corrected
    assert abs(naive.mean() - expected) < 3 * se_naive
    assert naive.mean() - corrected.mean() > 0.8 * expected  # the correction removes the optimism, not noise


def test_lower_is_better_chooses_the_minimum():
    rng = np.random.default_rng(1)
    values = rng.normal(0, 1, (100, 3)) + np.array([0.0, -1.0, 0.5])
    estimate = selection_corrected(means_of(values), 100, higher_is_better=False, n_resamples=200)
    assert estimate.chosen == 1 and estimate.indistinguishable == (1,)
    assert estimate.naive == pytest.approx(values[:, 1].mean())
    assert estimate.corrected == pytest.approx(-1.0, abs=0.3)  # the truth, within a few of its SE (0.1)


def test_indistinguishable_set_and_standard_errors_on_a_hand_case():
    """Configuration 0 is the best on all patients; 1 differs from it by +-0.001 alternating (indistinguishable), 2 is
    0.5 lower on every patient (distinguishable at once, same spread), 3 is 0.05 lower plus centred noise of sd 1
    (its difference's SE is 0.1: indistinguishable)."""
    rng = np.random.default_rng(2)
    n = 100
    base = rng.normal(0, 1, n)
    noise = rng.normal(0, 1, n)
    alternating = 0.001 * np.where(np.arange(n) % 2 == 0, 1.0, -1.0) - 1e-6
    values = np.column_stack([base, base + alternating, base - 0.5, base - 0.05 + noise - noise.mean()])
    estimate = selection_corrected(means_of(values), n, n_resamples=500)
    assert estimate.chosen == 0 and estimate.naive == pytest.approx(base.mean())
    assert estimate.indistinguishable == (0, 1, 3)
    errors = estimate.standard_errors
    assert errors[2] == pytest.approx(errors[0])  # a shift has the same spread
    assert errors[0] == pytest.approx(base.std() / np.sqrt(n), rel=0.15)  # the mean's bootstrap SE
    assert (estimate.patients, estimate.configurations, estimate.resamples) == (n, 4, 500)
    assert json.loads(json.dumps(estimate.to_dict()))["indistinguishable"] == [0, 1, 3]


def test_one_standard_error_rule():
    """Best mean 0.80 (SE 0.02): 0.79 and 0.795 are within one SE, 0.70 is not though cheapest; 0.79 and 0.795 cost
    the same, so the better mean (0.795) wins."""
    means, errors, costs = [0.80, 0.79, 0.70, 0.795], [0.02, 0.05, 0.01, 0.01], [10, 5, 1, 5]
    assert one_standard_error(means, errors, costs) == 3
    assert one_standard_error([-m for m in means], errors, costs, higher_is_better=False) == 3
    assert one_standard_error(means, [0.001, 0.05, 0.01, 0.01], costs) == 0  # a tight best: only itself
    assert one_standard_error([0.8, np.nan, 0.79], [0.02, 0.0, 0.02], [3, 1, 2]) == 2  # NaN is never chosen
    with pytest.raises(ValueError, match="as many"):
        one_standard_error(means, errors, costs[:2])


def test_a_configuration_nan_everywhere_is_never_chosen():
    rng = np.random.default_rng(3)
    values = rng.normal(0, 1, (60, 3)) + np.array([0.0, 5.0, 0.3])

    def scores(indices):
        out = values[indices].mean(axis=0)
        out[1] = np.nan  # the otherwise best configuration cannot be scored at all
        return out

    estimate = selection_corrected(scores, 60, n_resamples=200)
    assert estimate.chosen == 2 and 1 not in estimate.indistinguishable
    assert np.isnan(estimate.standard_errors[1]) and estimate.to_dict()["standard_errors"][1] is None
    assert np.isfinite(estimate.corrected)


def test_replicates_without_an_out_of_bag_score_are_dropped_and_too_many_raise():
    """AUC with 3 positives in 40 patients: all three are in-bag on about (1 - 0.368)^3 = 25 % of the replicates,
    whose out-of-bag AUC is undefined (dropped, not averaged as a number)."""
    rng = np.random.default_rng(4)
    labels = np.r_[np.ones(3), np.zeros(37)].astype(int)
    scorers = [[case_scorer_of(labels, labels + rng.normal(0, 1, 40))] for _ in range(3)]
    estimate = selection_corrected(scores_from_scorers(scorers), 40, n_resamples=200)
    assert 100 <= estimate.resamples < 180 and 0 <= estimate.low <= estimate.corrected <= estimate.high <= 100
    with pytest.raises(ValueError, match="too few"):  # a metric undefined on any out-of-bag set
        selection_corrected(lambda i: np.full(2, 1.0 if len(i) == 40 else np.nan), 40, n_resamples=100)


def case_scorer_of(labels: np.ndarray, scores: np.ndarray, reverse: bool = False):
    """A binary stage scorer (stage I against II) through the task's own case scorer: AUC in percent; ``reverse``:
    its records in reverse order."""
    probabilities = np.zeros((len(labels), 4))
    probabilities[:, 1] = 1 / (1 + np.exp(-scores))
    probabilities[:, 0] = 1 - probabilities[:, 1]
    records = [
        {"case_id": f"p{i:03d}", "prediction": "I", "target": STAGE_GROUPS[y], "probabilities": p.tolist()}
        for i, (y, p) in enumerate(zip(labels, probabilities, strict=True))
    ]
    return case_scorer("stage_classification", records[::-1] if reverse else records, "auc")


def test_the_interval_covers_the_truth():
    """One configuration (no selection): 150 studies of 80 patients, values N(0, 1). The out-of-bag interval is wider
    than the mean's (about 37 % of the patients each time): it covers 0 in at least 95 % of the studies."""
    rng = np.random.default_rng(5)
    estimates = [
        selection_corrected(means_of(rng.normal(0, 1, (80, 1))), 80, n_resamples=100, seed=s) for s in range(150)
    ]
    covered = [e.low <= 0 <= e.high for e in estimates]
    assert np.mean(covered) >= 0.95


def test_scores_from_scorers_is_the_seed_mean_of_the_scorers():
    """Two configurations of two seeds, one seed's records in reverse order and one with an extra patient: the scores
    are on the shared patients (sorted), each configuration the mean of its seeds' scorers called directly on the same
    cases (each at its own positions)."""
    rng = np.random.default_rng(6)
    labels = np.arange(30) % 2
    configs = [[case_scorer_of(labels, labels + rng.normal(0, 1, 30)) for _ in range(2)] for _ in range(2)]
    configs[0][0] = case_scorer_of(labels, labels + rng.normal(0, 1, 30), reverse=True)
    configs[1][1] = case_scorer_of(np.r_[labels, 1], np.r_[labels + rng.normal(0, 1, 30), 0.0])
    scores = scores_from_scorers(configs)
    assert scores.case_ids == [f"p{i:03d}" for i in range(30)] and configs[0][0].case_ids[0] == "p029"
    indices = rng.integers(0, 30, 30)
    direct = [
        np.mean([s.score(np.array([s.case_ids.index(scores.case_ids[i]) for i in indices])) for s in seeds])
        for seeds in configs
    ]
    assert scores(indices) == pytest.approx(direct)
    assert len(set(direct)) == 2 and np.isfinite(direct).all()
    with pytest.raises(ValueError, match="at least one"):
        scores_from_scorers([[]])
