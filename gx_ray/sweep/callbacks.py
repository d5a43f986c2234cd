"""Tune callbacks of a sweep: a progress bar of its trials in place of Tune's tables, one line per failed or retried
trial, the report's imports warmed up while the trials run, and Tune's trials as the experiment ends."""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from typing import Any, ClassVar

import ray
from ray import tune
from tqdm import tqdm

from gx_ray.sweep.spaces import SearchSpace
from gx_ray.tasks import task_class, task_of


class TrialProgress(tune.Callback):
    """A progress bar of the sweep's trials (finished, stopped, failed, and an ETA) on stderr, in place of Tune's
    tables. It counts Tune's ended trials, so a resumed sweep's bar starts where the interrupted one stopped; a trial
    Tune ended before its test metrics (the time budget, ASHA) is stopped, not finished."""

    def __init__(self, total: int):
        self.total, self.bar, self.shown = total, None, (0, 0, 0)

    def setup(self, **info: Any) -> None:
        interval = 1.0 if sys.stderr.isatty() else 30.0  # a log file gets a line now and then, not every update
        self.bar = tqdm(total=self.total, desc="trials", unit="trial", file=sys.stderr, mininterval=interval)

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        ended = [t for t in trials if t.status == "TERMINATED"]
        finished = sum("test_primary" in (t.last_result or {}) for t in ended)
        stopped, failed = len(ended) - finished, sum(t.status == "ERROR" for t in trials)
        if self.bar is not None and (finished, stopped, failed) != self.shown:
            self.shown = (finished, stopped, failed)
            counts = {"finished": finished, **({"stopped": stopped} if stopped else {}), "failed": failed}
            self.bar.set_postfix(counts, refresh=False)
            self.bar.update(finished + stopped + failed - self.bar.n)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(trial, "retried from its last checkpoint" if trial.checkpoint else "retried from the start")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(trial, f"failed; the traceback: {trial.error_file}")

    def _say(self, trial: Any, what: str) -> None:
        """One line above the bar: the trial, why it stopped (the exception inside Ray's wrapper), what happens now."""
        tqdm.write(f"trial {trial}: {trial_error(trial)}; {what}", file=sys.stderr)  # with or without a bar

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.on_step_end(0, trials)
        if self.bar is not None:
            self.bar.close()


class TrialRecord(tune.Callback):
    """Tune's trials as its experiment ends, in its ``ResultGrid``'s order. Tune restores a resumed sweep's callbacks
    from its first run's pickle, so they are kept by sweep id in :data:`ended`, where the driver finds them."""

    ended: ClassVar[dict[str, list[Any]]] = {}

    def __init__(self, sweep_id: str) -> None:
        self.sweep_id = sweep_id

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        TrialRecord.ended[self.sweep_id] = list(trials)


REPORT_MODULES = ("gx_ray.analysis.report",)
"""What every report imports (its statistics and figures); a task adds its own (:attr:`Task.report_imports`)."""


class ReportWarmUp(tune.Callback):
    """Once the first trial has ended (the sweep's start, launch → first step, is over), imports what the report will
    (statistics, figures, a task's rescoring) in a background thread of the idle driver, so the report does not pay."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.modules, self.thread = modules, None

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=_import_quietly, args=(self.modules,), name="report-warm-up", daemon=True
            )
            self.thread.start()


def report_modules(space: SearchSpace) -> tuple[str, ...]:
    """What the report on ``space``'s trials imports that the driver has not (:class:`ReportWarmUp`)."""
    sampled = space.sample.get("task", {}).get("choices", [])
    tasks = {task_of(str(t)) for t in [*space.grid.get("task", []), *sampled, space.fixed.get("task")] if t}
    return REPORT_MODULES + tuple(m for task in sorted(tasks) for m in task_class(task).report_imports)


def _import_quietly(modules: tuple[str, ...]) -> None:
    for module in modules:
        with contextlib.suppress(Exception):  # a failed import is the report's to raise, where it is needed
            importlib.import_module(module)


def trial_error(trial: Any) -> str:
    """``Type: first line`` of the exception that ended a Tune trial, the trainable's own rather than Ray's wrapper
    (a ``RayTaskError`` carries it as ``cause``); a worker that died says so."""
    try:  # the driver's own copy: the one in the sweep's storage is synced later
        with open(trial.pickled_error_file, "rb") as file:
            error = ray.cloudpickle.load(file)
    except Exception:  # none written (an error Tune did not pickle) or unreadable: the status is still reported
        error = None
    if error is None:
        return "stopped with an error"
    error = getattr(error, "cause", None) or error
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": .")
