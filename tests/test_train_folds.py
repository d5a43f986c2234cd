"""Cross-validation inside one trial (:mod:`gx_ray.train.folds`): the folds trained side by side report their mean,
end their runs only once every fold has tested, and a trial stopped between two checkpoints goes on from the group's
checkpoint to the same numbers as the uninterrupted one."""

from __future__ import annotations

import contextlib
import math
import shutil

import pytest
import torch
from ray import tune

from gx_ray.data.folds import fold_patients, write_fold_file
from gx_ray.train.config import TrialConfig
from gx_ray.train.folds import FOLD_FOLDER, FoldGroup, fold_checkpoint, fold_config, fold_mean
from gx_ray.train.loop import TrainingRecipe, WorkerContext

FOLDS, EPOCHS = 2, 2


def test_the_trials_report_averages_each_fold_score_sums_the_costs_and_never_averages_a_nan_away():
    folds = [
        {"epoch": 1, "val_primary": 60.0, "val_auc": 70.0, "cpu_seconds": 3.0, "parameters": 10, "task": "x"},
        {"epoch": 1, "val_primary": 80.0, "val_auc": math.nan, "cpu_seconds": 5.0, "parameters": 10, "task": "x"},
    ]
    merged = fold_mean(folds)
    assert merged["val_primary"] == 70.0 and math.isnan(merged["val_auc"])
    assert merged["cpu_seconds"] == 8.0  # each fold's ledger holds its share of the trial's CPUs
    assert (merged["epoch"], merged["parameters"], merged["task"]) == (1, 10, "x")
    assert (merged["fold0_val_primary"], merged["fold1_val_primary"]) == (60.0, 80.0)


class _Stop(Exception):
    pass


def _train(config: TrialConfig, latest, events: list, stop_at: int | None = None, kept=None) -> list[dict]:
    """The folds of ``config`` as a trial trains them, reporting into ``events``; the trial's checkpoint of epoch
    ``stop_at`` copied to ``kept`` and the trial stopped there (as a killed trial's last report)."""
    reports: list[dict] = []

    def report(metrics: dict, checkpoint=None) -> None:
        reports.append(dict(metrics))
        events.append(("report", metrics["epoch"], checkpoint is not None))
        if metrics["epoch"] == stop_at:
            checkpoint.to_directory(str(kept))
            raise _Stop

    group, recipes = FoldGroup(report, tune.Checkpoint, FOLDS), []
    for fold in range(FOLDS):
        ctx = WorkerContext(
            rank=0, world_size=1, device=torch.device("cpu"), report=group.collector(fold),
            latest_checkpoint=fold_checkpoint(latest, fold), before_final_report=group.deferred(
                lambda fold=fold: events.append(("end", fold))),
        )  # fmt: skip
        recipes.append(TrainingRecipe(fold_config(config, fold), ctx))
        recipes[-1].setup()
    with contextlib.suppress(_Stop):
        group.train(recipes)
    return reports


def test_folds_side_by_side_report_their_mean_and_resume_from_the_trials_checkpoint_to_the_same_numbers(
    ray_cluster, demo_prepared, tmp_path
):
    shards = str(demo_prepared.shard_dir)
    folds_file = write_fold_file(shards, str(tmp_path), fold_patients(shards, FOLDS), {"dealt": {"folds": FOLDS}})
    config = TrialConfig.from_flat(
        {"task": "stage_classification", "data.shards": shards, "data.folds_file": folds_file, "seed": 3,
         "schedule.epochs": EPOCHS, "schedule.max_steps_per_epoch": 1, "data.effective_batch": 2,
         "model.vision": "resnet10_3d", "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]},
         "model.text": "bert_tiny", "model.fusion": "concat", "model.hidden": 32, "optimiser.lr": 1e-3}
    )  # fmt: skip
    events: list = []
    whole = _train(config, None, events)
    assert [r["epoch"] for r in whole] == list(range(EPOCHS))
    for r in whole:  # the objective a search sees: the folds' mean, each fold's score beside it
        assert r["val_primary"] == pytest.approx((r["fold0_val_primary"] + r["fold1_val_primary"]) / 2)
    assert "test_primary" in whole[-1] and "test_primary" not in whole[0]
    # the folds' runs end once both have tested, just before the last report (where ASHA may stop the trial)
    assert events[-3:] == [("end", 0), ("end", 1), ("report", EPOCHS - 1, True)]
    assert all(e[0] == "report" for e in events[:-3])

    kept = tmp_path / "checkpoint"
    _train(config, None, [], stop_at=0, kept=kept)
    assert sorted(p.name for p in kept.iterdir()) == [FOLD_FOLDER.format(f) for f in range(FOLDS)]
    resumed = _train(config, tune.Checkpoint.from_directory(str(kept)), [])
    assert [r["epoch"] for r in resumed] == list(range(1, EPOCHS))
    keys = ("val_primary", "fold0_val_primary", "fold1_val_primary", "test_primary", "best_val_primary")
    flat = [r[k] for r in resumed for k in keys]  # to the digit (NaN where the tiny test split has one class)
    assert flat == pytest.approx([r[k] for r in whole[1:] for k in keys], rel=0, abs=0, nan_ok=True)
    shutil.rmtree(kept)
