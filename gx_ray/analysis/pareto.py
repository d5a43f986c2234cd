"""The Pareto front of a multi-objective search (a space whose ``metric`` lists several objectives: the primary metric
against GPU- or CPU-seconds or the parameter count): the trials no other trial beats in every objective, as a table
and a figure in the report; Optuna's own ``Study.best_trials`` of an in-memory study.

Only multi-objective sweeps get it: a single-objective search did not trade costs off, and in a grid ablation a front
would pick out lucky seeds, which the report's statistics over seeds are there to see through.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import optuna
import pandas as pd
from mlflow.tracking import MlflowClient

from gx_ray.analysis.runs import child_runs
from gx_ray.train.ledger import SEARCH_COSTS as COSTS

FOLDER = "pareto"
"""Objectives that measure what a trial costs rather than how good it is: the figures' x axes."""
LABELS = {"val_primary": "validation primary metric", "gpu_seconds": "GPU-seconds", "cpu_seconds": "CPU-seconds",
          "parameters": "parameters"}  # fmt: skip


def pareto_front(points: np.ndarray, directions: list[str]) -> list[int]:
    """The indices of the non-dominated rows of ``points`` (one column per objective, ``"max"`` or ``"min"`` each):
    no other row is at least as good in every objective and better in one. Equal rows are all on the front or none."""
    points = np.asarray(points, dtype=float).reshape(len(points), len(directions)).tolist()
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created in memory": a computation, not a study
    try:
        study = optuna.create_study(directions=["maximize" if d == "max" else "minimize" for d in directions])
    finally:
        optuna.logging.set_verbosity(level)
    study.add_trials([optuna.trial.create_trial(values=row, user_attrs={"row": i}) for i, row in enumerate(points)])
    return sorted(t.user_attrs["row"] for t in study.best_trials)


def trial_objectives(tracking_uri: str, sweep_id: str, objectives: list[tuple[str, str]]) -> pd.DataFrame:
    """One row per finished trial with every objective finite: its name, task, objective values (the last reported,
    as the searcher was told), its test primary metric and the parameters that vary between trials."""
    runs = [r for r in child_runs(MlflowClient(tracking_uri), sweep_id) if r.info.status == "FINISHED"]
    rows = []
    for run in runs:
        values = {key: run.data.metrics.get(key, math.nan) for key, _ in objectives}
        if all(math.isfinite(v) for v in values.values()):
            test = run.data.metrics.get("test_primary", math.nan)
            rows.append({"trial": run.info.run_name, "task": run.data.tags.get("task"), **values,
                         "test_primary": test, "params": run.data.params})  # fmt: skip
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    params = pd.DataFrame(list(table.pop("params")))
    varying = [c for c in params if params[c].nunique(dropna=False) > 1 and c not in ("seed", "data.fold")]
    table["chosen"] = [", ".join(f"{c}={_short(row[c])}" for c in varying) for _, row in params.iterrows()]
    return table


def pareto_section(tracking_uri: str, sweep_id: str, parent_run_id: str | None, folder: Path) -> tuple[str, list[Path]]:
    """The report's Pareto section (Markdown) and its files (``front.csv``, a figure per cost objective), for a sweep
    whose parent run records several objectives; nothing otherwise."""
    if not parent_run_id:
        return "", []
    recorded = MlflowClient(tracking_uri).get_run(parent_run_id).data.params.get("objectives")
    objectives = [tuple(o) for o in json.loads(recorded)] if recorded else []
    if len(objectives) < 2:
        return "", []
    table = trial_objectives(tracking_uri, sweep_id, objectives)
    keys, directions = [k for k, _ in objectives], [d for _, d in objectives]
    said = ", ".join(f"{LABELS.get(k, k)} ({'higher' if d == 'max' else 'lower'} is better)" for k, d in objectives)
    text = [
        "## Pareto front",
        f"The search had {len(objectives)} objectives: {said}. A trial is on the front when no other trial of its task "
        "is at least as good in every objective and better in one (Optuna's `best_trials`). Values are the last ones "
        "each trial reported, as the searcher was told; the test primary metric is beside them, not part of the front.",
    ]
    if table.empty:
        return "\n\n".join([*text, "No finished trial has every objective yet."]) + "\n", []
    folder.mkdir(parents=True, exist_ok=True)
    table["on_front"] = False
    for _, group in table.groupby("task", sort=False):  # primary metrics of two tasks are not comparable
        front = pareto_front(group[keys].to_numpy(), directions)
        table.loc[group.index[front], "on_front"] = True
    files = [folder / "front.csv"]
    table.to_csv(files[0], index=False)
    quality = next((k for k in keys if k not in COSTS), keys[0])
    for cost in [k for k in keys if k != quality]:
        files.append(_figure(table, quality, cost, dict(objectives), folder / f"front_{cost}.png"))
    best_first = directions[keys.index(quality)] != "max"
    front = table[table["on_front"]].sort_values(["task", quality], ascending=[True, best_first])
    header = ["trial", "task", *(LABELS.get(k, k) for k in keys), "test primary", "chosen"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in front.iterrows():
        values = [_number(row[k]) for k in [*keys, "test_primary"]]
        cells = [row["trial"], row["task"], *values, row["chosen"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    text += [f"{int(table['on_front'].sum())} of {len(table)} finished trials are on the front:", "\n".join(lines)]
    text += [f"![{p.stem}]({FOLDER}/{p.name})" for p in files if p.suffix == ".png"]
    return "\n\n".join(text) + "\n", files


def _figure(table: pd.DataFrame, quality: str, cost: str, directions: dict[str, str], path: Path) -> Path:
    """``quality`` against ``cost``, every trial grey, the front's trials coloured; with two objectives the front's
    staircase is drawn (with more, a front trial may be dominated in this projection)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(table[cost], table[quality], color="#999999", s=18, label="trial")
    front = table[table["on_front"]].sort_values(cost, ascending=directions[cost] == "min")
    ax.scatter(front[cost], front[quality], color="#D55E00", s=30, label="on the Pareto front", zorder=3)
    if len(directions) == 2:
        ax.step(front[cost], front[quality], where="post", color="#D55E00", linewidth=1)
    ax.set_xlabel(LABELS.get(cost, cost) + (" (lower is better)" if directions[cost] == "min" else ""))
    ax.set_ylabel(LABELS.get(quality, quality))
    ax.set_title(f"Pareto front: {LABELS.get(quality, quality)} against {LABELS.get(cost, cost)}", loc="left")
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def _number(value: float) -> str:
    if not math.isfinite(value):
        return "—"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _short(param: str) -> str:
    """A param as MLflow keeps it (text), a number to 3 significant digits (a sampled learning rate)."""
    try:
        return f"{float(param):.3g}"
    except (TypeError, ValueError):
        return str(param)
