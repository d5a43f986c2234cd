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


def stage_records(labels: np.ndarray, probabilities: np.ndarray) -> list[dict]:
    return [
        {"case_id": f"p{i:03d}", "prediction": STAGE_GROUPS[int(p.argmax())], "target": STAGE_GROUPS[y],
         "probabilities": p.tolist()}
        for i, (y, p) in enumerate(zip(labels, probabilities, strict=True))
    ]  # fmt: skip


def random_scorer(rng: np.random.Generator, kind: str, n: int):
    """A stage scorer (``auc``/``accuracy``; probabilities rounded to one decimal half the time: ties) or a VQA one
    (``vqa``: one or two questions a patient), over ``n`` patients, one of them missing a third of the time."""
    if kind == "vqa":
        records = [{"case_id": f"p{i:03d}", "category": "c", "prediction": str(rng.integers(2)), "target": "1"}
                   for i in range(n) for _ in range(rng.integers(1, 3))]  # fmt: skip
        return case_scorer("vqa", records, "accuracy")
    labels = rng.integers(0, rng.integers(2, 5), n)
    probabilities = rng.dirichlet(np.ones(4), n)
    if rng.integers(2):
        probabilities = np.round(probabilities, 1)
    missing = f"p{rng.integers(n):03d}" if rng.random() < 1 / 3 else None
    records = [r for r in stage_records(labels, probabilities) if r["case_id"] != missing]
    return case_scorer("stage_classification", records, kind)


@pytest.mark.parametrize("kind", ["auc", "accuracy", "vqa"])
def test_a_scorers_counted_form_is_its_score_on_the_repeated_cases_to_the_last_bit(kind):
    """``counted`` (every resample at once, from how often each case is drawn) against ``score`` on the cases so
    repeated, shuffled: 40 random scorers x 30 resamples, with ties, absent classes, single cases and an empty draw."""
    rng = np.random.default_rng(8)
    for _ in range(40):
        scorer = random_scorer(rng, kind, int(rng.integers(3, 50)))
        n = len(scorer.case_ids)
        counts = rng.multinomial(n, rng.dirichlet(np.full(n, 0.5)), size=30)
        counts[0], counts[1] = 0, np.eye(n, dtype=int)[0]  # nothing drawn; one case only
        expected = [scorer.score(rng.permutation(np.repeat(np.arange(n), row))) for row in counts]
        assert np.array_equal(scorer.counted(counts), expected, equal_nan=True)
        assert np.isnan(expected[0])


def test_every_replicate_scored_at_once_gives_the_estimate_of_scoring_them_one_by_one():
    """45 random selections (1-4 configurations of 1-3 seeds, 10-30 patients, stage AUC or accuracy with ties or VQA,
    either direction, 20-60 resamples, 80 or 90 % intervals): the counted path and the one-replicate-at-a-time path
    of the same scorers give the same estimate to the last bit, or the same refusal; so does, every third case, a
    bare scores callable (every configuration rescored on every out-of-bag set, as before only the chosen one was)."""
    from gx_ray.analysis.selection import ConfigurationScores

    rng = np.random.default_rng(9)
    estimated = 0
    for case in range(45):
        kind, n = str(rng.choice(["auc", "accuracy", "vqa"])), int(rng.integers(10, 30))
        configs = [[random_scorer(rng, kind, n) for _ in range(rng.integers(1, 4))] for _ in range(rng.integers(1, 5))]
        fast = scores_from_scorers(configs)
        assert fast.counted(0, np.ones((1, len(fast.case_ids)))) is not None  # the counted path is the one taken
        one_by_one = ConfigurationScores(fast.case_ids, fast.configurations)
        options = {
            "n_resamples": int(rng.integers(20, 60)),
            "seed": case,
            "higher_is_better": bool(rng.integers(2)),
            "confidence": float(rng.choice([0.8, 0.9])),
        }  # 95 % needs >= 40 replicates kept: too many here
        bare = [lambda indices: one_by_one(indices)] if case % 3 == 0 else []  # noqa: B023 - called in the loop
        results = []
        for scores in (fast, one_by_one, *bare):
            try:
                results.append(selection_corrected(scores, len(fast.case_ids), **options).to_dict())
            except ValueError as err:
                results.append(str(err))
        assert all(result == results[0] for result in results[1:]), case
        estimated += isinstance(results[0], dict)
    assert estimated >= 30  # most cases give an estimate, not the same refusal


def test_each_searched_tasks_winner_beside_its_corrected_estimate_from_hand_made_runs():
    """A search of ``optimiser.lr`` over two schemas (make_runs: 4 configurations x 2 seeds) whose validation
    predictions (60 patients) are informative for one configuration only: the report's row names it, its naive score
    is its seeds' mean AUC on those predictions, both it and the corrected estimate lie within the interval, and the
    uninformative configurations are told apart from it. A trial without predictions: the logged best is named and
    the note says why there is no estimate. A pure grid (nothing searched), or every validation score undefined: no
    row."""
    from gx_ray.analysis.selection import NO_VALIDATION_PREDICTIONS, task_winners
    from gx_ray.metrics.classification import classification_metrics
    from tests.common import make_runs

    runs = make_runs({"image_only": 0.0, "image_table": 0.0}, seeds=4, tasks=("stage_classification",),
                     searched={"optimiser.lr": [0.1, 0.001]})  # fmt: skip
    val = runs[(runs["split"] == "val") & (runs["metric"] == "auc")]
    rng = np.random.default_rng(10)
    labels = np.arange(60) % 4
    records = {}
    for run_id, schema, lr in val[["run_id", "schema", "optimiser.lr"]].itertuples(index=False):
        skill = 1.0 if (schema, lr) == ("image_table", 0.001) else 0.0
        logits = rng.normal(size=(60, 4)) + skill * np.eye(4)[labels]
        records[run_id] = stage_records(labels, np.exp(logits) / np.exp(logits).sum(1, keepdims=True))
    (winner,) = task_winners(runs, records.get, n_resamples=300).to_dict("records")
    assert (winner["task"], winner["metric"], winner["configurations"]) == ("stage_classification", "auc", 4)
    assert winner["best"] == "optimiser.lr=0.001, schema=image_table" and winner["note"] == ""
    best = val[(val["schema"] == "image_table") & (val["optimiser.lr"] == 0.001)]["run_id"]
    aucs = [classification_metrics(np.array([r["probabilities"] for r in records[run]]), labels)["auc"] for run in best]
    assert winner["naive"] == pytest.approx(np.mean(aucs))
    assert winner["low"] <= winner["corrected"] <= winner["high"] and winner["low"] < winner["naive"] < winner["high"]
    assert (winner["method"], winner["patients"], winner["indistinguishable"]) == ("select-then-score", 60, 1)
    assert winner["indistinguishable_configurations"] == winner["best"]

    silent = {**records, best.iloc[0]: None}  # one trial logged no validation predictions (an older run)
    (winner,) = task_winners(runs, silent.get, n_resamples=300).to_dict("records")
    assert winner["note"] == NO_VALIDATION_PREDICTIONS and np.isnan(winner["corrected"])
    logged = val.groupby(["schema", "optimiser.lr"])["value"].mean()
    schema, lr = logged.idxmax()
    assert winner["best"] == f"optimiser.lr={lr}, schema={schema}" and winner["naive"] == pytest.approx(logged.max())
    assert task_winners(make_runs(seeds=2, tasks=("stage_classification",)), records.get).empty
    undefined = runs.assign(value=np.where(runs["split"] == "val", np.nan, runs["value"]))  # every AUC undefined
    undefined.attrs = runs.attrs
    assert task_winners(undefined, records.get).empty
