"""Resuming: ``--resume`` continues only the sweep it was started as (a changed space or cohort is refused naming the
change, before Ray or MLflow start), and a trial retried from its checkpoint ends as the uninterrupted one."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gx_ray.sweep.driver import _sweep_id
from gx_ray.sweep.resume import ResumeError, check_resumable, record_inputs, sweep_inputs
from gx_ray.sweep.spaces import load_space
from gx_ray.train import loop
from gx_ray.train.config import TrialConfig
from tests.common import ROOT, small_stage_space


def _space_file(tmp_path: Path, **fixed) -> Path:
    description = "two stage-classification trials, started and resumed"
    budget = {"samples": 1, "time_s": 600}
    return small_stage_space(tmp_path / "space.yaml", 2, [0, 1], description, budget, **{"optimiser.lr": 1e-3, **fixed})


@pytest.fixture
def cohort(tmp_path: Path) -> Path:
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text(json.dumps({"files": [{"path": "train-00000.parquet"}]}), encoding="utf-8")
    return shards


def _edit_budget(space_path: Path, **budget) -> None:
    document = yaml.safe_load(space_path.read_text(encoding="utf-8"))
    document["budget"].update(budget)
    space_path.write_text(yaml.safe_dump(document), encoding="utf-8")


def _started(tmp_path: Path, space_path: Path, shards: Path) -> tuple[Path, str]:
    space = load_space(str(space_path))
    sweep_id = _sweep_id(space, shards)
    output = tmp_path / "out"
    (output / sweep_id).mkdir(parents=True)
    record_inputs(output / sweep_id, sweep_inputs(space, shards))
    return output, sweep_id


def test_the_same_space_and_cohort_resume(tmp_path, cohort):
    output, sweep_id = _started(tmp_path, _space_file(tmp_path), cohort)
    space = load_space(str(_space_file(tmp_path)))
    check_resumable(output, sweep_id, sweep_inputs(space, cohort))  # no error


def test_an_edited_space_is_refused_naming_the_key(tmp_path, cohort):
    output, _ = _started(tmp_path, _space_file(tmp_path), cohort)
    edited = load_space(str(_space_file(tmp_path, **{"optimiser.lr": 3e-4})))  # a new sweep id
    with pytest.raises(ResumeError, match=r"space\.fixed\.optimiser\.lr: 0\.001 → 0\.0003"):
        check_resumable(output, _sweep_id(edited, cohort), sweep_inputs(edited, cohort))


def test_an_edit_outside_the_sweep_id_is_refused_too(tmp_path, cohort):
    """The searcher's sample count is not part of the id: the same id, a different sweep."""
    space_path = _space_file(tmp_path)
    output, sweep_id = _started(tmp_path, space_path, cohort)
    _edit_budget(space_path, samples=4)
    edited = load_space(str(space_path))
    assert _sweep_id(edited, cohort) == sweep_id
    with pytest.raises(ResumeError, match=r"space\.samples: 1 → 4"):
        check_resumable(output, sweep_id, sweep_inputs(edited, cohort))


def test_a_changed_cohort_is_refused(tmp_path, cohort):
    output, sweep_id = _started(tmp_path, _space_file(tmp_path), cohort)
    (cohort / "manifest.json").write_text(json.dumps({"files": [{"path": "train-00001.parquet"}]}), encoding="utf-8")
    space = load_space(str(_space_file(tmp_path)))
    with pytest.raises(ResumeError, match="the cohort"):
        check_resumable(output, sweep_id, sweep_inputs(space, cohort))


def test_the_time_budget_may_change(tmp_path, cohort):
    space_path = _space_file(tmp_path)
    output, sweep_id = _started(tmp_path, space_path, cohort)
    _edit_budget(space_path, time_s=7200)
    check_resumable(output, sweep_id, sweep_inputs(load_space(str(space_path)), cohort))


def test_resume_without_a_sweep_exits_2_before_ray_starts(tmp_path, cohort):
    command = [
        sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", str(_space_file(tmp_path)),
        "--data", str(cohort), "--output", str(tmp_path / "nothing"), "--resume",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no sweep of space 'space'" in done.stderr and "without --resume" in done.stderr
    assert not (tmp_path / "nothing").exists()  # nothing was started or written


def test_the_demo_cohort_is_prepared_once(ray_cluster, tmp_path):
    """A second sweep (or a --resume) on the demo reuses its shards: preparing them again would rewrite the cohort
    a resumed sweep checks against."""
    from gx_ray.sweep.driver import SweepOptions, _prepare_demo

    options = SweepOptions(space="modality_ablation", demo_dir=tmp_path / "demo", demo_cases=6)
    _prepare_demo(options)
    manifest = tmp_path / "demo" / "shards" / "manifest.json"
    written = manifest.stat().st_mtime_ns
    from gx_ray.sweep.driver import DEMO_FRACTIONS

    splits = json.loads((tmp_path / "demo" / "shards" / "split.json").read_text(encoding="utf-8"))
    assert tuple(splits["fractions"].values()) == DEMO_FRACTIONS  # the demo's test-heavy split, not the paper's
    _prepare_demo(options)
    assert manifest.stat().st_mtime_ns == written


# --- a trial resumed from its checkpoint ------------------------------------------------------------------


RESUMED_TASKS = {
    "stage_classification": {},
    # the demo preset's report writing: its own vocabulary, the final epoch tested
    "report_generation": {"task_options.vocabulary": "training", "task_options.max_report_tokens": 24,
                          "task_options.max_new_tokens": 8, "schedule.select": "last"},
}  # fmt: skip


@pytest.mark.parametrize("task", RESUMED_TASKS)
def test_a_trial_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(ray_cluster, demo_prepared, tmp_path, task):
    """A trial retried from its last checkpoint (its worker or node lost) trains on exactly as if nothing happened:
    the checkpoint keeps the random generators' state with the weights (dropout draws from torch's), so every later
    epoch's loss and validation, and the test score, are the uninterrupted run's, bit for bit on the CPU."""
    from ray.train import Checkpoint

    config = TrialConfig.from_flat(
        {"task": task, "data.shards": str(demo_prepared.shard_dir), "schedule.epochs": 3,
         "schedule.max_steps_per_epoch": 2, "data.effective_batch": 2, "model.vision": "resnet10_3d",
         "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.text": "bert_tiny",
         "model.fusion": "concat", "model.hidden": 32, "seed": 3, "data.in_memory": True, "data.shuffle_buffer": 2,
         **RESUMED_TASKS[task]}
    )  # fmt: skip

    def run(latest: Checkpoint | None) -> list[dict]:
        reports: list[dict] = []

        def report(metrics: dict, checkpoint: Checkpoint | None = None) -> None:
            reports.append(dict(metrics))
            if checkpoint is not None and metrics["epoch"] == 0:  # the one a retried trial would start from
                checkpoint.to_directory(str(tmp_path / "epoch0"))

        loop.run_loop(
            config,
            loop.WorkerContext(
                rank=0, world_size=1, device=torch.device("cpu"), report=report, latest_checkpoint=latest
            ),
        )
        return reports

    whole = run(None)
    torch.manual_seed(12345)  # a retried trial's process has drawn other numbers before it resumes
    random.seed(12345)
    np.random.seed(12345)
    resumed = run(Checkpoint.from_directory(str(tmp_path / "epoch0")))
    assert [r["epoch"] for r in whole] == [0, 1, 2] and [r["epoch"] for r in resumed] == [1, 2]
    compared = ("train_loss", "val_primary", "val_accuracy", "test_primary", "test_accuracy")  # None where none
    for before, after in zip(whole[1:], resumed, strict=True):
        assert {k: before.get(k) for k in compared} == {k: after.get(k) for k in compared}
    assert whole[-1]["train_loss"] != whole[-2]["train_loss"]  # the epochs did train
