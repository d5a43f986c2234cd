"""The training loop (:mod:`gx_ray.train.loop`): the learning-rate schedule (torch's own schedulers give
transformers' linear warm-up and decay step for step), the run ended before the last report, the test split scored
with the last or the best-validated epoch's model, and a two-worker DDP trial on CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from transformers import get_linear_schedule_with_warmup

from gx_ray.data import stream as data_stream
from gx_ray.sweep.driver import EXPERIMENT, SweepOptions, run_sweep
from gx_ray.tracking import PARENT_TAG
from gx_ray.tracking.server import LocalMlflowServer
from gx_ray.train import loop
from gx_ray.train.build import build_trial
from gx_ray.train.config import TrialConfig
from gx_ray.train.loop import linear_warmup_decay


def _rates(make, total: int) -> list[float]:
    optimiser = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    scheduler = make(optimiser)
    rates = []
    for _ in range(total):  # the learning rate of each optimiser step a trial takes
        rates.append(optimiser.param_groups[0]["lr"])
        optimiser.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("seed", range(40))
def test_the_schedule_is_transformers_linear_warmup_and_decay(seed):
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 400))
    warmup = int(rng.integers(0, total + 2)) if seed % 4 else [0, 1, total, total - 1][seed // 4 % 4]
    ours = _rates(lambda o: linear_warmup_decay(o, warmup, total), total)
    theirs = _rates(lambda o: get_linear_schedule_with_warmup(o, warmup, total), total)
    np.testing.assert_allclose(ours, theirs, atol=1e-9)


def test_a_resumed_schedule_goes_on_where_it_stopped():
    optimiser = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = linear_warmup_decay(optimiser, 3, 10)
    for _ in range(5):
        optimiser.step()
        scheduler.step()
    state = scheduler.state_dict()
    again = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed = linear_warmup_decay(again, 3, 10)
    again.load_state_dict(optimiser.state_dict())
    resumed.load_state_dict(state)
    assert again.param_groups[0]["lr"] == pytest.approx(optimiser.param_groups[0]["lr"]) == pytest.approx(5 / 7)


@pytest.mark.parametrize("restored_at", [0, 2, 5, 9])  # before, within and after the warm-up
@pytest.mark.parametrize("lr", [1e-3, 2e-3, 5e-4])
def test_a_restored_schedule_takes_the_configs_rate_and_keeps_its_shape(restored_at, lr):
    """``apply_optimiser_settings``: an unchanged rate keeps the restored schedule itself (every later rate bit for bit
    the uninterrupted one's); a changed one goes on at the uninterrupted rates times the ratio, weight decay too."""
    from types import SimpleNamespace

    from gx_ray.models.registry import param_groups

    def fresh(rate: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        model = torch.nn.Linear(3, 1)
        optimiser = torch.optim.AdamW(param_groups(model, rate, 0.01, 1.0), lr=rate)
        return model, optimiser, linear_warmup_decay(optimiser, 3, 10)

    def step(optimiser, scheduler, times: int) -> list[float]:
        rates = []
        for _ in range(times):
            rates.append(scheduler.get_last_lr()[0])
            optimiser.step()
            scheduler.step()
        return rates

    _, optimiser, scheduler = fresh(1e-3)
    whole = step(optimiser, scheduler, 10)
    _, optimiser, scheduler = fresh(1e-3)
    step(optimiser, scheduler, restored_at)
    model, again, resumed = fresh(1e-3)
    again.load_state_dict(optimiser.state_dict())
    resumed.load_state_dict(scheduler.state_dict())
    config = SimpleNamespace(optimiser=SimpleNamespace(lr=lr, weight_decay=0.2, text_lr_multiplier=1.0))
    rebuild = lambda: linear_warmup_decay(again, 3, 10)  # noqa: E731
    going_on = loop.apply_optimiser_settings(config, model, again, resumed, rebuild)
    later = step(again, going_on, 10 - restored_at)
    if lr == 1e-3:
        assert going_on is resumed and later == whole[restored_at:]
    else:
        assert later == pytest.approx([r * lr / 1e-3 for r in whole[restored_at:]], rel=1e-9)
    assert [g["weight_decay"] for g in again.param_groups] == [0.2, 0.0]  # the bias is never decayed


# --- the loop ---------------------------------------------------------------------------------------------


class _StoppedByTheScheduler(Exception):
    """What a scheduler's stop looks like to the loop: its report never returns."""


class _Predictions:
    """A tracker that keeps which split each ``log_predictions`` call logged and its cases (nothing else)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log_predictions(self, records: list[dict], task, split: str = "test") -> None:
        self.calls.append((split, sorted(r["case_id"] for r in records)))

    def __getattr__(self, name: str):  # tags, metrics, points: not what this test reads
        return lambda *args, **kwargs: None


def test_the_run_ends_before_the_last_report_which_a_scheduler_may_stop_the_trial_at(ray_cluster, demo_prepared):
    """ASHA stops every trial at the report of its last epoch, and nothing after that report runs: the hook that
    ends the trial's run (status, telemetry) is called once the test split is scored, before that report. Before it, a
    single-split trial logs its tested model's predictions on the test and on the validation patients (what a
    selection-corrected estimate of a single-split sweep resamples)."""
    config = TrialConfig.from_flat(
        {"task": "stage_classification", "data.shards": str(demo_prepared.shard_dir), "schedule.epochs": 2,
         "schedule.max_steps_per_epoch": 1, "data.effective_batch": 2, "model.vision": "resnet10_3d",
         "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.text": "bert_tiny",
         "model.fusion": "concat", "model.hidden": 32}
    )  # fmt: skip
    calls = []

    def report(metrics: dict, checkpoint=None) -> None:
        calls.append(("report", "test_primary" in metrics))
        if "test_primary" in metrics:
            raise _StoppedByTheScheduler

    ctx = loop.WorkerContext(
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        report=report,
        latest_checkpoint=None,
        before_final_report=lambda: calls.append("end"),
        tracker=_Predictions(calls),
    )
    with pytest.raises(_StoppedByTheScheduler):
        loop.run_loop(config, ctx)
    cases = {s: sorted(r["case_id"] for r in data_stream.split_rows(config.data.shards, s)) for s in ("test", "val")}
    assert calls == [("report", False), ("test", cases["test"]), ("val", cases["val"]), "end", ("report", True)]
    assert cases["val"] and not set(cases["val"]) & set(cases["test"])


def test_the_loop_stops_after_the_epochs_its_context_asks_for(ray_cluster, demo_prepared):
    """``stop_after_epochs`` (the budget's pilot): the loop returns after that many epochs' reports, the test split
    not scored and the run's end not called; nothing raised."""
    config = TrialConfig.from_flat(
        {"task": "stage_classification", "data.shards": str(demo_prepared.shard_dir), "schedule.epochs": 3,
         "schedule.max_steps_per_epoch": 1, "data.effective_batch": 2, "model.vision": "resnet10_3d",
         "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.text": "bert_tiny",
         "model.fusion": "concat", "model.hidden": 32}
    )  # fmt: skip
    reports, ended = [], []
    ctx = loop.WorkerContext(
        rank=0, world_size=1, device=torch.device("cpu"), report=lambda m, checkpoint=None: reports.append(dict(m)),
        latest_checkpoint=None, before_final_report=lambda: ended.append(True), stop_after_epochs=2,
    )  # fmt: skip
    metrics = loop.run_loop(config, ctx)
    assert [r["epoch"] for r in reports] == [0, 1] and metrics == reports[-1]
    assert not any("test_primary" in r for r in reports) and not ended


def test_select_last_tests_the_final_epochs_model_where_best_tests_the_best_validated_one(
    ray_cluster, demo_prepared, tmp_path
):
    """``schedule.select``: the same training either way (same seed, same per-epoch validation); ``last`` scores the
    test split with the final epoch's weights (as the last checkpoint keeps them, re-scored here from scratch),
    ``best`` with the best-validated epoch's; anything else is refused naming the key."""
    from ray.train import Checkpoint

    flat = {"task": "vqa", "data.shards": str(demo_prepared.shard_dir), "schedule.epochs": 4,
            "schedule.max_steps_per_epoch": 2, "data.effective_batch": 2, "model.vision": "resnet10_3d",
            "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.text": "bert_tiny",
            "model.fusion": "concat", "model.hidden": 32, "seed": 5}  # fmt: skip

    def run(select: str) -> tuple[TrialConfig, list[dict], Path]:
        config = TrialConfig.from_flat({**flat, "schedule.select": select})
        reports: list[dict] = []
        kept = tmp_path / select

        def report(metrics: dict, checkpoint: Checkpoint | None = None) -> None:
            reports.append(dict(metrics))
            if checkpoint is not None and metrics["epoch"] == config.schedule.epochs - 1:
                checkpoint.to_directory(str(kept))

        loop.run_loop(
            config,
            loop.WorkerContext(rank=0, world_size=1, device=torch.device("cpu"), report=report, latest_checkpoint=None),
        )
        return config, reports, kept

    def rescored(config: TrialConfig, kept: Path) -> float:
        task, model, layout = build_trial(config, torch.device("cpu"))
        state = torch.load(kept / loop.CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        stream = data_stream.SplitStream(
            config.data, "test", layout, config.data.eval_batch_size or 2, seed=config.seed
        )
        return loop.evaluate(model, task, stream, config, torch.device("cpu"))[0][task.primary_metric]

    last_config, last, last_kept = run("last")
    best_config, best, best_kept = run("best")
    assert [r["val_primary"] for r in last] == [r["val_primary"] for r in best]  # the same training
    assert last[-1]["best_epoch"] == 3 and last[-1]["best_val_primary"] == last[-1]["val_primary"]
    assert last[-1]["test_primary"] == pytest.approx(rescored(last_config, last_kept), abs=1e-9)
    vals = [r["val_primary"] for r in best]
    assert best[-1]["best_epoch"] == vals.index(max(vals)) < 3  # (not the last here: the two selections differ)
    tested = [torch.load(k / loop.CHECKPOINT_FILE, weights_only=True)["model"] for k in (last_kept, best_kept)]
    assert any(not torch.equal(tested[0][name], tested[1][name]) for name in tested[0])  # two models were tested
    assert best[-1]["test_primary"] == pytest.approx(rescored(best_config, best_kept), abs=1e-9)
    with pytest.raises(ValueError, match="schedule.select"):
        TrialConfig.from_flat({**flat, "schedule.select": "worst"})


# --- DDP on CPU -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_two_worker_ddp_trial_trains_each_rank_on_its_own_rows(ray_cluster, demo_prepared, tmp_path):
    """Two Ray Train workers (gloo) train one trial: one MLflow run, its effective batch 2 ranks x micro-batch x
    accumulation, and the ranks' weights in step (DDP averaged the gradients: the test metrics exist)."""
    document = {
        "description": "two-worker DDP trial",
        "fixed": {
            "task": "stage_classification",
            "schema": "image_only",
            "model.vision": "resnet10_3d",
            "model.vision_kwargs": {"block_inplanes": [4, 8, 8, 8]},
            "model.text": "bert_tiny",
            "model.hidden": 16,
            "optimiser.lr": 1.0e-3,
            "schedule.epochs": 2,
            "data.effective_batch": 4,
            "data.micro_batch": 1,
        },
        "grid": {"seed": [0]},
        "resources": {"workers": 2, "cpus_per_worker": 0.5, "gpus_per_worker": 0},
    }
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    with LocalMlflowServer(tmp_path / "mlflow") as server:
        result = run_sweep(
            SweepOptions(space=str(path), output=tmp_path, data=demo_prepared.shard_dir, mlflow_uri=server.uri)
        )
        assert (result.finished, result.failed) == (1, 0)
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        (child,) = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{result.parent_run_id}'"
        )
        metrics = child.data.metrics
        assert child.info.status == "FINISHED" and child.data.params["resources.workers"] == "2"
        # `auto` kept each rank's share of the tiny cohort in memory, and the run says so split by split
        assert {s: child.data.tags[f"gx_ray.in_memory.{s}"] for s in ("train", "val", "test")} == dict.fromkeys(
            ("train", "val", "test"), "true"
        )
        assert (metrics["micro_batch"], metrics["accumulation"], metrics["effective_batch"]) == (1, 2, 4)
        assert np.isfinite(metrics["train_loss"]) and "test_accuracy" in metrics
        losses = [m.step for m in client.get_metric_history(child.info.run_id, "train_loss")]
        assert losses == [0, 1]  # rank 0 logs each epoch once
