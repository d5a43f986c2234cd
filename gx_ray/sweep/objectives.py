"""A search's objectives: the space's ``metric`` (one name or a list) as the result keys Tune's searcher reads, each
with its direction. The primary metric and the validation metrics go the way their task scores them (higher is
better but for ranks and a plug-in's lower-is-better metrics); the costs a trial reports (:mod:`gx_ray.train.ledger`)
and its parameter count are minimised. Several objectives make Optuna's search multi-objective (NSGA-II's Pareto
ranks inside TPE's sampler), and the report draws the Pareto front of the trials (:mod:`gx_ray.analysis.pareto`).
"""

from __future__ import annotations

from typing import Any

from gx_ray.tasks import task_class
from gx_ray.train.ledger import SEARCH_COSTS as COSTS

PRIMARY = "primary"
PRIMARY_KEY = "val_primary"
"""What every trial reports as its task's primary metric on the validation split, each epoch."""
"""Reported by every trial, lower is better: device-seconds so far (reserved GPUs or CPUs × wall seconds) and the
model's parameter count."""
VALID = f"{PRIMARY}, val_<metric> (a validation metric of the task, e.g. val_auc), {', '.join(COSTS)}"


def objectives(metric: Any, searcher: str = "optuna", task: str | None = None) -> list[tuple[str, str]]:
    """``metric`` (a space's) as ``[(result key, "max" | "min"), ...]``; ``task``: the space's fixed task, whose
    direction the primary metric takes (a grid or sample of tasks: higher is better, as every built-in task).
    Raises ValueError saying what is wrong and what is valid."""
    names = metric if isinstance(metric, list) else [metric]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{metric!r}: a metric name or a list of names; valid: {VALID}")
    if len(set(names)) < len(names):
        raise ValueError(f"{metric!r} names an objective twice")
    if len(names) > 1 and searcher != "optuna":
        raise ValueError(f"several objectives {names} need searcher: optuna (a grid runs every cell whatever they are)")
    if all(n in COSTS for n in names):
        raise ValueError(f"{metric!r}: costs alone find the cheapest model; add {PRIMARY} (or a val_ metric)")
    found = []
    for name in names:
        if name == PRIMARY:
            found.append((PRIMARY_KEY, _task_mode(task)))
        elif name in COSTS:
            found.append((name, "min"))
        elif name.startswith("val_") and len(name) > 4:
            # the analysis layer (pandas, MLflow) is kept out of the trial processes, which import the spaces
            from gx_ray.analysis.runs import higher_is_better

            found.append((name, "max" if higher_is_better(name.removeprefix("val_")) else "min"))
        else:
            raise ValueError(f"unknown objective {name!r}; valid: {VALID}")
    return found


def search_metric(metric: Any, task: str | None = None) -> tuple[str | list[str], str | list[str]]:
    """What Tune's searcher takes: one key and mode, or (several objectives) a list of each."""
    found = objectives(metric, task=task)
    if len(found) == 1:
        return found[0]
    return [k for k, _ in found], [m for _, m in found]


def _task_mode(task: str | None) -> str:
    if not isinstance(task, str):
        return "max"
    return task_class(task).mode
