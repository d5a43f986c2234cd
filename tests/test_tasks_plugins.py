"""Tasks from outside gx-ray: resolved from a ``module:Class`` reference or an entry point of the group
``gx_ray.tasks``, checked against the protocol with one error naming what is missing, refused where their declared
leaking inputs are given, combined over an ensemble, and run end to end through a sweep and its report under their
``name`` (tests/plugins/tumour_volume.py, the docs' worked example)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

import gx_ray.tasks
from gx_ray.analysis.cases import case_scorer
from gx_ray.analysis.runs import higher_is_better, load_runs
from gx_ray.analysis.runs import test_records as logged_records
from gx_ray.modalities import PRESETS, LeakageError, check_leakage, resolve_schema
from gx_ray.schema import BOX_LEVELS, PHASES
from gx_ray.sweep.spaces import SpaceError, load_space
from gx_ray.tasks import (
    Task,
    TaskPluginError,
    build_task,
    primary_metric,
    task_class,
    task_label,
    task_of,
)
from gx_ray.tasks.stage_classification import StageClassification
from gx_ray.train.config import TrialConfig
from tests.common import ROOT, run_smoke_sweep
from tests.plugins.tumour_volume import TumourVolume, volume_metrics

REFERENCE = "tests.plugins.tumour_volume:TumourVolume"
SPACE = ROOT / "tests" / "plugins" / "tumour_volume.yaml"
SPACING = (6.0, 4.5, 4.5)  # the demo preprocessing's grid: a voxel is 0.1215 mL


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """No plug-in resolved yet in this process: what a fresh trial or report process starts from."""
    monkeypatch.setattr(gx_ray.tasks, "_PLUGINS", {})


# --- resolution ----------------------------------------------------------------------------------------------------


def test_a_module_class_reference_resolves_and_goes_under_its_name(fresh_registry):
    assert task_class(REFERENCE) is TumourVolume
    assert task_label(REFERENCE, {}) == "tumour_volume"  # never the reference: it would head the report's tables
    assert task_class("tumour_volume") is TumourVolume  # a label's task, once resolved
    assert primary_metric("tumour_volume") == primary_metric(REFERENCE) == "mae_ml"
    assert task_of(REFERENCE) == REFERENCE and task_of("tumour_volume") == "tumour_volume"
    task = build_task(REFERENCE, spacing_zyx_mm=SPACING)
    assert isinstance(task, TumourVolume) and task.ml_per_voxel == pytest.approx(0.1215)
    with pytest.raises(ValueError, match="unknown options \\['spacing'\\]"):
        build_task(REFERENCE, spacing=SPACING)


def test_built_in_names_resolve_as_before(fresh_registry):
    assert task_class("stage_classification") is StageClassification
    assert task_label("lesion_qa", {"family": "img2size"}) == "lesion_qa.img2size.random"
    assert gx_ray.tasks.plugin_tasks() == {}


def write_distribution(folder: Path, entry_points: dict[str, str]) -> None:
    """A real installed distribution: a dist-info folder with an entry_points.txt, as pip writes it."""
    info = folder / "gx_plugin_example-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gx-plugin-example\nVersion: 0.1\n", encoding="utf-8")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[gx_ray.tasks]\n{lines}", encoding="utf-8")


def test_an_entry_point_resolves_by_its_name(fresh_registry, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown task 'tumour_volume'.*none installed"):
        task_class("tumour_volume")
    write_distribution(tmp_path, {"tumour_volume": REFERENCE, "volume": REFERENCE, "broken": "no_such_module:Task"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskPluginError, match="entry point 'volume' .*named 'tumour_volume'.*must be its task's"):
        task_class("volume")
    with pytest.raises(
        TaskPluginError, match="entry point 'broken' \\(no_such_module:Task\\): module 'no_such_module'"
    ):
        task_class("broken")
    assert task_class("tumour_volume") is TumourVolume
    assert task_label("tumour_volume", {}) == "tumour_volume"
    with pytest.raises(ValueError, match="unknown task 'segmentation'.*broken, tumour_volume, volume"):
        task_class("segmentation")  # the error lists what is installed
    config = TrialConfig.from_flat({"task": "tumour_volume", "schema": "image_only"})
    assert config.task == "tumour_volume"


# --- the protocol, checked -----------------------------------------------------------------------------------------


@dataclass
class NoMode(TumourVolume):
    name = "no_mode"
    mode = "best"


class NotADataclass(Task):
    name = "not_a_dataclass"
    primary_metric = "mae_ml"
    mode = "min"


@dataclass
class Unfinished(Task):
    name = "unfinished"
    primary_metric = "mae_ml"
    mode = "min"

    def build_head(self, dim, tokenizer, map_channels=()):
        return torch.nn.Linear(dim, 1)


@dataclass
class Shadow(TumourVolume):
    name = "stage_classification"


@dataclass
class BadInputs(TumourVolume):
    name = "bad_inputs"
    leaking_inputs = {"boxes:liver": "a level that does not exist", "phases": "every schema has a phase"}


@dataclass
class Impostor(TumourVolume):
    name = "tumour_volume"


@pytest.mark.parametrize(
    ("attribute", "missing"),
    [
        ("no_such_module.tasks:Task", "module 'no_such_module.tasks' does not import \\(ModuleNotFoundError"),
        ("tests.plugins.tumour_volume:Volume", "module 'tests.plugins.tumour_volume' has no 'Volume'"),
        ("tests.plugins.tumour_volume", "is not 'module:Class'"),  # a dotted name is no entry point
        ("tests.plugins.tumour_volume:volume_metrics", "it is function"),
        ("tests.plugins.tumour_volume:VolumeMetric", "VolumeMetric is not a subclass of gx_ray.tasks.Task"),
        (f"{__name__}:NoMode", "mode is 'best', not 'max' or 'min'"),
        (f"{__name__}:NotADataclass", "not a dataclass"),
        (f"{__name__}:Unfinished", "missing methods forward, loss, predict, metric"),
        (f"{__name__}:Shadow", "name 'stage_classification' is a built-in task's"),
        (f"{__name__}:BadInputs", "unknown boxes 'liver'.*'phases': every schema has a CT phase"),
        ("gx_ray.tasks.base:Task", "missing class attribute name.*missing class attribute primary_metric"),
    ],
)
def test_a_bad_reference_gets_one_error_naming_it_and_what_is_missing(fresh_registry, attribute, missing):
    with pytest.raises(ValueError, match=missing) as error:
        task_class(attribute)
    assert repr(attribute) in str(error.value)


def test_two_tasks_of_one_name_are_refused(fresh_registry):
    task_class(REFERENCE)
    with pytest.raises(TaskPluginError, match="two tasks are named 'tumour_volume'.*Impostor.*must be unique"):
        task_class(f"{__name__}:Impostor")


def test_a_space_names_a_bad_reference_and_its_key(fresh_registry, tmp_path):
    space = yaml.safe_load(SPACE.read_text(encoding="utf-8"))
    space["fixed"]["task"] = "tests.plugins.tumour_volume:Volume"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(space), encoding="utf-8")
    with pytest.raises(SpaceError, match="tests.plugins.tumour_volume:Volume.*has no 'Volume'"):
        load_space(str(path), weights=False)


# --- leakage -------------------------------------------------------------------------------------------------------


def test_the_declared_leaking_inputs_refuse_a_schema_with_the_tumour_box(fresh_registry, tmp_path):
    for schema in (PRESETS["image_bbox"], resolve_schema({"boxes": "channels", "box_levels": ["tumour"]})):
        with pytest.raises(LeakageError, match="declared_leaking_inputs.*boxes:tumour.*extent is the volume") as error:
            check_leakage(schema, TumourVolume)
        assert error.value.rule == "declared_leaking_inputs"
    check_leakage(resolve_schema({"boxes": "overlay", "box_levels": ["stomach", "lymph_nodes"]}), TumourVolume)
    check_leakage(PRESETS["image_table"], build_task(REFERENCE))  # an instance declares it as its class does
    with pytest.raises(LeakageError, match="declared_leaking_inputs"):
        TrialConfig.from_flat({"task": REFERENCE, "schema": "image_table_bbox"})
    with pytest.raises(LeakageError, match="post_diagnosis_variables"):  # the rule of every task holds for plug-ins
        check_leakage(resolve_schema({"table": "text", "table_variables": ["t_stage"]}), TumourVolume)
    # in a space: refused before Ray starts, naming the cell
    space = yaml.safe_load(SPACE.read_text(encoding="utf-8"))
    space["grid"]["schema"] = ["image_only", "image_bbox"]
    path = tmp_path / "leaking.yaml"
    path.write_text(yaml.safe_dump(space), encoding="utf-8")
    with pytest.raises(SpaceError, match="schema=image_bbox.*declared_leaking_inputs"):
        load_space(str(path), weights=False)


def test_built_in_leakage_rules_hold_by_name_and_by_class():
    with pytest.raises(LeakageError, match="box_cues_in_detection"):
        check_leakage(PRESETS["image_bbox"], task_class("lesion_detection"))
    with pytest.raises(LeakageError, match="stage_in_reports"):
        check_leakage(resolve_schema({"reports": ["diagnosis_report"]}), StageClassification)
    check_leakage(PRESETS["image_bbox"], StageClassification)
    with pytest.raises(ValueError, match="unknown task 'tumour_volume'"):  # a name alone: this layer cannot import it
        check_leakage(PRESETS["image_only"], "tumour_volume")


# --- the example task, its ensemble hook and its analysis ----------------------------------------------------------


def batch_of(sizes: list[tuple[int, int, int] | None]) -> dict:
    """A collated batch's box columns: each case's venous tumour box of ``sizes`` (z, y, x voxels; None: no box)."""
    boxes = np.zeros((len(sizes), len(PHASES), len(BOX_LEVELS), 6), dtype=np.int32)
    present = np.zeros((len(sizes), len(PHASES), len(BOX_LEVELS)), dtype=bool)
    phase, level = PHASES.index("venous"), BOX_LEVELS.index("tumour")
    for i, size in enumerate(sizes):
        if size is not None:
            boxes[i, phase, level] = (2, 3, 4, 2 + size[0], 3 + size[1], 4 + size[2])
            present[i, phase, level] = True
    return {
        "case_id": [f"c{i}" for i in range(len(sizes))],
        "split": ["train"] * len(sizes),
        "boxes": torch.tensor(boxes.reshape(len(sizes), -1)),
        "box_present": torch.tensor(present.reshape(len(sizes), -1)),
    }


def rows_of(batch: dict) -> list[dict]:
    return [
        {"case_id": c, "split": s, "boxes": b.tolist(), "box_present": p.tolist()}
        for c, s, b, p in zip(batch["case_id"], batch["split"], batch["boxes"], batch["box_present"], strict=True)
    ]


def test_the_example_task_learns_predicts_and_scores_in_millilitres():
    task = build_task(REFERENCE, spacing_zyx_mm=SPACING)
    batch = batch_of([(2, 10, 10), (4, 10, 10), (8, 10, 10), None])  # 24.3, 48.6, 97.2 mL
    task.prepare(rows_of(batch))
    assert task.mean == pytest.approx(math.log(400)) and task.std == pytest.approx(math.log(2) * math.sqrt(2 / 3))
    with pytest.raises(ValueError, match="training rows only"):
        task.prepare([{**rows_of(batch)[0], "split": "test"}])
    outputs = {"z": torch.zeros(4, requires_grad=True)}  # a standardised 0: the training mean log volume, 48.6 mL
    loss = task.loss(outputs, batch)
    assert loss.item() == pytest.approx(1.0, rel=1e-5)  # standardised targets -1.22, 0, 1.22; the boxless case out
    loss.backward()
    records = task.predict(outputs, batch)
    assert records[0] == {"case_id": "c0", "prediction": 48.6, "target": 24.3}
    assert records[3]["target"] is None
    metric = task.metric()
    metric.update(outputs, batch)
    scores = metric.compute()
    assert scores["mae_ml"] == pytest.approx((24.3 + 0 + 48.6) / 3) and scores["r2"] == pytest.approx(
        1 - (24.3**2 + 48.6**2) / np.var([24.3, 48.6, 97.2]) / 3
    )
    assert task.chance_level(rows_of(batch), rows_of(batch)) == pytest.approx(scores["mae_ml"])
    assert math.isnan(volume_metrics(np.array([1.0]), np.array([2.0]))["r2"])  # R² of one case: undefined


def test_combine_is_the_members_mean_with_their_spread():
    task = build_task(REFERENCE, spacing_zyx_mm=SPACING)
    members = [
        [{"case_id": "a", "prediction": 10.0, "target": 12.0}, {"case_id": "b", "prediction": 1.0, "target": None}],
        [{"case_id": "a", "prediction": 14.0, "target": 12.0}, {"case_id": "b", "prediction": 1.0, "target": None}],
    ]
    combined = task.combine(members)
    assert combined == [
        {"case_id": "a", "prediction": 12.0, "target": 12.0, "spread": 2.0, "members": 2},
        {"case_id": "b", "prediction": 1.0, "target": None, "spread": 0.0, "members": 2},
    ]
    with pytest.raises(ValueError, match="member 1 holds other cases"):
        task.combine([members[0], members[1][::-1]])
    with pytest.raises(NotImplementedError, match="task 'stage_classification' does not say how.*combine"):
        Task.combine(StageClassification(), members)


def test_the_analysis_reads_a_plug_in_by_its_name_and_direction(fresh_registry):
    records = [{"case_id": "a", "prediction": 10.0, "target": 12.0}, {"case_id": "b", "prediction": 1.0, "target": 2}]
    assert higher_is_better("r2")
    task_class(REFERENCE)
    assert not higher_is_better("mae_ml") and higher_is_better("r2") and higher_is_better("auc")
    assert not higher_is_better("image_to_text_median_rank")
    scorer = case_scorer("tumour_volume", records, "mae_ml")  # the plug-in's own record_metrics, resampled
    assert scorer.score(np.array([0, 1, 1])) == pytest.approx((2.0 + 1.0 + 1.0) / 3)
    assert case_scorer("tumour_volume", records, "no_such_metric") is None
    with pytest.raises(ValueError, match="unknown task 'segmentation'"):
        case_scorer("segmentation", records, "mae_ml")


def test_a_margin_goes_under_the_plug_ins_name(fresh_registry, tmp_path):
    space = yaml.safe_load(SPACE.read_text(encoding="utf-8"))
    space["analysis"] = {"margin": {"tumour_volume": 5.0}}
    path = tmp_path / "margin.yaml"
    path.write_text(yaml.safe_dump(space), encoding="utf-8")
    assert load_space(str(path), weights=False).analysis["margin"] == {"tumour_volume": 5.0}
    space["analysis"] = {"margin": {REFERENCE: 5.0}}
    path.write_text(yaml.safe_dump(space), encoding="utf-8")
    with pytest.raises(SpaceError, match="unknown task .*valid: .*tumour_volume"):
        load_space(str(path), weights=False)


# --- end to end ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_plug_in_task_runs_through_a_sweep_and_its_report(ray_cluster, demo_prepared, tmp_path, mlflow_server):
    with run_smoke_sweep(str(SPACE), demo_prepared.shard_dir, tmp_path, mlflow_server.uri) as result:
        assert (result.finished, result.failed) == (2, 0)
        client = MlflowClient(result.tracking_uri)
        runs = load_runs(result.tracking_uri, result.sweep_id)
        children = {client.get_run(r).data.tags["task"] for r in runs["run_id"]}
        assert children == {REFERENCE}  # the tag keeps what the space said: any process can import it again
        assert set(runs["task"]) == {"tumour_volume"}
        assert all(name.startswith("volume ") for name in runs["trial"])  # the run names use the class's short name
        assert {client.get_run(r).data.tags["gx_ray.primary_unit"] for r in runs["run_id"]} == {"mL"}
        assert {"mae_ml", "r2", "chance"} <= set(runs["metric"])
        run_id = runs["run_id"].iloc[0]
        local = client.download_artifacts(run_id, "predictions/test.json", str(tmp_path))
        records = json.loads(Path(local).read_text(encoding="utf-8"))
        assert set(records[0]) == {"case_id", "prediction", "target"} and records[0]["prediction"] > 0
        params = client.get_run(run_id).data.params
        assert json.loads(params["task_options.spacing_zyx_mm"]) == list(SPACING)  # the sweep read the manifest
        report = result.output / "report"
        summary = result.report.read_text(encoding="utf-8")
        assert "tests.plugins" not in summary  # the reference heads no table
        headline = [line for line in summary.splitlines() if line.startswith("| tumour_volume |")]
        assert any("| mae_ml ↓ |" in line and "t over seeds" in line for line in headline), headline
        cells = pd.read_csv(report / "cells.csv")
        volume = cells[cells["task"] == "tumour_volume"]
        assert set(volume["schema"]) == {"image_only", "image_table"}
        mae = volume[volume["metric"] == "mae_ml"]
        assert (mae["mean"] > 0).all() and not mae["higher_is_better"].any()  # scored as an error, lower is better
        assert set(volume.loc[volume["metric"] == "r2", "higher_is_better"]) == {True}
        table = (report / "tables" / "table_tumour_volume.md").read_text(encoding="utf-8").splitlines()[0]
        assert "Image Only · mae_ml ↓" in table and "Image Only · r2 ↑" in table
        assert "Image Only · chance ↓" in table  # a chance level is an error in mL here, too
        significance = pd.read_csv(report / "significance.csv")
        (row,) = significance.itertuples()
        assert (row.task, row.metric, row.schema_a) == ("tumour_volume", "mae_ml", "image_table")
        # (the smoke cohort's test split has too few labelled patients for the bootstrap over them: the seeds' test)

        # finalized and predicting: the registered model gives its own test predictions; the external evaluation has
        # the plug-in's metrics with intervals. Through the sweep's own server on its store, still up in this block
        # (a second server on the same store after it cost a server's start-up)
        from gx_ray.deploy.finalize import FinalizeOptions, finalize
        from gx_ray.deploy.predict import PredictOptions, predict_cohort

        final = finalize(FinalizeOptions(str(result.output), "tumour_volume", mlflow_uri=result.tracking_uri))
        own = {r["case_id"]: r["prediction"] for r in logged_records(result.tracking_uri, final.run_id)}
        out = tmp_path / "predicted"
        options = PredictOptions(final.model_uri, str(demo_prepared.shard_dir), out, mlflow_uri=result.tracking_uri)
        predicted = predict_cohort(options)
    records = json.loads((out / "predictions.json").read_text(encoding="utf-8"))
    assert {r["case_id"]: r["prediction"] for r in records if r["split"] == "test"} == pytest.approx(own, rel=1e-5)
    evaluation = {row["metric"]: row for row in predicted.evaluation}
    assert set(evaluation) == {"mae_ml", "r2"}
    assert evaluation["mae_ml"]["external"]["low"] <= evaluation["mae_ml"]["external"]["value"]
    assert evaluation["mae_ml"]["internal"]["cases"] == len(own)
