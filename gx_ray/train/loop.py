"""The per-worker training loop of a trial: one recipe (:class:`TrainingRecipe`) that Ray Train's workers and a
one-worker Tune trial both run (torchtune's shape: ``setup`` then ``train``; no trainer framework in between).

Per epoch: stream this rank's share of the training split in a seeded order, AdamW (text encoder at its own rate),
linear warm-up then decay, micro-batches accumulated to the effective batch, bf16 autocast on GPU; validate; report
the metrics and a checkpoint (latest and best, :mod:`gx_ray.train.checkpoint`) to Ray and, from rank 0, to MLflow.
After the last epoch the best model scores the test split.

What keeps a GPU busy: batches collated and pinned in Ray's prefetch threads and copied one batch ahead; the loss read
once per epoch (a read waits for the GPU); the next epoch's first batch fetched while this one validates; each rank
reads its own row groups; DDP looks for unused parameters only when a measured step found some.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler

from gx_ray.data.shards import TensorLayout
from gx_ray.data.stream import Reader, SplitStream, first_rows, on_device, split_rows
from gx_ray.models.registry import param_groups
from gx_ray.runtime import quiet_data_context
from gx_ray.tasks import TaskModel, gather_state
from gx_ray.tracking import TrialTracker
from gx_ray.train import checkpoint, probe
from gx_ray.train.build import autocast, build_trial, loss_function
from gx_ray.train.checkpoint import CHECKPOINT_FILE as CHECKPOINT_FILE  # where callers have read it
from gx_ray.train.checkpoint import Best, ResumePoint, Trainables
from gx_ray.train.config import TrialConfig


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
    checkpoint_class: type | None = None
    """The Checkpoint class ``report`` takes (Tune's for a Tune trial); None: Ray Train's."""
    stop_after_epochs: int | None = None
    """Return after this many epochs of this attempt (their reports made, the test split not scored): a pilot."""
    drain: Any = None
    """A :class:`~gx_ray.preemption.DrainWatch` of the trial's node, or None: seen draining between two optimiser
    steps, the loop checkpoints where it is within the epoch and raises :class:`~gx_ray.preemption.NodePreempted`."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def stream_of(
    config: TrialConfig, split: str, layout: TensorLayout, ctx: WorkerContext, batch_size: int
) -> SplitStream:
    """This rank's stream of ``split``, in the trial's seeded order."""
    reader = Reader(
        rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, cpus_per_worker=config.resources.cpus_per_worker
    )
    return SplitStream(config.data, split, layout, batch_size, seed=config.seed, reader=reader)


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


class TrainingRecipe:
    """One trial's training on one rank, by step: :meth:`setup` (model, optimiser, data, restore), then :meth:`train`:
    per epoch :meth:`train_one_epoch` and :meth:`validate`, after the last the best model's :meth:`test`."""

    def __init__(self, config: TrialConfig, ctx: WorkerContext) -> None:
        self.config, self.ctx = config, ctx
        self.best = Best()
        self.resume: ResumePoint | None = None  # the steps of an epoch a preempted node interrupted
        self.start_epoch = 0
        self.metrics: dict[str, Any] = {}

    def setup(self) -> None:
        """Everything before the first epoch; its seconds are reported as ``setup_seconds``."""
        started, started_at = time.perf_counter(), time.time()
        seed_everything(self.config.seed)
        self._setup_model()
        built = time.perf_counter() - started
        self._setup_data()
        self._setup_optimizer()
        if self.ctx.latest_checkpoint is not None:
            self._restore()
        self.train_stream.prefetch(self.start_epoch)  # reads start while DDP is set up
        self.train_model, self.no_sync = self.model, None
        if self.ctx.world_size > 1:  # Ray Train has set up the process group
            first = first_rows(self.config.data.shards, "train", self.micro, self.layout)
            self.train_model = _ddp(self.model, self.task, self.config, self.ctx, first)
            self.no_sync = self.train_model.no_sync
        self.loss_of = loss_function(self.task, self.config, self.ctx.device)
        self.timing = {
            **self.ctx.timing,
            "setup_started_at": started_at,  # wall clock, as first_step_at
            "setup_seconds": time.perf_counter() - started,
            "cohort_seconds": self.cohort_seconds,  # of build_seconds: the training rows' ids read
            "build_seconds": built,  # of setup_seconds: the training rows' ids, the model (its imports the first time)
            "train_seconds": 0.0,
            "micro_batch": self.micro,
            "accumulation": self.accumulation,
            "effective_batch": self.micro * self.accumulation * self.ctx.world_size,
        }

    def _setup_model(self) -> None:
        """The task and its model, fitted on the training rows (under cross-validation: the fold's training patients,
        whose chance level the test split reports), and the micro-batch that fits."""
        config, ctx = self.config, self.ctx
        started = time.perf_counter()
        self.train_rows = split_rows(config.data.shards, "train", config.data.folds_file, config.data.fold,
                                     config.data.refit)  # fmt: skip
        self.cohort_seconds = time.perf_counter() - started
        self.task, self.model, self.layout = build_trial(config, ctx.device, self.train_rows)
        self.parameters = sum(p.numel() for p in self.model.parameters())  # every report: a search may minimise it
        self.micro = ctx.micro_batch or probe.micro_batch_for(config, self.model, self.task, self.layout, ctx.device,
                                                              ctx.world_size)[0]  # fmt: skip
        self.accumulation = config.data.accumulation(ctx.world_size, self.micro)
        if ctx.tracker:
            ctx.tracker.set_tags({"gx_ray.micro_batch": str(self.micro), "gx_ray.accumulation": str(self.accumulation)})

    def _setup_data(self) -> None:
        """This rank's stream of each split and the optimiser steps of each epoch."""
        config, ctx = self.config, self.ctx
        eval_size = config.data.eval_batch_size or self.micro
        self.streams = {split: stream_of(config, split, self.layout, ctx, self.micro if split == "train" else eval_size)
                        for split in ("train", "val", "test")}  # fmt: skip
        if ctx.tracker:  # with `auto`, which way each split went (a share too large for the host streams)
            ctx.tracker.set_tags({f"gx_ray.in_memory.{s}": str(v.in_memory).lower() for s, v in self.streams.items()})
        self.train_stream = self.streams["train"]
        epochs = range(config.schedule.epochs)
        fewest = self.train_stream.fewest_rows
        self.steps = {e: optimiser_steps(fewest(e), self.micro, self.accumulation, config) for e in epochs}
        if ctx.world_size > 1 and min(self.steps.values()) < 1:
            raise ValueError(
                f"the training split has too few rows for an effective batch of {config.data.effective_batch} on "
                f"{ctx.world_size} ranks ({fewest(0)} rows on the smallest rank)"
            )

    def _setup_optimizer(self) -> None:
        """AdamW (the text encoder at its own rate), linear warm-up then linear decay over all epochs' steps."""
        o = self.config.optimiser
        optimiser = probe.adamw(param_groups(self.model, o.lr, o.weight_decay, o.text_lr_multiplier), o.lr)
        self.parts = Trainables(self.model, optimiser, self._schedule(optimiser))

    def _schedule(self, optimiser: torch.optim.Optimizer) -> LRScheduler:
        """Linear warm-up then linear decay over every epoch's optimiser steps, from the groups' current rates."""
        total = max(1, sum(self.steps.values()))
        warmup = math.ceil(self.config.schedule.warmup_fraction * total)
        return linear_warmup_decay(optimiser, warmup, total)

    def _restore(self) -> None:
        """Go on from ``ctx.latest_checkpoint``: its state, its best so far, the epoch (or the step within it)."""
        ctx = self.ctx
        restored = checkpoint.load(ctx.latest_checkpoint, self.parts)
        # the optimiser's state holds the learning rates it was saved with: a config changed since (a PBT exploit's
        # mutation, a replayed schedule) takes effect from here, the schedule's shape kept
        optimiser = self.parts.optimiser
        rebuild = functools.partial(self._schedule, optimiser)
        scheduler = apply_optimiser_settings(self.config, self.model, optimiser, self.parts.scheduler, rebuild)
        self.parts = Trainables(self.model, optimiser, scheduler)
        self.start_epoch, self.best, self.resume = restored.start_epoch, restored.best, restored.resume
        if ctx.tracker:  # a retried trial (its node lost, say) goes on from here: the run tells where it resumed
            ctx.tracker.log_metrics({"resumed_from_epoch": self.start_epoch}, step=self.start_epoch)
        if ctx.on_restore:
            done = {"epoch": restored.epoch, "weights_sha256": weights_sha256(self.model.state_dict())}
            ctx.on_restore({**done, "config": restored.written_by, "path": str(ctx.latest_checkpoint.path)})

    def train(self) -> dict[str, float]:
        """Every epoch from the start (or the restored one); returns the last report's metrics."""
        for epoch in range(self.start_epoch, self.config.schedule.epochs):
            self.run_epoch(epoch)
            if self.ctx.stop_after_epochs and epoch + 1 - self.start_epoch >= self.ctx.stop_after_epochs:
                break
        return self.metrics

    def run_epoch(self, epoch: int) -> None:
        """Train, validate (after the last epoch, test) and report ``epoch``, with a checkpoint where one is due."""
        last = self.config.schedule.epochs - 1
        started = time.perf_counter()
        at, train_loss = self.train_one_epoch(epoch)
        if epoch < last:
            self.train_stream.prefetch(epoch + 1)  # the next epoch's first batch is read while this one validates
        self.metrics = self.validate(epoch, at, train_loss, started)
        if epoch == last:
            self.test(epoch, started)
        else:
            self.timing["train_seconds"] += time.perf_counter() - started
        config = self.config if self.checkpoint_due(epoch) else None
        checkpoint.report(
            self.ctx,
            checkpoint.Report(metrics=self.metrics, parts=self.parts, epoch=epoch, best=self.best, config=config),
        )

    def checkpoint_due(self, epoch: int) -> bool:
        """Whether ``epoch``'s report carries a checkpoint: every ``checkpoint_every`` epochs, and the last."""
        schedule = self.config.schedule
        return epoch == schedule.epochs - 1 or (epoch + 1) % schedule.checkpoint_every == 0

    def train_one_epoch(self, epoch: int) -> tuple[ResumePoint, float]:
        """The epoch's optimiser steps (a resumed attempt's done ones skipped); returns their sums and mean loss."""
        at = self.resume if self.resume and self.resume.epoch == epoch else ResumePoint(epoch)
        loss_sum = torch.zeros((), device=self.ctx.device) + at.loss_sum
        skip, group = at.micro_steps, []  # the same seeded order: skipped batches are in the weights already
        self.model.train()
        for batch in self.train_stream.batches(epoch):
            self.timing.setdefault("first_batch_at", time.time())  # wall clock, as first_step_at
            if skip:
                skip -= 1
                continue
            group.append(batch)
            if len(group) < self.accumulation:
                continue
            loss_sum += self._step(group, at)
            at.micro_steps += len(group)
            at.samples += sum(len(b["case_id"]) for b in group)
            group = []
            self.timing.setdefault("first_step_at", time.time())  # wall clock: the sweep measures launch → first step
            if self.ctx.drain is not None and self.ctx.drain.draining:  # the node is going: checkpoint, go elsewhere
                at.loss_sum = float(loss_sum)
                checkpoint.preempt(self.ctx, self.metrics, self.parts, self.best, self.config, at)
            if at.micro_steps >= self.steps[epoch] * self.accumulation:
                break
        if group and self.steps[epoch] == 0:  # fewer rows than one effective batch (tiny cohorts, one rank): step
            loss_sum += self._step(group, at)
            at.micro_steps, at.samples = len(group), sum(len(b["case_id"]) for b in group)
        at.loss_sum = float(loss_sum)
        return at, (loss_sum / max(1, at.micro_steps)).item()  # the epoch's one wait for the GPU

    def _step(self, group: list[dict], at: ResumePoint) -> torch.Tensor:
        """One optimiser step over ``group``'s micro-batches; its learning rate joins ``at.rates``."""
        loss = probe.accumulate(self.train_model, self.loss_of, group, self.accumulation, self.no_sync)
        at.rates.append(self.parts.scheduler.get_last_lr()[0])
        _optimiser_step(self.model, self.parts.optimiser, self.parts.scheduler, self.config)
        return loss

    def validate(self, epoch: int, at: ResumePoint, train_loss: float, started: float) -> dict[str, float]:
        """Score the validation split, keep the best epoch, log and return the epoch's metrics."""
        train_seconds = time.perf_counter() - started
        val, _ = evaluate(self.model, self.task, self.streams["val"], self.config, self.ctx.device)
        eval_seconds = time.perf_counter() - started - train_seconds
        score = val[self.task.primary_metric]
        if self.best.beaten_by(score, self.task.mode):
            # a copy of the weights only where they will be tested: with select: last, the final epoch's are
            kept = copy.deepcopy(self.model.state_dict()) if self.config.schedule.select == "best" else None
            self.best = Best(score, epoch, kept)
        metrics = {
            "epoch": epoch,
            "train_loss": train_loss if at.micro_steps else math.nan,
            "epoch_seconds": time.perf_counter() - started,
            "eval_seconds": eval_seconds,
            "train_samples_per_second": at.samples * self.ctx.world_size / train_seconds,
            "data_wait_seconds": self.train_stream.waited,  # of train_seconds: the loop waiting for its next batch
            **{f"val_{k}": v for k, v in val.items()},
            "val_primary": score,
            "best_val_primary": self.best.score,
            "parameters": self.parameters,
        }
        if self.ctx.tracker:
            self.ctx.tracker.log_metrics(metrics, step=epoch)
            # per optimiser step, numbered across epochs (a resumed trial numbers its steps the same)
            self.ctx.tracker.log_points("lr", sum(self.steps[e] for e in range(epoch)), at.rates)
        return metrics

    def test(self, epoch: int, started: float) -> None:
        """The best model (with select: last, the final one) scores the test split and predicts its validation
        patients (``predictions/val.json``: under cross-validation its fold's, every patient once a seed; on a single
        split what a selection-corrected estimate resamples; not for a refit, which trained on them). The run's end is
        written last."""
        config, ctx, task = self.config, self.ctx, self.task
        if config.schedule.select == "last":  # the tested model is this one: the checkpoint keeps it as tested
            self.best = Best(self.metrics["val_primary"], epoch, None)
            self.metrics["best_val_primary"] = self.metrics["val_primary"]  # the tested model's, as with best
        else:
            self.model.load_state_dict(self.best.state)
        test, records = evaluate(self.model, task, self.streams["test"], config, ctx.device, records=True)
        self.timing["train_seconds"] += time.perf_counter() - started
        final = {
            **{f"test_{k}": v for k, v in test.items()},
            "test_primary": test[task.primary_metric],
            # the primary metric of a predictor that never looks at the patient: the bar a model must clear
            "test_chance": task.chance_level(self.train_rows, split_rows(config.data.shards, "test")),
            "best_epoch": self.best.epoch,
            **self.timing,
        }
        self.metrics.update(final)
        if ctx.tracker:
            ctx.tracker.log_metrics(final, step=epoch)
            ctx.tracker.log_predictions(records, task)
        if not config.data.refit:  # a refit trained on its validation patients: their predictions are no evidence
            # every rank evaluates (the records are gathered collectively); a fold's are its out-of-fold predictions
            _, validation = evaluate(self.model, task, self.streams["val"], config, ctx.device, records=True)
            if ctx.tracker:
                ctx.tracker.log_predictions(validation, task, split="val")
        if ctx.before_final_report:
            ctx.before_final_report()


def run_loop(config: TrialConfig, ctx: WorkerContext) -> dict[str, float]:
    """Train, validate every epoch, test the best model; returns the final metrics."""
    recipe = TrainingRecipe(config, ctx)
    recipe.setup()
    return recipe.train()


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """The SHA-256 of a model's weights: every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def apply_optimiser_settings(
    config: TrialConfig, model: TaskModel, optimiser: torch.optim.Optimizer, scheduler: LRScheduler,
    rebuild: Callable[[], LRScheduler],
) -> LRScheduler:  # fmt: skip
    """Give a restored optimiser the config's weight decay and learning rates; returns the schedule to go on with.
    A config unchanged since the checkpoint leaves every number, and the schedule, as it was. A changed rate (a PBT
    mutation, a replayed schedule) becomes each group's base rate, and ``rebuild``'s schedule is stepped to the
    restored step from it: the schedule's shape kept, through torch's public API."""
    o = config.optimiser
    wanted = param_groups(model, o.lr, o.weight_decay, o.text_lr_multiplier)
    for group, new in zip(optimiser.param_groups, wanted, strict=True):
        group["weight_decay"] = new["weight_decay"]
    if all(new["lr"] == group["initial_lr"] for group, new in zip(optimiser.param_groups, wanted, strict=True)):
        return scheduler
    for group, new in zip(optimiser.param_groups, wanted, strict=True):
        group["lr"] = group["initial_lr"] = new["lr"]
    with warnings.catch_warnings():  # torch warns of a schedule stepped before the optimiser: here, a replay
        warnings.simplefilter("ignore", UserWarning)
        rebuilt = rebuild()
        for _ in range(scheduler.last_epoch):
            rebuilt.step()
    return rebuilt


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
        checkpoint_class=ray.train.Checkpoint,
    )
    run_loop(config, worker)


def linear_warmup_decay(optimiser: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> LRScheduler:
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
