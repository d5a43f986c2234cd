"""The sweep: a search space → Ray Tune trials (each a training run) → MLflow → a summary per task and schema.

A Tune trial is :func:`run_trial`. With one worker it runs the training loop itself (it is already a Ray actor
holding the trial's resources, and a ``TorchTrainer`` would add ~20 s of start-up); with several it starts a
Ray Train ``TorchTrainer`` for DDP, whose metrics reach Tune through Train's Tune report callback (Train V2).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from mlflow.tracking import MlflowClient
from ray import tune
from ray.tune.search.optuna import OptunaSearch

from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.prepare import PrepareConfig, prepare_data
from gx_ray.data.preprocess import PreprocessConfig
from gx_ray.data.shards import read_manifest, read_split
from gx_ray.data.splits import SPLITS
from gx_ray.runtime import init_ray, quiet_data_context
from gx_ray.sweep.spaces import SearchSpace, available_presets, load_space
from gx_ray.tracking import TrialTracker, child_run, close_stopped_runs, log_metrics, parent_run, set_tags
from gx_ray.tracking.server import LocalMlflowServer
from gx_ray.train.config import TrialConfig
from gx_ray.train.loop import WorkerContext, run_loop, train_loop_per_worker

SWEEP_FILE = "sweep.json"
EXPERIMENT = "gx-ray"
CONTEXT_KEY = "__sweep"
METRIC = "val_primary"  # every task reports its primary metric under this name too; all are "higher is better"


@dataclass
class SweepOptions:
    space: str
    output: Path = Path("outputs/sweeps")
    data: Path | None = None
    """A prepared dataset (its ``shards/`` folder or the folder above it); None prepares the demo cohort once."""
    address: str | None = None
    mlflow_uri: str | None = None
    presets: tuple[str, ...] = ()
    resume: bool = False
    max_concurrent: int | None = None
    demo_cases: int = 48
    demo_dir: Path = Path("outputs/demo")


@dataclass
class SweepResult:
    sweep_id: str
    output: Path
    tracking_uri: str
    experiment: str
    parent_run_id: str
    finished: int
    failed: int
    stopped_early: int = 0
    """Trials the scheduler (ASHA) stopped before their last epoch: no test metrics, by design."""
    best: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    report: Path | None = None
    """``OUTPUT/report/summary.md``, or None when the report failed (rerun ``analysis/report.py``)."""


# --- the trial -------------------------------------------------------------------------------------------


def run_trial(params: dict[str, Any]) -> None:
    """One Tune trial: build its config, open its MLflow child run, train (directly or with a TorchTrainer)."""
    trial_started = time.perf_counter()
    quiet_data_context()
    # MLflow prints two "View run" lines whenever a run ends: 120 lines per sweep; the parent run's are enough
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    context = params[CONTEXT_KEY]
    chosen = {k: v for k, v in params.items() if k != CONTEXT_KEY}
    flat = {**_resolve(context, chosen), "data.shards": context["shards"]}
    config = TrialConfig.from_flat(flat)
    trial = tune.get_context()
    client = MlflowClient(context["tracking_uri"])
    tags = {"task": config.task, "schema": config.schema.name, "seed": str(config.seed), "space": context["space"]}
    run_id = child_run(
        client, context["parent_run_id"], trial.get_trial_id(), trial.get_trial_name(), tags, config.to_flat()
    )
    client.log_dict(run_id, config.to_flat(), "config.json")
    try:
        if config.resources.workers == 1 and not config.resources.torch_trainer:
            torch.set_num_threads(max(1, int(config.resources.cpus_per_worker)))
            device = torch.device("cuda" if config.resources.use_gpu and torch.cuda.is_available() else "cpu")
            data = {split: _dataset(config, split).iterator() for split in SPLITS}
            worker = WorkerContext(
                0, 1, device, data, tune.report, tune.get_checkpoint(), TrialTracker(context["tracking_uri"], run_id)
            )
            run_loop(config, worker)
        else:
            _fit_torch_trainer(config, flat, context, run_id, trial)
        log_metrics(client, run_id, {"trial_seconds": time.perf_counter() - trial_started}, step=0)
        client.set_terminated(run_id, "FINISHED")
    except Exception as err:
        set_tags(client, run_id, {"gx_ray.error": f"{type(err).__name__}: {err}"[:5000]})
        client.log_text(run_id, traceback.format_exc(), "error.txt")
        client.set_terminated(run_id, "FAILED")
        raise


def _fit_torch_trainer(config: TrialConfig, flat: dict, context: dict, run_id: str, trial: Any) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"trial": flat, "tracking_uri": context["tracking_uri"], "run_id": run_id},
        scaling_config=ScalingConfig(
            num_workers=config.resources.workers,
            use_gpu=config.resources.use_gpu,
            resources_per_worker={"CPU": config.resources.cpus_per_worker},
        ),
        datasets={split: _dataset(config, split) for split in SPLITS},
        run_config=RunConfig(
            name=f"{context['sweep_id']}-{trial.get_trial_name()}",  # deterministic: Train resumes by name
            storage_path=context["storage_path"],
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


def _dataset(config: TrialConfig, split: str) -> ray.data.Dataset:
    shards = Path(config.data.shards)
    return read_split(shards, split, num_cpus=config.data.read_cpus, concurrency=config.data.read_concurrency)


def _resolve(context: dict, chosen: dict[str, Any]) -> dict[str, Any]:
    flat = {**context["fixed"], **chosen}
    for rule in context["overrides"]:
        if all(flat.get(k) == v for k, v in rule["when"].items()):
            flat.update(rule["set"])
    return flat


# --- the sweep -------------------------------------------------------------------------------------------


def _sweep_id(space: SearchSpace, shards: Path) -> str:
    """Deterministic: the same space, presets and data give the same id (and so the same names on resume)."""
    digest = hashlib.sha1(
        json.dumps(
            [space.fixed, space.grid, space.sample, space.overrides, str(shards.resolve())], sort_keys=True, default=str
        ).encode()
    ).hexdigest()[:8]
    return "-".join([space.name, *space.presets_applied, digest])


def _shard_dir(options: SweepOptions) -> Path:
    if options.data is None:
        config = PrepareConfig(preprocess=PreprocessConfig.preset("demo"), endoscopy_size=64)
        result = prepare_data(
            "demo", options.demo_dir, config, DemoConfig(cases=options.demo_cases), address=options.address
        )
        return result.shard_dir
    data = Path(options.data)
    return data if (data / "manifest.json").is_file() else data / "shards"


def _concurrency(space: SearchSpace, options: SweepOptions) -> int:
    """How many trials fit the cluster at once, from its GPUs (or CPUs) and one trial's needs."""
    resources = ray.cluster_resources()
    if space.gpus_per_worker > 0:
        fit = int(resources.get("GPU", 0) // (space.gpus_per_worker * space.workers))
    else:
        fit = int(resources.get("CPU", 1) // (space.cpus_per_worker * space.workers))
    fit = max(1, fit)
    return min(fit, options.max_concurrent) if options.max_concurrent else fit


def _param_space(space: SearchSpace, context: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {key: tune.grid_search(values) for key, values in space.grid.items()}
    for key, spec in space.sample.items():
        kind = spec["type"]
        params[key] = {
            "uniform": lambda s: tune.uniform(s["low"], s["high"]),
            "loguniform": lambda s: tune.loguniform(float(s["low"]), float(s["high"])),
            "int": lambda s: tune.randint(int(s["low"]), int(s["high"]) + 1),
            "categorical": lambda s: tune.choice(s["choices"]),
        }[kind](spec)
    params[CONTEXT_KEY] = context
    return params


def _trial_name(trial: Any) -> str:
    index = trial.trial_id.rsplit("_", 1)[-1]
    config = trial.config
    parts = [index, str(config.get("task", "")), str(config.get("schema", "")), f"s{config.get('seed', 0)}"]
    return "-".join(p for p in parts if p and p != "s")


def run_sweep(options: SweepOptions) -> SweepResult:
    """Run (or resume) a sweep; writes ``OUTPUT/sweep.json`` and prints a summary table."""
    started = time.perf_counter()
    # on the built-in demo cohort a space's "demo" preset (CPU-sized models) comes first, when it has one
    presets = options.presets
    if options.data is None and "demo" not in presets and "demo" in available_presets(options.space):
        presets = ("demo", *presets)
    space = load_space(options.space, presets)  # a malformed space fails here, before Ray starts
    init_ray(options.address)
    timings: dict[str, float] = {"ray_seconds": time.perf_counter() - started}
    shards = _shard_dir(options)
    timings["data_seconds"] = time.perf_counter() - started - timings["ray_seconds"]
    read_manifest(shards, verify=False)
    sweep_id = _sweep_id(space, shards)
    output = Path(options.output) / sweep_id
    storage = output / "ray"
    if (storage / sweep_id).exists() and not options.resume:
        raise FileExistsError(f"{output} holds this sweep already: pass --resume to continue it, or another --output")
    output.mkdir(parents=True, exist_ok=True)
    server = None
    if options.mlflow_uri is None:
        mlflow_started = time.perf_counter()
        server = LocalMlflowServer(output / "mlflow").start()
        timings["mlflow_seconds"] = time.perf_counter() - mlflow_started
    tracking_uri = options.mlflow_uri or server.uri
    try:
        result = _tune(space, options, shards, sweep_id, output, storage, tracking_uri, timings)
        result.report = _write_report(result, shards)
    finally:
        if server:
            server.stop()
    result.timings["total_seconds"] = time.perf_counter() - started
    _write_sweep_file(result, space)
    if server:
        print(f"\nbrowse the runs:  {server.ui_command()}")
    return result


def _tune(space, options, shards, sweep_id, output, storage, tracking_uri, timings) -> SweepResult:
    client = MlflowClient(tracking_uri)
    parent = parent_run(
        client,
        EXPERIMENT,
        sweep_id,
        {
            "space": space.name,
            "presets": ",".join(space.presets_applied),
            "data": str(shards.resolve()),  # the report reads its manifest (which cohort) from anywhere
            **{f"fixed.{k}": v for k, v in space.fixed.items()},
            **{f"grid.{k}": v for k, v in space.grid.items()},
        },
    )
    context = {
        "tracking_uri": tracking_uri,
        "parent_run_id": parent,
        "sweep_id": sweep_id,
        "space": space.name,
        "shards": str(shards.resolve()),
        "storage_path": str(storage.resolve()),
        # the space's resources section decides what every trial config says about resources
        "fixed": {
            "resources.workers": space.workers,
            "resources.cpus_per_worker": space.cpus_per_worker,
            "resources.use_gpu": space.gpus_per_worker > 0,
            **space.fixed,
        },
        "overrides": space.overrides,
    }
    in_trial = space.workers == 1 and not context["fixed"].get("resources.torch_trainer", False)
    # a trial that runs its own loop holds the worker's resources; one that starts a TorchTrainer holds none
    # but a sliver (the trainer's workers ask for theirs)
    resources = {"cpu": space.cpus_per_worker, "gpu": space.gpus_per_worker} if in_trial else {"cpu": 0.1}
    trainable = tune.with_resources(run_trial, resources)
    metric, mode = (space.metric, ["max"] * len(space.metric)) if space.multi_objective else (METRIC, "max")
    search_alg = None
    if space.searcher == "optuna":
        search_alg = OptunaSearch(metric=metric, mode=mode, seed=0)
    scheduler = None
    if space.scheduler == "asha":  # stops on the primary metric, also when Optuna searches several objectives
        scheduler = tune.schedulers.ASHAScheduler(
            time_attr="epoch", metric=METRIC, mode="max", grace_period=1, reduction_factor=2
        )
    concurrency = _concurrency(space, options)
    timings["concurrency"] = concurrency
    tune_config = tune.TuneConfig(
        # the searcher and the scheduler carry their own metric; Tune refuses it given twice
        metric=None if search_alg or scheduler else metric,
        mode=None if search_alg or scheduler else mode,
        search_alg=search_alg,
        scheduler=scheduler,
        num_samples=space.samples,
        max_concurrent_trials=concurrency,
        time_budget_s=space.time_s,
        trial_name_creator=_trial_name,
        trial_dirname_creator=_trial_name,
        reuse_actors=True,
    )
    run_config = tune.RunConfig(
        name=sweep_id,
        storage_path=str(storage.resolve()),
        failure_config=tune.FailureConfig(max_failures=1),  # a trial that fails twice is reported, not fatal
        checkpoint_config=tune.CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute=METRIC, checkpoint_score_order="max"
        ),
        verbose=1 if sys.stderr.isatty() else 0,
    )
    path = str(storage / sweep_id)
    if options.resume and tune.Tuner.can_restore(path):
        tuner = tune.Tuner.restore(
            path,
            trainable,
            resume_unfinished=True,
            resume_errored=False,
            restart_errored=True,
            param_space=_param_space(space, context),
        )
    else:
        tuner = tune.Tuner(
            trainable, param_space=_param_space(space, context), tune_config=tune_config, run_config=run_config
        )
    print(
        f"sweep {sweep_id}: {space.trial_count()} trials, {concurrency} at a time; MLflow {tracking_uri}",
        file=sys.stderr,
    )
    tune_started = time.perf_counter()
    grid = tuner.fit()
    timings["tune_seconds"] = time.perf_counter() - tune_started
    rows = _result_rows(grid)
    failed = sum(1 for r in rows if r["error"])
    finished = sum(1 for r in rows if r["completed"] and not r["error"])
    stopped = [r["trial"] for r in rows if r["stopped_early"]]
    close_stopped_runs(client, parent, stopped)
    best = summarise(rows)
    print(format_summary(best, finished, failed, len(rows), len(stopped)))
    counts = {"trials_finished": finished, "trials_failed": failed, "trials_stopped_early": len(stopped)}
    log_metrics(client, parent, counts, step=0)
    # an interrupted sweep's parent stays open for --resume; one whose trials all failed is FAILED
    done = finished + failed + len(stopped) == len(rows)
    status = "FAILED" if failed == len(rows) else "FINISHED" if done else "KILLED"
    client.set_terminated(parent, status)
    return SweepResult(
        sweep_id, output, tracking_uri, EXPERIMENT, parent, finished, failed, len(stopped), best, timings
    )


def _write_report(result: SweepResult, shards: Path) -> Path | None:
    """The sweep's report (tables, figures, statistics), also on the parent run; a failure is printed, not fatal:
    the trials are in MLflow, and ``analysis/report.py`` writes the report again."""
    from gx_ray.analysis.report import cohort_of, write_report

    started = time.perf_counter()
    try:
        report = write_report(
            result.tracking_uri, result.sweep_id, result.output, result.parent_run_id, cohort_of(read_manifest(shards))
        )
    except Exception:
        traceback.print_exc()
        print(f"the report failed; write it again with: python analysis/report.py --sweep {result.output}")
        return None
    result.timings["report_seconds"] = time.perf_counter() - started
    summary = report.folder / "summary.md"
    print(f"report: {summary}  ({summary.with_suffix('.html').name} beside it; also on the parent run)")
    return summary


def _result_rows(grid: Any) -> list[dict[str, Any]]:
    rows = []
    for result in grid:
        params = dict(result.config or {})
        context = params.pop(CONTEXT_KEY, {"fixed": {}, "overrides": []})
        flat = _resolve(context, params)
        metrics = result.metrics or {}
        rows.append(
            {
                "trial": metrics.get("trial_id") or (result.path and Path(result.path).name),
                "task": flat.get("task"),
                "schema": flat.get("schema", "image_only") if isinstance(flat.get("schema", ""), str) else "custom",
                "seed": flat.get("seed", 0),
                "chosen": {k: v for k, v in params.items() if k not in ("task", "schema", "seed")},
                "val_primary": metrics.get("best_val_primary"),
                "test_primary": metrics.get("test_primary"),
                "completed": "best_epoch" in metrics,  # the loop reports it with the test metrics, at its end
                # Tune marks the result at which the scheduler stopped a trial done; a trial that ran to its end
                # (or was interrupted) returned after its last report, which is not marked
                "stopped_early": bool(metrics.get("done")) and "best_epoch" not in metrics and not result.error,
                "error": str(result.error).splitlines()[0][:300] if result.error else None,
            }
        )
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task and schema: test primary metric over seeds (mean, sd, n) and the best trial by validation."""
    from gx_ray.tasks import build_task

    cells: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["task"], row["schema"]), []).append(row)
    summary = []
    for (task, schema), members in sorted(cells.items()):
        done = [m for m in members if not m["error"] and m["completed"]]
        tests = np.array([m["test_primary"] for m in done], dtype=float)
        tests = tests[np.isfinite(tests)]  # a metric undefined on a split (one-class AUC) counts as no value
        best = max(done, key=lambda m: _finite(m["val_primary"]), default=None)
        summary.append(
            {
                "task": task,
                "schema": schema,
                "metric": build_task(task).primary_metric,
                "trials": len(members),
                "failed": len(members) - len(done),
                "test_mean": float(tests.mean()) if len(tests) else None,
                "test_sd": float(tests.std(ddof=1)) if len(tests) > 1 else None,
                "best_trial": best and best["trial"],
                "best_val": best and best["val_primary"],
                "best_test": best and best["test_primary"],
                "best_params": best and best["chosen"],
            }
        )
    return summary


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else -math.inf


def format_summary(
    summary: list[dict[str, Any]], finished: int, failed: int, total: int, stopped_early: int = 0
) -> str:
    unfinished = total - finished - failed - stopped_early
    lines = [
        f"\n{finished} of {total} trials finished, {failed} failed"
        + (f", {stopped_early} stopped early by the scheduler" if stopped_early else "")
        + (f", {unfinished} unfinished (resume with --resume)" if unfinished else ""),
        f"{'task':<22} {'schema':<18} {'metric':<26} {'test mean ± sd (n)':<24} best val → test",
    ]
    for cell in summary:
        n = cell["trials"] - cell["failed"]
        mean = "—" if cell["test_mean"] is None else f"{cell['test_mean']:.1f}"
        sd = "" if cell["test_sd"] is None else f" ± {cell['test_sd']:.1f}"
        best = "—" if cell["best_val"] is None else f"{cell['best_val']:.1f} → {cell['best_test']:.1f}"
        lines.append(f"{cell['task']:<22} {cell['schema']:<18} {cell['metric']:<26} {mean + sd + f' ({n})':<24} {best}")
    return "\n".join(lines)


def _write_sweep_file(result: SweepResult, space: SearchSpace) -> Path:
    document = {
        "sweep_id": result.sweep_id,
        "space": space.name,
        "presets": list(space.presets_applied),
        "tracking_uri": result.tracking_uri,
        "experiment": result.experiment,
        "parent_run_id": result.parent_run_id,
        "trials": {"finished": result.finished, "failed": result.failed, "stopped_early": result.stopped_early},
        "report": str(result.report) if result.report else None,
        "best": result.best,
        "timings_seconds": {k: round(v, 1) for k, v in result.timings.items()},
    }
    path = result.output / SWEEP_FILE
    path.write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")
    return path
