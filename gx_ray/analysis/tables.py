"""A task's cell statistics as the paper's result tables (Tables 2a, 2b, 4, 5, 6): Markdown, LaTeX and CSV.

Input is a *cells* table (:func:`gx_ray.analysis.stats.cell_statistics`). A task's table has one row per model
(``model (fusion)`` when the task has several fusions), the schemas as column groups and the task's metrics as columns
within each group; cells read ``mean ± sd`` over seeds.

Marking, as in the paper: within each metric, over *all* cells of the table, the best value is **bold** and the second
best underlined. Values are compared at the displayed precision (:data:`DECIMALS`): all tied best are bold, and
"second" is the next distinct printed value. The smallest is best for lower-is-better metrics (MedR, MnR). Missing or
NaN cells print "—" and are never ranked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gx_ray.analysis.runs import higher_is_better

DECIMALS = 1
CELL_COLUMNS = ("task", "model", "fusion", "schema", "metric", "mean", "sd", "n", "ci_low", "ci_high")
TASK_ORDER = ("vqa", "report_generation", "retrieval", "stage_classification", "lesion_detection")  # the paper's
SCHEMA_ORDER = ("image_only", "image_table", "image_bbox", "image_table_bbox")
SCHEMA_LABELS = {
    "image_only": "Image Only",
    "image_table": "Image + Table",
    "image_bbox": "Image + BBox",
    "image_table_bbox": "Image + Table + BBox",
}
METRIC_LABELS = {  # the paper's names, in the paper's column order
    "precision": "Precision",
    "recall": "Recall",
    "accuracy": "Accuracy",
    "f1": "F1",
    "auc": "AUC",
    "rouge_l": "ROUGE-L",
    "bleu_4": "BLEU-4",
    "meteor": "METEOR",
    "bertscore_f1": "BERTScore",
    "recall_at_1": "R@1",
    "recall_at_5": "R@5",
    "recall_at_10": "R@10",
    "median_rank": "MedR",
    "mean_rank": "MnR",
    "map": "mAP",
    "ap_50": "AP@0.5",
    "ap_75": "AP@0.75",
    "f1_50": "F1@0.5",
    "map_50_95": "mAP@[.5:.95]",
    "loc_acc_50": "Loc.Acc@0.5",
}
DIRECTION_PREFIXES = {"image_to_text": "I→T", "text_to_image": "T→I"}  # retrieval: Image→Text, Text→Image
LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_"}
LATEX_SPECIALS |= {"{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
LATEX_UNICODE = {"→": r"$\rightarrow$", "±": r"$\pm$", "↑": r"$\uparrow$", "↓": r"$\downarrow$", "—": "---"}


def schema_order(schemas) -> list[str]:
    """The paper's four settings first (Image Only … Image + Table + BBox), then any others alphabetically."""
    schemas = set(schemas)
    return [s for s in SCHEMA_ORDER if s in schemas] + sorted(schemas - set(SCHEMA_ORDER))


def task_order(tasks) -> list[str]:
    """The paper's task order (VQA, report generation, retrieval, staging, detection), then others alphabetically."""
    tasks = set(tasks)
    return [t for t in TASK_ORDER if t in tasks] + sorted(tasks - set(TASK_ORDER))


def schema_label(schema: str) -> str:
    return SCHEMA_LABELS.get(schema, schema.replace("_", " "))


def _split_direction(metric: str) -> tuple[str, str]:
    for direction in DIRECTION_PREFIXES:
        if metric.startswith(direction + "_"):
            return direction, metric[len(direction) + 1 :]
    return "", metric


def metric_order(metrics) -> list[str]:
    """Retrieval's Image→Text before Text→Image, then the paper's column order; unknown metrics alphabetically."""
    known = list(METRIC_LABELS)

    def key(metric: str):
        direction, base = _split_direction(metric)
        d = list(DIRECTION_PREFIXES).index(direction) if direction else -1
        return (d, known.index(base) if base in known else len(known), base)

    return sorted(set(metrics), key=key)


def metric_label(metric: str, arrow: bool = True) -> str:
    """The paper's name, e.g. ``I→T R@5 ↑``, ``T→I MedR ↓``, ``Accuracy (staging) ↑`` for ``accuracy_staging``."""
    direction, base = _split_direction(metric)
    if base in METRIC_LABELS:
        name = METRIC_LABELS[base]
    elif base.startswith("accuracy_"):
        name = f"Accuracy ({base.removeprefix('accuracy_').replace('_', ' ')})"
    else:
        name = base
    if direction:
        name = f"{DIRECTION_PREFIXES[direction]} {name}"
    return f"{name} {'↑' if higher_is_better(metric) else '↓'}" if arrow else name


def latex_escape(text: str) -> str:
    """Escape LaTeX's special characters (``_`` → ``\\_`` …) and spell ``→ ± ↑ ↓ —`` as LaTeX."""
    text = "".join(LATEX_SPECIALS.get(c, c) for c in text)
    for char, latex in LATEX_UNICODE.items():
        text = text.replace(char, latex)
    return text


def rank_cells(cells: pd.DataFrame, decimals: int = DECIMALS) -> pd.Series:
    """1 for the best printed value of each metric, 2 for the next distinct one, <NA> otherwise (and for NaN)."""
    rank = pd.Series(pd.NA, index=cells.index, dtype="Int64")
    for metric, group in cells.groupby("metric", sort=False):
        shown = group["mean"].astype(float).dropna().map(lambda x: float(f"{x:.{decimals}f}"))  # as printed
        better_high = bool(group["higher_is_better"].iloc[0]) if "higher_is_better" in group else None
        better_high = higher_is_better(str(metric)) if better_high is None else better_high
        distinct = sorted(shown.unique(), reverse=better_high)
        for place, value in enumerate(distinct[:2], start=1):
            rank[shown.index[shown == value]] = place
    return rank


def number(value: float | None, decimals: int = DECIMALS) -> str:
    """``value`` to ``decimals`` places, "—" for none; a value that rounds to zero prints "0.0", never "-0.0"."""
    if value is None or pd.isna(value):
        return "—"
    text = f"{value:.{decimals}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def plural(count: int, word: str) -> str:
    """``"1 seed"``, ``"3 seeds"``."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def format_cell(mean: float, sd: float, n: float, decimals: int = DECIMALS) -> str:
    """``mean ± sd``; the sd is left out when n < 2 (or NaN); "—" for a missing mean."""
    if mean is None or pd.isna(mean) or pd.isna(n) or n < 2 or pd.isna(sd):
        return number(mean, decimals)
    return f"{number(mean, decimals)} ± {number(sd, decimals)}"


def shown_interval(cells: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Each cell's 95 % interval as the report shows it: the two-level bootstrap's (``boot_low``/``boot_high``)
    where its ``interval`` column says so, else Student's t over seeds (``ci_low``/``ci_high``)."""
    if "boot_low" not in cells or "interval" not in cells:
        return cells["ci_low"], cells["ci_high"]
    booted = cells["interval"] == "two-level bootstrap"
    return cells["boot_low"].where(booted, cells["ci_low"]), cells["boot_high"].where(booted, cells["ci_high"])


@dataclass
class TaskTable:
    """One task's table: ``cells`` (the task's cells plus ``label``, ``rank`` and ``text``) in display order."""

    task: str
    rows: list[str]  # row labels: model, or "model (fusion)" when the task has several fusions
    schemas: list[str]
    metrics: list[str]
    cells: pd.DataFrame
    decimals: int = DECIMALS

    def cell(self, row: str, schema: str, metric: str) -> tuple[str, int | None]:
        """The printed text and rank (1, 2 or None) of one cell; ("—", None) where the cells have none."""
        hit = self._index.get((row, schema, metric))
        if hit is None:
            return "—", None
        rank = self.cells.at[hit, "rank"]
        return self.cells.at[hit, "text"], None if pd.isna(rank) else int(rank)

    def __post_init__(self) -> None:
        keys = zip(self.cells["label"], self.cells["schema"], self.cells["metric"], strict=True)
        self._index = {key: i for key, i in zip(keys, self.cells.index, strict=True)}


def task_table(cells: pd.DataFrame, task: str, decimals: int = DECIMALS) -> TaskTable:
    """The table of ``task`` from a cells table (see the module docstring for the layout and marking)."""
    frame = cells[cells["task"] == task].reset_index(drop=True)
    if frame.empty:
        raise ValueError(f"no cells for task {task!r}; tasks present: {sorted(cells['task'].unique())}")
    keys = ["model", "fusion", "schema", "metric"]
    if frame.duplicated(keys).any():
        raise ValueError(f"cells of {task!r} are not unique per (model, fusion, schema, metric)")
    if "higher_is_better" not in frame:
        frame["higher_is_better"] = frame["metric"].map(higher_is_better)
    several_fusions = frame["fusion"].nunique() > 1
    frame["label"] = [
        f"{m} ({f})" if several_fusions else str(m) for m, f in zip(frame["model"], frame["fusion"], strict=True)
    ]
    frame["rank"] = rank_cells(frame, decimals)
    frame["text"] = [format_cell(*v, decimals) for v in zip(frame["mean"], frame["sd"], frame["n"], strict=True)]
    pairs = frame[["model", "fusion", "label"]].drop_duplicates().sort_values(["model", "fusion"])
    schemas, metrics = schema_order(frame["schema"]), metric_order(frame["metric"])
    return TaskTable(
        task=task, rows=list(pairs["label"]), schemas=schemas, metrics=metrics, cells=frame, decimals=decimals
    )


def _columns(table: TaskTable) -> list[tuple[str, str]]:
    return [(schema, metric) for schema in table.schemas for metric in table.metrics]


def _header(table: TaskTable, metric: str) -> str:
    """The metric's name with the direction its cells are ranked by (a chance level's is its task's primary's)."""
    better_high = table.cells.loc[table.cells["metric"] == metric, "higher_is_better"]
    high = bool(better_high.iloc[0]) if len(better_high) else higher_is_better(metric)
    return f"{metric_label(metric, arrow=False)} {'↑' if high else '↓'}"


def caption(table: TaskTable, second: str = "underlined") -> str:
    """The table's legend; ``second``: how the format marks the second best."""
    return (
        f"{table.task}: mean ± sd over seeds (sd left out where n < 2). Best per metric over all models and "
        f"settings in bold, second best {second} (compared as printed, {table.decimals} decimal). "
        "↑ higher is better, ↓ lower is better."
    )


def to_markdown(table: TaskTable) -> str:
    """A GitHub Markdown table; headers read ``Setting · Metric ↑``; ``**best**``, ``*second*`` (the paper
    underlines the second best; Markdown has no underline, and raw HTML shows as markup in most viewers)."""
    header = ["Model"] + [f"{schema_label(s)} · {_header(table, m)}" for s, m in _columns(table)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" + ":-:|" * (len(header) - 1)]
    for row in table.rows:
        texts = []
        for schema, metric in _columns(table):
            text, rank = table.cell(row, schema, metric)
            texts.append(f"**{text}**" if rank == 1 else f"*{text}*" if rank == 2 else text)
        lines.append("| " + " | ".join([row, *texts]) + " |")
    return "\n".join(lines) + f"\n\n{caption(table, second='in italics')}\n"


def to_latex(table: TaskTable) -> str:
    """A booktabs ``tabular``: a ``\\multicolumn`` per setting over its metrics; ``\\textbf``/``\\underline``."""
    k, columns = len(table.metrics), _columns(table)
    groups = " & ".join(rf"\multicolumn{{{k}}}{{c}}{{{latex_escape(schema_label(s))}}}" for s in table.schemas)
    rules = " ".join(rf"\cmidrule(lr){{{2 + i * k}-{1 + (i + 1) * k}}}" for i in range(len(table.schemas)))
    lines = [
        f"% {latex_escape(caption(table))}",
        "% needs \\usepackage{booktabs}",
        r"\begin{tabular}{l" + "c" * len(columns) + "}",
        r"\toprule",
        rf" & {groups} \\",
        rules,
        "Model & " + " & ".join(latex_escape(_header(table, m)) for _, m in columns) + r" \\",
        r"\midrule",
    ]
    for row in table.rows:
        texts = []
        for schema, metric in columns:
            text, rank = table.cell(row, schema, metric)
            text = latex_escape(text)
            texts.append(rf"\textbf{{{text}}}" if rank == 1 else rf"\underline{{{text}}}" if rank == 2 else text)
        lines.append(" & ".join([latex_escape(row), *texts]) + r" \\")
    return "\n".join([*lines, r"\bottomrule", r"\end{tabular}"]) + "\n"


def to_csv(table: TaskTable) -> str:
    """Long form: one line per cell (``CELL_COLUMNS`` + ``rank``: 1 best, 2 second, empty otherwise)."""
    frame = table.cells.assign(
        _s=table.cells["schema"].map(table.schemas.index),
        _m=table.cells["metric"].map(table.metrics.index),
        _r=table.cells["label"].map(table.rows.index),
    ).sort_values(["_r", "_s", "_m"])
    return frame[[*CELL_COLUMNS, "rank"]].to_csv(index=False, lineterminator="\n")


RENDERERS = {"md": to_markdown, "tex": to_latex, "csv": to_csv}


def render(table: TaskTable, fmt: str) -> str:
    """``fmt``: ``md``, ``tex`` or ``csv``."""
    if fmt not in RENDERERS:
        raise ValueError(f"unknown table format {fmt!r}; valid: {', '.join(RENDERERS)}")
    return RENDERERS[fmt](table)


def write_task_tables(cells: pd.DataFrame, folder: str | Path) -> list[Path]:
    """``table_<task>.md``, ``.tex`` and ``.csv`` in ``folder`` for every task in ``cells``; the paths written.
    Markdown and LaTeX print the paper's metrics only (more would be too wide to read); the CSV holds every metric."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = cells["metric"].str.replace(r"^(image_to_text|text_to_image)_", "", regex=True)
    printed = cells[base.isin(list(METRIC_LABELS))]
    paths = []
    for task in task_order(cells["task"]):
        narrow = printed if (printed["task"] == task).any() else cells
        for fmt in RENDERERS:
            path = folder / f"table_{task}.{fmt}"
            path.write_text(render(task_table(cells if fmt == "csv" else narrow, task), fmt), encoding="utf-8")
            paths.append(path)
    return paths


__all__ = [
    "DECIMALS",
    "SCHEMA_ORDER",
    "TaskTable",
    "format_cell",
    "latex_escape",
    "metric_label",
    "metric_order",
    "rank_cells",
    "render",
    "schema_label",
    "schema_order",
    "task_order",
    "task_table",
    "to_csv",
    "to_latex",
    "to_markdown",
    "write_task_tables",
]
