"""The paper's Figure 4 (a radar of input settings over the tasks' headline metrics), a CI dot chart, and CT-Bench's
Figure 2 (what drawing the lesion's box in changes, per model and lesion QA family) and Figure 3 (one slice or nine).

They read a *cells* table (see :mod:`gx_ray.analysis.tables`), one colour per schema (:data:`SCHEMA_COLOURS`). Like
Figure 4 (X2-VLM-Med only), each task is drawn for one (model, fusion): the one given, or else the task's best by its
headline metric over the schemas (named in the footnote), so that settings are compared within one model.
Radar axes (:func:`normalise_axis`) are min–max over the schemas to [0.2, 1], outward always better; a setting without
a value is drawn at the centre.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from gx_ray.analysis.runs import headline_metric, higher_is_better, lesion_qa_cells
from gx_ray.analysis.tables import metric_label, number, schema_label, schema_order, shown_interval, task_order

SCHEMA_COLOURS = {  # colour-blind-safe (Okabe–Ito)
    "image_only": "#0072B2",
    "image_table": "#E69F00",
    "image_bbox": "#009E73",
    "image_table_bbox": "#D55E00",
}
EXTRA_COLOURS = ("#CC79A7", "#56B4E9", "#F0E442", "#000000", "#999999")
RADAR_FLOOR = 0.2
DPI = 150


def schema_colour(schema: str) -> str:
    """The schema's colour: fixed for the paper's four settings, a stable pick (by name) for any other."""
    return SCHEMA_COLOURS.get(schema) or EXTRA_COLOURS[zlib.crc32(schema.encode()) % len(EXTRA_COLOURS)]


def normalise_axis(values, higher_is_better: bool = True, floor: float = RADAR_FLOOR) -> np.ndarray:
    """Min–max over ``values`` to [floor, 1], 1 = best (the smallest when lower is better); NaN stays NaN. All equal
    is a tie, half-way between floor and 1 (else an axis where every setting scores 0 would be all "best")."""
    values = np.asarray(values, dtype=float)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return values.copy()
    low, high = finite.min(), finite.max()
    if high == low:
        return np.where(np.isfinite(values), (floor + 1.0) / 2, np.nan)
    share = (values - low) / (high - low)
    return floor + (1.0 - floor) * (share if higher_is_better else 1.0 - share)


def _headlines(cells: pd.DataFrame, metric_per_task: dict[str, str] | None) -> dict[str, str]:
    metric_per_task = metric_per_task or {}
    return {task: metric_per_task.get(task) or headline_metric(task) for task in task_order(cells["task"])}


def _pick_model(cells: pd.DataFrame, task: str, metric: str, model: str | None) -> pd.DataFrame:
    """The task's headline cells of one (model, fusion): ``model`` if given, else the best on average."""
    frame = cells[(cells["task"] == task) & (cells["metric"] == metric)]
    if model is not None:
        frame = frame[frame["model"] == model]
    if frame.empty:
        return frame
    key = frame["model"].astype(str) + " (" + frame["fusion"].astype(str) + ")"
    means = frame["mean"].groupby(key).mean()
    if means.isna().all():
        return frame[key == key.iloc[0]]
    return frame[key == (means.idxmax() if higher_is_better(metric) else means.idxmin())]


def _footnote(picked: dict[str, pd.DataFrame]) -> str:
    used = {task: f"{f['model'].iloc[0]} ({f['fusion'].iloc[0]})" for task, f in picked.items() if not f.empty}
    if len(set(used.values())) == 1:
        return f"Model: {next(iter(used.values()))}"
    return "Model per task: " + "; ".join(f"{task}: {label}" for task, label in used.items())


def _save(fig, path_stem: str | Path) -> list[Path]:
    """The figure as ``<path_stem>.png`` (dpi 150) and ``.svg``; nothing for no figure (a plot with no cell)."""
    if fig is None:
        return []
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".svg")]
    fig.savefig(paths[0], dpi=DPI, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def radar_figure(cells: pd.DataFrame, metric_per_task: dict[str, str] | None = None, model: str | None = None):
    """Figure 4: one closed polygon per schema (gid ``radar-<schema>``) over one axis per task."""
    headlines = _headlines(cells, metric_per_task)
    tasks = list(headlines)
    picked = {task: _pick_model(cells, task, headlines[task], model) for task in tasks}
    schemas = schema_order(pd.concat(picked.values())["schema"])
    grid = np.full((len(schemas), len(tasks)), np.nan)  # normalised value per schema x task
    ties = []
    for j, task in enumerate(tasks):
        means = picked[task].set_index("schema")["mean"].reindex(schemas).to_numpy(dtype=float)
        grid[:, j] = normalise_axis(means, higher_is_better(headlines[task]))
        finite = means[np.isfinite(means)]
        if len(finite) > 1 and np.ptp(finite) == 0:
            ties.append(task)
    angles = np.linspace(0, 2 * np.pi, len(tasks), endpoint=False)
    closed = np.append(angles, angles[0])
    fig, ax = plt.subplots(figsize=(6.4, 6.4), subplot_kw={"projection": "polar"})
    for schema, row in zip(schemas, np.nan_to_num(grid, nan=0.0), strict=True):
        values, colour = np.append(row, row[0]), schema_colour(schema)
        ax.plot(closed, values, color=colour, linewidth=2, label=schema_label(schema), gid=f"radar-{schema}")
        ax.fill(closed, values, color=colour, alpha=0.12, gid=f"radar-fill-{schema}")
    labels = [f"{task}\n{metric_label(headlines[task])}" + ("\n(tie)" if task in ties else "") for task in tasks]
    ax.set_xticks(angles, labels, fontsize=9)
    ax.tick_params(axis="x", pad=18)
    ax.set_ylim(0, 1.0)
    ax.set_yticks([RADAR_FLOOR, 0.6, 1.0], ["worst", "", "best"], fontsize=7, color="grey")
    ax.legend(loc="upper right", bbox_to_anchor=(1.32, 1.12), fontsize=8)
    fig.text(
        0.5,
        -0.06,
        f"Per axis: min–max over settings to [{RADAR_FLOOR}, 1]; outward is better (↓ axes inverted); "
        f"missing = centre; a tie (every setting the same) half-way.\n{_footnote(picked)}",
        ha="center",
        fontsize=7,
        wrap=True,
    )
    return fig


def radar_plot(
    cells: pd.DataFrame,
    path_stem: str | Path,
    metric_per_task: dict[str, str] | None = None,
    model: str | None = None,
) -> list[Path]:
    """Write the radar (Figure 4) as ``<path_stem>.png`` (dpi 150) and ``.svg``; the paths written."""
    return _save(radar_figure(cells, metric_per_task, model), path_stem)


def interval_figure(cells: pd.DataFrame, metric_per_task: dict[str, str] | None = None, model: str | None = None):
    """One panel per task: a dot per schema at its mean with the report's 95 % CI (:func:`tables.shown_interval`:
    the two-level bootstrap's where the cells have it, else t over seeds) as error bar."""
    headlines = _headlines(cells, metric_per_task)
    # A4 width (~7.5 in, three panels a row): one row of five panels was 16 in wide, unreadable on a page
    columns = min(3, len(headlines))
    rows = math.ceil(len(headlines) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7.5, 2.5 * rows), squeeze=False)
    for ax in axes.flat[len(headlines) :]:
        ax.remove()
    for ax, (task, metric) in zip(axes.flat[: len(headlines)], headlines.items(), strict=True):
        frame = _pick_model(cells, task, metric, model).set_index("schema")
        frame["ci_low"], frame["ci_high"] = shown_interval(frame)
        schemas = schema_order(frame.index)
        for y, schema in enumerate(schemas):
            mean, low, high = (float(frame.at[schema, c]) for c in ("mean", "ci_low", "ci_high"))
            colour = schema_colour(schema)
            if np.isfinite(low) and np.isfinite(high):  # the interval as it is: a percentile one need not hold the mean
                ax.errorbar((low + high) / 2, y, xerr=(high - low) / 2, fmt="none", ecolor=colour, capsize=3)
            ax.plot(mean, y, "o", color=colour)
        ax.set_yticks(range(len(schemas)), [schema_label(s) for s in schemas], fontsize=8)
        ax.set_ylim(-0.6, len(schemas) - 0.4)
        ax.invert_yaxis()
        ax.set_xlabel(metric_label(metric), fontsize=8)
        subtitle = f"{frame['model'].iloc[0]} ({frame['fusion'].iloc[0]})" if len(frame) else "no cells"
        ax.set_title(f"{task}\n{subtitle}", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Test mean and 95 % CI over seeds", fontsize=9)
    fig.tight_layout()
    return fig


def interval_plot(
    cells: pd.DataFrame,
    path_stem: str | Path,
    metric_per_task: dict[str, str] | None = None,
    model: str | None = None,
) -> list[Path]:
    """Write the CI dot chart as ``<path_stem>.png`` (dpi 150) and ``.svg``; the paths written."""
    return _save(interval_figure(cells, metric_per_task, model), path_stem)


BOX_SCHEMAS = ("image_only", "image_bbox")
"""CT-Bench's two conditions: without and with the lesion's box drawn in."""


def box_effect(cells: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Model x lesion QA family: the test mean with the box drawn in minus without it (points), for the families
    that have both conditions; empty when the cells hold none."""
    qa = lesion_qa_cells(cells, metric)
    means = qa[qa["schema"].isin(BOX_SCHEMAS)].pivot_table(
        index="model", columns=["question", "schema"], values="mean", aggfunc="first"
    )
    questions = [q for q in sorted(set(qa["question"])) if all((q, s) in means.columns for s in BOX_SCHEMAS)]
    return pd.DataFrame(
        {q: means[(q, BOX_SCHEMAS[1])] - means[(q, BOX_SCHEMAS[0])] for q in questions}, index=means.index
    )


def box_effect_figure(cells: pd.DataFrame, metric: str = "accuracy"):
    """CT-Bench's Figure 2: a heatmap of :func:`box_effect` (blue: the box helps, red: it hurts), each cell's
    value written in; None when no lesion QA family has both conditions."""
    effect = box_effect(cells, metric)
    if effect.empty or not effect.shape[1]:
        return None
    values = effect.to_numpy(dtype=float)
    limit = max(1.0, float(np.nanmax(np.abs(values)))) if np.isfinite(values).any() else 1.0
    fig, ax = plt.subplots(figsize=(2.5 + 1.3 * values.shape[1], 1.5 + 0.45 * values.shape[0]))
    image = ax.imshow(values, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    for (row, column), value in np.ndenumerate(values):
        ax.text(column, row, number(value), ha="center", va="center", fontsize=8)  # as the tables: never "-0.0"
    ax.set_xticks(range(values.shape[1]), list(effect.columns), rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(values.shape[0]), list(effect.index), fontsize=8)
    fig.colorbar(image, ax=ax, label=f"{metric_label(metric)}: with box − without (points)")
    ax.set_title("Drawing the lesion's box in (CT-Bench Fig. 2)", fontsize=9)
    fig.tight_layout()
    return fig


def box_effect_plot(cells: pd.DataFrame, path_stem: str | Path, metric: str = "accuracy") -> list[Path]:
    """Write :func:`box_effect_figure` as ``<path_stem>.png`` and ``.svg``; nothing when it has no cell."""
    return _save(box_effect_figure(cells, metric), path_stem)


SLICE_CONTEXT = {"img2txt": "one key slice", "ct2txt": "nine slices"}
"""CT-Bench's Figure 3: the same question (which description) asked on one slice or on nine."""


def slice_context(cells: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Rows (schema, distractor kind, model) with the mean and 95 % CI of Img2txt and CT2txt side by side: the
    pairs that have both; empty when none."""
    qa = lesion_qa_cells(cells, metric)
    qa = qa[qa["family"].isin(SLICE_CONTEXT)]
    means = qa.pivot_table(index=["schema", "distractors", "model"], columns="family", values="mean", aggfunc="first")
    if not set(SLICE_CONTEXT) <= set(means.columns):
        return pd.DataFrame()
    both = means[list(SLICE_CONTEXT)].notna().all(axis=1)
    wide = qa.pivot_table(
        index=["schema", "distractors", "model"],
        columns="family",
        values=["mean", "ci_low", "ci_high"],
        aggfunc="first",
    )
    return wide.loc[both[both].index]


def slice_context_figure(cells: pd.DataFrame, metric: str = "accuracy"):
    """CT-Bench's Figure 3: per schema (and distractor kind, model), Img2txt on one slice beside CT2txt on nine,
    means with their 95 % CIs; None when no pair has both."""
    table = slice_context(cells, metric)
    if table.empty:
        return None
    fig, ax = plt.subplots(figsize=(2.5 + 1.4 * len(table), 3.2))
    x = np.arange(len(table))
    for offset, (family, label) in zip((-0.18, 0.18), SLICE_CONTEXT.items(), strict=True):
        mean = table[("mean", family)].to_numpy(float)
        low = table[("ci_low", family)].to_numpy(float) if ("ci_low", family) in table else mean
        high = table[("ci_high", family)].to_numpy(float) if ("ci_high", family) in table else mean
        err = np.nan_to_num(np.vstack([mean - low, high - mean]), nan=0.0)
        ax.bar(x + offset, mean, width=0.34, yerr=err, capsize=3, label=f"{family} ({label})")
    ax.set_xticks(x, [f"{schema_label(s)}\n{d}; {m}" for s, d, m in table.index], fontsize=7)
    ax.set_ylabel(f"{metric_label(metric)} (test)", fontsize=8)
    ax.axhline(25.0, color="grey", linestyle=":", linewidth=1, label="chance (25 %)")
    ax.legend(fontsize=7)
    ax.set_title("One slice or nine (CT-Bench Fig. 3)", fontsize=9)
    fig.tight_layout()
    return fig


def slice_context_plot(cells: pd.DataFrame, path_stem: str | Path, metric: str = "accuracy") -> list[Path]:
    """Write :func:`slice_context_figure` as ``<path_stem>.png`` and ``.svg``; nothing when it has no pair."""
    return _save(slice_context_figure(cells, metric), path_stem)


__all__ = [
    "SCHEMA_COLOURS",
    "box_effect",
    "box_effect_figure",
    "box_effect_plot",
    "interval_figure",
    "interval_plot",
    "normalise_axis",
    "radar_figure",
    "radar_plot",
    "schema_colour",
    "slice_context",
    "slice_context_figure",
    "slice_context_plot",
]


def power_curve_figure(curve: dict, target: float = 0.8):
    """Two panels from :func:`gx_ray.analysis.power.power_curve`: planned power against seeds (gid ``power-seeds``) and
    against test patients (gid ``power-patients``), with Monte-Carlo error bars and the ``target`` power dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 2.8), sharey=True)
    panels = (("against_seeds", "seeds", "patients"), ("against_patients", "patients", "seeds"))
    for ax, (key, axis, fixed) in zip(axes, panels, strict=True):
        rows = curve[key]
        x = [r[axis] for r in rows]
        power = np.array([100 * r["power"] for r in rows])
        error = np.array([100 * r["mc_error"] for r in rows])
        ax.errorbar(x, power, yerr=error, fmt="o-", color=SCHEMA_COLOURS["image_only"], capsize=3, gid=f"power-{axis}")
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(f"{axis} (at {rows[0][fixed]} {fixed})" if rows else axis, fontsize=8)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("power (%)", fontsize=8)
    fig.suptitle(f"Planned power to find a difference of {curve['effect']:g}", fontsize=9)
    fig.tight_layout()
    return fig


def power_curve_plot(curve: dict, path_stem: str | Path, target: float = 0.8) -> list[Path]:
    """Write :func:`power_curve_figure` as ``<path_stem>.png`` (dpi 150) and ``.svg``; the paths written."""
    return _save(power_curve_figure(curve, target), path_stem)
