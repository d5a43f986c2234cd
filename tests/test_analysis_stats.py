"""Statistics across seeds and paired significance between schemas (gx_ray.analysis.stats)."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

from gx_ray.analysis import stats
from gx_ray.analysis.stats import (
    cell_statistics,
    family_resamples,
    holm,
    paired_bootstrap,
    seed_comparisons,
    seed_summary,
    significance_table,
    wilcoxon_over_seeds,
)
from tests.common import TASK_METRICS, make_runs


def accuracy(correct: np.ndarray):
    """A seed's score: percent correct on the resampled cases."""
    return lambda idx: 100.0 * correct[idx].mean()


# seed_summary


def test_seed_summary_known_values():
    s = seed_summary([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s["mean"] == 3.0 and s["n"] == 5
    assert s["sd"] == pytest.approx(np.sqrt(2.5))
    half = 2.776445105 * np.sqrt(2.5) / np.sqrt(5)  # t(0.975, 4 dof) x SD / sqrt(n), from a printed t table
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((3.0 - half, 3.0 + half))


def test_seed_summary_interval_covers_the_mean_at_its_level_with_few_seeds():
    """Over many cells of n normal seeds the 95 % interval holds the true mean about 95 % of the time; the percentile
    bootstrap it replaced held it 75 % of the time at n = 3 (its interval is then the seeds' min and max)."""
    rng = np.random.default_rng(7)
    for n in (3, 5, 10):
        draws = rng.normal(60.0, 4.0, size=(3000, n))
        summaries = [seed_summary(row) for row in draws]
        covered = np.mean([s["ci_low"] <= 60.0 <= s["ci_high"] for s in summaries])
        assert 0.935 <= covered <= 0.965, (n, covered)
    three = rng.normal(60.0, 4.0, size=(3000, 3))
    assert np.mean((three.min(axis=1) <= 60.0) & (three.max(axis=1) >= 60.0)) < 0.8  # what min-max would hold


def test_seed_summary_ci_narrows_with_noise():
    z = np.random.default_rng(1).normal(size=5)
    wide, narrow = seed_summary(10 + 1.0 * z), seed_summary(10 + 0.1 * z)
    for s in (wide, narrow):
        assert s["ci_low"] < s["mean"] < s["ci_high"]
    assert narrow["ci_high"] - narrow["ci_low"] < 0.2 * (wide["ci_high"] - wide["ci_low"])


def test_seed_summary_nan_dropped_and_small_n():
    s = seed_summary([1.0, np.nan, 3.0])
    assert s["n"] == 2 and s["mean"] == 2.0 and s["sd"] == pytest.approx(np.sqrt(2))
    one = seed_summary([7.0, np.nan])
    assert one["n"] == 1 and one["mean"] == 7.0
    assert np.isnan(one["sd"]) and np.isnan(one["ci_low"]) and np.isnan(one["ci_high"])
    none = seed_summary([np.nan])
    assert none["n"] == 0 and np.isnan(none["mean"])


def test_seed_summary_all_equal_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = seed_summary([5.0, 5.0, 5.0])
    assert (s["mean"], s["sd"], s["ci_low"], s["ci_high"]) == (5.0, 0.0, 5.0, 5.0)


# cell_statistics


def test_cell_statistics_one_row_per_cell_ordered_as_effects():
    effects = {"image_only": 0.0, "image_table": 2.0, "image_bbox": 4.0, "image_table_bbox": 6.0}
    runs = make_runs(effects, seeds=5, noise=0.1)
    cells = cell_statistics(runs)
    assert len(cells) == len(effects) * sum(len(m) for m in TASK_METRICS.values())
    assert not cells.duplicated(["task", "model", "fusion", "schema", "metric"]).any()
    assert (cells["n"] == 5).all()
    for (task, metric), cell in cells.groupby(["task", "metric"]):
        means = cell.set_index("schema")["mean"][list(effects)].to_numpy()
        rank = metric.endswith("median_rank")
        assert (np.diff(means) < 0).all() if rank else (np.diff(means) > 0).all(), (task, metric)
        assert (cell["higher_is_better"] == (not rank)).all()
    # the test split, not val (val = test + 1)
    one = runs[(runs.split == "test") & (runs.task == "vqa") & (runs.schema == "image_bbox") & (runs.metric == "f1")]
    row = cells[(cells.task == "vqa") & (cells.schema == "image_bbox") & (cells.metric == "f1")].iloc[0]
    assert row["mean"] == pytest.approx(one["value"].mean())
    assert row["ci_low"] <= row["mean"] <= row["ci_high"]


# paired_bootstrap


def test_paired_bootstrap_known_difference():
    rng = np.random.default_rng(0)
    n, seeds = 200, 3
    a = [accuracy(rng.random(n) < 0.8) for _ in range(seeds)]
    b = [accuracy(rng.random(n) < 0.5) for _ in range(seeds)]
    r = paired_bootstrap(a, b, n_cases=n)
    assert r["p_value"] < 0.01
    assert 0 < r["ci_low"] < 30.0 < r["ci_high"]
    assert r["ci_low"] < r["diff"] < r["ci_high"]
    assert (r["n_seeds"], r["n_cases"], r["n_resamples"], r["dropped"]) == (3, 200, 2000, 0)
    assert r["method"] == "paired bootstrap over patients"


def test_paired_bootstrap_calibrated_under_no_difference():
    n, seeds, false_positives = 200, 3, 0
    for rep in range(20):
        rng = np.random.default_rng(100 + rep)
        a = [accuracy(rng.random(n) < 0.7) for _ in range(seeds)]
        b = [accuracy(rng.random(n) < 0.7) for _ in range(seeds)]
        false_positives += paired_bootstrap(a, b, n_cases=n, n_resamples=500, seed=rep)["p_value"] < 0.05
    assert false_positives <= 2


def test_paired_bootstrap_same_indices_for_both_arms_and_all_seeds():
    rng = np.random.default_rng(0)
    n, seeds = 60, 3
    data = [rng.random(n) < 0.6 for _ in range(seeds)]
    calls: dict[tuple[str, int], list[np.ndarray]] = {}

    def recording(arm: str, s: int):
        def score(idx: np.ndarray) -> float:
            calls.setdefault((arm, s), []).append(idx.copy())
            return 100.0 * data[s][idx].mean()

        return score

    # identical data through separate callables: any difference would come from different resamples
    a = [recording("a", s) for s in range(seeds)]
    b = [recording("b", s) for s in range(seeds)]
    r = paired_bootstrap(a, b, n_cases=n, n_resamples=300)
    assert (r["diff"], r["ci_low"], r["ci_high"], r["p_value"]) == (0.0, 0.0, 0.0, 1.0)
    reference = calls[("a", 0)]
    assert len(reference) == 301 and np.array_equal(reference[0], np.arange(n))
    assert any(len(np.unique(idx)) < n for idx in reference[1:])  # resampled with replacement
    for key, seen in calls.items():
        assert all(np.array_equal(x, y) for x, y in zip(seen, reference, strict=True)), key


def test_paired_bootstrap_drops_nan_replicates():
    rng = np.random.default_rng(0)
    n = 30
    labels = np.zeros(n, bool)
    labels[:2] = True  # two positives: a resample often has none, where an AUC-like score is undefined
    seen = []

    def auc_like(correct: np.ndarray, record: bool = False):
        def score(idx: np.ndarray) -> float:
            if record:
                seen.append(idx.copy())
            return float("nan") if not labels[idx].any() else 100.0 * correct[idx].mean()

        return score

    a = [auc_like(rng.random(n) < 0.8, record=True)]
    b = [auc_like(rng.random(n) < 0.5)]
    r = paired_bootstrap(a, b, n_cases=n, n_resamples=400)
    undefined = sum(not labels[idx].any() for idx in seen[1:])
    assert undefined > 0 and r["dropped"] == undefined
    assert r["n_resamples"] == 400 - undefined
    assert np.isfinite([r["diff"], r["ci_low"], r["ci_high"], r["p_value"]]).all()


def test_paired_bootstrap_needs_same_seeds():
    with pytest.raises(ValueError):
        paired_bootstrap([accuracy(np.ones(5, bool))], [], n_cases=5)


# wilcoxon_over_seeds


def test_wilcoxon_known_difference_and_identical():
    rng = np.random.default_rng(0)
    b = rng.normal(50, 1, size=10)
    a = b + 2 + rng.normal(0, 0.1, size=10)
    r = wilcoxon_over_seeds(a, b)
    assert r["p_value"] < 0.01 and r["n_seeds"] == 10
    assert r["diff"] == pytest.approx(np.mean(a - b))
    assert r["method"] == "Wilcoxon signed-rank over seeds"
    same = wilcoxon_over_seeds(b, b)
    assert same["p_value"] == 1.0 and same["diff"] == 0.0


def test_wilcoxon_cannot_reach_005_with_five_seeds():
    assert wilcoxon_over_seeds([10.0] * 5, [0.0] * 5)["p_value"] == pytest.approx(0.0625)
    r = wilcoxon_over_seeds([3.0, np.nan, 5.0, 6.0], [1.0, 1.0, np.nan, 1.0])
    assert r["n_seeds"] == 2 and r["diff"] == 3.5


def test_family_resamples_keep_significance_within_reach_of_any_family():
    rng = np.random.default_rng(3)
    for m, alpha in zip(rng.integers(0, 2000, 300), rng.choice([0.01, 0.05, 0.1], 300), strict=True):
        b = family_resamples(int(m), 1000, float(alpha))
        floor = 2 / (b + 1)  # the smallest two-sided p of paired_bootstrap: no replicate on the far side
        assert b >= 1000 and m * floor <= alpha / 2 + 1e-12
        assert b == 1000 or m * 2 / b > alpha / 2  # and no more replicates than that takes
    with pytest.raises(ValueError):
        family_resamples(-1)


def test_a_large_family_of_clear_differences_is_found_significant():
    """30 comparisons where arm A answers every case right and arm B every case wrong: at a fixed 1,000 replicates
    each p sits at the floor 2/1001, Holm makes it 30 x that = 0.06, and none is significant; with the family's
    replicates all are."""
    n, m = 30, 30
    a, b = [accuracy(np.ones(n, bool))], [accuracy(np.zeros(n, bool))]
    cell = {"task": "vqa", "metric": "accuracy", "schema_b": "image_only"}

    def family(resamples: int) -> pd.DataFrame:
        rows = [{**cell, "schema_a": f"s{i}", **paired_bootstrap(a, b, n, resamples, seed=i)} for i in range(m)]
        return significance_table(rows)

    assert not family(1000)["significant"].any()
    table = family(family_resamples(m))
    assert table["significant"].all() and (table["better"] == table["schema_a"]).all()
    assert (table["p_holm"] <= 0.025 + 1e-12).all()


# holm


def test_holm_hand_worked():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.06
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])


def test_holm_nan_not_counted_and_capped():
    np.testing.assert_allclose(holm([0.01, np.nan, 0.04]), [0.02, np.nan, 0.04])
    np.testing.assert_allclose(holm([0.5, 0.6]), [1.0, 1.0])
    assert holm([]).shape == (0,)


def test_holm_monotone():
    p = np.random.default_rng(0).random(30) ** 3
    adjusted = holm(p)
    order = np.argsort(p)
    assert (np.diff(adjusted[order]) >= 0).all()
    assert (adjusted >= p).all() and (adjusted <= 1).all()


# significance_table


def _comparison(task: str, metric: str, schema_a: str, diff: float, p_value: float) -> dict:
    return {"task": task, "metric": metric, "schema_a": schema_a, "schema_b": "image_only", "diff": diff,
            "p_value": p_value}  # fmt: skip


def test_significance_table_direction_and_holm():
    rank, recall = "image_to_text_median_rank", "image_to_text_recall_at_5"
    comparisons = [
        _comparison("retrieval", rank, "image_table", -3.0, 0.001),
        _comparison("retrieval", rank, "image_bbox", 3.0, 0.002),
        _comparison("retrieval", recall, "image_bbox", 3.0, 0.003),
        _comparison("retrieval", recall, "image_table", -3.0, 0.004),
        _comparison("vqa", "accuracy", "image_table", 5.0, 0.02),
        _comparison("retrieval", rank, "image_table_bbox", -5.0, float("nan")),
    ]
    t = significance_table(comparisons)
    assert list(t["task"]) == ["retrieval"] * 5 + ["vqa"]
    assert list(t["p_value"][:4]) == [0.001, 0.002, 0.003, 0.004]
    # Holm over the five non-NaN comparisons of both tasks: 0.005, 0.008, 0.009, 0.009, 0.02
    np.testing.assert_allclose(t["p_holm"], [0.005, 0.008, 0.009, 0.009, np.nan, 0.02])
    assert list(t["significant"]) == [True, True, True, True, False, True]
    # lower rank wins: image_table's -3 beats image_only, image_bbox's +3 loses to it; recall: higher wins
    assert list(t["better"]) == ["image_table", "image_only", "image_bbox", "image_only", "", "image_table"]
    assert significance_table(comparisons, alpha=0.001)["better"].eq("").all()
    assert significance_table([]).empty


def test_significance_table_vqa_beyond_alpha_after_holm():
    comparisons = [
        {"task": "vqa", "metric": "accuracy", "schema_a": f"s{i}", "schema_b": "image_only", "diff": 1.0}
        | {"p_value": 0.02}
        for i in range(3)
    ]
    t = significance_table(comparisons)
    np.testing.assert_allclose(t["p_holm"], [0.06] * 3)
    assert not t["significant"].any() and t["better"].eq("").all()


def test_a_declared_primary_family_is_holm_corrected_alone_and_the_rest_as_an_exploratory_family():
    """15 comparisons (3 schemas x 5 tasks): image_table's 0.008 is significant in its declared family of 5 (x 5 =
    0.04) but not in one family of 15 (behind 0.004: max(0.06, 0.112)); the exploratory family of the other 10 is
    corrected alone (0.004 x 10 = 0.04, not 0.06). Undeclared, the rows are one family as before."""
    schemas, tasks = ["image_table", "image_bbox", "image_table_bbox"], ["t0", "t1", "t2", "t3", "t4"]
    p = {"image_table": [0.008, 0.2, 0.3, 0.4, 0.5], "image_bbox": [0.004, 0.6, 0.7, 0.8, 0.9]}
    p["image_table_bbox"] = [0.25, 0.35, 0.45, 0.55, 0.65]
    rows = [_comparison(t, "accuracy", s, 1.0, p[s][i]) for s in schemas for i, t in enumerate(tasks)]
    labels, sizes = stats.families([r["schema_a"] for r in rows], ["image_table"])
    assert sizes == [5] * 5 + [10] * 10 and labels == ["primary"] * 5 + ["exploratory"] * 10
    declared = significance_table([r | {"family": f} for r, f in zip(rows, labels, strict=True)])
    one = significance_table(rows)
    key = ["task", "schema_a"]
    declared, one = declared.sort_values(key, ignore_index=True), one.sort_values(key, ignore_index=True)
    primary, exploratory = declared["family"] == "primary", declared["family"] == "exploratory"
    np.testing.assert_allclose(declared.loc[primary, "p_holm"], holm(declared.loc[primary, "p_value"]))
    np.testing.assert_allclose(declared.loc[exploratory, "p_holm"], holm(declared.loc[exploratory, "p_value"]))
    significant = set((declared["schema_a"] + "/" + declared["task"])[declared["significant"]])
    assert significant == {"image_table/t0", "image_bbox/t0"} and not one["significant"].any()
    np.testing.assert_allclose(one["p_holm"], holm(one["p_value"]))
    labels, sizes = stats.families([r["schema_a"] for r in rows], None)  # undeclared: one family, as before
    assert set(labels) == {"all"} and sizes == [15] * 15
    undeclared = significance_table([r | {"family": f} for r, f in zip(rows, labels, strict=True)])
    pd.testing.assert_frame_equal(undeclared.drop(columns="family"), significance_table(rows))


# seed_comparisons


def test_seed_comparisons_on_fixture():
    runs = make_runs({"image_only": 0.0, "image_table_bbox": 5.0}, seeds=10, noise=0.5, tasks=("retrieval",))
    comparisons = seed_comparisons(runs)
    assert {(c["metric"], c["schema_a"], c["schema_b"]) for c in comparisons} == {
        (m, "image_table_bbox", "image_only") for m in TASK_METRICS["retrieval"]
    }
    assert all(c["n_seeds"] == 10 and c["p_value"] < 0.01 for c in comparisons)
    t = significance_table(comparisons)
    assert t["significant"].all() and (t["better"] == "image_table_bbox").all()
    rank = t[t.metric == "image_to_text_median_rank"].iloc[0]
    assert rank["diff"] == pytest.approx(-5.0, abs=1.0)


def test_seed_comparisons_headline_only(monkeypatch):
    monkeypatch.setattr(stats, "headline_metric", lambda task: "image_to_text_recall_at_5")
    runs = make_runs(seeds=3, tasks=("retrieval",))
    comparisons = seed_comparisons(runs, headline_only=True)
    assert len(comparisons) == 3
    assert {c["metric"] for c in comparisons} == {"image_to_text_recall_at_5"}
    assert {c["schema_a"] for c in comparisons} == {"image_table", "image_bbox", "image_table_bbox"}
    assert seed_comparisons(runs, baseline="missing") == []


def test_bootstrap_jobs_spread_over_processes_equal_one_process():
    """The report's bootstraps run in joblib's processes when they are long, in its own process when short: either way
    each gives what it gives alone, in order; a comparison without predictions stays None; a cross-validated seed's
    fold models count as one unit (their mean)."""
    from gx_ray.analysis.cases import BootstrapJob, CaseScorer, bootstrap_job, bootstrap_jobs

    rng = np.random.default_rng(0)
    cases = [f"case-{i}" for i in range(30)]

    def arm(shift: float) -> CaseScorer:
        values = rng.normal(shift, 1.0, len(cases))
        return CaseScorer(cases, lambda indices, v=values: float(v[indices].mean()))

    jobs = [
        BootstrapJob([[arm(shift) for _ in range(4)], [arm(0.0) for _ in range(4)]], margin=0.5)
        for shift in (0.0, 0.5, 1.5)
    ]
    jobs.append(BootstrapJob([[arm(1.0), None], [arm(0.0), arm(0.0)]]))
    jobs.append(
        BootstrapJob([[[arm(1.0), arm(1.0)], [arm(1.0), arm(1.0)]], [[arm(0.0), arm(0.0)], [arm(0.0), arm(0.0)]]])
    )
    jobs.append(BootstrapJob([[arm(0.3), arm(0.3), arm(0.3)]]))  # a cell: one arm
    alone = [bootstrap_job(job, 300) for job in jobs]
    spread = bootstrap_jobs(jobs, 300, process_start_s=0.0)  # processes, however short the comparisons
    assert spread == alone == bootstrap_jobs(jobs, 300, process_start_s=1e9)  # and all in this one
    assert spread[3] is None
    assert spread[2]["diff"] > spread[1]["diff"] > spread[0]["diff"] - 0.5 and spread[2]["p_value"] < 0.01
    assert spread[2]["method"] == "two-level bootstrap: patients × seeds" and spread[2]["mde"] > 0
    assert spread[0]["equivalence"] != "no difference" and spread[3 + 1]["equivalence"] == "equivalence not tested"
    assert spread[4]["diff"] > 0.5 and spread[4]["n_seeds"] == 2  # two seeds of two fold models each
    assert "diff" not in spread[5] and spread[5]["ci_low"] < 0.3 < spread[5]["ci_high"]


def test_a_cross_validated_seeds_fold_models_are_listed_in_fold_order_whatever_order_the_runs_come_in():
    """Fold k must be the k-th run of every seed's list, in every schema: the planner pairs folds by their place."""
    rng = np.random.default_rng(0)
    rows = [{"seed": seed, "fold": fold, "value": 10.0 * seed + fold, "run_id": f"s{seed}f{fold}"}
            for seed in range(3) for fold in range(5)]  # fmt: skip
    frame = pd.DataFrame(rows).iloc[rng.permutation(len(rows))]
    seeds = stats.per_seed(frame)
    assert list(seeds.index) == [0, 1, 2]
    for seed, row in seeds.iterrows():
        assert row["run_id"] == [f"s{seed}f{fold}" for fold in range(5)]
        assert row["value"] == pytest.approx(10.0 * seed + 2.0)
