"""Views of sweeps that searched parameters: best-so-far curves, parameter importance and parallel coordinates.

The runs of one task become an in-memory Optuna study (:func:`study_from_runs`) so that Optuna's own importance
evaluators and matplotlib plots do the work; a pure grid ablation (only task/schema/seed axes) has no search to
show and :func:`write_search_views` writes nothing for it.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import optuna
import pandas as pd
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.visualization import matplotlib as optuna_plots

from gx_ray.analysis.runs import headline_metric, higher_is_better

_log = logging.getLogger(__name__)
MIN_TRIALS_FOR_IMPORTANCE = 4


def _infer(seen: pd.Series) -> tuple[BaseDistribution, list]:
    """The distribution a parameter was searched over, guessed from its values, and the values Optuna accepts."""
    seen = seen.infer_objects()
    if pd.api.types.is_numeric_dtype(seen) and not pd.api.types.is_bool_dtype(seen):
        low, high = seen.min(), seen.max()
        if pd.api.types.is_integer_dtype(seen):
            return IntDistribution(int(low), int(high)), [int(v) for v in seen]
        # A span of two decades or more means a log-uniform axis (lr, weight decay), as the search spaces use.
        log = bool(low > 0 and high / low >= 100)
        return FloatDistribution(float(low), float(high), log=log), [float(v) for v in seen]
    # Optuna's choices must be plain scalars: lists (block_inplanes) and the like become their str.
    values = [v.item() if isinstance(v, np.generic) else v for v in seen]
    values = [v if isinstance(v, (str, bool, int, float)) else str(v) for v in values]
    return CategoricalDistribution(sorted(set(values), key=str)), values


def _ended(runs: pd.DataFrame) -> pd.Series:
    """Trials that ran to their end, or that the scheduler stopped (their best validation value is what the
    searcher was told, as Tune's Optuna searcher records a stopped trial as complete)."""
    stopped = runs["stopped_early"].eq(True) if "stopped_early" in runs else False
    return (runs["status"] == "FINISHED") | stopped


def study_from_runs(runs: pd.DataFrame, task: str, metric: str | None = None, split: str = "val") -> optuna.Study:
    """The task's finished trials as a study whose objective is ``metric`` on ``split`` (default: what it optimised),
    in start order (a trial's ``number`` is its place in the sweep); NaN objectives are left out."""
    metric = metric or headline_metric(task)
    rows = runs[(runs["task"] == task) & (runs["split"] == split) & (runs["metric"] == metric) & _ended(runs)]
    rows = rows.dropna(subset=["value"]).sort_values(["start_time", "trial"]).drop_duplicates("trial")
    params: dict[str, tuple[BaseDistribution, dict]] = {}
    for name in runs.attrs.get("searched", []):
        seen = rows[name].dropna()  # a conditional parameter is absent from the trials that did not use it
        if len(seen):
            distribution, values = _infer(seen)
            params[name] = distribution, dict(zip(seen.index, values, strict=True))
    direction = "maximize" if higher_is_better(metric) else "minimize"
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created in memory": the report's own, not news
    try:
        study = optuna.create_study(study_name=f"{task}/{metric}/{split}", direction=direction)
    finally:
        optuna.logging.set_verbosity(level)
    for key, value in {"task": task, "metric": metric, "split": split}.items():
        study.set_user_attr(key, value)
    study.add_trials(
        [
            optuna.trial.create_trial(
                value=float(row.value),
                params={name: values[row.Index] for name, (_, values) in params.items() if row.Index in values},
                distributions={name: dist for name, (dist, values) in params.items() if row.Index in values},
                user_attrs={"trial": row.trial, "run_id": row.run_id},
            )
            for row in rows.itertuples()
        ]
    )
    return study


def best_so_far(study: optuna.Study) -> np.ndarray:
    """The best objective after each trial, in trial order, in the study's direction."""
    values = np.array([t.value for t in study.trials], dtype=float)
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return (np.maximum if maximize else np.minimum).accumulate(values)


def _varying(study: optuna.Study) -> list[str]:
    distributions = {name: d for t in study.trials for name, d in t.distributions.items()}
    return [name for name, d in distributions.items() if not d.single()]


@contextmanager
def _optuna_figure() -> Iterator[None]:
    # Optuna's matplotlib plots are experimental and some call plt.style.use("ggplot"), which would restyle every
    # later figure in the process; rc_context puts the style back once the figure has been saved inside it.
    with warnings.catch_warnings(), matplotlib.rc_context():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def _save(figure: plt.Figure, path_stem: Path | str) -> list[Path]:
    paths = [Path(f"{path_stem}.png"), Path(f"{path_stem}.svg")]
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for path in paths:
        figure.savefig(path, dpi=150, bbox_inches="tight")  # tight: optuna's long flat keys overflow its axes
    plt.close(figure)
    return paths


def _best_so_far_plot(studies: list[optuna.Study], path_stem: Path | str) -> list[Path]:
    studies = [s for s in studies if s.trials]
    if not studies:
        return []
    # Not optuna's plot_optimization_history: it draws a whole figure per study, and the tasks share one figure.
    ncols = min(3, len(studies))
    nrows = math.ceil(len(studies) / ncols)
    figure, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.5 * nrows), squeeze=False)
    for ax, study in zip(axes.flat, studies, strict=False):
        values = [t.value for t in study.trials]
        ax.plot(range(len(values)), values, "o", color="tab:blue", alpha=0.6, label="trial")
        ax.plot(range(len(values)), best_so_far(study), drawstyle="steps-post", color="tab:red", label="best so far")
        metric = study.user_attrs["metric"]
        better = "higher" if higher_is_better(metric) else "lower"
        ax.set(title=study.user_attrs["task"], xlabel="trial (start order)", ylabel=f"{metric} ({better} is better)")
        ax.legend(fontsize="small")
    for ax in axes.flat[len(studies) :]:
        ax.set_axis_off()
    figure.tight_layout()
    return _save(figure, path_stem)


def best_so_far_plot(
    runs: pd.DataFrame, path_stem: Path | str, metric_per_task: dict[str, str] | None = None
) -> list[Path]:
    """One panel per task: each trial's validation objective in start order and the best so far; PNG and SVG."""
    metric_per_task = metric_per_task or {}
    studies = [study_from_runs(runs, task, metric_per_task.get(task)) for task in runs["task"].unique()]
    return _best_so_far_plot(studies, path_stem)


def _evaluator(study: optuna.Study) -> optuna.importance.BaseImportanceEvaluator:
    # PED-ANOVA needs only numpy; fANOVA (and mean decrease impurity) need scikit-learn, which is in the dev extra
    # only, not the runtime dependencies. Optuna advises >= 5 trials in the top quantile, more than the default
    # top 10% holds in our 12-40 trial sweeps, so the quantile widens for small studies.
    quantile = min(0.5, max(0.1, 5 / max(len(study.trials), 1)))
    return optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile)


def _importance(study: optuna.Study) -> dict[str, float]:
    varying = _varying(study)
    if len(varying) < 2 or len(study.trials) < MIN_TRIALS_FOR_IMPORTANCE:
        _log.info(
            "No parameter importance for %s: %d varying searched parameters and %d trials (needs >= 2 and >= %d)",
            study.user_attrs["task"],
            len(varying),
            len(study.trials),
            MIN_TRIALS_FOR_IMPORTANCE,
        )
        return {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        shares = optuna.importance.get_param_importances(study, evaluator=_evaluator(study), params=varying)
    if any("select the same set of trials" in str(w.message) for w in said):  # tied scores: every share equal, empty
        _log.info(
            "No parameter importance for %s: its best trials are all its trials (tied scores)", study.user_attrs["task"]
        )
        return {}
    for warning in said:  # anything else Optuna says stays said
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return shares


def importance(runs: pd.DataFrame, task: str, metric: str | None = None, split: str = "val") -> dict[str, float]:
    """Each varying searched parameter's share of the importance (PED-ANOVA) for the objective, largest first; empty
    (the reason logged) when fewer than two searched parameters vary or the task has too few trials."""
    return _importance(study_from_runs(runs, task, metric, split))


def _importance_plot(study: optuna.Study, path_stem: Path | str) -> list[Path]:
    shares = _importance(study)
    if not shares:
        return []
    with _optuna_figure():
        ax = optuna_plots.plot_param_importances(
            study, evaluator=_evaluator(study), params=list(shares), target_name=study.user_attrs["metric"]
        )
        ax.set_title(f"Parameter importance: {study.user_attrs['task']}", loc="left")  # replaces optuna's
        return _save(ax.figure, path_stem)


def importance_plot(
    runs: pd.DataFrame, task: str, path_stem: Path | str, metric: str | None = None, split: str = "val"
) -> list[Path]:
    """Optuna's parameter-importance bars for the task, PNG and SVG; nothing when :func:`importance` is empty."""
    return _importance_plot(study_from_runs(runs, task, metric, split), path_stem)


def _parallel_coordinates_plot(study: optuna.Study, path_stem: Path | str) -> list[Path]:
    varying = _varying(study)
    if len(study.trials) < 2 or not varying:
        return []
    with _optuna_figure():
        ax = optuna_plots.plot_parallel_coordinate(study, params=varying, target_name=study.user_attrs["metric"])
        ax.set_title(f"Parallel coordinates: {study.user_attrs['task']}", y=1.03)  # replaces optuna's
        return _save(ax.figure, path_stem)


def parallel_coordinates_plot(
    runs: pd.DataFrame, task: str, path_stem: Path | str, metric: str | None = None, split: str = "val"
) -> list[Path]:
    """Optuna's parallel-coordinate plot of the varying searched parameters and the objective, PNG and SVG."""
    return _parallel_coordinates_plot(study_from_runs(runs, task, metric, split), path_stem)


def searched_tasks(runs: pd.DataFrame) -> list[str]:
    """The tasks whose trials took at least two values of some searched parameter (none for a pure grid)."""
    searched = runs.attrs.get("searched", [])
    return [
        task
        for task, rows in runs.groupby("task", sort=False)
        # str: list-valued parameters are unhashable
        if any(rows[name].dropna().astype(str).nunique() >= 2 for name in searched)
    ]


def write_search_views(
    runs: pd.DataFrame, folder: Path | str, metric_per_task: dict[str, str] | None = None
) -> list[Path]:
    """Every search view for every task that searched parameters, into ``folder``; the files written."""
    folder, metric_per_task = Path(folder), metric_per_task or {}
    studies = [study_from_runs(runs, task, metric_per_task.get(task)) for task in searched_tasks(runs)]
    paths = _best_so_far_plot(studies, folder / "search_best_so_far")
    for study in studies:
        task = study.user_attrs["task"]
        paths += _importance_plot(study, folder / f"search_importance_{task}")
        paths += _parallel_coordinates_plot(study, folder / f"search_parallel_{task}")
    return paths
