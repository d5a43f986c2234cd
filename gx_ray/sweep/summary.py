"""What a sweep tells its user: each trial's name (MLflow's runs table) and folder, one row per trial, the table per
task and schema printed at the end, and ``sweep.json``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gx_ray.sweep.spaces import SearchSpace
from gx_ray.sweep.trial import SweepContext
from gx_ray.tasks import primary_metric, task_class, task_label

SWEEP_FILE = "sweep.json"
SCHEMA_SHORT = {"image": "img", "table": "tab", "bbox": "box", "endoscopy": "endo", "only": ""}


def trial_dirname(trial: Any) -> str:
    """The trial's folder under Tune's storage: its counter first (unique), then what it trains."""
    index = trial.trial_id.rsplit("_", 1)[-1]
    config = trial.config
    task = str(config.get("task", ""))
    task = task_class(task).name if ":" in task else task  # a plug-in's reference holds a colon: not in a folder name
    parts = [index, task, str(config.get("schema", "")), f"s{config.get('seed', 0)}"]
    return "-".join(p for p in parts if p and p != "s")


def trial_name(fixed: dict[str, Any], trial: Any) -> str:
    """What MLflow's runs table shows, which cuts names at ~20 characters: task, inputs and seed first
    (``stage img+tab+box s0``), the trial counter last (and as the ``gx_ray.trial`` tag). A task or schema the space
    fixes is in ``fixed``, not in the trial's config (which holds only what the space varies)."""
    config = {**fixed, **trial.config}
    task = str(config.get("task", ""))
    schema = config.get("schema", "")
    inputs = "+".join(filter(None, (SCHEMA_SHORT.get(p, p) for p in str(schema).split("_")))) if schema else ""
    # a grid's ids end in a counter (5c0a1_00015: #15); a searcher's are one hex id (0da6b457), kept whole
    experiment, _, counter = trial.trial_id.rpartition("_")
    index = (counter.lstrip("0") or "0") if experiment else trial.trial_id
    short = task
    if task:  # a built-in name or a plug-in's module:Class reference: the class names itself
        cls = task_class(task)
        short = cls.short_name or cls.name
    parts = [short, inputs, f"s{config['seed']}" if "seed" in config else "", f"#{index}"]
    return " ".join(p for p in parts if p)


def result_rows(grid: Any, trials: list[Any], context: SweepContext, cut_short: bool = False) -> list[dict[str, Any]]:
    """One row per Tune result: what the trial trained (task label, schema, seed, the other chosen values) and how it
    ended. A trial that never started (a time budget ended first) has no config, so no task: it is in no cell.

    A trial that ended unfinished and without error was stopped early by the scheduler when Tune ended it
    (TERMINATED) in a sweep not ``cut_short`` (by a signal or a budget, which end the running trials the same way), or
    when Tune marked its last result done (the scheduler's decision on that result). The status is what survives a
    resume: a trial that BOHB's or ASHA's bracket stopped before the driver was killed comes back without the mark.
    ``trials`` are Tune's trials of ``grid``, in its order."""
    rows = []
    for result, status in zip(grid, [t.status for t in trials], strict=True):
        params = dict(result.config or {})
        config = context.setting(params).config if params else None
        metrics = result.metrics or {}
        rows.append(
            {
                "trial": metrics.get("trial_id") or (result.path and Path(result.path).name),
                "task": task_label(config.task, config.task_options) if config else None,
                "schema": config.schema.name if config else None,
                "seed": config.seed if config else None,
                "chosen": {k: v for k, v in params.items() if k not in ("task", "schema", "seed")},
                "val_primary": metrics.get("best_val_primary"),
                "test_primary": metrics.get("test_primary"),
                "test_chance": metrics.get("test_chance"),
                "completed": "best_epoch" in metrics,  # the loop reports it with the test metrics, at its end
                "stopped_early": "best_epoch" not in metrics
                and not result.error
                and (bool(metrics.get("done")) or (status == "TERMINATED" and not cut_short)),
                "error": str(result.error).splitlines()[0][:300] if result.error else None,
            }
        )
    return rows


POOLED_AXES = ("task", "schema", "seed", "data.fold", "task_options.family")
"""Grid axes a summary cell pools or is keyed by already: its seeds and folds are its repetitions, and a question
family is in its task's label (``lesion_qa/size``)."""


def summarise(rows: list[dict[str, Any]], axes: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Per task, schema and setting (the values of the grid's other ``axes``: a model, a fusion): test primary metric
    over seeds (mean, sd, n) and the best trial by validation. Sampled values (a searched learning rate) are pooled:
    the best trial names them."""
    cells: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        if row["task"] is not None:
            setting = ", ".join(f"{k}={row['chosen'][k]}" for k in axes if k in row["chosen"])
            cells.setdefault((row["task"], row["schema"], setting), []).append(row)
    summary = []
    for (task, schema, setting), members in sorted(cells.items()):
        done = [m for m in members if not m["error"] and m["completed"]]
        tests = np.array([m["test_primary"] for m in done], dtype=float)
        tests = tests[np.isfinite(tests)]  # a metric undefined on a split (one-class AUC) counts as no value
        chances = np.array([m.get("test_chance") for m in done], dtype=float)
        chances = chances[np.isfinite(chances)]
        best = max(done, key=lambda m: _finite(m["val_primary"]), default=None)
        summary.append(
            {
                "task": task,
                "schema": schema,
                "setting": setting,
                "metric": primary_metric(task),
                "trials": len(members),
                "failed": len(members) - len(done),
                "test_mean": float(tests.mean()) if len(tests) else None,
                "test_sd": float(tests.std(ddof=1)) if len(tests) > 1 else None,
                # the bar the mean must clear: a predictor that never looks at the patient (seeds share the test split)
                "chance": float(chances.mean()) if len(chances) else None,
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
    ]
    width = max([22, *(len(cell["task"]) + 1 for cell in summary)])  # lesion QA's tasks carry their family
    setting = max([0, *(len(cell["setting"]) + 1 for cell in summary if cell.get("setting"))])  # models, fusions
    lines.append(
        f"{'task':<{width}} {'schema':<18} {'setting' if setting else '':<{setting}}{' ' if setting else ''}"
        f"{'metric':<26} {'test mean ± sd (n)':<24} {'chance':>6}   best val → test"
    )
    for cell in summary:
        n = cell["trials"] - cell["failed"]
        mean = "—" if cell["test_mean"] is None else f"{cell['test_mean']:.1f}"
        sd = "" if cell["test_sd"] is None else f" ± {cell['test_sd']:.1f}"
        chance = "—" if cell.get("chance") is None else f"{cell['chance']:.1f}"
        best = "—" if cell["best_val"] is None else f"{cell['best_val']:.1f} → {cell['best_test']:.1f}"
        test = mean + sd + f" ({n})"
        chosen = f"{cell.get('setting', ''):<{setting}} " if setting else ""
        lines.append(
            f"{cell['task']:<{width}} {cell['schema']:<18} {chosen}{cell['metric']:<26} {test:<24} {chance:>6}   {best}"
        )
    return "\n".join(lines)


def write_sweep_file(result: Any, space: SearchSpace) -> Path:
    """``OUTPUT/sweep.json``: what ran, how it ended, its best trials, timings and GPU figures (a ``SweepResult``)."""
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
        "timings_seconds": {k: round(v, 1) for k, v in result.timings.items() if k != "launched_at"},
        "gpus": result.gpus,
        "interrupted": result.interrupted,
        "costs": result.costs,
        "mlflow_error": result.mlflow_error,
    }
    path = result.output / SWEEP_FILE
    path.write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")
    return path
