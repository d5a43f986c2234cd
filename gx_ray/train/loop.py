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
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gx_ray.data.shards import (
    TENSOR_COLUMNS,
    BatchCollate,
    TensorLayout,
    open_shard,
    rank_pieces,
    read_manifest,
    read_shard,
    read_split,
    row_groups,
    split_files,
    to_device,
)
from gx_ray.models.registry import build_encoder, param_groups
from gx_ray.models.text import choose_attention_backends
from gx_ray.runtime import quiet_data_context
from gx_ray.tasks import Task, TaskModel, build_task, gather_state
from gx_ray.tracking import TrialTracker
from gx_ray.train import probe
from gx_ray.train.config import AUTO, IN_MEMORY_SHARE_OF_SLOT, TrialConfig

CHECKPOINT_FILE = "state.pt"


@dataclass
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


def autocast(config: TrialConfig, device: torch.device):
    use_bf16 = config.amp == "bf16" or (config.amp == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


class SplitStream:
    """One split's batches for one rank, epoch by epoch, on the device.

    The row groups are ordered by a seed per epoch (training only) and dealt to the ranks, so every rank streams its
    own rows and an epoch's batches are the same on every run with the same seed. :meth:`prefetch` starts the next
    epoch's stream (its first batch waits for reads and the shuffle buffer to fill) while the current epoch ends.
    """

    def __init__(self, config: TrialConfig, split: str, layout: TensorLayout, ctx: WorkerContext, batch_size: int):
        self.config, self.split, self.layout, self.ctx, self.batch_size = config, split, layout, ctx, batch_size
        self.pieces = row_groups(config.data.shards, split)
        self.shuffle = config.data.shuffle_buffer if split == "train" else 0
        self.collate = BatchCollate(layout, pin_memory=ctx.device.type == "cuda")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prefetch-{split}")
        self._next: tuple[int, Iterator, Future] | None = None
        self._kept: dict[tuple[str, int], Future] = {}
        """Row groups read or being read, with ``data.in_memory``: (path, row group) → the read's table."""
        self.waited = 0.0
        self.in_memory = keeps_in_memory(config.data.in_memory, self.my_pieces(0), config.resources.cpus_per_worker)
        self._collator = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"collate-{split}")
        """With ``data.in_memory``: collates (and pins) the next batch while the loop trains on this one, as Ray's
        prefetch threads do for a stream."""
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"read-{split}")
        """With ``data.in_memory``: reads the row groups, in the order an epoch first asks for them."""

    def order_seed(self, epoch: int) -> int | None:
        return self.config.seed * 1000 + epoch if self.split == "train" else None

    def my_pieces(self, epoch: int, rank: int | None = None) -> list[dict[str, Any]]:
        rank = self.ctx.rank if rank is None else rank
        return rank_pieces(self.pieces, rank, self.ctx.world_size, self.order_seed(epoch))

    def fewest_rows(self, epoch: int) -> int:
        """The rows of the rank with fewest this epoch: every rank takes as many optimiser steps as it allows."""
        return min(sum(p["rows"] for p in self.my_pieces(epoch, r)) for r in range(self.ctx.world_size))

    def _iterator(self, epoch: int) -> Iterator[dict]:
        data = self.config.data
        if self.in_memory:
            return self._kept_batches(epoch)
        dataset = read_split(
            data.shards, self.split, num_cpus=data.read_cpus, concurrency=data.read_concurrency,
            pieces=self.my_pieces(epoch),
        )  # fmt: skip
        seed = self.order_seed(epoch)
        batches = dataset.iter_torch_batches(
            batch_size=self.batch_size,
            collate_fn=self.collate,
            prefetch_batches=2,
            local_shuffle_buffer_size=max(self.shuffle, self.batch_size) if self.shuffle else None,
            local_shuffle_seed=seed if self.shuffle else None,
        )
        return iter(batches)

    def _kept_batches(self, epoch: int) -> Iterator[dict]:
        """``data.in_memory``: the epoch's row groups (each read once, pages verified) in its order. A reader thread
        reads the groups an epoch asks for first in the epoch's order. In epoch 0 the rows flow as their groups arrive,
        shuffled within windows of ``data.shuffle_buffer`` rows as the stream shuffles: the first batch waits for its
        own groups, not for the whole share (11.5 s of a 9.5 GB share on an H200 node). Every later epoch permutes the
        whole share with the epoch's seed when training shuffles, whether or not this process has read its groups
        yet: a trial resumed at epoch k (its first here) draws epoch k's batches as the uninterrupted trial did."""
        pieces = self.my_pieces(epoch)
        keys = [(piece["path"], piece["row_group"]) for piece in pieces]
        unread = [key for key in keys if key not in self._kept]
        for key in unread:  # read in the epoch's order, each group once
            self._kept[key] = self._reader.submit(read_shard, key[0], row_group=key[1])
        rng = np.random.default_rng(self.order_seed(epoch)) if self.shuffle else None
        # the order depends on the epoch and the seed only: never on how fast the reads went, nor on which epoch this
        # process started at (choosing the windowed order by "some group unread" trained a resumed trial on another
        # order: report generation's ROUGE-L 28.3 against 46.0 uninterrupted, killed at epoch 3 of 6)
        if epoch == 0:
            chunks = self._windowed_order([piece["rows"] for piece in pieces], rng)
        else:
            starts = np.cumsum([0] + [piece["rows"] for piece in pieces])
            order = rng.permutation(starts[-1]) if rng is not None else np.arange(starts[-1])
            group = np.searchsorted(starts, order, side="right") - 1
            rows = np.stack([group, order - starts[group]], axis=1)
            chunks = [rows[start : start + self.batch_size] for start in range(0, len(rows), self.batch_size)]

        def collated(chunk: np.ndarray) -> dict:
            """The rows ``chunk`` (row group, row) in that order, sliced from their own row groups and copied once: a
            take on the concatenated share would copy the whole share for every batch (Arrow joins a column's chunks
            first: 2.7 samples/s against 37 streamed at the bench shape, H200)."""
            rows = pa.concat_tables([self._kept[keys[g]].result().slice(i, 1) for g, i in chunk])
            return self.collate(rows.combine_chunks())

        ahead = [self._collator.submit(collated, chunk) for chunk in chunks[:1]]
        for chunk in chunks[1:]:  # one batch gathered and collated ahead, in its own thread
            ahead.append(self._collator.submit(collated, chunk))
            yield ahead.pop(0).result()
        yield from (batch.result() for batch in ahead)

    def _windowed_order(self, group_rows: list[int], rng: np.random.Generator | None) -> list[np.ndarray]:
        """Batches of (row group, row) in the groups' order, the rows of each window of consecutive groups (at least
        ``data.shuffle_buffer`` rows) permuted together, after the few rows the window before left over."""
        window = max(self.shuffle, self.batch_size)
        chunks, carried, filling = [], np.empty((0, 2), dtype=np.int64), []
        for g, count in enumerate(group_rows):
            filling.append(np.stack([np.full(count, g), np.arange(count)], axis=1))
            last = g == len(group_rows) - 1
            if sum(map(len, filling)) < window and not last:
                continue
            rows = np.concatenate(filling)
            pending = np.concatenate([carried, rows[rng.permutation(len(rows))] if rng is not None else rows])
            whole = len(pending) if last else len(pending) // self.batch_size * self.batch_size
            chunks += [pending[start : start + self.batch_size] for start in range(0, whole, self.batch_size)]
            carried, filling = pending[whole:], []
        return chunks

    def prefetch(self, epoch: int) -> None:
        """Start the stream of ``epoch`` now: its first batch is fetched in the background."""
        if self._next is None or self._next[0] != epoch:
            iterator = self._iterator(epoch)
            self._next = (epoch, iterator, self._pool.submit(next, iterator, None))

    def batches(self, epoch: int) -> Iterator[dict]:
        """The epoch's batches on the device, each copied while the one before it trains. ``waited``: the seconds the
        loop has spent in this epoch waiting for a batch (the data path not keeping up)."""
        self.prefetch(epoch)
        _, iterator, first = self._next
        self._next = None
        asked = time.perf_counter()
        batch = first.result()
        self.waited = time.perf_counter() - asked
        if batch is None:
            return
        current = on_device(batch, self.ctx.device)
        while True:
            asked = time.perf_counter()
            batch = next(iterator, None)
            self.waited += time.perf_counter() - asked
            if batch is None:
                break
            upcoming = on_device(batch, self.ctx.device)
            yield current
            current = upcoming
        yield current


def keeps_in_memory(setting: bool | str, pieces: list[dict[str, Any]], cpus_per_worker: float = 1.0) -> bool:
    """``data.in_memory`` for a rank's share of a split: as set, or with ``auto`` whether the share (uncompressed)
    is at most :func:`in_memory_budget` bytes."""
    if setting != AUTO:
        return bool(setting)
    return sum(p["bytes"] for p in pieces) <= in_memory_budget(cpus_per_worker)


def in_memory_budget(cpus_per_worker: float) -> float:
    """:data:`IN_MEMORY_SHARE_OF_SLOT` of the host memory available now, over the trial workers its CPUs hold (a
    1 x H200 VM of 16 cores and 126 GiB, 4 CPUs a worker: 15.7 GB; a sixteenth of the host, the rule before, kept the
    bench cohort's 9.5 GB share out of memory there, and streamed VQA trained at 0.31 of its raw step)."""
    slots = max(1, int((os.cpu_count() or 1) / cpus_per_worker))  # the config holds cpus_per_worker positive
    return IN_MEMORY_SHARE_OF_SLOT * psutil.virtual_memory().available / slots


def on_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A batch with its volumes on ``device`` (asynchronously, from pinned memory); the rest stays on the host."""
    return to_device(batch, device, keys=TENSOR_COLUMNS)


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


def build_trial(
    config: TrialConfig, device: torch.device, train_rows: list[dict] | None = None
) -> tuple[Any, TaskModel, TensorLayout]:
    """The trial's task (fitted on the training split: ``train_rows``, read here when not given) and model."""
    manifest = read_manifest(config.data.shards)
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    task = build_task(config.task, **config.task_options)
    train_rows = split_rows(config.data.shards, "train") if train_rows is None else train_rows
    task.prepare(train_rows)  # training split only
    if type(task).attach_splits is not Task.attach_splits:  # only a task that asks reads the other splits
        splits = {"train": train_rows, **{s: split_rows(config.data.shards, s) for s in ("val", "test")}}
        task.attach_splits(splits, manifest, str(config.data.shards))
    if device.type == "cuda":
        choose_attention_backends()
    if config.model.family == "vlm":
        return (*build_vlm_trial(config, task, device), layout)
    model = TaskModel(task, build_encoder(config.model, config.schema), config.schema).to(device)
    return task, model, layout


def build_vlm_trial(config: TrialConfig, task: Task, device: torch.device) -> tuple[Any, torch.nn.Module]:
    """``model.family: vlm``: the task asked of a vision-language model in words (:mod:`gx_ray.tasks.vlm`); the loop
    trains, evaluates, logs and checkpoints it as any task model."""
    from gx_ray.models.vlm import VisionLanguageModel  # transformers and peft load only for a VLM trial
    from gx_ray.tasks.vlm import VisionLanguageTask, VisionLanguageTaskModel

    asked = VisionLanguageTask(task, config.vlm.max_new_tokens)
    vlm = VisionLanguageModel.from_config(config.vlm, device)
    return asked, VisionLanguageTaskModel(asked, vlm, config.views.recipe(config.schema), config.schema)


def loss_function(task: Any, config: TrialConfig, device: torch.device) -> Callable[[torch.nn.Module, dict], Any]:
    def loss_of(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        with autocast(config, device):
            return task.loss(model(batch), batch)

    return loss_of


def micro_batch_for(
    config: TrialConfig, model: TaskModel, task: Any, layout: TensorLayout, device: torch.device, world_size: int
) -> tuple[int, int | None]:
    """The trial's micro-batch and its measured step peak (bytes; None where not measured). ``auto``: the whole
    per-rank batch on the CPU; on a GPU the largest divisor of it whose step fits the trial's share of the card
    (a fixed ``gpus_per_worker`` fraction, else the whole card). Where not even one sample fits, gradient
    checkpointing is switched on in the model (blocks that offer it) and the choice made again."""
    per_rank = config.data.per_rank_batch(world_size)
    if config.data.micro_batch != AUTO:
        return int(config.data.micro_batch), None
    if device.type != "cuda":
        return per_rank, None
    rows = first_rows(config.data.shards, "train", per_rank, layout)
    loss_of = loss_function(task, config, device)

    def peak_of(micro: int) -> int | None:
        return probe.step_peak_bytes(model, loss_of, on_device(slice_batch(rows, micro), device), device)

    gpus = config.resources.gpus_per_worker
    share = float(gpus) if gpus != AUTO and 0 < float(gpus) < 1 else 1.0
    budget = torch.cuda.get_device_properties(device).total_memory * share * (1 - probe.MARGIN) - probe.CONTEXT_BYTES
    try:
        return probe.choose_micro_batch(per_rank, peak_of, budget)
    except MemoryError:
        if not probe.enable_checkpointing(model):
            raise
        return probe.choose_micro_batch(per_rank, peak_of, budget)


def run_loop(config: TrialConfig, ctx: WorkerContext) -> dict[str, float]:
    """Train, validate every epoch, test the best model; returns the final metrics."""
    setup_started = time.perf_counter()
    seed_everything(config.seed)
    train_rows = split_rows(config.data.shards, "train")  # the task's fit and, at the end, its chance level
    task, model, layout = build_trial(config, ctx.device, train_rows)
    built = time.perf_counter() - setup_started
    micro = ctx.micro_batch or micro_batch_for(config, model, task, layout, ctx.device, ctx.world_size)[0]
    accumulation = config.data.accumulation(ctx.world_size, micro)
    if ctx.tracker:
        ctx.tracker.set_tags({"gx_ray.micro_batch": str(micro), "gx_ray.accumulation": str(accumulation)})
    eval_size = config.data.eval_batch_size or micro
    streams = {split: SplitStream(config, split, layout, ctx, micro if split == "train" else eval_size)
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
    if ctx.latest_checkpoint is not None:
        with ctx.latest_checkpoint.as_directory() as folder:
            # tensors and plain data only: a checkpoint on shared storage is not a program anyone may plant
            state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best = state["epoch"] + 1, state["best"]
        if "random" in state:
            restore_random_state(state["random"])
        if ctx.tracker:  # a retried trial (its node lost, say) goes on from here: the run tells where it resumed
            ctx.tracker.log_metrics({"resumed_from_epoch": start_epoch}, step=start_epoch)
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
        for batch in train.batches(epoch):
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
            if ctx.before_final_report:
                ctx.before_final_report()
        else:
            timing["train_seconds"] += time.perf_counter() - started
        _report(ctx, metrics, model, optimiser, scheduler, epoch, best)
    return metrics


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


def _report(ctx: WorkerContext, metrics: dict, model, optimiser, scheduler, epoch: int, best: dict) -> None:
    """Report the epoch with a checkpoint holding the latest state and the best weights so far."""
    # each reporter takes its own library's Checkpoint (Tune warns on Train's, every epoch of every trial)
    if ctx.report.__module__.startswith("ray.tune"):
        from ray.tune import Checkpoint
    else:
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
            "random": random_state(),  # a retried trial goes on drawing where this one stopped
        }
        torch.save(state, Path(folder) / CHECKPOINT_FILE)
        (Path(folder) / "metrics.json").write_text(json.dumps(metrics, default=float), encoding="utf-8")
        ctx.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def split_rows(shard_dir: str, split: str) -> list[dict]:
    """A split's rows without the image columns (what a task may learn from, e.g. VQA answers)."""
    files = split_files(shard_dir, split)
    columns = [c for c in open_shard(files[0]).schema_arrow.names if c not in TENSOR_COLUMNS]
    return [row for f in files for row in read_shard(f, columns=columns).to_pylist()]


def first_rows(shard_dir: Path | str, split: str, rows: int, layout: TensorLayout) -> dict[str, Any]:
    """The first ``rows`` rows of a split as one collated batch (what a probe step trains on)."""
    tables = []
    for f in split_files(shard_dir, split):
        for batch in open_shard(f).iter_batches(batch_size=rows):  # page checksums verified
            tables.append(batch)
            if sum(len(b) for b in tables) >= rows:
                break
        if sum(len(b) for b in tables) >= rows:
            break
    return slice_batch(BatchCollate(layout)(pa.Table.from_batches(tables).slice(0, rows)), rows)


def slice_batch(batch: dict[str, Any], rows: int) -> dict[str, Any]:
    """The first ``rows`` samples of a collated batch; a batch smaller than ``rows`` is repeated to fill it."""
    size = len(batch["case_id"])
    index = [i % size for i in range(rows)]
    return {k: v[index] if isinstance(v, torch.Tensor) else [v[i] for i in index] for k, v in batch.items()}


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train's entry point (one call per DDP rank): the same loop; each rank reads its own row groups."""
    import ray.train
    import ray.train.torch

    quiet_data_context()
    config = TrialConfig.from_flat(loop_config["trial"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    tracker = (
        TrialTracker(loop_config["tracking_uri"], loop_config["run_id"], loop_config.get("resumed", False))
        if rank == 0
        else None
    )
    worker = WorkerContext(
        rank,
        context.get_world_size(),
        ray.train.torch.get_device(),
        ray.train.report,
        ray.train.get_checkpoint(),
        tracker,
        loop_config.get("micro_batch"),
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


def probe_trial(flat: dict[str, Any]) -> dict[str, Any]:
    """One measured training step and one evaluation forward of a trial's model on a whole GPU, before the sweep
    places its trials: the micro-batch it will use (``auto``: the largest that fits the card) and the peak memory of
    the step at it or of the evaluation at ``data.eval_batch_size``, whichever is higher."""
    config = TrialConfig.from_flat(flat)
    device = torch.device("cuda")
    task, model, layout = build_trial(config, device)
    micro, peak = micro_batch_for(config, model, task, layout, device, config.resources.workers)
    if peak is None:
        rows = first_rows(config.data.shards, "train", micro, layout)
        peak = probe.step_peak_bytes(model, loss_function(task, config, device), on_device(rows, device), device)
    eval_size = config.data.eval_batch_size or micro
    batch = on_device(first_rows(config.data.shards, "val", eval_size, layout), device)

    def forward() -> None:
        model.eval()
        with torch.no_grad(), autocast(config, device):
            model(batch)
        model.train()

    eval_peak = probe.eval_peak_bytes(forward, device)
    properties = torch.cuda.get_device_properties(device)
    if eval_peak is None:
        raise MemoryError(
            f"{config.task} x {config.schema}: an evaluation batch of {eval_size} does not fit a whole "
            f"{properties.name}: give data.eval_batch_size a smaller value"
        )
    return {
        "micro_batch": micro,
        "peak_bytes": max(peak, eval_peak),  # what the trial needs at its peak, training or evaluating
        "train_peak_bytes": peak,
        "eval_peak_bytes": eval_peak,
        "eval_batch": eval_size,
        "card_bytes": properties.total_memory,
        "gpu": properties.name,
        "gradient_checkpointing": probe.checkpointing(model),
    }
