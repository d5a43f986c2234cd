"""The sweep driver (:mod:`gx_ray.sweep.driver`) end to end: the smoke modality ablation into a real MLflow server, a
failing trial, an interrupted sweep resumed (and its report written again by the report command), an Optuna search
with ASHA; and the driver's run names, summary, progress bar and report warm-up. Search-space validation:
``test_sweep_spaces.py``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.analysis.runs import headline_metric, load_runs
from gx_ray.schema import PAPER_TASKS as TASKS
from gx_ray.sweep.driver import EXPERIMENT, SweepOptions, run_sweep
from gx_ray.sweep.spaces import load_space
from gx_ray.tracking import SHARED_VIEW_TAG, TRIAL_TAG
from tests.common import ROOT, SCHEMAS


def _children(uri: str, sweep_id: str) -> list:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`gx_ray.sweep_id` = '{sweep_id}'")
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags]


# --- the smoke modality ablation, end to end --------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_ablation(ray_cluster, demo_prepared, mlflow_server, tmp_path_factory):
    options = SweepOptions(
        space="modality_ablation",
        output=tmp_path_factory.mktemp("sweeps"),
        data=demo_prepared.shard_dir,
        mlflow_uri=mlflow_server.uri,
        presets=("demo", "smoke"),
    )
    return run_sweep(options)


@pytest.mark.slow
def test_smoke_ablation_runs_all_20_cells(smoke_ablation):
    assert (smoke_ablation.finished, smoke_ablation.failed) == (20, 0)
    cells = {(b["task"], b["schema"]) for b in smoke_ablation.best}
    assert cells == {(t, s) for t in TASKS for s in SCHEMAS}
    assert all(b["best_test"] is not None for b in smoke_ablation.best)
    assert (smoke_ablation.output / "sweep.json").is_file()


def test_mlflow_holds_one_parent_and_a_child_per_trial_with_metrics(smoke_ablation, mlflow_server):
    client = MlflowClient(mlflow_server.uri)
    parent = client.get_run(smoke_ablation.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["gx_ray.sweep_id"] == smoke_ablation.sweep_id
    children = _children(mlflow_server.uri, smoke_ablation.sweep_id)
    assert len(children) == 20 and len({c.data.tags[TRIAL_TAG] for c in children}) == 20
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == smoke_ablation.parent_run_id
        assert {"task", "schema", "seed"} <= set(child.data.tags) and child.info.status == "FINISHED"
        assert child.data.params["optimiser.lr"] and child.data.params["schema"] == child.data.tags["schema"]
        assert "val_primary" in child.data.metrics and "test_primary" in child.data.metrics
        # the bar the trial's test number must clear, on its own test split (AUC's is 50 whatever the stage mix)
        # the bar the trial's test number must clear, on its own test split: undefined exactly where the metric is
        # (an AUC on a one-stage test split of the tiny cohort), else a number on the metric's scale
        chance, metric = child.data.metrics["test_chance"], child.data.metrics["test_primary"]
        assert math.isnan(chance) == math.isnan(metric) and (math.isnan(chance) or 0 <= chance <= 100)
        artifacts = {a.path for a in client.list_artifacts(child.info.run_id, "predictions")}
        assert "predictions/test_sample.json" in artifacts
        # where a trial's start-up went: the model's build is part of the loop's set-up
        assert 0 < child.data.metrics["build_seconds"] <= child.data.metrics["setup_seconds"]
    # a trial that started a process says how old the process was (Ray's start of it, the imports); the trials that
    # reused it say nothing (Tune reuses actors: 20 trials, a few processes)
    ages = [c.data.metrics["process_start_seconds"] for c in children if "process_start_seconds" in c.data.metrics]
    assert 1 <= len(ages) < len(children) and all(0 < age < 600 for age in ages)
    # the runs table's link opens a view of this sweep's trials with their headline columns (MLflow's shared views)
    view = json.loads(client.get_experiment(parent.info.experiment_id).tags[SHARED_VIEW_TAG + smoke_ablation.view])
    found = client.search_runs([parent.info.experiment_id], view["searchFilter"], max_results=100)
    assert {r.info.run_id for r in found} == {c.info.run_id for c in children}
    assert "metrics.`test_primary`" in view["selectedColumns"] and "tags.`schema`" in view["selectedColumns"]


def test_every_sweep_ends_with_its_report_on_disk_and_on_the_parent_run(smoke_ablation, mlflow_server):
    folder = smoke_ablation.output / "report"
    assert smoke_ablation.report == folder / "summary.md"
    summary = smoke_ablation.report.read_text(encoding="utf-8")
    assert "synthetic demo cohort" in summary and "not comparable" in summary
    # each schema's inputs in the form the demo preset gives them, read back from the runs' params
    assert "- **image_only**: CT (4 phases)\n" in summary
    assert "- **image_table**: CT (4 phases), lab table as numbers\n" in summary
    box_cues = "boxes as mask channels (lymph nodes, stomach)"  # detection's: never the tumour box it predicts
    assert f"- **image_table_bbox** (lesion_detection): CT (4 phases), lab table as numbers, {box_cues}" in summary
    for task in TASKS:
        assert all((folder / "tables" / f"table_{task}.{ext}").is_file() for ext in ("md", "tex", "csv"))
        assert f"| {task} |" in summary  # its headline metric, per schema
    for figure in ("radar", "intervals"):
        assert (folder / "figures" / f"{figure}.png").is_file() and (folder / "figures" / f"{figure}.svg").is_file()
    significance = pd.read_csv(folder / "significance.csv")
    # every schema against image_only, per task, on the same seed and test patients
    assert len(significance) == 5 * 3 and set(significance["schema_b"]) == {"image_only"}
    tested = significance.dropna(subset=["p_value"])  # one-class test split: AUC undefined, nothing to test
    assert tested["p_holm"].ge(tested["p_value"]).all() and len(tested) >= 12
    # the tiny cohort has one test patient: too few to resample, so the comparisons fall back to the seeds
    assert set(significance["method"]) == {"Wilcoxon signed-rank over seeds"}
    assert "<table>" in (folder / "summary.html").read_text(encoding="utf-8")
    # the reporting appendix: the CLAIM / TRIPOD+AI items a sweep can fill, from its cohort and its runs
    appendix = summary.split("## Reporting appendix (CLAIM 2024, TRIPOD+AI)")[1]
    for section in ("Flow of patients", "Characteristics per split", "Sample size", "Metric definitions", "Provenance"):
        assert f"### {section}" in appendix, section
    assert "Cases found: 10; included: 10" in appendix and "| test | 1 |" in appendix
    assert all(f"| {task} | `" in appendix for task in TASKS)  # every task's metric and its reference implementation
    assert "- seeds: 0" in appendix and "- code: git:" in appendix
    logged = MlflowClient(mlflow_server.uri).list_artifacts(smoke_ablation.parent_run_id, "report")
    assert {"report/summary.md", "report/summary.html", "report/tables", "report/figures"} <= {a.path for a in logged}
    assert json.loads((smoke_ablation.output / "sweep.json").read_text())["report"] == str(smoke_ablation.report)


def test_the_runs_table_holds_every_trial_metric_and_the_searched_nothing(smoke_ablation, mlflow_server):
    runs = load_runs(mlflow_server.uri, smoke_ablation.sweep_id)
    assert runs["run_id"].nunique() == 20 and runs.attrs["searched"] == []  # a grid over task, schema and seed
    test = runs[runs["split"] == "test"]
    assert set(test[test["task"] == "retrieval"]["metric"]) >= {"image_to_text_recall_at_5", "text_to_image_mean_rank"}
    val = runs[runs["split"] == "val"]
    assert len(val) == 20 and (val["metric"] == val["task"].map(headline_metric)).all()
    cell = test.query("task == 'stage_classification' and schema == 'image_table' and metric == 'auc'")
    child = MlflowClient(mlflow_server.uri).get_run(cell["run_id"].item())
    assert cell["value"].item() == pytest.approx(child.data.metrics["test_auc"], nan_ok=True)


# --- failures and resume ----------------------------------------------------------------------------------


def _small_space(
    tmp_path: Path, vision_kwargs: list, name: str = "small", seeds: tuple[int, ...] = (0, 1), exclude: list = ()
) -> Path:
    document = {
        "description": "small stage-classification trials",
        "fixed": {
            "task": "stage_classification",
            "model.vision": "resnet18_3d",
            "model.text": "bert_tiny",
            "model.hidden": 32,
            "optimiser.lr": 1.0e-3,
            "schedule.epochs": 1,
            "schedule.max_steps_per_epoch": 1,
            "data.effective_batch": 4,
        },
        "grid": {"model.vision_kwargs": vision_kwargs, "seed": list(seeds)},
        **({"exclude": list(exclude)} if exclude else {}),
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_failing_trial_is_reported_and_the_others_finish(ray_cluster, demo_prepared, mlflow_server, tmp_path, capfd):
    # three block widths where MONAI's ResNet needs four: the model fails to build inside the trial. The grid leaves
    # out its seed-1 cells (`exclude`, Tune given the cells one by one): each width runs once
    good, bad = {"block_inplanes": [8, 16, 32, 64]}, {"block_inplanes": [8, 16, 32]}
    exclude = [{"seed": 1, "model.vision_kwargs": [good, bad]}]
    path = _small_space(tmp_path, [good, bad], seeds=(0, 1), exclude=exclude)
    options = SweepOptions(space=str(path), output=tmp_path, data=demo_prepared.shard_dir, mlflow_uri=mlflow_server.uri)
    result = run_sweep(options)
    assert (result.finished, result.failed) == (1, 1)
    # each failure in one line: the trial, the trainable's own exception (not Ray's wrapper), what happens now
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("trial ") and "Error" in line]
    assert sum("retried from the start" in line for line in lines) == 2, err[-4000:]  # it failed before a checkpoint
    failed = [line for line in lines if "failed; the traceback: " in line]
    assert len(failed) == 1 and all(Path(line.rsplit(": ", 1)[1]).is_file() for line in failed), err[-4000:]
    assert "RayTaskError" not in err and "Traceback" not in err, err[-4000:]
    client = MlflowClient(mlflow_server.uri)
    children = _children(mlflow_server.uri, result.sweep_id)
    assert sorted(c.info.status for c in children) == ["FAILED", "FINISHED"]
    assert {c.data.params["seed"] for c in children} == {"0"}
    parent = client.get_run(children[0].data.tags["mlflow.parentRunId"])
    assert json.loads(parent.data.params["exclude"]) == [{"seed": [1], "model.vision_kwargs": [good, bad]}]


@pytest.mark.slow
def test_an_optuna_search_with_asha_ends_every_trial_and_shows_its_search(
    ray_cluster, demo_prepared, mlflow_server, tmp_path
):
    document = yaml.safe_load((ROOT / "search_spaces" / "lr_sweep.yaml").read_text(encoding="utf-8"))
    document["presets"]["smoke"]["budget"] = {"samples": 4}
    path = tmp_path / "lr_search.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    options = SweepOptions(
        space=str(path), output=tmp_path, data=demo_prepared.shard_dir, mlflow_uri=mlflow_server.uri,
        presets=("demo", "smoke"),
    )  # fmt: skip
    result = run_sweep(options)
    assert result.failed == 0 and result.finished >= 1 and result.finished + result.stopped_early == 4
    client = MlflowClient(mlflow_server.uri)
    assert client.get_run(result.parent_run_id).info.status == "FINISHED"  # nothing is left to resume
    children = _children(mlflow_server.uri, result.sweep_id)
    statuses = {c.info.status: [] for c in children}
    for child in children:
        statuses[child.info.status].append(child.data.tags.get("gx_ray.stopped_early"))
    # ASHA's stopped trials are ended and tagged, not left RUNNING
    assert statuses.get("FINISHED", []) == [None] * result.finished
    assert statuses.get("KILLED", []) == ["true"] * result.stopped_early and "RUNNING" not in statuses
    lrs = {c.data.params["optimiser.lr"] for c in children}
    assert len(lrs) == 4  # Optuna sampled four learning rates
    search = result.output / "report" / "search"
    assert (search / "search_best_so_far.png").is_file()
    assert (search / "search_parallel_stage_classification.svg").is_file()


def test_run_names_lead_with_task_inputs_and_seed_also_when_the_space_fixes_them():
    from types import SimpleNamespace

    from gx_ray.sweep.summary import trial_name

    varied = SimpleNamespace(
        trial_id="5c0a1_00015", config={"task": "stage_classification", "schema": "image_table_bbox", "seed": 0}
    )
    assert trial_name({}, varied) == "stage img+tab+box s0 #15"
    fixed = SimpleNamespace(trial_id="5c0a1_00000", config={"seed": 1})  # Tune's config holds only what varies
    assert trial_name({"task": "vqa", "schema": "image_only"}, fixed) == "vqa img s1 #0"
    searched = SimpleNamespace(trial_id="0da6b457", config={"seed": 0})  # Optuna's or BOHB's: a hex id, no counter
    assert trial_name({"task": "vqa"}, searched) == "vqa s0 #0da6b457"


def test_the_summary_leaves_out_trials_a_time_budget_never_started():
    """A time-boxed sweep (benchmark.py cluster --budget) can end before some trials start: Tune keeps them without
    a config. They are no cell; before, their task None failed the whole summary ("unknown task None")."""
    from gx_ray.sweep.summary import format_summary, summarise

    done = {"schema": "image_only", "error": None, "completed": True, "trial": "t0", "chosen": {}}
    rows = [
        {**done, "task": "stage_classification", "val_primary": 70.0, "test_primary": 60.0, "test_chance": 50.0},
        {**done, "task": "stage_classification", "val_primary": 80.0, "test_primary": 64.0, "trial": "t1"},
        {**done, "task": None, "completed": False, "val_primary": None, "test_primary": None, "trial": "t2"},
    ]
    (cell,) = summarise(rows)
    assert (cell["task"], cell["metric"], cell["trials"], cell["best_trial"]) == (
        "stage_classification",
        "auc",
        2,
        "t1",
    )
    assert cell["test_mean"] == pytest.approx(62.0)
    assert cell["chance"] == pytest.approx(50.0)  # the one trial that logged it (the other predates test_chance)

    header, row = format_summary([cell], 2, 0, 3).splitlines()[-2:]
    assert "chance" in header and row.split()[-4:] == ["50.0", "80.0", "→", "64.0"]


def test_the_summary_shows_each_model_or_fusion_a_grid_compares_apart_and_pools_only_seeds_and_samples():
    """A grid over fusions (or models) printed one row per task and schema pooled the fusions as if they were seeds
    (paper_models: four VLMs' VQA as one "0.1 ± 0.1 (4)"). Each grid setting is its own row; a sampled learning rate
    is still pooled, its best trial naming it."""
    from gx_ray.sweep.summary import format_summary, summarise

    done = {"task": "vqa", "schema": "image_only", "error": None, "completed": True, "test_chance": 37.0}
    rows = [
        {**done, "trial": f"t{k}", "val_primary": 40.0 + k, "test_primary": test,
         "chosen": {"model.fusion": fusion, "optimiser.lr": lr}}
        for k, (fusion, lr, test) in enumerate(
            [("concat", 1e-3, 40.0), ("film", 1e-3, 50.0), ("concat", 1e-4, 42.0), ("film", 1e-4, 54.0)]
        )
    ]  # fmt: skip
    concat, film = summarise(rows, ["model.fusion"])
    assert (concat["setting"], concat["test_mean"], concat["trials"]) == ("model.fusion=concat", 41.0, 2)
    best_lr = film["best_params"]["optimiser.lr"]
    assert (film["setting"], film["test_mean"], best_lr) == ("model.fusion=film", 52.0, 1e-4)
    printed = format_summary([concat, film], 4, 0, 4).splitlines()
    assert "setting" in printed[-3] and "model.fusion=film" in printed[-1] and "52.0 ± 2.8 (2)" in printed[-1]
    (pooled,) = summarise(rows)  # no axis named: as before, one row (and no setting column)
    assert pooled["test_mean"] == 46.5 and "setting" not in format_summary([pooled], 4, 0, 4)


def test_the_progress_bar_counts_a_trial_the_time_budget_ended_as_stopped_not_finished(capsys):
    from types import SimpleNamespace

    from gx_ray.sweep.callbacks import TrialProgress

    progress = TrialProgress(total=4)
    progress.setup()
    trials = [
        SimpleNamespace(status="TERMINATED", last_result={"epoch": 1, "test_primary": 70.0}),
        SimpleNamespace(status="TERMINATED", last_result={"epoch": 0}),  # Tune's time budget ended it
        SimpleNamespace(status="ERROR", last_result={}),
        SimpleNamespace(status="RUNNING", last_result={"epoch": 0}),
    ]
    progress.on_step_end(0, trials)
    assert progress.bar.n == 3 and progress.shown == (1, 1, 1)
    progress.on_experiment_end(trials)
    assert "finished=1, stopped=1, failed=1" in capsys.readouterr().err


def test_the_report_s_imports_are_warmed_once_the_first_trial_ends(tmp_path, monkeypatch):
    """The driver imports what the report needs while trials still run: MONAI's box matching only when the sweep has
    detection trials, and nothing before the first trial ends (the sweep's start stays short)."""
    from gx_ray.sweep.callbacks import REPORT_MODULES, ReportWarmUp, report_modules

    assert report_modules(load_space("modality_ablation")) == (*REPORT_MODULES, "monai.apps.detection.metrics.matching")
    assert report_modules(load_space("modality_ablation", ("planted",))) == REPORT_MODULES  # stage only
    (tmp_path / "warmed_for_the_report.py").write_text("import time\ntime.sleep(0.2)\nVALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    warm = ReportWarmUp(("warmed_for_the_report",))
    assert warm.thread is None and "warmed_for_the_report" not in sys.modules
    warm.on_trial_complete(0, [], None)
    first = warm.thread
    warm.on_trial_complete(1, [], None)  # once per sweep
    assert warm.thread is first and first.daemon
    first.join(10)
    assert sys.modules["warmed_for_the_report"].VALUE == 1
    monkeypatch.delitem(sys.modules, "warmed_for_the_report")


def test_the_checkpoints_kept_hold_a_minimised_task_s_best_weights(ray_cluster, tmp_path):
    """Every checkpoint the loop writes holds the best weights so far: those Tune keeps of a trial must be the latest,
    whichever way the task's primary metric goes. Ranked by the validation score, highest first, a plug-in task whose
    primary metric is minimised (the tumour volume's mean absolute error) kept its worst epochs' checkpoints."""
    from ray import tune

    from gx_ray.sweep.driver import checkpoint_config

    space = load_space(str(ROOT / "tests" / "plugins" / "tumour_volume.yaml"))
    assert space.fixed["task"] == "tests.plugins.tumour_volume:TumourVolume"  # lower is better

    def trainable(config: dict) -> None:
        for epoch, error in enumerate([4.0, 3.0, 5.0, 2.0]):  # the best so far: epoch 0, 1, 1, 3
            folder = tmp_path / f"epoch{epoch}"
            folder.mkdir()
            checkpoint = tune.Checkpoint.from_directory(str(folder))
            tune.report({"val_primary": error, "epoch": epoch}, checkpoint=checkpoint)

    run_config = tune.RunConfig(storage_path=str(tmp_path / "state"), checkpoint_config=checkpoint_config(space),
                                verbose=0)  # fmt: skip
    (result,) = tune.Tuner(trainable, run_config=run_config).fit()
    kept = sorted(metrics["epoch"] for _, metrics in result.best_checkpoints)
    assert kept == [2, 3]  # the latest two: the last holds the best weights (epoch 3's), the one before epoch 1's


def test_tune_s_trials_are_recorded_at_the_experiment_s_end_by_whichever_copy_of_the_callback_tune_holds():
    """Tune restores a resumed sweep's callbacks from its first run's pickle: the copy it unpickles records the trials
    where the driver, which built another, finds them by sweep id."""
    import pickle
    from types import SimpleNamespace

    from gx_ray.sweep.callbacks import TrialRecord

    restored = pickle.loads(pickle.dumps(TrialRecord("sweep-a")))  # the copy in Tune's saved state
    trials = [SimpleNamespace(trial_id="a_00000", status="TERMINATED"), SimpleNamespace(trial_id="a_00001")]
    restored.on_experiment_end(trials)
    TrialRecord("sweep-b").on_experiment_end([])
    assert TrialRecord.ended.pop("sweep-a") == trials and TrialRecord.ended.pop("sweep-b") == []
