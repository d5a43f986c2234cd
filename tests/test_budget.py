"""Device budgets and the ledger (gx_ray/sweep/budget.py, gx_ray/train/ledger.py) on a real local Ray runtime and
MLflow server, with CPU-hours so that no GPU is needed: the forecast from its pilot and a real run's ledger, a
multi-objective search's Pareto front in the report, and the hard stop, its resume with the same budget (nothing
starts) and with a larger one (every trial finishes, nothing counted twice or lost)."""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.analysis.pareto import pareto_front
from gx_ray.sweep.budget import BUDGET_FILE, Budget, BudgetError, read_ledger, sweep_budget
from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.sweep.spaces import load_space
from gx_ray.sweep.study import JOURNAL_FILE, optuna_storage
from gx_ray.train.ledger import Ledger
from tests.common import small_stage_space


@pytest.fixture(scope="module")
def pilots(tmp_path_factory):
    """One pilot cache for this file's sweeps (the same setting, pilot once), none kept from before."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(folder))
        yield folder


def _epochs_logged(client: MlflowClient, run_id: str, metric: str = "val_primary") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, metric))


def test_a_budget_is_checked_before_ray_starts_and_kept_for_resume(tmp_path):
    space = load_space(str(small_stage_space(tmp_path / "space.yaml", 1, [0], "budget")))

    def options(**given) -> SweepOptions:
        return SweepOptions(space=str(space.path), **given)

    with pytest.raises(BudgetError, match="--gpu-hours: the trials of space hold no GPU"):
        sweep_budget(options(gpu_hours=1.0), space, tmp_path)
    with pytest.raises(BudgetError, match="--cpu-hours -1.0: a positive number of hours"):
        sweep_budget(options(cpu_hours=-1.0), space, tmp_path)
    with pytest.raises(BudgetError, match="give one budget"):
        sweep_budget(options(cpu_hours=1.0, gpu_hours=1.0), space, tmp_path)
    assert sweep_budget(options(cpu_hours=0.5), space, tmp_path) == Budget("cpu_seconds", 0.5)
    assert json.loads((tmp_path / BUDGET_FILE).read_text()) == {"metric": "cpu_seconds", "hours": 0.5}
    assert sweep_budget(options(resume=True), space, tmp_path) == Budget("cpu_seconds", 0.5)  # the same budget
    assert sweep_budget(options(), space, tmp_path / "fresh") is None


def test_a_trials_cost_is_its_reservation_times_its_wall_seconds_going_on_from_its_earlier_attempts():
    reported = []

    def report(metrics: dict, checkpoint: object = None) -> None:
        reported.append((metrics, checkpoint))

    ledger = Ledger(gpus=0.25, cpus=2.0, spent={"gpu_seconds": 10.0, "cpu_seconds": 80.0}, started=time.time() - 4)
    with_costs = ledger.reporting(report)
    # (the Checkpoint class is the worker context's own, not read from this reporter: test_train_checkpoint.py)
    with_costs({"epoch": 3, "val_primary": 0.5}, checkpoint="saved")
    ((metrics, checkpoint),) = reported
    assert checkpoint == "saved" and metrics["val_primary"] == 0.5
    # the same wall seconds (at least the 4 s since this attempt started) times each reservation, on top of the spent
    wall = (metrics["cpu_seconds"] - 80.0) / 2.0
    assert wall >= 4 and metrics["gpu_seconds"] == pytest.approx(10.0 + 0.25 * wall)
    assert Ledger(gpus=0.0, cpus=1.0).costs()["gpu_seconds"] == 0.0  # a CPU trial spends no GPU-seconds


@pytest.mark.slow
def test_a_forecast_from_its_pilot_a_ledger_of_every_trial_and_a_multi_objective_searchs_pareto_front(
    ray_cluster, demo_prepared, tmp_path, pilots, mlflow_server
):
    path = small_stage_space(tmp_path / "space.yaml", 2, [0], "two objectives")
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    document["fixed"].pop("model.hidden")
    document.update(
        searcher="optuna", grid={}, budget={"samples": 3}, metric=["primary", "parameters"],
        sample={"optimiser.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2},
                "model.hidden": {"type": "categorical", "choices": [16, 64]}},
    )  # fmt: skip
    document["fixed"]["seed"] = 0
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    result = run_sweep(SweepOptions(space=str(path), output=tmp_path / "out", data=str(demo_prepared.shard_dir),
                                    cpu_hours=1.0, max_concurrent=1, mlflow_uri=mlflow_server.uri))  # fmt: skip
    assert (result.finished, result.failed) == (3, 0)
    output = tmp_path / "out" / result.sweep_id
    sweep = json.loads((output / "sweep.json").read_text(encoding="utf-8"))
    ledger = read_ledger(output)
    measured = [float(row["cpu_seconds"]) for row in ledger]
    assert [row["status"] for row in ledger] == ["FINISHED"] * 3 and all(m > 0 for m in measured)
    forecast = sweep["costs"]["budget"]["forecast_seconds"]
    assert forecast["trials_that_fit"] == 3 and not sweep["costs"]["budget"]["stopped"]
    # the forecast is the pilot's figures (kept in the cache) times what each trial trains: 2 epochs of 2 steps
    # (max_steps_per_epoch), the test once, on the 1 CPU it holds; only the first trial of the one trial process pays
    # its imports. How close it comes to the seconds spent is a timing, measured by `jobs/benchmark.py sweep
    # --cpu-hours` (docs/benchmarks.md), not asserted on a shared machine.
    kept = [json.loads(cache.read_text())["settings"] for cache in (pilots / "gx-ray" / "pilots").glob("*.json")]
    (pilot,) = [figures for settings in kept for figures in settings.values()]
    warm = pilot["setup_seconds"] + 2 * (2 * pilot["step_seconds"] + pilot["epoch_seconds"]) + pilot["test_seconds"]
    first, *others = forecast["per_trial"]
    assert others == [pytest.approx(warm, abs=0.06)] * 2 and warm > 0
    assert first == pytest.approx(warm + pilot["cold_seconds"], abs=0.06)
    assert forecast["total"] == pytest.approx(sum(forecast["per_trial"]), abs=0.2)
    client = MlflowClient(result.store_uri)
    parent = client.get_run(result.parent_run_id).data.metrics
    assert parent["cpu_seconds"] == pytest.approx(sum(measured), abs=0.01)
    for row in ledger:  # one CPU reserved: CPU-seconds are the trial's wall seconds, growing with every epoch
        run = client.search_runs([result.experiment_id], f"tags.`gx_ray.trial_id` = '{row['trial_id']}'")[0]
        history = sorted(client.get_metric_history(run.info.run_id, "cpu_seconds"), key=lambda m: m.step)
        assert [m.step for m in history] == [0, 1] and history[0].value < history[1].value
        assert history[-1].value == pytest.approx(float(row["cpu_seconds"]), abs=0.01)
        # the trial's own seconds, once (the last report comes after the run's end is logged: an MLflow call or two)
        assert history[-1].value < 1.5 * run.data.metrics["trial_seconds"]

    # the search minimised the parameter count: a study with those directions, and the report's front is the
    # brute-force non-dominated set of what the trials reported
    journal = output / "ray" / result.sweep_id / JOURNAL_FILE
    study = optuna.load_study(study_name=result.sweep_id, storage=optuna_storage(str(journal)))
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE, optuna.study.StudyDirection.MINIMIZE]
    front = list(csv.DictReader((output / "report" / "pareto" / "front.csv").open(encoding="utf-8")))
    points = np.array([[float(r["val_primary"]), float(r["parameters"])] for r in front])
    expected = {front[i]["trial"] for i in pareto_front(points, ["max", "min"])}
    assert {r["trial"] for r in front if r["on_front"] == "True"} == expected and expected
    summary = (output / "report" / "summary.md").read_text(encoding="utf-8")
    # the figure named by its path (MLflow's Markdown view shows no relative image; summary.html embeds it, below)
    assert "## Pareto front" in summary and "`pareto/front_parameters.png`" in summary
    assert (output / "report" / "pareto" / "front_parameters.png").is_file()
    assert all(trial in summary.split("## Pareto front")[1] for trial in expected)
    assert "data:image/png;base64" in (output / "report" / "summary.html").read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_budget_stops_the_sweep_and_resume_continues_it_nothing_counted_twice(
    ray_cluster, demo_prepared, tmp_path, pilots, mlflow_server
):
    path = small_stage_space(tmp_path / "space.yaml", 3, [0, 1], "a budget", **{"model.hidden": 16})  # piloted

    def sweep(**given):  # one server for the three runs, as a team's would be
        given = {"data": str(demo_prepared.shard_dir), "mlflow_uri": mlflow_server.uri, "max_concurrent": 1, **given}
        return run_sweep(SweepOptions(space=str(path), output=tmp_path / "out", **given))

    # a budget the first epoch of the first trial spends: once that epoch's checkpoint is saved the sweep stops; the
    # trial ends there (a tiny one may finish the epochs it trains while Tune stops) and no other trial starts
    first = sweep(cpu_hours=1e-6)
    output = tmp_path / "out" / first.sweep_id
    assert first.costs["budget"]["stopped"] and not first.interrupted and first.failed == 0
    (stopped,) = read_ledger(output)  # the others never started
    spent = float(stopped["cpu_seconds"])
    assert stopped["status"] in ("KILLED", "FINISHED") and spent >= 1e-6 * 3600
    assert first.costs["cpu_seconds"] == pytest.approx(spent, abs=0.01)
    # the same budget again, read back: already spent, so no trial starts and nothing is added
    again = sweep(resume=True)
    assert again.costs["budget"]["hours"] == 1e-6 and again.costs["budget"]["stopped"]
    assert [float(r["cpu_seconds"]) for r in read_ledger(output)] == [spent]
    # a larger budget: every trial finishes; the stopped one goes on from what it had spent and, unless it had
    # finished, from its checkpoint
    last = sweep(resume=True, cpu_hours=1.0)
    assert (last.finished, last.failed) == (2, 0) and not last.costs["budget"]["stopped"]
    client = MlflowClient(last.store_uri)
    for row in read_ledger(output):
        run = client.search_runs([last.experiment_id], f"tags.`gx_ray.trial_id` = '{row['trial_id']}'")[0]
        assert row["status"] == "FINISHED" and _epochs_logged(client, run.info.run_id) == [0, 1, 2]  # each once
        # what the earlier attempt spent, plus the last attempt's own seconds (its trial_seconds, logged just before
        # its last report): neither lost nor counted twice
        earlier = spent if row["trial_id"] == stopped["trial_id"] else 0.0
        assert earlier <= float(row["cpu_seconds"]) <= earlier + run.data.metrics["trial_seconds"] + 1.0
        if row["trial_id"] == stopped["trial_id"] and stopped["status"] == "KILLED":
            assert run.data.metrics["resumed_from_epoch"] >= 1  # from the checkpoint saved before the stop
    spent_in_all = sum(float(r["cpu_seconds"]) for r in read_ledger(output))
    assert last.costs["cpu_seconds"] == pytest.approx(spent_in_all, abs=0.01)
