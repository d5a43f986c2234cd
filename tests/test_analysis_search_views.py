"""Search views: the Optuna study built from a runs table, best so far, parameter importance and the files."""

from __future__ import annotations

import logging
import warnings
import xml.etree.ElementTree as ET

import matplotlib
import numpy as np
import pandas as pd
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.study import StudyDirection

from gx_ray.analysis import search_views
from tests.common import make_runs

LRS = [1e-5, 1e-4, 1e-3, 1e-2]
FUSIONS = ["concat", "cross_attention", "film"]
TASK = "stage_classification"  # 4 schemas x 3 seeds: 12 trials, each (lr, fusion) pair once


def _searched(tasks: tuple[str, ...] = (TASK,), **extra: list) -> pd.DataFrame:
    return make_runs(tasks=tasks, searched={"optimiser.lr": LRS, "model.fusion": FUSIONS, **extra})


def _planted(param: str) -> pd.DataFrame:
    """Validation values that depend on ``param`` alone (plus tiny noise)."""
    runs = _searched()
    val = runs["split"] == "val"
    if param == "optimiser.lr":
        effect = -((np.log10(runs.loc[val, param].astype(float)) + 3.5) ** 2)
    else:
        effect = runs.loc[val, param].map({"concat": 0.0, "cross_attention": 3.0, "film": 1.0})
    runs.loc[val, "value"] = effect + np.random.default_rng(0).normal(0, 1e-3, val.sum())
    return runs


def test_study_has_the_finished_trials_in_start_order_with_inferred_distributions() -> None:
    runs = _searched()
    nan_trial, killed_trial = "trial-003", "trial-007"
    runs.loc[(runs["trial"] == nan_trial) & (runs["split"] == "val") & (runs["metric"] == "auc"), "value"] = np.nan
    runs.loc[runs["trial"] == killed_trial, "status"] = "KILLED"
    shuffled = runs.sample(frac=1.0, random_state=0)
    shuffled.attrs = runs.attrs

    study = search_views.study_from_runs(shuffled, TASK)  # default metric: the headline (auc) on val

    assert study.direction == StudyDirection.MAXIMIZE
    names = [t.user_attrs["trial"] for t in study.trials]
    expected = [f"trial-{i:03d}" for i in range(1, 13) if f"trial-{i:03d}" not in (nan_trial, killed_trial)]
    assert names == expected
    val_auc = runs[(runs["split"] == "val") & (runs["metric"] == "auc")].set_index("trial")["value"]
    assert [t.value for t in study.trials] == pytest.approx(val_auc[expected].tolist())
    lr, fusion = study.trials[0].distributions["optimiser.lr"], study.trials[0].distributions["model.fusion"]
    assert lr == FloatDistribution(1e-5, 1e-2, log=True)
    assert isinstance(fusion, CategoricalDistribution) and set(fusion.choices) == set(FUSIONS)
    assert study.trials[0].params["model.fusion"] in FUSIONS


def test_distributions_for_ints_bools_lists_and_narrow_floats() -> None:
    runs = _searched(
        **{
            "model.hidden": [128, 256],
            "schema.endoscopy": [False, True],
            "model.vision_kwargs.block_inplanes": [[8, 16], [16, 32]],
            "schedule.warmup_fraction": [0.05, 0.1, 0.2],
        }
    )
    dists = search_views.study_from_runs(runs, TASK, "auc").trials[0].distributions
    assert dists["model.hidden"] == IntDistribution(128, 256)
    assert dists["schema.endoscopy"] == CategoricalDistribution([False, True])
    assert set(dists["model.vision_kwargs.block_inplanes"].choices) == {"[8, 16]", "[16, 32]"}
    assert dists["schedule.warmup_fraction"] == FloatDistribution(0.05, 0.2, log=False)


@pytest.mark.parametrize(
    ("task", "metric", "direction"),
    [(TASK, "auc", StudyDirection.MAXIMIZE), ("retrieval", "image_to_text_median_rank", StudyDirection.MINIMIZE)],
)
def test_best_so_far_is_monotone_in_the_metrics_direction(task: str, metric: str, direction: StudyDirection) -> None:
    study = search_views.study_from_runs(_searched(tasks=(task,)), task, metric)
    values, best = np.array([t.value for t in study.trials]), search_views.best_so_far(study)

    assert study.direction == direction
    improving = best if direction == StudyDirection.MAXIMIZE else -best
    assert np.all(np.diff(improving) >= 0) and np.any(np.diff(improving) > 0)
    assert best[0] == values[0] and best[-1] == study.best_value
    pick = max if direction == StudyDirection.MAXIMIZE else min
    assert best.tolist() == [pick(values[: i + 1]) for i in range(len(values))]


@pytest.mark.parametrize(
    ("planted", "irrelevant"), [("optimiser.lr", "model.fusion"), ("model.fusion", "optimiser.lr")]
)
def test_importance_finds_the_planted_parameter(planted: str, irrelevant: str) -> None:
    shares = search_views.importance(_planted(planted), TASK, "auc")

    assert set(shares) == {planted, irrelevant}
    assert shares[planted] > 2 * shares[irrelevant]
    assert sum(shares.values()) == pytest.approx(1.0)


def test_importance_is_empty_with_one_varying_parameter_or_too_few_trials(caplog: pytest.LogCaptureFixture) -> None:
    one_param = make_runs(tasks=(TASK,), searched={"optimiser.lr": LRS, "model.fusion": ["concat"]})
    three_trials = make_runs(tasks=(TASK,), effects={"image_only": 0.0}, searched={"optimiser.lr": LRS, "x": [1, 2]})
    with caplog.at_level(logging.INFO, logger=search_views.__name__):
        assert search_views.importance(one_param, TASK, "auc") == {}
        assert search_views.importance(three_trials, TASK, "auc") == {}
    assert "1 varying searched parameters" in caplog.text and "and 3 trials" in caplog.text


def test_importance_is_empty_where_tied_scores_make_every_trial_a_best_one(caplog: pytest.LogCaptureFixture) -> None:
    """Every trial scoring the same (a smoke sweep's VQA at 0): PED-ANOVA's best quantile is every trial, so it warns
    and calls every parameter equally important. No figure of equal shares, no warning: the reason, logged."""
    tied = _searched()
    tied.loc[tied["split"] == "val", "value"] = 0.0
    with caplog.at_level(logging.INFO, logger=search_views.__name__), warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna's warning would fail here
        assert search_views.importance(tied, TASK, "auc") == {}
    assert "tied scores" in caplog.text
    assert search_views.importance(_planted("model.fusion"), TASK, "auc")  # varying scores still have shares


def test_write_search_views_writes_valid_png_and_svg_per_searched_task(tmp_path) -> None:
    style_before = matplotlib.rcParams["axes.facecolor"]
    metrics = {TASK: "auc", "retrieval": "image_to_text_median_rank"}  # a minimised one too
    paths = search_views.write_search_views(_searched(tasks=(TASK, "retrieval")), tmp_path, metrics)

    stems = {"search_best_so_far"} | {
        f"search_{v}_{t}" for v in ("importance", "parallel") for t in (TASK, "retrieval")
    }
    assert {p.name for p in paths} == {f"{s}.{ext}" for s in stems for ext in ("png", "svg")}
    for path in paths:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert ET.parse(path).getroot().tag.endswith("svg")
    # optuna's importance plot calls plt.style.use("ggplot"); that must not restyle later figures
    assert matplotlib.rcParams["axes.facecolor"] == style_before


@pytest.mark.parametrize("searched", [None, {"optimiser.lr": [1e-4]}], ids=["grid", "constant"])
def test_a_grid_without_a_search_writes_no_views(tmp_path, searched: dict | None) -> None:
    runs = make_runs(searched=searched)  # every task x schema x seed
    assert search_views.searched_tasks(runs) == []
    assert search_views.write_search_views(runs, tmp_path / "views") == []
    assert not (tmp_path / "views").exists()


def test_plots_from_the_runs_table(tmp_path) -> None:
    runs = _planted("optimiser.lr")
    paths = [
        *search_views.best_so_far_plot(runs, tmp_path / "best", {TASK: "auc"}),
        *search_views.importance_plot(runs, TASK, tmp_path / "importance", "auc"),
        *search_views.parallel_coordinates_plot(runs, TASK, tmp_path / "parallel", "auc"),
    ]
    assert sorted(p.name for p in paths) == [
        f"{s}.{e}" for s in ("best", "importance", "parallel") for e in ("png", "svg")
    ]
    assert all(p.stat().st_size > 1000 for p in paths)
