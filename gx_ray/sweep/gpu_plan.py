"""A sweep's GPUs: before the trials, each model setting's measured step and GPU share (the GPU plan) and how many
trials fit the cluster at once; after them, how busy the GPUs were."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import ray
from mlflow.tracking import MlflowClient

from gx_ray.runtime import one_process_per_gpu
from gx_ray.schema import AUTO
from gx_ray.sweep.plan_cache import measured_plan
from gx_ray.sweep.trial import SweepContext, gpu_plan_key
from gx_ray.tasks import task_class
from gx_ray.tracking import log_series
from gx_ray.train.config import TrialConfig
from gx_ray.train.probe import CONTEXT_BYTES, MAX_TRIALS_PER_GPU, gpu_share, probe_trial, trials_per_gpu
from gx_ray.train.telemetry import GpuSampler, busy_fraction, sample_metrics


def gpu_plan(context: SweepContext, output: Path) -> dict[str, dict[str, Any]]:
    """Each distinct model setting's micro-batch, GPU share and host memory where the space asks for ``auto``: one
    measured training step on a GPU (one Ray task a setting, all GPUs at once), or the plan cache's for the same card,
    code and cohort. Written to ``OUTPUT/gpu_plan.json``, read back on resume; empty for CPU sweeps, fixed settings."""
    space = context.space
    if space.gpus_per_worker == 0:
        return {}
    path = output / "gpu_plan.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    settings: dict[str, TrialConfig] = {}
    for cell in space.cells():
        config = context.setting(cell).config  # the context has no plan yet: the config as measured
        if config.resources.gpus_per_worker == AUTO or config.data.micro_batch == AUTO:
            settings.setdefault(gpu_plan_key(config), config)
    if not settings:
        return {}
    resources = ray.cluster_resources()
    kinds = sorted(k for k in resources if k.startswith("accelerator_type:"))
    measured = measured_plan(settings, _measure_steps, {"cards": kinds, **context.provenance})
    most = trials_per_card(space.trial_count(), space.cpus_per_worker, resources)
    plan = {}
    for key, config in settings.items():
        m, gpus = measured[key], config.resources.gpus_per_worker
        share = float(gpus) if gpus != AUTO else auto_share(config.task, m, most)
        plan[key] = {**m, "share": share, "trials_per_gpu": trials_per_gpu(share)}
    path.write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
    return plan


def trials_per_card(trials: int, cpus_per_trial: float, resources: dict[str, float]) -> int:
    """The most trials a card of the cluster (Ray's ``resources``) needs to hold: the sweep's trials over its cards,
    and no more than the CPUs beside each card run (packed beyond them, trials would wait for a core, not the card)."""
    cards = max(1, int(resources.get("GPU", 1)))
    cpu_slots = int(resources.get("CPU", 1) // max(cpus_per_trial, 1e-6)) // cards
    return max(1, min(math.ceil(trials / cards), cpu_slots))


def auto_share(task: str, measured: dict[str, Any], trials_per_card: int = MAX_TRIALS_PER_GPU) -> float:
    """``auto``'s GPU share: as many trials as the measured peak fits, for a task that packs well, and no more than
    ``trials_per_card`` (the sweep's trials over the GPUs, rounded up, at most a card's CPU slots): Ray fills one card
    before the next, so four trials packed two to a card on a 4-GPU node left a card idle (4 x H200)."""
    if not task_class(task).shares_a_gpu:
        return 1.0
    most = max(1, min(MAX_TRIALS_PER_GPU, trials_per_card))
    return gpu_share(measured["peak_bytes"] + CONTEXT_BYTES, measured["card_bytes"], max_trials=most)


def _measure_steps(settings: dict[str, TrialConfig]) -> dict[str, dict[str, Any]]:
    print(f"measuring a training step of {len(settings)} model settings on the GPUs ...", file=sys.stderr)
    return dict(zip(settings, one_process_per_gpu(probe_trial, list(settings.values())), strict=True))


def concurrency(context: SweepContext, max_concurrent: int | None = None) -> int:
    """How many trials fit the cluster at once: the plan's smallest GPU share and host memory decide how many a GPU
    (or the CPUs) and a node's memory hold; Ray places each trial by its own."""
    space = context.space
    resources = ray.cluster_resources()
    workers = 1 if space.workers == 1 and not space.fixed.get("resources.torch_trainer") else space.workers
    fit = int(resources.get("CPU", 1) // (space.cpus_per_worker * workers))
    if space.gpus_per_worker != 0:
        shares = [plan["share"] for plan in context.gpu_plan.values()] or [1.0]
        share = min(shares) if space.gpus_per_worker == AUTO else float(space.gpus_per_worker)
        fit = min(fit, round(resources.get("GPU", 0) / (share * workers), 6) // 1)
    if needs := [plan["host_bytes"] for plan in context.gpu_plan.values() if "host_bytes" in plan]:
        fit = min(fit, sum(n["Resources"].get("memory", 0) // min(needs) for n in ray.nodes() if n["Alive"]))
    fit = max(1, int(fit))
    return min(fit, max_concurrent) if max_concurrent else fit


def gpu_usage(client: MlflowClient, parent: str, runs: list, host: GpuSampler, finished: int) -> dict[str, Any]:
    """The node's GPUs from the first trial's start to the last trial's end: busy fraction per GPU (mean NVML
    utilisation), trials finished per GPU-hour, and the node's GPU utilisation over time on the parent run."""
    starts = [r.info.start_time / 1000 for r in runs if r.info.start_time]
    ends = [r.info.end_time / 1000 for r in runs if r.info.end_time]
    samples = host.samples
    if not samples or not starts or not ends:
        return {}
    start, end = min(starts), max(ends)
    per_gpu = busy_fraction(samples, start, end)
    gpu_hours = len(per_gpu) * (end - start) / 3600
    log_series(client, parent, sample_metrics(samples))
    return {
        "gpu_busy_fraction": float(np.mean(list(per_gpu.values()))) if per_gpu else math.nan,
        "gpu_busy_fraction_per_gpu": {str(k): round(v, 4) for k, v in per_gpu.items()},
        "gpus": len(per_gpu),
        "trials_window_seconds": end - start,
        "trials_per_gpu_hour": finished / gpu_hours if gpu_hours else math.nan,
    }
