"""One Tune trial: the only part of a sweep that runs in trial processes, so it imports what training needs and nothing
of the driver's (Optuna, the MLflow server, data preparation, analysis).

A trial's config takes one route: Tune's chosen values → :meth:`SweepContext.setting` (the space's resolve, the
shards, what the task built before the trials, the GPU plan's share) → a validated
:class:`~gx_ray.train.config.TrialConfig`. The driver places trials and measures the GPU plan through the same method,
so what Ray reserves is what the trial runs with. :func:`run_trial` runs the training loop itself with one worker (it
is already a Ray actor, and a ``TorchTrainer`` would add ~20 s of start-up), a Ray Train ``TorchTrainer`` for DDP.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray
import torch
from mlflow.tracking import MlflowClient
from ray import tune

from gx_ray.preemption import DrainWatch, NodePreempted
from gx_ray.runtime import quiet_data_context
from gx_ray.schema import AUTO
from gx_ray.sweep import IMPORT_STARTED_AT
from gx_ray.sweep.schedulers import restore_record
from gx_ray.sweep.spaces import SearchSpace
from gx_ray.tasks import task_class
from gx_ray.tracking import FOLD_TAG, ChildRun, TrialTracker, child_run, log_series, set_tags
from gx_ray.train.config import TrialConfig
from gx_ray.train.folds import FoldGroup, fold_checkpoint, fold_config, fold_mean
from gx_ray.train.ledger import COSTS, Ledger
from gx_ray.train.loop import TrainingRecipe, WorkerContext, run_loop, train_loop_per_worker
from gx_ray.train.telemetry import GpuSampler, sample_metrics, visible_gpu_uuids

IMPORTED_AT = time.time()
"""When this module's imports ended (torch, MLflow, Tune, the loop): with ``gx_ray.sweep.IMPORT_STARTED_AT``, what a
trial process spends importing (``python jobs/benchmark.py startup``)."""


@dataclass(frozen=True)
class TrialSetting:
    """What one trial runs with: its config, its GPU plan entry (measured step, micro-batch; empty where nothing was
    measured) and the GPU share Ray reserves for it."""

    config: TrialConfig
    plan: dict[str, Any]
    gpu_share: float


@dataclass(frozen=True)
class SweepContext:
    """What every trial of a live sweep shares, handed to trials by ``tune.with_parameters``: never kept in Tune's
    saved trial configs, so a resumed sweep's trials log to the resumed sweep's MLflow server and parent run."""

    sweep_id: str
    space: SearchSpace
    shards: str
    """The prepared cohort every trial reads (a path or URI)."""
    storage_path: str
    """Tune's and Train's state (a Ray Train ``TorchTrainer`` of a DDP trial keeps its own there)."""
    provenance: dict[str, str] = field(default_factory=dict)
    """Tags every run carries: the code, libraries and cohort it ran on."""
    task_inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Task options built once before the trials (:meth:`~gx_ray.tasks.Task.sweep_inputs`), by :func:`task_key`."""
    gpu_plan: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Measured model settings by :func:`gpu_plan_key` (``gpus_per_worker: auto`` and ``micro_batch: auto``)."""
    folds_file: str = ""
    """The sweep's fold assignment (:mod:`gx_ray.data.folds`), where its space asks for ``cv``."""
    tracking_uri: str = ""
    parent_run_id: str = ""

    def setting(self, chosen: dict[str, Any]) -> TrialSetting:
        """The trial of ``chosen`` (Tune's values for the space's grid and sampled keys)."""
        data = {"data.shards": self.shards, **({"data.folds_file": self.folds_file} if self.folds_file else {})}
        config = TrialConfig.from_flat({**self.space.resolve(chosen), **data})
        if inputs := self.task_inputs.get(task_key(config)):
            config = dataclasses.replace(config, task_options={**config.task_options, **inputs})
        plan = self.gpu_plan.get(gpu_plan_key(config), {})
        gpus = config.resources.gpus_per_worker
        # ``auto`` a setting the plan could not know (a sampled model key, say) gets a whole GPU
        share = float(plan.get("share", 1.0)) if gpus == AUTO else float(gpus)
        if plan.get("gradient_checkpointing"):  # the measured step fitted only with it
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, gradient_checkpointing=True))
        return TrialSetting(config, plan, share)

    def resources(self, chosen: dict[str, Any]) -> dict[str, float]:
        """What Ray reserves for a trial: the worker's CPUs, its GPU share and the host memory the GPU plan measured
        (Ray's ``memory``). A trial that starts a TorchTrainer holds a sliver; the trainer's workers ask for theirs."""
        setting = self.setting(chosen)
        if under_torch_trainer(setting.config):
            return {"cpu": 0.1}
        memory = {"memory": setting.plan["host_bytes"]} if "host_bytes" in setting.plan else {}
        return {"cpu": setting.config.resources.cpus_per_worker, "gpu": setting.gpu_share, **memory}


def under_torch_trainer(config: TrialConfig) -> bool:
    """Whether the trial trains under a Ray Train ``TorchTrainer`` (several workers, or asked to), or in itself."""
    return config.resources.workers > 1 or config.resources.torch_trainer


def task_key(config: TrialConfig) -> str:
    """A trial's task and its options: which of the task's sweep inputs it reads."""
    return json.dumps([config.task, config.task_options], sort_keys=True, default=str)


def gpu_plan_key(config: TrialConfig) -> str:
    """What decides a trial's GPU memory: task, inputs, model, batches and workers (not its seed or learning rate)."""
    sections = ("task", "schema", "model", "task_options", "vlm", "views")
    flat = config.to_flat()
    kept = {k: v for k, v in flat.items() if k.split(".")[0] in sections}
    keys = ("data.effective_batch", "data.micro_batch", "data.eval_batch_size", "resources.workers")
    kept.update({k: flat[k] for k in keys})
    return json.dumps(kept, sort_keys=True, default=str)


_process_started: list[float] = []
"""This process's age when its first trial began (Ray's start of the actor and the imports): reused actors' later
trials have none."""


def run_trial(params: dict[str, Any], context: SweepContext) -> None:
    """One Tune trial: build its config, open its MLflow child run, train (directly or with a TorchTrainer)."""
    trial_started = time.perf_counter()
    # wall clocks, for launch → first step across the driver's and this process's parts (jobs/benchmark.py startup)
    stamps = {"trial_started_at": time.time()}
    cold = not _process_started
    if cold:
        _process_started.append(time.time() - psutil.Process().create_time())
        stamps.update(imported_at=IMPORTED_AT, import_started_at=IMPORT_STARTED_AT)
    quiet_data_context()
    # MLflow prints two "View run" lines whenever a run ends: 120 lines per sweep; the parent run's are enough
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    setting = context.setting(params)
    config, trial = setting.config, tune.get_context()
    client = MlflowClient(context.tracking_uri)
    if context.space.folds_in_trial:
        stamps["trial_start_seconds"] = time.perf_counter() - trial_started
        _train_folds(setting, context, client, trial_started, stamps)
        return
    tags = _run_tags(config, context, trial)
    run = child_run(client, context.parent_run_id, trial.get_trial_id(), trial.get_trial_name(), tags, _params(config))
    if run.status == "FINISHED":  # done before the sweep was killed, its end not saved by Tune: never trained twice
        tune.report(run.metrics)
        return
    tracker = _tracker(client, run, setting, context)
    end = _RunEnd(client, run.run_id, tracker, trial_started, config.resources.use_gpu)
    # its cost: what Ray reserves for it over its wall time, going on from its earlier attempts' (gx_ray.train.ledger)
    workers = config.resources.workers if under_torch_trainer(config) else 1
    ledger = _ledger(run, workers * setting.gpu_share, workers * config.resources.cpus_per_worker, trial_started)
    try:
        if not under_torch_trainer(config):
            started = {"trial_start_seconds": time.perf_counter() - trial_started, **stamps}
            if cold:
                started["process_start_seconds"] = _process_started[0]
            _train_here(setting, trial, ledger, end, started)
        else:
            _fit_torch_trainer(config, context, run, trial, setting.plan.get("micro_batch"), ledger)
        end()
    except NodePreempted:  # checkpointed where it was: Tune goes on from there on another node, in this same run
        raise
    except Exception as err:
        end.failed(err)
        raise


def _run_tags(config: TrialConfig, context: SweepContext, trial: Any) -> dict[str, str]:
    """The tags of a trial's run: its cell, its trial counter and what its primary metric is."""
    task = task_class(config.task)  # its primary metric and direction are class attributes: nothing to build
    return {
        "task": config.task,
        "schema": config.schema.name,
        "seed": str(config.seed),
        "space": context.space.name,
        "gx_ray.trial": trial.get_trial_id().rsplit("_", 1)[-1],  # the counter the run name ends with
        # what val_primary/test_primary are for this task, and which way is better (the MLflow UI cannot tell)
        "gx_ray.primary_metric": task.primary_metric,
        "gx_ray.primary_direction": task.mode,
        # every metric is on the paper's 0-100 scale (accuracy, AUC, recall, ROUGE, AP ...), a median rank is a rank
        "gx_ray.primary_unit": task.primary_unit or ("rank" if "rank" in task.primary_metric else "%"),
    }


def _tracker(client: MlflowClient, run: ChildRun, setting: TrialSetting, context: SweepContext) -> TrialTracker:
    """The trial's run, tagged with where it runs; a retried or resumed trial logs into its earlier run (what that
    attempt logged is kept, never logged twice)."""
    config, plan = setting.config, setting.plan
    tracker = TrialTracker(context.tracking_uri, run.run_id, resumed=run.status is not None)
    tracker.set_tags({**context.provenance, **_device_tags(config)})
    if run.status is None:
        client.log_dict(run.run_id, config.to_flat(), "config.json")
    if config.resources.use_gpu:
        peak = {"probe_peak_gib": plan["peak_bytes"] / 2**30} if plan else {}
        tracker.log_metrics({"gpu_share": setting.gpu_share, **peak}, 0)
    return tracker


class _RunEnd:
    """Ends a trial's run once: FINISHED with its time and GPU telemetry (written before the trial's last report,
    at which a scheduler may stop the trial), or FAILED with the error."""

    def __init__(self, client: MlflowClient, run_id: str, tracker: TrialTracker, trial_started: float, gpu: bool):
        self.client, self.run_id, self.tracker, self.trial_started = client, run_id, tracker, trial_started
        self.sampler = GpuSampler(visible_gpu_uuids()).start() if gpu else None
        self.ended = False

    def __call__(self) -> None:
        if not self.ended:
            self.ended = True
            self.tracker.log_metrics({"trial_seconds": time.perf_counter() - self.trial_started}, step=0)
            _log_gpu(self.tracker, self.sampler)
            self.client.set_terminated(self.run_id, "FINISHED")

    def failed(self, err: Exception) -> None:
        if not self.ended:
            _log_gpu(self.tracker, self.sampler)
        set_tags(self.client, self.run_id, {"gx_ray.error": f"{type(err).__name__}: {err}"[:5000]})
        self.client.log_text(self.run_id, traceback.format_exc(), "error.txt")
        self.client.set_terminated(self.run_id, "FAILED")


def _device(setting: TrialSetting) -> torch.device:
    """The device a trial trains on in this process, its threads and (a packed trial's) share of the card set."""
    config, share = setting.config, setting.gpu_share
    torch.set_num_threads(max(1, int(config.resources.cpus_per_worker)))
    device = torch.device("cuda" if config.resources.use_gpu and torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and share < 1:  # a packed trial keeps to its share of the card's memory
        torch.cuda.set_per_process_memory_fraction(share, torch.cuda.current_device())
    return device


def _train_here(setting: TrialSetting, trial: Any, ledger: Ledger, end: _RunEnd, started: dict[str, float]) -> None:
    """Run the loop in this process (a one-worker trial: it already holds the trial's resources)."""
    config, tracker = setting.config, end.tracker
    device = _device(setting)
    worker = WorkerContext(
        rank=0, world_size=1, device=device, report=ledger.reporting(tune.report, tracker),
        latest_checkpoint=tune.get_checkpoint(), checkpoint_class=tune.Checkpoint,
        tracker=tracker, micro_batch=setting.plan.get("micro_batch"), timing=started, before_final_report=end,
        on_restore=lambda restored: record_restore(tracker, config, trial, restored),
        drain=DrainWatch().start(),
    )  # fmt: skip
    try:
        run_loop(config, worker)
    finally:  # Tune reuses this process for the next trial: give back what this one's CUDA cache holds, so that the
        # next one's memory telemetry is its own (a VLM's VQA trial left 129 GiB to a 29 GiB trial after it)
        worker.drain.stop()
        del worker
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _train_folds(
    setting: TrialSetting, context: SweepContext, client: MlflowClient, trial_started: float, timing: dict[str, float]
) -> None:
    """The configuration's folds side by side in this trial (``cv`` with a searcher or scheduler,
    :mod:`gx_ray.train.folds`): a run, a tracker and a ledger a fold, each fold's ledger holding its share of what
    the trial reserves; the trial reports the folds' mean. Folds whose runs had all FINISHED are not trained again."""
    config, trial, folds = setting.config, tune.get_context(), context.space.folds_in_trial
    tags = _run_tags(config, context, trial)
    runs = [
        child_run(client, context.parent_run_id, trial.get_trial_id(), f"{trial.get_trial_name()}_fold{fold}",
                  {**tags, FOLD_TAG: str(fold)}, _params(fold_config(config, fold)))
        for fold in range(folds)
    ]  # fmt: skip
    if all(run.status == "FINISHED" for run in runs):
        tune.report(fold_mean([run.metrics for run in runs]))
        return
    device, latest = _device(setting), tune.get_checkpoint()
    group, ends = FoldGroup(tune.report, tune.Checkpoint, folds), []
    try:
        recipes = []
        for fold, run in enumerate(runs):
            fold_setting = dataclasses.replace(setting, config=fold_config(config, fold))
            tracker = _tracker(client, run, fold_setting, context)
            ends.append(_RunEnd(client, run.run_id, tracker, trial_started, config.resources.use_gpu and fold == 0))
            ledger = _ledger(run, setting.gpu_share / folds, config.resources.cpus_per_worker / folds, trial_started)
            # a PBT exploit's donor is read from the trial's checkpoint's path, not the fold's folder within it
            on_restore = functools.partial(_record_fold_restore, tracker, fold_setting.config, trial, latest)
            worker = WorkerContext(
                rank=0, world_size=1, device=device, report=ledger.reporting(group.collector(fold), tracker),
                latest_checkpoint=fold_checkpoint(latest, fold), checkpoint_class=tune.Checkpoint, tracker=tracker,
                micro_batch=setting.plan.get("micro_batch"), timing=dict(timing),
                before_final_report=group.deferred(ends[-1]), on_restore=on_restore,
            )  # fmt: skip
            recipes.append(TrainingRecipe(fold_setting.config, worker))
            recipes[-1].setup()
        group.train(recipes)
    except Exception as err:
        for end in ends:
            end.failed(err)
        raise


def _ledger(run: ChildRun, gpus: float, cpus: float, trial_started: float) -> Ledger:
    """The ledger of ``run`` holding ``gpus`` and ``cpus``: going on from what its earlier attempts logged, counting
    this attempt from the trial's start (``trial_started``, ``time.perf_counter()``)."""
    spent = {k: v for k, v in run.metrics.items() if k in COSTS}
    return Ledger(gpus, cpus, spent, started=time.time() - (time.perf_counter() - trial_started))


def _record_fold_restore(tracker: TrialTracker, config: TrialConfig, trial: Any, latest: Any, restored: dict) -> None:
    record_restore(tracker, config, trial, {**restored, "path": str(latest.path)})


def record_restore(tracker: TrialTracker, config: TrialConfig, trial: Any, restored: dict[str, Any]) -> None:
    """A trial restored from another trial's checkpoint (a PBT exploit) or with a changed config (a mutation, a
    replayed schedule) says so on its run, whose params keep the values it started with: the artifact
    ``schedule/epoch-NNNN.json`` (donor, epochs, values changed, the restored weights' SHA-256), each changed number
    as the metric ``schedule.<key>`` at the first epoch it trains, and the tag ``gx_ray.exploits`` counting them."""
    record = restore_record(restored, config.to_flat(), trial.get_trial_id(), trial.get_trial_dir())
    if record is None:  # a retried or resumed trial, going on from its own checkpoint
        return
    tracker.client.log_dict(tracker.run_id, record, f"schedule/epoch-{record['epoch']:04d}.json")
    numbers = {f"schedule.{key}": new for key, (_, new) in record["changed"].items()
               if isinstance(new, int | float) and not isinstance(new, bool)}  # fmt: skip
    tracker.log_metrics(numbers, step=record["epoch"])
    exploits = tracker.client.list_artifacts(tracker.run_id, "schedule")
    tracker.set_tags({"gx_ray.exploits": str(len(exploits)), "gx_ray.donor": record["donor_trial"] or "itself"})


def _params(config: TrialConfig) -> dict[str, Any]:
    """The trial's settings as MLflow params, less those said elsewhere: ``schema.name`` is ``schema``, and the
    shards are the parent run's ``data`` (the full config is the run's ``config.json``)."""
    return {k: v for k, v in config.to_flat().items() if k not in ("schema.name", "data.shards")}


def _log_gpu(tracker: TrialTracker, sampler: GpuSampler | None) -> None:
    """The trial's GPU utilisation and memory over time (MLflow's system-metric names) and their summary."""
    if sampler is None:
        return
    summary = sampler.stop()
    log_series(tracker.client, tracker.run_id, sample_metrics(sampler.samples))
    tracker.log_metrics(summary.as_metrics(), step=0)


def _device_tags(config: TrialConfig) -> dict[str, str]:
    """Where the trial runs and at which batch (the micro-batch the loop settles on is tagged by the loop)."""
    gpu = config.resources.use_gpu and torch.cuda.is_available()
    device = torch.cuda.get_device_name(torch.cuda.current_device()) if gpu else f"cpu ({os.cpu_count()} cores)"
    return {
        "gx_ray.device": device,
        "gx_ray.effective_batch": str(config.data.effective_batch),
        # the node of the trial's latest attempt (a retried trial may move): which machine's logs to read
        "gx_ray.node_id": ray.get_runtime_context().get_node_id(),
        "gx_ray.node_ip": ray.util.get_node_ip_address(),
    }


def _fit_torch_trainer(
    config: TrialConfig, context: SweepContext, run: ChildRun, trial: Any, micro_batch: int | None, ledger: Ledger
) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    gpus = config.resources.gpus_per_worker if config.resources.use_gpu else 0
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "trial": config,
            "tracking_uri": context.tracking_uri,
            "run_id": run.run_id,
            "micro_batch": micro_batch,
            "resumed": run.status is not None,
            "ledger": ledger,
        },  # fmt: skip
        scaling_config=ScalingConfig(
            num_workers=config.resources.workers,
            use_gpu=config.resources.use_gpu,
            resources_per_worker={"CPU": config.resources.cpus_per_worker, **({"GPU": gpus} if gpus else {})},
        ),
        run_config=RunConfig(
            name=f"{context.sweep_id}-{trial.get_trial_id()}",  # deterministic: Train resumes by name
            storage_path=context.storage_path,
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()
