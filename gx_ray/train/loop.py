"""The per-worker training loop of a trial: one readable function that Ray Train's workers and a one-worker Tune trial
both run (torchtune style: the recipe is the loop; no trainer framework in between).

Per epoch: stream this rank's share of the training split in a seeded per-epoch order, AdamW with the text encoder at
its own learning rate, linear warm-up then linear decay, micro-batches accumulated to the effective batch, bf16
autocast on GPU; validate with the task's metric; report the epoch's metrics and a checkpoint (the latest and the
best model). After the last epoch the best model scores the test split. Metrics go to Ray (Tune sees them) and,
from rank 0, to the trial's MLflow run.

What keeps a GPU busy here: batches are collated and pinned in Ray's prefetch threads and copied to the GPU one batch
ahead; the loss is read once per epoch, not per step (a read waits for the GPU); the next epoch's first batch is
fetched while this epoch validates; each rank reads its own row groups (no coordinator between ranks); DDP looks
for unused parameters only when a measured step found some.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gx_ray.data.shards import TensorLayout
from gx_ray.data.stream import SplitStream, first_rows, on_device, split_rows
from gx_ray.models.registry import param_groups
from gx_ray.runtime import quiet_data_context
from gx_ray.tasks import TaskModel, gather_state
from gx_ray.tracking import TrialTracker
from gx_ray.train import probe
from gx_ray.train.build import autocast, build_trial, loss_function
from gx_ray.train.config import TrialConfig

CHECKPOINT_FILE = "state.pt"
CONFIG_FILE = "config.json"
"""Beside a checkpoint's state: the flat config that trained it (a trial restored from it compares its own)."""


@dataclass(kw_only=True)
class WorkerContext:
    """Where this copy of the loop runs: its rank, its device, and how it reports."""

    rank: int
    world_size: int
    device: torch.device
    report: Callable[..., None]
    """``report(metrics, checkpoint=None)``: ray.train.report or ray.tune.report."""
    latest_checkpoint: Any
    """The checkpoint to resume from (Ray's), or None."""
    tracker: Any = None
    """Logs metrics and artifacts to the trial's MLflow run (rank 0 only), or None."""
    micro_batch: int | None = None
    """The micro-batch measured for this trial before it started (``gpus_per_worker: auto``), or None."""
    timing: dict[str, float] = field(default_factory=dict)
    """Start-up seconds measured before the loop (added to the loop's own timing metrics)."""
    before_final_report: Callable[[], None] | None = None
    """Called once the test split is scored, just before the last report: a scheduler that stops the trial at that
    report (ASHA stops every trial that reaches its last epoch) ends the trial there, so the run's own end (its
    status, GPU telemetry) must be written first."""
    on_restore: Callable[[dict[str, Any]], None] | None = None
    """Called once ``latest_checkpoint`` is restored, with what was restored: ``epoch`` (the checkpoint's),
    ``weights_sha256`` (of the weights now in the model), ``config`` (the flat config that wrote it) and ``path``.
    A trial restored from another trial's checkpoint (a PBT exploit) records it from here."""
    drain: Any = None
    """A :class:`~gx_ray.preemption.DrainWatch` of the trial's node, or None: seen draining between two optimiser
    steps, the loop checkpoints where it is within the epoch and raises :class:`~gx_ray.preemption.NodePreempted`."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def random_state() -> dict[str, Any]:
    """Every random generator a trial draws from (Python's, NumPy's global, torch's CPU and CUDA ones), in what a
    ``weights_only`` checkpoint holds: a trial resumed with :func:`restore_random_state` draws what the uninterrupted
    one would have (its dropout masks among them)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }  # fmt: skip


def restore_random_state(state: dict[str, Any]) -> None:
    """The generators as :func:`random_state` saved them; a checkpoint without one (older) leaves them as seeded."""
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def stream_of(
    config: TrialConfig, split: str, layout: TensorLayout, ctx: WorkerContext, batch_size: int
) -> SplitStream:
    """This rank's stream of ``split``, in the trial's seeded order."""
    return SplitStream(
        config.data, split, layout, batch_size, seed=config.seed, rank=ctx.rank, world_size=ctx.world_size,
        device=ctx.device, cpus_per_worker=config.resources.cpus_per_worker,
    )  # fmt: skip


def evaluate(
    model: TaskModel, task: Any, stream: SplitStream, config: TrialConfig, device, records: bool = False
) -> tuple[dict, list]:
    """The task's metrics over one split and, with ``records``, its prediction records; both gathered over all
    ranks. Validation every epoch needs only the metrics; the test split's records are logged."""
    model.eval()
    metric, kept = task.metric(), []
    with torch.no_grad(), autocast(config, device):
        for batch in stream.batches(0):
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
    # the task's fit and, at the end, its chance level (under cross-validation: the fold's training patients)
    train_rows = split_rows(config.data.shards, "train", config.data.folds_file, config.data.fold, config.data.refit)
    task, model, layout = build_trial(config, ctx.device, train_rows)
    built = time.perf_counter() - setup_started
    parameters = sum(p.numel() for p in model.parameters())  # every report: a search may minimise it
    micro = ctx.micro_batch or probe.micro_batch_for(config, model, task, layout, ctx.device, ctx.world_size)[0]
    accumulation = config.data.accumulation(ctx.world_size, micro)
    if ctx.tracker:
        ctx.tracker.set_tags({"gx_ray.micro_batch": str(micro), "gx_ray.accumulation": str(accumulation)})
    eval_size = config.data.eval_batch_size or micro
    streams = {split: stream_of(config, split, layout, ctx, micro if split == "train" else eval_size)
               for split in ("train", "val", "test")}  # fmt: skip
    if ctx.tracker:  # with `auto`, which way each split went (a share too large for the host streams)
        ctx.tracker.set_tags({f"gx_ray.in_memory.{split}": str(s.in_memory).lower() for split, s in streams.items()})
    train = streams["train"]
    optimiser = probe.adamw(
        param_groups(model, config.optimiser.lr, config.optimiser.weight_decay, config.optimiser.text_lr_multiplier),
        config.optimiser.lr,
    )
    epochs = range(config.schedule.epochs)
    steps = {epoch: optimiser_steps(train.fewest_rows(epoch), micro, accumulation, config) for epoch in epochs}
    if ctx.world_size > 1 and min(steps.values()) < 1:
        raise ValueError(
            f"the training split has too few rows for an effective batch of {config.data.effective_batch} on "
            f"{ctx.world_size} ranks ({train.fewest_rows(0)} rows on the smallest rank)"
        )
    total_steps = max(1, sum(steps.values()))
    scheduler = linear_warmup_decay(optimiser, math.ceil(config.schedule.warmup_fraction * total_steps), total_steps)
    start_epoch, best = 0, {"score": -math.inf, "epoch": -1, "state": None}
    partial = None  # the steps of an epoch a preempted node interrupted (gx_ray.preemption)
    if ctx.latest_checkpoint is not None:
        with ctx.latest_checkpoint.as_directory() as folder:
            # tensors and plain data only: a checkpoint on shared storage is not a program anyone may plant
            state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
            config_file = Path(folder) / CONFIG_FILE
            written_by = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        model.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        scheduler.load_state_dict(state["scheduler"])
        # the optimiser's state holds the learning rates it was saved with: a config changed since (a PBT exploit's
        # mutation, a replayed schedule) takes effect from here, the schedule's shape kept
        apply_optimiser_settings(config, model, optimiser, scheduler)
        start_epoch, best = state["epoch"] + 1, state["best"]
        if partial := state.get("partial"):
            start_epoch = partial["epoch"]
        if "random" in state:
            restore_random_state(state["random"])
        if ctx.tracker:  # a retried trial (its node lost, say) goes on from here: the run tells where it resumed
            ctx.tracker.log_metrics({"resumed_from_epoch": start_epoch}, step=start_epoch)
        if ctx.on_restore:
            restored = {"epoch": state["epoch"], "weights_sha256": weights_sha256(model.state_dict())}
            ctx.on_restore({**restored, "config": written_by, "path": str(ctx.latest_checkpoint.path)})
    train.prefetch(start_epoch)  # reads start while DDP is set up
    train_model, no_sync = model, None
    if ctx.world_size > 1:  # Ray Train has set up the process group
        train_model = _ddp(model, task, config, ctx, first_rows(config.data.shards, "train", micro, layout))
        no_sync = train_model.no_sync

    loss_of = loss_function(task, config, ctx.device)
    sign = 1.0 if task.mode == "max" else -1.0
    metrics: dict[str, float] = {}
    timing = {
        **ctx.timing,
        "setup_seconds": time.perf_counter() - setup_started,
        "build_seconds": built,  # of setup_seconds: the training rows' ids and the model (its imports the first time)
        "train_seconds": 0.0,
        "micro_batch": micro,
        "accumulation": accumulation,
        "effective_batch": micro * accumulation * ctx.world_size,
    }
    for epoch in range(start_epoch, config.schedule.epochs):
        started = time.perf_counter()
        model.train()
        loss_sum, micro_steps, samples = torch.zeros((), device=ctx.device), 0, 0
        group: list[dict] = []
        rates: list[float] = []  # the learning rate of each optimiser step (warm-up, then linear decay)
        skip = 0
        if partial and partial["epoch"] == epoch:  # resumed within the epoch: its steps so far are not taken again
            loss_sum += partial["loss_sum"]
            micro_steps, samples, rates = partial["micro_steps"], partial["samples"], partial["rates"]
            skip = micro_steps
        for batch in train.batches(epoch):
            if skip:  # the same seeded order: these batches are in the checkpoint's weights already
                skip -= 1
                continue
            group.append(batch)
            if len(group) < accumulation:
                continue
            loss_sum += probe.accumulate(train_model, loss_of, group, accumulation, no_sync)
            micro_steps += len(group)
            samples += sum(len(b["case_id"]) for b in group)
            group = []
            rates.append(scheduler.get_last_lr()[0])
            _optimiser_step(model, optimiser, scheduler, config)
            timing.setdefault("first_step_at", time.time())  # wall clock: the sweep measures launch → first step
            if ctx.drain is not None and ctx.drain.draining:  # the node is going: checkpoint here, go on elsewhere
                at = {"epoch": epoch, "micro_steps": micro_steps, "samples": samples, "rates": rates,
                      "loss_sum": float(loss_sum)}  # fmt: skip
                _preempted(ctx, metrics, model, optimiser, scheduler, best, config, at)
            if micro_steps >= steps[epoch] * accumulation:
                break
        if group and steps[epoch] == 0:  # fewer rows than one effective batch (tiny cohorts, one rank): step anyway
            loss_sum += probe.accumulate(train_model, loss_of, group, accumulation, no_sync)
            micro_steps, samples = len(group), sum(len(b["case_id"]) for b in group)
            rates.append(scheduler.get_last_lr()[0])
            _optimiser_step(model, optimiser, scheduler, config)
        if epoch + 1 < config.schedule.epochs:
            train.prefetch(epoch + 1)  # the next epoch's first batch is read while this one validates
        train_loss = (loss_sum / max(1, micro_steps)).item()  # the epoch's one wait for the GPU
        train_seconds = time.perf_counter() - started
        val, _ = evaluate(model, task, streams["val"], config, ctx.device)
        eval_seconds = time.perf_counter() - started - train_seconds
        score = sign * val[task.primary_metric]
        score = -math.inf if math.isnan(score) else score  # undefined on this split: never better than a number
        if best["epoch"] < 0 or score > best["score"] or score == best["score"] == -math.inf:
            # a copy of the weights only where they will be tested: with select: last, the final epoch's are
            kept = copy.deepcopy(model.state_dict()) if config.schedule.select == "best" else None
            best = {"score": score, "epoch": epoch, "state": kept}
        metrics = {
            "epoch": epoch,
            "train_loss": train_loss if micro_steps else math.nan,
            "epoch_seconds": time.perf_counter() - started,
            "eval_seconds": eval_seconds,
            "train_samples_per_second": samples * ctx.world_size / train_seconds,
            "data_wait_seconds": train.waited,  # of train_seconds: the loop waiting for its next batch
            **{f"val_{k}": v for k, v in val.items()},
            "val_primary": val[task.primary_metric],
            "best_val_primary": sign * best["score"] if math.isfinite(best["score"]) else math.nan,
            "parameters": parameters,
        }
        if ctx.tracker:
            ctx.tracker.log_metrics(metrics, step=epoch)
            # per optimiser step, numbered across epochs (a resumed trial numbers its steps the same)
            ctx.tracker.log_points("lr", sum(steps[e] for e in range(epoch)), rates)
        if epoch == config.schedule.epochs - 1:  # the best model (with select: last, this one) scores the test split
            if config.schedule.select == "last":
                best = {"score": score, "epoch": epoch, "state": None}  # the checkpoint keeps the model as tested
                metrics["best_val_primary"] = val[task.primary_metric]  # the tested model's, as with best
            else:
                model.load_state_dict(best["state"])
            test, records = evaluate(model, task, streams["test"], config, ctx.device, records=True)
            timing["train_seconds"] += time.perf_counter() - started
            final = {
                **{f"test_{k}": v for k, v in test.items()},
                "test_primary": test[task.primary_metric],
                # the primary metric of a predictor that never looks at the patient: the bar a model must clear
                "test_chance": task.chance_level(train_rows, split_rows(config.data.shards, "test")),
                "best_epoch": best["epoch"],
                **timing,
            }
            metrics.update(final)
            if ctx.tracker:
                ctx.tracker.log_metrics(final, step=epoch)
                ctx.tracker.log_predictions(records, task)
            if config.data.fold is not None:  # the tested model's out-of-fold predictions: every patient once a seed
                _, out_of_fold = evaluate(model, task, streams["val"], config, ctx.device, records=True)
                if ctx.tracker:
                    ctx.tracker.log_predictions(out_of_fold, task, split="val")
            if ctx.before_final_report:
                ctx.before_final_report()
        else:
            timing["train_seconds"] += time.perf_counter() - started
        last = epoch == config.schedule.epochs - 1
        saved = last or (epoch + 1) % config.schedule.checkpoint_every == 0
        _report(ctx, metrics, model, optimiser, scheduler, epoch, best, config if saved else None)
    return metrics


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """The SHA-256 of a model's weights: every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def apply_optimiser_settings(config: TrialConfig, model: TaskModel, optimiser, scheduler) -> None:
    """Give a restored optimiser the config's learning rates and weight decay: each group's base rate becomes the
    config's, its current rate scaled by the same factor (where warm-up or decay has brought it), so that the
    schedule goes on in its shape. A config unchanged since the checkpoint leaves every number as it was."""
    o = config.optimiser
    wanted = param_groups(model, o.lr, o.weight_decay, o.text_lr_multiplier)
    schedulers = [scheduler, *getattr(scheduler, "_schedulers", [])]
    for i, (group, new) in enumerate(zip(optimiser.param_groups, wanted, strict=True)):
        group["weight_decay"] = new["weight_decay"]
        if new["lr"] == group["initial_lr"]:
            continue
        ratio = new["lr"] / group["initial_lr"]
        group["lr"] *= ratio
        group["initial_lr"] = new["lr"]
        for each in schedulers:  # SequentialLR keeps no base rates of its own, its parts do
            if hasattr(each, "base_lrs"):
                each.base_lrs[i] = new["lr"]
            if getattr(each, "_last_lr", None):  # (SequentialLR's list may be its part's: set, not scaled)
                each._last_lr[i] = group["lr"]


def optimiser_steps(rows: int, micro: int, accumulation: int, config: TrialConfig) -> int:
    """Optimiser steps in an epoch of ``rows`` rows: whole effective batches only (the remainder is dropped, as
    every rank must take the same number of steps), capped by ``schedule.max_steps_per_epoch``."""
    steps = rows // (micro * accumulation)
    cap = config.schedule.max_steps_per_epoch
    return min(steps, cap) if cap else steps


def _optimiser_step(model: torch.nn.Module, optimiser, scheduler, config: TrialConfig) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimiser.grad_clip)
    optimiser.step()
    scheduler.step()
    optimiser.zero_grad(set_to_none=True)


def _ddp(model: TaskModel, task: Any, config: TrialConfig, ctx: WorkerContext, batch: dict) -> DistributedDataParallel:
    """DDP over the model; ``find_unused_parameters`` only if a measured backward on any rank left a parameter
    without a gradient (e.g. a text encoder under an image-only schema), since it costs a graph walk per step.
    The probe step trains nothing: its gradients are dropped and the normalisation statistics it moved restored."""
    state = copy.deepcopy(model.state_dict())
    probe.accumulate(model, loss_function(task, config, ctx.device), [on_device(batch, ctx.device)], 1)
    unused = torch.tensor(float(bool(probe.unused_parameters(model))), device=ctx.device)
    dist.all_reduce(unused, op=dist.ReduceOp.MAX)
    model.zero_grad(set_to_none=True)
    model.load_state_dict(state)
    device_ids = [ctx.device] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(
        model, device_ids=device_ids, find_unused_parameters=bool(unused.item()), gradient_as_bucket_view=True
    )


def _preempted(ctx: WorkerContext, metrics: dict, model, optimiser, scheduler, best: dict, config, at: dict) -> None:
    """Checkpoint the trial where it is within epoch ``at["epoch"]`` (reported with the last whole epoch's metrics,
    marked ``preempted``) and end this attempt: Tune restarts the trial from here on a node that is not draining."""
    from gx_ray.preemption import NodePreempted

    reported = {**metrics, "val_primary": metrics.get("val_primary", math.nan), "preempted": 1.0}
    _report(ctx, reported, model, optimiser, scheduler, at["epoch"] - 1, best, config, partial=at)
    raise NodePreempted(f"node {ctx.drain.node_id} is draining: checkpointed at step {len(at['rates'])} of epoch "
                        f"{at['epoch']}, to go on elsewhere")  # fmt: skip


def _report(
    ctx: WorkerContext, metrics: dict, model, optimiser, scheduler, epoch: int, best: dict, config: TrialConfig | None,
    partial: dict | None = None,
) -> None:  # fmt: skip
    """Report the epoch with a checkpoint holding the latest state, the best weights so far and the config that
    trained them; without ``config`` (between ``schedule.checkpoint_every`` epochs), the metrics alone."""
    # each reporter takes its own library's Checkpoint (Tune warns on Train's, every epoch of every trial)
    if ctx.report.__module__.startswith("ray.tune"):
        from ray.tune import Checkpoint
    else:
        from ray.train import Checkpoint

    if ctx.rank != 0 or config is None:
        ctx.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as folder:
        state = {
            "model": model.state_dict(),
            "optimiser": optimiser.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "best": best,
            "random": random_state(),  # a retried trial goes on drawing where this one stopped
            **({"partial": partial} if partial else {}),
        }
        torch.save(state, Path(folder) / CHECKPOINT_FILE)
        (Path(folder) / "metrics.json").write_text(json.dumps(metrics, default=float), encoding="utf-8")
        (Path(folder) / CONFIG_FILE).write_text(json.dumps(config.to_flat(), default=str), encoding="utf-8")
        ctx.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train's entry point (one call per DDP rank): the same loop; each rank reads its own row groups."""
    import ray.train
    import ray.train.torch

    quiet_data_context()
    config: TrialConfig = loop_config["trial"]
    context = ray.train.get_context()
    rank = context.get_world_rank()
    tracker = (
        TrialTracker(loop_config["tracking_uri"], loop_config["run_id"], loop_config.get("resumed", False))
        if rank == 0
        else None
    )
    ledger = loop_config.get("ledger")  # rank 0's reports reach Tune: they carry the trial's costs
    worker = WorkerContext(
        rank=rank,
        world_size=context.get_world_size(),
        device=ray.train.torch.get_device(),
        report=ledger.reporting(ray.train.report, tracker) if ledger and rank == 0 else ray.train.report,
        latest_checkpoint=ray.train.get_checkpoint(),
        tracker=tracker,
        micro_batch=loop_config.get("micro_batch"),
    )
    run_loop(config, worker)


def linear_warmup_decay(
    optimiser: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate rises linearly from 0 over ``warmup_steps`` and falls linearly to 0 at ``total_steps``:
    transformers' ``get_linear_schedule_with_warmup``, built from torch's own schedulers because importing that one
    imports peft and transformers' trainer (about 1.7 s of every trial process's start)."""
    from torch.optim.lr_scheduler import LinearLR, SequentialLR

    if warmup_steps < 1:
        return LinearLR(optimiser, start_factor=1.0, end_factor=0.0, total_iters=total_steps)
    warmup = LinearLR(optimiser, start_factor=1e-12, end_factor=1.0, total_iters=warmup_steps)  # torch wants > 0
    if warmup_steps >= total_steps:  # all warm-up, as transformers' (whose one-step schedule trains at 0)
        return warmup
    decay = LinearLR(optimiser, start_factor=1.0, end_factor=0.0, total_iters=total_steps - warmup_steps)
    return SequentialLR(optimiser, [warmup, decay], milestones=[warmup_steps])
