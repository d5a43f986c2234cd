"""A sweep's device budget (``--gpu-hours N``, or ``--cpu-hours N`` for trials on CPUs): a forecast before the trials
start, a hard stop once spent, and the ledger of what every trial cost.

- **The ledger.** Every trial reports its cost with each epoch (:mod:`gx_ray.train.ledger`: reserved GPUs or CPUs ×
  wall seconds, over its attempts); the sweep writes ``OUTPUT/ledger.csv`` (one row per trial) and logs it and the
  totals to the parent run.
- **The forecast.** Each distinct trial setting is piloted once: a Ray task holding what its trials hold trains it
  twice (as a fresh trial process, then a reused one) for two epochs of a few steps, giving its set-up time, seconds
  per optimiser step and fixed cost per epoch; with each trial's epochs and steps that forecasts every trial, and the
  sweep prints the total and how many fit. Pilots are cached with the GPU plans (same machine, code and cohort).
- **The hard stop.** :class:`BudgetStop` sums the trials' reported costs (earlier drivers' read back from MLflow, so
  ``--resume`` continues the same budget); once spent it stops the sweep as Ctrl-C does: running trials keep their
  last checkpoint and end, none starts, ``--resume`` with a larger budget goes on.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from mlflow.tracking import MlflowClient
from ray import tune
from tqdm import tqdm

from gx_ray.data.stream import split_rows
from gx_ray.schema import AUTO
from gx_ray.sweep.plan_cache import default_cache_dir, measured_plan
from gx_ray.sweep.spaces import SearchSpace
from gx_ray.sweep.trial import SweepContext, TrialSetting, gpu_plan_key, under_torch_trainer
from gx_ray.tracking import ABANDONED_TAG, TRIAL_TAG, child_runs, log_metrics
from gx_ray.train.config import TrialConfig
from gx_ray.train.ledger import COSTS
from gx_ray.train.loop import WorkerContext, optimiser_steps, run_loop

BUDGET_FILE = "budget.json"
LEDGER_FILE = "ledger.csv"
PILOT_STEPS = 3
"""Optimiser steps a pilot epoch takes: a few, so that the step time is measured without the pilot costing much."""
UNITS = {"gpu_seconds": "GPU-hours", "cpu_seconds": "CPU-hours"}


class BudgetError(ValueError):
    """A budget that cannot work: not positive, two kinds at once, or GPU-hours for trials that hold no GPU."""


@dataclass(frozen=True)
class Budget:
    metric: str
    """What it counts: ``gpu_seconds`` or ``cpu_seconds``."""
    hours: float

    @property
    def seconds(self) -> float:
        return self.hours * 3600

    def says(self, seconds: float) -> str:
        return f"{seconds / 3600:.3g} {UNITS[self.metric]}"


def sweep_budget(options: Any, space: SearchSpace, output: Path) -> Budget | None:
    """The budget of a sweep's options (``gpu_hours``, ``cpu_hours``, ``resume``): the one given, else on ``--resume``
    the one it was started with (``OUTPUT/budget.json``), else none. A given budget is recorded there; a bad one
    raises :class:`BudgetError` naming the flag (before Ray starts)."""
    gpu_hours, cpu_hours = options.gpu_hours, options.cpu_hours
    if gpu_hours is not None and cpu_hours is not None:
        raise BudgetError("--gpu-hours and --cpu-hours: give one budget")
    path = output / BUDGET_FILE
    if gpu_hours is None and cpu_hours is None:
        if options.resume and path.is_file():
            return Budget(**json.loads(path.read_text(encoding="utf-8")))
        return None
    flag, hours = ("--gpu-hours", gpu_hours) if gpu_hours is not None else ("--cpu-hours", cpu_hours)
    if not (isinstance(hours, int | float) and math.isfinite(hours) and hours > 0):
        raise BudgetError(f"{flag} {hours!r}: a positive number of hours")
    if flag == "--gpu-hours" and space.gpus_per_worker == 0:
        raise BudgetError(f"--gpu-hours: the trials of {space.name} hold no GPU (resources.gpus_per_worker: 0); "
                          "give --cpu-hours, or a preset that puts them on GPUs")  # fmt: skip
    budget = Budget("gpu_seconds" if flag == "--gpu-hours" else "cpu_seconds", float(hours))
    output.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(budget)) + "\n", encoding="utf-8")
    return budget


@dataclass
class BudgetState:
    """A live sweep's budget and what its trials have spent (by Tune trial id)."""

    budget: Budget | None
    spent: dict[str, float]
    stopped: bool = False
    signalled: bool = False
    forecast: dict[str, Any] | None = None

    @property
    def total(self) -> float:
        return sum(self.spent.values())


_ACTIVE: dict[str, BudgetState] = {}
"""The live sweeps' budgets by sweep id. Tune restores a resumed sweep's callbacks from its first run's pickle, so
:class:`BudgetStop` keeps only the id and finds the budget this run was given here."""


def budgeted(options: Any, context: SweepContext, output: Path, client: MlflowClient, parent: str,
             at_once: int) -> BudgetStop:  # fmt: skip
    """The sweep's budget made live: what earlier runs of it spent (read back from MLflow), the forecast printed,
    and the Tune callback that stops it when spent (inert without a budget; every sweep has it, so that a sweep resumed
    with a budget it was not started with has it too)."""
    budget = sweep_budget(options, context.space, output)
    state = BudgetState(budget, spent_so_far(client, parent, budget.metric) if budget else {})
    if budget is not None:
        state.forecast = forecast(context, budget, state.total, at_once)
    _ACTIVE[context.sweep_id] = state
    return BudgetStop(context.sweep_id)


def spent_so_far(client: MlflowClient, parent: str, metric: str) -> dict[str, float]:
    """Each trial's cost as its MLflow runs last logged it (a cross-validating trial's folds' runs each hold their
    share), by Tune trial id: what earlier runs of the sweep spent."""
    spent: dict[str, float] = {}
    for run in child_runs(client, parent, abandoned=True):
        trial = run.data.tags[TRIAL_TAG]
        spent[trial] = spent.get(trial, 0.0) + run.data.metrics.get(metric, 0.0)
    return spent


class BudgetStop(tune.Callback):
    """Stops the sweep once its trials' costs reach the budget, as Ctrl-C does: Tune's graceful stop (its SIGUSR1
    handler) saves the experiment with the running trials unfinished, so they keep their last checkpoint and
    ``--resume`` goes on with them. A resumed sweep already spent starts no trial."""

    def __init__(self, sweep_id: str):
        self.sweep_id = sweep_id

    @property
    def spent(self) -> bool:
        """Whether this run of the sweep was stopped by its budget (its running trials ended unfinished)."""
        state = _ACTIVE.get(self.sweep_id)
        return bool(state and state.stopped)

    def setup(self, **info: Any) -> None:
        self._check()  # Tune's signal handler is in place, and no trial has started
        self._stop_once_saved([])

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        state = _ACTIVE.get(self.sweep_id)
        if state is None or state.budget is None:
            return
        if state.budget.metric in result:  # a cumulative cost: the latest replaces the trial's earlier ones
            cost = float(result[state.budget.metric])
            state.spent[trial.trial_id] = max(state.spent.get(trial.trial_id, 0.0), cost)
        self._check()

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        self._stop_once_saved(trials)

    def _check(self) -> None:
        state = _ACTIVE.get(self.sweep_id)
        if state is None or state.budget is None or state.stopped or state.total < state.budget.seconds:
            return
        state.stopped = True
        budget = state.budget
        tqdm.write(
            f"budget spent: {budget.says(state.total)} of {budget.hours:g} {UNITS[budget.metric]}; the running trials "
            "keep their last checkpoint and end, no trial starts",
            file=sys.stderr,
        )

    def _stop_once_saved(self, trials: list) -> None:
        """Tune's graceful stop, once no trial is saving: the checkpoint a trial has just reported is registered by a
        save task Tune resolves a step later, and a stop before that would resume the trial from the one before."""
        state = _ACTIVE.get(self.sweep_id)
        if state is None or not state.stopped or state.signalled or any(t.is_saving for t in trials):
            return
        state.signalled = True
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):  # Tune not in the main thread: no handler
            raise RuntimeError("the budget is spent but Tune's graceful stop is not installed (not the main thread)")
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's graceful stop, as Ctrl-C's (gx_ray.sweep.signals)


def forecast(context: SweepContext, budget: Budget, spent: float, at_once: int) -> dict[str, Any]:
    """Each trial's forecast cost (:func:`pilot` of its setting), printed with the total, how many trials fit the
    budget from the sweep's start and what earlier runs of it ``spent``; the figures, for ``sweep.json``."""
    space = context.space
    probe = {k: s["choices"][0] if s["type"] == "categorical" else s["low"] for k, s in space.sample.items()}
    settings = [context.setting({**probe, **cell}) for cell in space.cells() for _ in range(space.samples)]
    keyed = {_pilot_key(s): s for s in settings}
    started = time.perf_counter()
    pilots = _pilots(keyed, context)
    rows: dict[tuple, int] = {}
    # the first trial of each of the at_once trial processes pays the process's imports; Tune reuses them after
    costs = [_trial_cost(s, pilots[_pilot_key(s)], budget.metric, rows, i < at_once) for i, s in enumerate(settings)]
    if space.folds_in_trial:  # each trial trains every fold, each on about the training split's rows
        costs = [cost * space.folds_in_trial for cost in costs]
    fit, total = 0, 0.0  # of the whole sweep, from its start: a resumed sweep's spent is said beside it
    for cost in costs:
        if total + cost > budget.seconds:
            break
        total, fit = total + cost, fit + 1
    figures = {
        "per_trial": [round(c, 1) for c in costs],
        "total": round(sum(costs), 1),
        "trials_that_fit": fit,
        "pilot_seconds": round(time.perf_counter() - started, 1),
    }
    left_over = f"; {budget.says(spent)} spent before this run" if spent else ""
    print(
        f"budget {budget.hours:g} {UNITS[budget.metric]}{left_over}: forecast {budget.says(sum(costs))} for "
        f"{len(costs)} trials ({budget.says(sum(costs) / max(1, len(costs)))} each, {at_once} at a time); "
        f"{fit} of {len(costs)} fit" + ("" if space.scheduler == "none" else " (more: the scheduler stops some early)"),
        file=sys.stderr,
    )
    if sampled := sorted(k for k in space.sample if k.split(".")[0] in ("model", "schema", "task", "vlm", "views")):
        print(f"  (forecast at the first value of the sampled {', '.join(sampled)}; others cost otherwise)",
              file=sys.stderr)  # fmt: skip
    return figures


def _pilot_key(setting: TrialSetting) -> str:
    """What decides a trial's seconds per step and per epoch: its GPU plan key and what Ray reserves for it."""
    resources = setting.config.resources
    return json.dumps([gpu_plan_key(setting.config), resources.cpus_per_worker, setting.gpu_share])


def _pilots(keyed: dict[str, TrialSetting], context: SweepContext) -> dict[str, dict[str, float]]:
    """Each setting's pilot (:func:`pilot`), all at once as Ray tasks holding what one of its trials holds; kept in
    the plan cache by the cluster's kind of card and CPU count, the code and the cohort."""
    resources = ray.cluster_resources()
    identity = {"pilot_steps": PILOT_STEPS, "cpus": resources.get("CPU"), **context.provenance,
                "cards": sorted(k for k in resources if k.startswith("accelerator_type:"))}  # fmt: skip

    def measure(settings: dict[str, TrialSetting]) -> dict[str, dict[str, float]]:
        print(f"piloting {len(settings)} trial settings for the budget's forecast ...", file=sys.stderr)
        # max_calls=1: each pilot's process exits after it, giving back its memory (and a GPU's context) to the trials
        tasks = [
            ray.remote(max_calls=1)(pilot).options(num_cpus=s.config.resources.cpus_per_worker,
                                                   num_gpus=s.gpu_share if s.config.resources.use_gpu else 0)
            .remote(s.config, s.plan.get("micro_batch"), s.gpu_share)
            for s in settings.values()
        ]  # fmt: skip
        return dict(zip(settings, ray.get(tasks), strict=True))

    return measured_plan(keyed, measure, identity, cache_dir=default_cache_dir().parent / "pilots")


def pilot(config: TrialConfig, micro_batch: int | None = None, share: float = 1.0) -> dict[str, float]:
    """Train ``config`` twice here, each for two epochs of at most :data:`PILOT_STEPS` optimiser steps, and time the
    second run: ``setup_seconds`` (to the first report, less a steady epoch), ``step_seconds`` (per optimiser step),
    ``epoch_seconds`` (a steady epoch less its steps), ``test_seconds`` (validation's time scaled to the test rows)
    and ``cold_seconds`` (what the first run's set-up took more: a fresh process's imports and caches)."""
    cap = min(PILOT_STEPS, config.schedule.max_steps_per_epoch or PILOT_STEPS)
    schedule = dataclasses.replace(config.schedule, epochs=3, max_steps_per_epoch=cap)
    config = dataclasses.replace(config, schedule=schedule)
    device = torch.device("cuda" if config.resources.use_gpu and torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and share < 1:  # as its trials: a packed pilot keeps to its share of the card
        torch.cuda.set_per_process_memory_fraction(share, torch.cuda.current_device())
    torch.set_num_threads(max(1, int(config.resources.cpus_per_worker)))
    timed = []
    for _ in range(2):
        started, marks = time.perf_counter(), []

        def report(metrics: dict, checkpoint: Any = None, marks: list = marks) -> None:
            marks.append((time.perf_counter(), dict(metrics)))

        # two epochs reported, the test split not scored
        run_loop(config, WorkerContext(rank=0, world_size=1, device=device, report=report, latest_checkpoint=None,
                                       micro_batch=micro_batch, stop_after_epochs=2))  # fmt: skip
        (first, _), (second, metrics) = marks
        timed.append(((first - started) - (second - first), second - first, metrics))
    (cold, _, _), (setup, epoch, metrics) = timed
    steps = _epoch_steps(config, micro_batch, 1, {})
    step = max(0.0, metrics["epoch_seconds"] - metrics["eval_seconds"]) / steps
    data = config.data
    val, test = (len(split_rows(data.shards, s, data.folds_file, data.fold)) for s in ("val", "test"))
    return {
        "setup_seconds": max(0.0, setup),
        "cold_seconds": max(0.0, cold - setup),
        "step_seconds": step,
        "epoch_seconds": max(0.0, epoch - steps * step),
        "test_seconds": metrics["eval_seconds"] * test / max(1, val),
    }


def _epoch_steps(config: TrialConfig, micro_batch: int | None, world: int, rows: dict[tuple, int]) -> int:
    """Optimiser steps an epoch of ``config`` takes on each of ``world`` ranks (as the loop counts them; at least one,
    as the loop steps on a split smaller than a batch). ``rows`` caches the training rows by fold."""
    data = config.data
    key = (data.shards, data.folds_file, data.fold, data.refit)
    if key not in rows:
        rows[key] = len(split_rows(data.shards, "train", data.folds_file, data.fold, data.refit))
    micro = micro_batch or (int(data.micro_batch) if data.micro_batch != AUTO else data.per_rank_batch(world))
    return max(1, optimiser_steps(rows[key] // world, micro, data.accumulation(world, micro), config))


def _trial_cost(
    setting: TrialSetting, measured: dict[str, float], metric: str, rows: dict[tuple, int], cold: bool = False
) -> float:
    """A trial's forecast device-seconds: its set-up (``cold``: in a fresh process), its epochs' steps and fixed costs,
    its test, times what it reserves. A DDP trial's ranks share each step (its pilot ran one rank with the batch)."""
    config = setting.config
    world = config.resources.workers if under_torch_trainer(config) else 1
    epochs = config.schedule.epochs
    steps = _epoch_steps(config, setting.plan.get("micro_batch"), world, rows)
    training = epochs * (steps * measured["step_seconds"] + measured["epoch_seconds"]) + measured["test_seconds"]
    wall = measured["setup_seconds"] + (measured["cold_seconds"] if cold else 0.0) + training / world
    reserved = setting.gpu_share if metric == "gpu_seconds" else config.resources.cpus_per_worker
    return wall * reserved * world


def read_ledger(output: Path) -> list[dict[str, str]]:
    """The rows of ``OUTPUT/ledger.csv`` as :func:`write_ledger` wrote them (text: trial, status, costs, epochs)."""
    with (output / LEDGER_FILE).open(encoding="utf-8") as file:
        return list(csv.DictReader(file))


def write_ledger(client: MlflowClient, parent: str, output: Path, sweep_id: str) -> dict[str, Any]:
    """``OUTPUT/ledger.csv``: every trial's device-seconds, parameters, epochs and status (ABANDONED: a run that
    :func:`~gx_ray.tracking.abandon_unknown_runs` deleted), also on the parent run with the totals as its metrics;
    returns the sweep's figures for ``sweep.json`` (with its budget's, where it has one)."""
    rows = []
    for run in sorted(child_runs(client, parent, abandoned=True), key=lambda r: r.info.start_time or 0):
        metrics, tags = run.data.metrics, run.data.tags
        status = "ABANDONED" if ABANDONED_TAG in tags else run.info.status
        rows.append({
            "trial": run.info.run_name,
            "trial_id": run.data.tags.get(TRIAL_TAG),
            "status": "STOPPED_EARLY" if tags.get("gx_ray.stopped_early") == "true" else status,
            **{name: round(metrics.get(name, 0.0), 3) for name in COSTS},
            "parameters": int(metrics["parameters"]) if "parameters" in metrics else None,
            "epochs": int(metrics["epoch"]) + 1 if "epoch" in metrics else 0,
        })  # fmt: skip
    path = output / LEDGER_FILE
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, ["trial", "trial_id", "status", *COSTS, "parameters", "epochs"])
        writer.writeheader()
        writer.writerows(rows)
    client.log_artifact(parent, str(path))
    totals = {name: round(sum(r[name] for r in rows), 3) for name in COSTS}
    log_metrics(client, parent, totals, step=0)
    figures: dict[str, Any] = {**totals, "ledger": str(path)}
    state = _ACTIVE.pop(sweep_id, None)
    if state is not None and state.budget is not None:
        budget, spent = state.budget, totals[state.budget.metric]
        figures["budget"] = {**dataclasses.asdict(budget), "spent_hours": round(spent / 3600, 6),
                             "stopped": state.signalled, "forecast_seconds": state.forecast}  # fmt: skip
        if state.signalled:  # spent by the last trials' last reports, with nothing left to stop, it stopped nothing
            flag = "--gpu-hours" if budget.metric == "gpu_seconds" else "--cpu-hours"
            print(f"stopped by the budget: {budget.says(spent)} of {budget.hours:g} {UNITS[budget.metric]} spent; "
                  f"resume with a larger {flag} to go on")  # fmt: skip
    return figures
