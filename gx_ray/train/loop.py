"""The per-worker training loop of a trial: one readable function that Ray Train's workers and a one-worker Tune trial
both run (torchtune style: the recipe is the loop; no trainer framework in between).

Per epoch: stream the worker's share of the training split, AdamW with the text encoder at its own learning rate,
linear warm-up then linear decay, gradient accumulation, bf16 autocast on GPU; validate with the task's metric;
report the epoch's metrics and a checkpoint (the latest and the best model). After the last epoch the best
model scores the test split. Metrics go to Ray (Tune sees them) and, from rank 0, to the trial's MLflow run.
"""

from __future__ import annotations

import copy
import json
import math
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import get_linear_schedule_with_warmup

from gx_ray.data.shards import TENSOR_COLUMNS, BatchCollate, TensorLayout, read_manifest, split_files
from gx_ray.data.splits import SPLITS
from gx_ray.models.registry import build_encoder, param_groups
from gx_ray.runtime import quiet_data_context
from gx_ray.tasks import TaskModel, build_task, gather_state
from gx_ray.train.config import TrialConfig
from gx_ray.train.tracker import TrialTracker

CHECKPOINT_FILE = "state.pt"


@dataclass
class WorkerContext:
    """Where this copy of the loop runs: its rank, its device, its data, and how it reports."""

    rank: int
    world_size: int
    device: torch.device
    data: dict[str, Any]
    """split → Ray DataIterator of this worker's share."""
    report: Callable[..., None]
    """``report(metrics, checkpoint=None)``: ray.train.report or ray.tune.report."""
    latest_checkpoint: Any
    """The checkpoint to resume from (Ray's), or None."""
    tracker: Any = None
    """Logs metrics and artifacts to the trial's MLflow run (rank 0 only), or None."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast(config: TrialConfig, device: torch.device):
    use_bf16 = config.amp == "bf16" or (config.amp == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


def batches(iterator: Any, layout: TensorLayout, batch_size: int, shuffle: int, seed: int) -> Iterator[dict]:
    return iterator.iter_torch_batches(
        batch_size=batch_size,
        collate_fn=BatchCollate(layout),
        prefetch_batches=2,
        local_shuffle_buffer_size=shuffle or None,
        local_shuffle_seed=seed if shuffle else None,
    )


def evaluate(
    model: TaskModel, task: Any, data: Any, layout: TensorLayout, config: TrialConfig, device, records: bool = False
) -> tuple[dict, list]:
    """The task's metrics over one split and, with ``records``, its prediction records; both gathered over all
    ranks. Validation every epoch needs only the metrics; the test split's records are logged."""
    model.eval()
    metric, kept = task.metric(), []
    size = config.data.eval_batch_size or config.data.batch_size
    with torch.no_grad(), autocast(config, device):
        for batch in batches(data, layout, size, 0, 0):
            outputs = model(batch)
            metric.update(outputs, batch)
            if records:
                kept += task.predict(outputs, batch)
    if not records:
        return metric.compute(), []
    # every rank's records (a collective call, like the metric's): the test predictions logged are the whole split's
    return metric.compute(), [r for part in gather_state({"records": [kept]}).get("records", []) for r in part]


def run_loop(config: TrialConfig, ctx: WorkerContext) -> dict[str, float]:
    """Train, validate every epoch, test the best model; returns the final metrics."""
    setup_started = time.perf_counter()
    seed_everything(config.seed)
    manifest = read_manifest(Path(config.data.shards))
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    task = build_task(config.task, **config.task_options)
    task.prepare(_train_rows(Path(config.data.shards), task))  # fitted on the training split only
    model = TaskModel(task, build_encoder(config.model, config.schema), config.schema).to(ctx.device)
    groups = param_groups(
        model, config.optimiser.lr, config.optimiser.weight_decay, config.optimiser.text_lr_multiplier
    )
    optimiser = torch.optim.AdamW(groups)
    per_rank = math.ceil(manifest["rows"]["train"] / ctx.world_size)
    steps_per_epoch = math.ceil(per_rank / (config.data.batch_size * config.data.grad_accum))
    if config.schedule.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, config.schedule.max_steps_per_epoch)
    total_steps = max(1, steps_per_epoch * config.schedule.epochs)
    scheduler = get_linear_schedule_with_warmup(
        optimiser, math.ceil(config.schedule.warmup_fraction * total_steps), total_steps
    )
    train_model = model
    if ctx.world_size > 1:  # Ray Train has set up the process group
        device_ids = [ctx.device] if ctx.device.type == "cuda" else None
        train_model = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)

    start_epoch, best = 0, {"score": -math.inf, "epoch": -1, "state": None}
    if ctx.latest_checkpoint is not None:
        with ctx.latest_checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best = state["epoch"] + 1, state["best"]

    sign = 1.0 if task.mode == "max" else -1.0
    metrics: dict[str, float] = {}
    timing = {"setup_seconds": time.perf_counter() - setup_started, "train_seconds": 0.0}
    for epoch in range(start_epoch, config.schedule.epochs):
        started = time.perf_counter()
        model.train()
        losses, samples = [], 0
        seed = config.seed * 1000 + epoch
        for step, batch in enumerate(
            batches(ctx.data["train"], layout, config.data.batch_size, config.data.shuffle_buffer, seed)
        ):
            if step >= steps_per_epoch * config.data.grad_accum:
                break
            with autocast(config, ctx.device):
                loss = task.loss(train_model(batch), batch) / config.data.grad_accum
            loss.backward()
            losses.append(loss.item() * config.data.grad_accum)
            samples += len(batch["case_id"])
            if (step + 1) % config.data.grad_accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimiser.grad_clip)
                optimiser.step()
                scheduler.step()
                optimiser.zero_grad(set_to_none=True)
        train_seconds = time.perf_counter() - started
        val, _ = evaluate(model, task, ctx.data["val"], layout, config, ctx.device)
        score = sign * val[task.primary_metric]
        score = -math.inf if math.isnan(score) else score  # undefined on this split: never better than a number
        if best["state"] is None or score > best["score"] or score == best["score"] == -math.inf:
            best = {"score": score, "epoch": epoch, "state": copy.deepcopy(model.state_dict())}
        metrics = {
            "epoch": epoch,
            "train_loss": float(np.mean(losses)) if losses else math.nan,
            "lr": scheduler.get_last_lr()[0],
            "epoch_seconds": time.perf_counter() - started,
            "train_samples_per_second": samples * ctx.world_size / train_seconds,
            **{f"val_{k}": v for k, v in val.items()},
            "val_primary": val[task.primary_metric],
            "best_val_primary": sign * best["score"] if math.isfinite(best["score"]) else math.nan,
        }
        if ctx.tracker:
            ctx.tracker.log_metrics(metrics, step=epoch)
        if epoch == config.schedule.epochs - 1:  # the best model scores the test split
            model.load_state_dict(best["state"])
            test, records = evaluate(model, task, ctx.data["test"], layout, config, ctx.device, records=True)
            timing["train_seconds"] += time.perf_counter() - started
            final = {
                **{f"test_{k}": v for k, v in test.items()},
                "test_primary": test[task.primary_metric],
                "best_epoch": best["epoch"],
                **timing,
            }
            metrics.update(final)
            if ctx.tracker:
                ctx.tracker.log_metrics(final, step=epoch)
                ctx.tracker.log_predictions(records, task)
        else:
            timing["train_seconds"] += time.perf_counter() - started
        _report(ctx, metrics, model, optimiser, scheduler, epoch, best)
    return metrics


def _report(ctx: WorkerContext, metrics: dict, model, optimiser, scheduler, epoch: int, best: dict) -> None:
    """Report the epoch with a checkpoint holding the latest state and the best weights so far."""
    from ray.train import Checkpoint

    if ctx.rank != 0:
        ctx.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as folder:
        state = {
            "model": model.state_dict(),
            "optimiser": optimiser.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "best": best,
        }
        torch.save(state, Path(folder) / CHECKPOINT_FILE)
        (Path(folder) / "metrics.json").write_text(json.dumps(metrics, default=float), encoding="utf-8")
        ctx.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def _train_rows(shard_dir: Path, task: Any) -> list[dict]:
    """The training split's rows without the image columns (what a task may learn from, e.g. VQA answers)."""
    files = split_files(shard_dir, "train")
    columns = [c for c in pq.read_schema(files[0]).names if c not in TENSOR_COLUMNS]
    return [row for f in files for row in pq.read_table(f, columns=columns).to_pylist()]


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train's entry point (one call per DDP rank): the same loop, fed by this rank's dataset shards."""
    import ray.train
    import ray.train.torch

    quiet_data_context()
    config = TrialConfig.from_flat(loop_config["trial"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    data = {split: ray.train.get_dataset_shard(split) for split in SPLITS}
    tracker = TrialTracker(loop_config["tracking_uri"], loop_config["run_id"]) if rank == 0 else None
    worker = WorkerContext(
        rank,
        context.get_world_size(),
        ray.train.torch.get_device(),
        data,
        ray.train.report,
        ray.train.get_checkpoint(),
        tracker,
    )
    run_loop(config, worker)
