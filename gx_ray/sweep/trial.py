"""One Tune trial, and what Ray needs to place it: the only part of a sweep that runs in trial processes, so it
imports what training needs and nothing of the driver's (Optuna, the MLflow server, data preparation, analysis).

A Tune trial is :func:`run_trial`. With one worker it runs the training loop itself (it is already a Ray actor
holding the trial's resources, and a ``TorchTrainer`` would add ~20 s of start-up); with several it starts a
Ray Train ``TorchTrainer`` for DDP, whose metrics reach Tune through Train's Tune report callback (Train V2).
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from typing import Any

import psutil
import ray
import torch
from mlflow.tracking import MlflowClient
from ray import tune

from gx_ray.runtime import quiet_data_context
from gx_ray.tasks import task_class
from gx_ray.tracking import ChildRun, TrialTracker, child_run, log_series, set_tags
from gx_ray.train.config import AUTO, TrialConfig
from gx_ray.train.loop import WorkerContext, run_loop, train_loop_per_worker
from gx_ray.train.telemetry import GpuSampler, sample_metrics, visible_gpu_uuids

_process_started: list[float] = []
"""This process's age when its first trial began (Ray's start of the actor and the imports): reused actors' later
trials have none."""


def run_trial(params: dict[str, Any], context: dict[str, Any]) -> None:
    """One Tune trial: build its config, open its MLflow child run, train (directly or with a TorchTrainer).

    ``context`` is the live sweep's (tracking URI, parent run, fixed keys, GPU plan), bound with
    ``tune.with_parameters``: never kept in Tune's saved trial configs, so a resumed sweep's trials log to the resumed
    sweep's MLflow server and parent run, not to the killed one's."""
    trial_started = time.perf_counter()
    cold = not _process_started
    if cold:
        _process_started.append(time.time() - psutil.Process().create_time())
    quiet_data_context()
    # MLflow prints two "View run" lines whenever a run ends: 120 lines per sweep; the parent run's are enough
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    flat, plan, share = trial_setting(context, params)
    config = TrialConfig.from_flat(flat)
    trial = tune.get_context()
    client = MlflowClient(context["tracking_uri"])
    task = task_class(config.task)  # its primary metric and direction are class attributes: nothing to build
    tags = {
        "task": config.task,
        "schema": config.schema.name,
        "seed": str(config.seed),
        "space": context["space"],
        "gx_ray.trial": trial.get_trial_id().rsplit("_", 1)[-1],  # the counter the run name ends with
        # what val_primary/test_primary are for this task, and which way is better (the MLflow UI cannot tell)
        "gx_ray.primary_metric": task.primary_metric,
        "gx_ray.primary_direction": task.mode,
        # every metric is on the paper's 0-100 scale (accuracy, AUC, recall, ROUGE, AP ...), a median rank is a rank
        "gx_ray.primary_unit": "rank" if "rank" in task.primary_metric else "%",
    }
    run = child_run(
        client, context["parent_run_id"], trial.get_trial_id(), trial.get_trial_name(), tags, _params(config)
    )
    run_id = run.run_id
    if run.status == "FINISHED":  # done before the sweep was killed, its end not saved by Tune: never trained twice
        tune.report(run.metrics)
        return
    # a retried or resumed trial logs into its earlier run: what that attempt logged is kept, never logged twice
    tracker = TrialTracker(context["tracking_uri"], run_id, resumed=run.status is not None)
    tracker.set_tags({**context.get("provenance", {}), **_device_tags(config)})
    if run.status is None:
        client.log_dict(run_id, config.to_flat(), "config.json")
    if config.resources.use_gpu:
        tracker.log_metrics({"gpu_share": share, **({"probe_peak_gib": plan["peak_bytes"] / 2**30} if plan else {})}, 0)
    sampler = GpuSampler(visible_gpu_uuids()).start() if config.resources.use_gpu else None
    ended = False

    def end_run() -> None:
        """The run's end, written before the trial's last report (a scheduler may stop the trial at it)."""
        nonlocal ended
        if not ended:
            ended = True
            tracker.log_metrics({"trial_seconds": time.perf_counter() - trial_started}, step=0)
            _log_gpu(tracker, sampler)
            client.set_terminated(run_id, "FINISHED")

    try:
        if config.resources.workers == 1 and not config.resources.torch_trainer:
            torch.set_num_threads(max(1, int(config.resources.cpus_per_worker)))
            device = torch.device("cuda" if config.resources.use_gpu and torch.cuda.is_available() else "cpu")
            if device.type == "cuda" and share < 1:  # a packed trial keeps to its share of the card's memory
                torch.cuda.set_per_process_memory_fraction(share, torch.cuda.current_device())
            worker = WorkerContext(
                0, 1, device, tune.report, tune.get_checkpoint(), tracker, plan.get("micro_batch"),
                {"trial_start_seconds": time.perf_counter() - trial_started,
                 **({"process_start_seconds": _process_started[0]} if cold else {})}, end_run,
            )  # fmt: skip
            try:
                run_loop(config, worker)
            finally:  # Tune reuses this process for the next trial: give back what this one's CUDA cache holds, so that
                # the next one's memory telemetry is its own (a VLM's VQA trial left 129 GiB to a 29 GiB trial after it)
                del worker
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        else:
            _fit_torch_trainer(config, flat, context, run, trial, plan.get("micro_batch"))
        end_run()
    except Exception as err:
        if not ended:
            _log_gpu(tracker, sampler)
        set_tags(client, run_id, {"gx_ray.error": f"{type(err).__name__}: {err}"[:5000]})
        client.log_text(run_id, traceback.format_exc(), "error.txt")
        client.set_terminated(run_id, "FAILED")
        raise


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
    config: TrialConfig, flat: dict, context: dict, run: ChildRun, trial: Any, micro_batch: int | None
) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    gpus = config.resources.gpus_per_worker if config.resources.use_gpu else 0
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "trial": flat,
            "tracking_uri": context["tracking_uri"],
            "run_id": run.run_id,
            "micro_batch": micro_batch,
            "resumed": run.status is not None,
        },  # fmt: skip
        scaling_config=ScalingConfig(
            num_workers=config.resources.workers,
            use_gpu=config.resources.use_gpu,
            resources_per_worker={"CPU": config.resources.cpus_per_worker, **({"GPU": gpus} if gpus else {})},
        ),
        run_config=RunConfig(
            name=f"{context['sweep_id']}-{trial.get_trial_id()}",  # deterministic: Train resumes by name
            storage_path=context["storage_path"],
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


def trial_setting(context: dict[str, Any], params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], float]:
    """A trial's flat config, its GPU plan entry and its GPU share. The plan and the share are found by the key the
    driver measured and Ray reserved with, before the config gains its questions file (lesion QA) or gradient
    checkpointing (where the measured step fitted only with it), either of which changes that key."""
    flat = {**resolve(context, params), "data.shards": context["shards"]}
    plan = context["gpu_plan"].get(gpu_plan_key(flat), {})
    share = gpu_share_of(context, flat)
    if flat.get("task") == "lesion_qa":  # the questions the driver built once for this recipe and cohort
        flat = {**question_file_of(context, flat), **flat}
    if plan.get("gradient_checkpointing"):
        flat["model.gradient_checkpointing"] = True
    return flat, plan, share


def gpu_plan_key(flat: dict[str, Any]) -> str:
    """What decides a trial's GPU memory: task, inputs, model, batches and workers (not its seed or learning rate)."""
    sections = ("task", "schema", "model", "task_options", "vlm", "views")
    kept = {k: v for k, v in flat.items() if k.split(".")[0] in sections}
    keys = ("data.effective_batch", "data.micro_batch", "data.eval_batch_size", "resources.workers")
    kept.update({k: flat.get(k) for k in keys})
    return json.dumps(kept, sort_keys=True, default=str)


def trial_resources(context: dict[str, Any], params: dict[str, Any]) -> dict[str, float]:
    """What Ray reserves for a trial: the worker's CPUs and its GPU share (the measured one for ``auto``). A trial that
    starts a TorchTrainer holds a sliver; the trainer's workers ask for theirs."""
    flat = resolve(context, params)
    if flat.get("resources.workers", 1) > 1 or flat.get("resources.torch_trainer"):
        return {"cpu": 0.1}
    return {"cpu": flat.get("resources.cpus_per_worker", 1), "gpu": gpu_share_of(context, flat)}


def gpu_share_of(context: dict[str, Any], flat: dict[str, Any]) -> float:
    """A one-worker trial's GPU share: the space's fixed ``resources.gpus_per_worker``, or for ``auto`` the plan's
    measured share (a setting the plan could not know, a sampled model key say, gets a whole GPU)."""
    gpus = flat.get("resources.gpus_per_worker", 0)
    if gpus == AUTO:
        return float(context["gpu_plan"].get(gpu_plan_key(flat), {}).get("share", 1.0))
    return float(gpus)


def question_file_of(context: dict, flat: dict[str, Any]) -> dict[str, str]:
    """``{"task_options.questions_file": …}`` for a lesion QA trial whose recipe the driver wrote, else nothing."""
    from gx_ray.tasks.lesion_qa import recipe_options

    location = context.get("questions", {}).get(".".join(map(str, recipe_options(task_options(flat)))))
    return {"task_options.questions_file": location} if location else {}


def task_options(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat config's ``task_options.*`` keys, by option name."""
    return {k.removeprefix("task_options."): v for k, v in flat.items() if k.startswith("task_options.")}


def resolve(context: dict, chosen: dict[str, Any]) -> dict[str, Any]:
    flat = {**context["fixed"], **chosen}
    for rule in context["overrides"]:
        if all(flat.get(k) == v for k, v in rule["when"].items()):
            flat.update(rule["set"])
    return flat


# --- the sweep -------------------------------------------------------------------------------------------
