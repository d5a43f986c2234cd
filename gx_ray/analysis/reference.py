"""The Gastric-X paper's published numbers, and our cell statistics placed beside them.

The paper's tables ship as ``analysis/gastric_x_paper_results.csv``, one row per printed number (369), ``value``
exactly as printed (percent scale, ranks as ranks). :func:`beside_paper` puts each of our cells next to every paper
model's value for the same (task, schema, metric), with a ``cohort`` column that says whether our numbers come from the
paper's test set at all. The paper does not ablate retrieval and lesion detection by input setting: their rows carry
``image_only`` and match our ``image_only`` cells only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

import gx_ray
from gx_ray.analysis.runs import lesion_qa_cells
from gx_ray.analysis.tables import (
    format_cell,
    metric_label,
    metric_order,
    number,
    schema_label,
    schema_order,
    shown_interval,
    task_order,
)

REFERENCE_FILE = "gastric_x_paper_results.csv"
PAPER_PREFIX = "paper: "
COHORTS = {
    "demo": "built-in demo cohort (synthetic) — not comparable to the paper's Gastric-X test set",
    "gastric_x": "Gastric-X (the paper's dataset) — our own split, models and training; compare with care",
}
OURS_COLUMNS = ["task", "schema", "metric", "model", "ours", "mean", "sd", "n", "ci_low", "ci_high"]
SAME_MODEL = "paper, same model"
PAPER_VLMS = (
    ("llava-med", "LLaVA-Med v1.5"),
    ("med-flamingo", "Med-Flamingo"),
    ("medvint", "MedVInT"),
    ("x2-vlm", "X2-VLM-Med"),
    ("llava-1.5", "LLaVA-1.5-7B"),
    ("llava-v1.5", "LLaVA-1.5-7B"),
    ("blip2", "BLIP-2"),
)
"""A VLM's name (hub name, folder or ``tiny:`` model, lower case) containing the first key → the paper's model it
is (``search_spaces/paper_models.yaml``'s names and their tiny stand-ins): LLaVA-Med before LLaVA-1.5, which
``llava-med-v1.5`` would also match."""


def paper_model_of(model: str) -> str | None:
    """The paper's model that our ``model`` (the runs' ``vlm:<vlm.name>``) is, or None (an encoder, another VLM)."""
    if not model.startswith("vlm:"):
        return None
    name = model.removeprefix("vlm:").lower()
    return next((paper for key, paper in PAPER_VLMS if key in name), None)


def default_reference_path() -> Path:
    """``analysis/gastric_x_paper_results.csv`` beside the (editable-installed) package."""
    return Path(gx_ray.__file__).resolve().parents[1] / "analysis" / REFERENCE_FILE


def load_reference(path: str | Path | None = None) -> pd.DataFrame:
    """The paper's numbers: task, model, schema, metric (our name), value, higher_is_better, source_table, …;
    ``paper_metric`` keeps the paper's own name; retrieval rows get ``metric = f"{direction}_{paper_metric}"``."""
    path = Path(path) if path is not None else default_reference_path()
    if not path.is_file():
        raise FileNotFoundError(f"the Gastric-X paper results are not at {path} (expected {REFERENCE_FILE})")
    frame = pd.read_csv(path, dtype={"direction": "string"})
    frame["paper_metric"] = frame["metric"]
    direction = frame["direction"].fillna("")
    frame["metric"] = (direction + "_").where(direction != "", "") + frame["paper_metric"]
    frame["higher_is_better"] = frame["higher_is_better"].astype(str).str.lower().eq("true")
    return frame


def cohort_note(cohort: str) -> str:
    """Plain words for where our numbers come from, e.g. ``demo`` → "built-in demo cohort (synthetic) — …"."""
    return COHORTS.get(cohort, f"{cohort} cohort — not the paper's Gastric-X test set; not directly comparable")


def _note(task: str, schema: str, metric: str, reference: pd.DataFrame, unablated: set[str]) -> str:
    if task in unablated:
        if schema != "image_only":
            return "the paper has no input settings for this task"
        return "the paper reports this task without input settings: matched to our image_only only"
    if not ((reference["task"] == task) & (reference["metric"] == metric)).any():
        return "not reported by the paper"
    return ""


def beside_paper(cells: pd.DataFrame, reference: pd.DataFrame, cohort: str) -> pd.DataFrame:
    """One row per cell of ours: ``OURS_COLUMNS``, then ``paper: <model>`` per paper model, ``note``, ``cohort``;
    ``ours`` reads "mean ± sd", a paper column is NaN where that model has no number for the row."""
    ours = cells.copy()
    several = ours.groupby("task")["fusion"].transform("nunique") > 1
    ours["model"] = (
        ours["model"].astype(str).where(~several, ours["model"].astype(str) + " (" + ours["fusion"].astype(str) + ")")
    )
    ours["ours"] = [format_cell(m, s, n) for m, s, n in zip(ours["mean"], ours["sd"], ours["n"], strict=True)]
    ours["ci_low"], ours["ci_high"] = shown_interval(ours)  # the interval the headline table shows
    ours = ours[OURS_COLUMNS]
    paper = reference.pivot_table(index=["task", "schema", "metric"], columns="model", values="value", aggfunc="first")
    models = list(reference["model"].drop_duplicates())
    paper = paper.reindex(columns=models).add_prefix(PAPER_PREFIX).reset_index()
    frame = ours.merge(paper, on=["task", "schema", "metric"], how="left")
    same = [paper_model_of(str(m)) for m in frame["model"]]  # a paper model's own row: its printed number beside
    frame[SAME_MODEL] = [
        frame.at[i, PAPER_PREFIX + m] if m and PAPER_PREFIX + m in frame.columns else np.nan
        for i, m in zip(frame.index, same, strict=True)
    ]
    schemas_per_task = reference.groupby("task")["schema"].unique()
    unablated = {task for task, schemas in schemas_per_task.items() if set(schemas) == {"image_only"}}
    frame["note"] = [
        _note(t, s, m, reference, unablated)
        for t, s, m in zip(frame["task"], frame["schema"], frame["metric"], strict=True)
    ]
    frame["cohort"] = cohort_note(cohort)
    order = {"task": task_order, "schema": schema_order, "metric": metric_order}
    keys = {f"_{c}": frame[c].map(sort(frame[c]).index) for c, sort in order.items()}
    frame = frame.assign(**keys).sort_values([*keys, "model"], kind="stable")
    return frame.drop(columns=list(keys)).reset_index(drop=True)


def beside_paper_markdown(frame: pd.DataFrame) -> str:
    """Markdown: the cohort statement first, then one table per task with only the paper models it reports."""
    lines = [f"**Our cohort: {c}.**" for c in frame["cohort"].drop_duplicates()]
    lines.append("Ours: test mean ± sd over seeds and 95 % CI; paper: the value printed in the Gastric-X paper.")
    for task, group in frame.groupby("task", sort=False):
        papers = [c for c in group.columns if c.startswith(PAPER_PREFIX) and group[c].notna().any()]
        if SAME_MODEL in group.columns and group[SAME_MODEL].notna().any():  # the paper's models run here: theirs
            papers = [SAME_MODEL, *papers]
        header = ["Setting", "Metric", "Our model", "Ours", "95 % CI", *papers, "Note"]
        lines += ["", f"### {task}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in group.to_dict("records"):
            ci = "—" if pd.isna(row["ci_low"]) else f"[{number(row['ci_low'])}, {number(row['ci_high'])}]"
            ours = [schema_label(row["schema"]), metric_label(row["metric"]), row["model"], row["ours"], ci]
            cells = [*ours, *(number(row[c]) for c in papers), row["note"]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


RELATED_FILE = "related_papers_results.csv"
OTHER_DATASET = "another dataset, never comparable with ours: shown for scale only"
CONDITIONS = {"image_only": "without box", "image_bbox": "with box"}


def load_related(path: str | Path | None = None) -> pd.DataFrame:
    """The related papers' numbers (``analysis/related_papers_results.csv``: CT-Bench's QA averages and readers, the
    upper-GI endoscopy paper's CLS/REC/REG), one row per printed number, the papers' inconsistencies in ``note``."""
    path = Path(path) if path is not None else default_reference_path().with_name(RELATED_FILE)
    return pd.read_csv(path)


def beside_related_markdown(cells: pd.DataFrame, related: pd.DataFrame) -> str | None:
    """Lesion QA beside CT-Bench: our test accuracy per condition, averaged over the families the sweep asked,
    above CT-Bench's averages over its QA tasks, under a heading that names the other dataset; None when the
    sweep has no lesion QA cell with a condition CT-Bench reports."""
    ours = lesion_qa_cells(cells, "accuracy")
    ours = ours[ours["schema"].isin(CONDITIONS)]
    if ours.empty:
        return None
    theirs = related[(related["task"] == "lesion_qa") & (related["metric"] == "accuracy")]
    dataset = theirs["dataset"].iloc[0] if len(theirs) else "CT-Bench"
    families = ", ".join(ours["question"].drop_duplicates())
    header = ["", *CONDITIONS.values(), "note"]
    lines = [
        f"### lesion_qa beside CT-Bench ({dataset}): {OTHER_DATASET}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    means = ours.groupby("schema")["mean"].mean()
    row = [f"ours (mean over {families})", *(number(means.get(s, float("nan"))) for s in CONDITIONS), ""]
    lines.append("| " + " | ".join(row) + " |")
    for model, group in theirs.groupby("model", sort=False):
        values = group.set_index("schema")["value"]
        notes = "; ".join(dict.fromkeys(n for n in group["note"].dropna() if n))
        lines.append(
            "| " + " | ".join([f"{model} (CT-Bench)", *(number(values.get(s)) for s in CONDITIONS), notes]) + " |"
        )
    return "\n".join(lines) + "\n"


ENDOSCOPY_METRICS = {"cls": "accuracy", "reg": "accuracy", "rec": "accuracy_iou_50"}
"""The upper-GI endoscopy paper's metric per family (its REC accuracy is ours: the share of boxes at IoU >= 0.5)."""
UNSEEN = "test (unseen)"


def beside_endoscopy_markdown(cells: pd.DataFrame, related: pd.DataFrame) -> str | None:
    """The endoscopy tasks beside the upper-GI endoscopy paper (GastroINST, its test split of unseen patients): our
    test accuracy per family (mean over seeds and schemas) above each of its models' numbers, under a heading that
    names the other dataset; None when the sweep ran no family the paper reports (CAP: it reviewed captions by hand)."""
    ours = cells[cells["task"].astype(str).str.startswith("endoscopy.") & (cells["metric"] == "accuracy")]
    ours = ours.assign(family=ours["task"].str.split(".").str[1])
    ours = ours[ours["family"].isin(ENDOSCOPY_METRICS)]
    if ours.empty:
        return None
    families = [f for f in ENDOSCOPY_METRICS if f in set(ours["family"])]
    theirs = related[related["task"].isin([f"endoscopy_{f}" for f in families]) & (related["split"] == UNSEEN)]
    dataset = theirs["dataset"].iloc[0] if len(theirs) else "GastroINST"
    header = ["", *(f.upper() for f in families), "note"]
    lines = [
        f"### endoscopy beside the upper-GI endoscopy paper ({dataset}, unseen patients): {OTHER_DATASET}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    means = ours.groupby("family")["mean"].mean()
    lines.append("| " + " | ".join(["ours (mean over schemas)", *(number(means.get(f)) for f in families), ""]) + " |")
    for model, group in theirs.groupby("model", sort=False):
        values = {t.removeprefix("endoscopy_"): v for t, v in zip(group["task"], group["value"], strict=True)}
        notes = "; ".join(dict.fromkeys(n for n in group["note"].dropna() if n))
        lines.append("| " + " | ".join([model, *(number(values.get(f)) for f in families), notes]) + " |")
    return "\n".join(lines) + "\n"


__all__ = [
    "beside_endoscopy_markdown",
    "beside_paper",
    "beside_paper_markdown",
    "beside_related_markdown",
    "cohort_note",
    "default_reference_path",
    "load_reference",
    "load_related",
    "paper_model_of",
]
