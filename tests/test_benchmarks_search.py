"""The search benchmark's logic alone (``benchmarks/search.py``; its sweeps run from the command line): the truth set
is new patients of the demo's own generator, and each search's figures follow from its reports and true scores."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import yaml

from benchmarks.search import (
    SearchBenchmarkConfig,
    covers,
    format_search_result,
    method_space,
    targets,
    timeline,
    to_target,
    truth_demo,
)
from gx_ray.data.demo.cohort import DemoConfig, case_findings
from gx_ray.sweep.driver import SweepOptions


def patient(config: DemoConfig, index: int) -> str:
    """Who case ``index`` is: everything drawn for it but its id."""
    return json.dumps({**dataclasses.asdict(case_findings(config, index)), "case_id": None}, default=str)


def test_the_truth_set_is_new_patients_of_the_same_generator_drawn_alike_every_time():
    cohort = DemoConfig(cases=SweepOptions.demo_cases)  # the sweeps' demo cohort: its three splits
    truth = truth_demo(400)
    assert dataclasses.replace(truth, seed=cohort.seed, cases=cohort.cases) == cohort  # the generator's settings
    searched = {patient(cohort, i) for i in range(cohort.cases)}
    drawn = [patient(truth, i) for i in range(truth.cases)]
    assert len(set(drawn)) == truth.cases and not searched & set(drawn)
    assert drawn[:50] == [patient(truth_demo(50), i) for i in range(50)]  # a smaller truth set is its first patients


def test_a_searchs_leader_is_the_best_configuration_so_far_its_folds_averaged_and_reaches_the_target_by_its_truth():
    # config a's two folds, b one run, c never finished (no true score); costs are each run's so far
    reports = [
        {"config": "a", "run": "a0", "step": 0, "at": 1, "val": 80.0, "cost": 10.0},
        {"config": "b", "run": "b0", "step": 0, "at": 2, "val": 75.0, "cost": 20.0},
        {"config": "a", "run": "a1", "step": 0, "at": 3, "val": 60.0, "cost": 30.0},  # a's mean falls to 70
        {"config": "a", "run": "a0", "step": 1, "at": 4, "val": 70.0, "cost": 15.0},  # a0's cost grows, not adds
        {"config": "c", "run": "c0", "step": 0, "at": 5, "val": 90.0, "cost": 5.0},
    ]
    truth = {"a": 70.0, "b": 77.0}
    line = timeline(list(reversed(reports)), truth)  # wall-clock order, whatever the input's
    assert [(round(h * 3600), e, v) for h, e, v, _ in line] == [(10, 1, 80), (30, 2, 80), (60, 3, 75), (65, 4, 75),
                                                                 (70, 5, 90)]  # fmt: skip
    assert [t for *_, t in line][:4] == [70, 70, 77, 77] and math.isnan(line[-1][3])
    assert to_target(line, 76.0) == (pytest.approx(60 / 3600), 3.0)
    assert all(math.isnan(x) for x in to_target(line, 78.0))
    lower = timeline(reports, truth, higher=False)  # a loss: the lowest leads, and the target is reached from above
    assert [(v, t) for _, _, v, t in lower] == [(80, 70), (75, 77), (70, 70), (70, 70), (70, 70)]
    assert to_target(lower, 75.0, higher=False) == (pytest.approx(10 / 3600), 1.0)
    assert to_target(lower[1:], 75.0, higher=False) == (pytest.approx(60 / 3600), 3.0)


def search(hours: float, reached_at: float, best_truth: float, covered: bool | None = True) -> dict:
    """A search's figures as ``evaluate_sweep`` gives them: its leader's truth is ``best_truth`` from ``reached_at``."""
    line = [(reached_at / 2, 1, 70.0, 70.0), (reached_at, 2, 75.0, best_truth), (hours, 3, 75.0, best_truth)]
    return {"runs": 3, "epochs": 3, "hours": hours, "higher_is_better": True, "best_truth": best_truth,
            "truth": best_truth, "naive": 75.0, "corrected": 71.0, "low": 60.0, "high": 80.0, "covers": covered,
            "wall_seconds": 1.0, "timeline": line}  # fmt: skip


def test_the_target_is_half_the_grids_hours_of_the_same_objective_and_every_interval_must_cover():
    methods = {
        "grid": search(1.0, 0.9, 81.5),
        "asha_tpe": search(0.6, 0.4, 81.5),  # within half the grid's 1.0: met
        "pbt": search(0.6, 0.55, 81.5),  # reached, but past half: not met
        "grid+cv2": search(2.0, 1.5, 82.0),  # the best true score
        "asha_tpe+cv2": search(1.2, 0.9, 81.5),  # past half the single-split grid, within half its own grid
    }
    got = targets(methods, 0.01)
    assert got["best_truth"] == 82.0 and got["target_truth"] == pytest.approx(82.0 - 0.82)
    assert got["met_target"] == ["asha_tpe", "asha_tpe+cv2"] and got["all_covered"]
    assert methods["pbt"]["hours_to_target"] == 0.55 and methods["grid"]["epochs_to_target"] == 2.0
    methods["pbt"]["covers"] = False
    assert not targets(methods, 0.01)["all_covered"]
    assert targets({"grid": search(1.0, 0.9, 80.0)}, 0.01)["met_target"] == []  # the grid is not its own target
    config = dataclasses.asdict(SearchBenchmarkConfig(folds=2))
    text = format_search_result({"config": config, "methods": methods, **targets(methods, 0.01)})
    assert "met by asha_tpe, asha_tpe+cv2" in text and "covers its choice's true score: no" in text
    assert (covers(60.0, 80.0, 80.0), covers(60.0, 80.0, 80.5), covers(math.nan, 80.0, 70.0)) == (True, False, None)


def test_each_search_sweeps_the_space_with_its_own_searcher_objective_epochs_and_trials(tmp_path):
    config = SearchBenchmarkConfig(presets=("smoke",), lrs=2, epochs=3, samples=4)
    grid, extra = method_space(tmp_path, config, "grid", 3)
    document = yaml.safe_load(grid.read_text(encoding="utf-8"))
    assert extra == () and document["cv"] == {"folds": 3}
    assert (document["searcher"], document["scheduler"]) == ("grid", "none")
    assert len(document["grid"]["optimiser.lr"]) == 2 and document["budget"] == {"samples": 1}  # a grid's: every cell
    smoke = document["presets"]["smoke"]
    assert smoke["fixed"]["schedule.epochs"] == 3 and "budget" not in smoke
    path, extra = method_space(tmp_path, config, "pbt", 0)
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert extra == ("pbt",) and "cv" not in document and document["presets"]["pbt"]["budget"] == {"samples": 4}
    random = yaml.safe_load(method_space(tmp_path, config, "random", 0)[0].read_text(encoding="utf-8"))
    assert (random["searcher"], random["scheduler"], random["budget"]) == ("random", "none", {"samples": 4})
    with pytest.raises(ValueError, match="unknown search"):
        method_space(tmp_path, config, "hyperband", 0)
