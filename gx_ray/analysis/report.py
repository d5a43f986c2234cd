"""A sweep's report: the paper's tables, the radar plot, seed statistics and significance, in ``OUTPUT/report/``.

:func:`write_report` reads the sweep's trial runs from MLflow, summarises each task x model x schema cell over seeds,
compares every schema with the baseline on the same seeds and test patients (bootstrap over patients from the logged
test predictions; Wilcoxon over seeds where a trial logged none), Holm-corrects across all comparisons, writes tables,
figures, the paper's numbers beside ours, search views and a one-page summary, and logs the folder to the parent run.
"""

from __future__ import annotations

import base64
import functools
import html
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.tracking import MlflowClient

from gx_ray.analysis import pareto, plots, reference, search_views, stats, tables
from gx_ray.analysis.appendix import appendix_markdown
from gx_ray.analysis.cases import BootstrapJob, CaseScorer, bootstrap_jobs, case_scorer
from gx_ray.analysis.runs import (
    headline_metric,
    higher_is_better,
    load_runs,
    space_analysis,
    sweep_parent,
    test_records,
)
from gx_ray.analysis.selection import task_winners
from gx_ray.analysis.study import format_p

REPORT_FOLDER = "report"
BASELINE = "image_only"
DEMO_COHORT = "demo"
CELLS_FILE = "cells.csv"
CHANCE = "chance"
"""The metric each trial logs as ``test_chance``: its primary metric for a predictor that never looks at the patient
(:meth:`gx_ray.tasks.base.Task.chance_level`)."""


@dataclass
class Report:
    folder: Path
    files: list[Path] = field(default_factory=list)
    significance: pd.DataFrame | None = None
    distractors: pd.DataFrame | None = None
    """Lesion QA: each distractor kind against random ones, per family and schema (``distractors.csv``)."""
    cells: pd.DataFrame | None = None
    out_of_fold: pd.DataFrame | None = None
    """Cross-validated sweeps: each cell's headline metric on its out-of-fold predictions (``out_of_fold.csv``)."""
    out_of_fold_significance: pd.DataFrame | None = None
    selection: pd.DataFrame | None = None
    """Searches: each task's best configuration, its naive and selection-corrected validation scores
    (``selection.csv``: :func:`~gx_ray.analysis.selection.task_winners`)."""
    seconds: float = 0.0

    def save(self, frame: pd.DataFrame | None, name: str) -> None:
        """``frame`` as ``<folder>/<name>.csv``, one of the report's files; nothing for None."""
        if frame is not None:
            frame.to_csv(self.folder / f"{name}.csv", index=False)
            self.files.append(self.folder / f"{name}.csv")


def write_report(
    tracking_uri: str,
    sweep_id: str,
    output: Path,
    parent_run_id: str | None = None,
    cohort: str = "",
    baseline: str = BASELINE,
    n_resamples: int = 1000,
) -> Report:
    """Write ``output/report/`` for the sweep and log it to ``parent_run_id`` (when given). ``cohort`` ``"demo"``
    labels every number as from the synthetic demo cohort; ``n_resamples``: bootstrap replicates per comparison, at
    least (a large family gets more: :func:`~gx_ray.analysis.stats.family_resamples`)."""
    started = time.perf_counter()
    folder = Path(output) / REPORT_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    runs = load_runs(tracking_uri, sweep_id)
    finished = runs[runs["status"] == "FINISHED"]
    report = Report(folder)
    margins = space_margins(tracking_uri, parent_run_id)
    primary = space_analysis(tracking_uri, parent_run_id, "primary")
    if finished.empty:
        summary = f"# Sweep {sweep_id}\n\nNo finished trials yet: nothing to report.\n"
        report.files += _write_summary(folder, summary)
    else:
        _write_cells(report, finished, runs, tracking_uri, n_resamples)
        _write_comparisons(report, finished, tracking_uri, baseline, n_resamples, margins, primary)
        write_selection(report, runs, tracking_uri, n_resamples)
        appendix = appendix_markdown(
            tracking_uri, sweep_id, runs, report.significance, _shards(tracking_uri, parent_run_id),
            _trial_scorers(tracking_uri),
        )  # fmt: skip
        front, files = pareto.pareto_section(tracking_uri, sweep_id, parent_run_id, folder / pareto.FOLDER)
        beside = _beside_markdown(report, cohort)
        summary = _summary(sweep_id, runs, report, cohort, baseline, beside) + "\n" + front + "\n" + appendix + "\n"
        report.files += files + _write_summary(folder, summary)
    if parent_run_id:
        client = MlflowClient(tracking_uri)
        client.log_artifacts(parent_run_id, str(folder), REPORT_FOLDER)
        # the run page shows its description as Markdown: the headline table there, the whole report one click away
        description = (
            f"**Report**: Artifacts → `{REPORT_FOLDER}/summary.html` (figures and tables on one page).\n\n"
            f"{_headline_markdown(report.cells) if report.cells is not None else ''}"
        )
        client.set_tag(parent_run_id, "mlflow.note.content", description)
    report.seconds = time.perf_counter() - started
    return report


def _write_cells(report: Report, finished: pd.DataFrame, runs: pd.DataFrame, tracking_uri: str, n_resamples: int):
    """Every metric of every cell over seeds with its interval (chance levels among them: for scripts), the per-task
    tables, the figures and the search's views."""
    cells = stats.cell_statistics(finished, split="test")
    report.cells = cell_intervals(_chance_directions(cells), finished, tracking_uri, n_resamples)
    report.save(report.cells, Path(CELLS_FILE).stem)
    folder = report.folder
    report.files += tables.write_task_tables(report.cells, folder / "tables")
    report.files += plots.radar_plot(report.cells, folder / "figures" / "radar")
    report.files += plots.interval_plot(report.cells, folder / "figures" / "intervals")
    report.files += plots.box_effect_plot(report.cells, folder / "figures" / "box_effect")  # lesion QA only
    report.files += plots.slice_context_plot(report.cells, folder / "figures" / "slice_context")  # likewise
    report.files += search_views.write_search_views(runs, folder / "search")  # stopped trials count there


def _write_comparisons(
    report: Report, finished: pd.DataFrame, tracking_uri: str, baseline: str, n_resamples: int, margins, primary
) -> None:
    """Each schema against the baseline, on the test split and out of fold (in the space's declared Holm families),
    and lesion QA's distractor kinds."""
    comparisons = schema_comparisons(finished, tracking_uri, baseline, n_resamples, margins, primary)
    report.significance = stats.significance_table(comparisons) if comparisons else None
    report.save(report.significance, "significance")
    oof_cells, oof_comparisons = out_of_fold(finished, tracking_uri, baseline, n_resamples, margins, primary)
    if not oof_cells.empty:
        report.out_of_fold = oof_cells
        report.out_of_fold_significance = stats.significance_table(oof_comparisons) if oof_comparisons else None
        report.save(oof_cells, "out_of_fold")
        report.save(report.out_of_fold_significance, "out_of_fold_significance")
    kinds = distractor_comparisons(finished, tracking_uri, n_resamples)
    if kinds:
        report.distractors = stats.significance_table(kinds)
        report.save(report.distractors, "distractors")


def write_selection(report: Report, runs: pd.DataFrame, tracking_uri: str, n_resamples: int = 1000) -> None:
    """Searches: each task's winner with its selection-corrected estimate, from the trials' ``predictions/val.json``
    (``selection.csv``); nothing for a sweep that searched no parameter."""
    records_of = functools.partial(test_records, tracking_uri, split="val")
    winners = task_winners(runs, records_of, n_resamples)
    if not winners.empty:
        report.selection = winners
        report.save(winners, "selection")


SHOWN_NAMES = 5
"""The summary names this many configurations indistinguishable from the best (``selection.csv`` all of them)."""


def _selection_markdown(table: pd.DataFrame | None) -> str:
    """Each searched task's winner: the naive best validation score beside the selection-corrected estimate, or why
    there is none, in words."""
    if table is None or table.empty:
        return ""
    lines = [
        "## The search's winner per task, corrected for its selection",
        "The best validation score of many configurations is the largest of many noisy numbers: optimistic. "
        "*Corrected*: the patients drawn with replacement, the best configuration chosen on the drawn ones and scored "
        "on the others (BBC-CV over out-of-fold predictions under cross-validation, else select-then-score over the "
        "validation patients), its mean and 95 % interval. *Indistinguishable*: configurations whose paired "
        "difference to the best has an interval holding 0. The test split plays no part.",
        "| task | metric | configurations | best configuration | naive best validation | corrected [95 % CI] | "
        "indistinguishable from the best |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, row in table.iterrows():
        if isinstance(row.get("note"), str) and row["note"]:
            corrected, same = "none: " + row["note"].removeprefix("no selection-corrected estimate: "), "—"
        else:
            corrected = (f"{_fmt(row['corrected'])} [{_fmt(row['low'])}, {_fmt(row['high'])}] ({row['method']}, "
                         f"{int(row['patients'])} patients)")  # fmt: skip
            names = row["indistinguishable_configurations"].split("; ")  # a wide search: five, the rest in the CSV
            more = f"; and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
            same = f"{int(row['indistinguishable'])}: {'; '.join(names[:SHOWN_NAMES])}{more}"
        # BBC-CV's naive score is of the pooled out-of-fold predictions, not the folds' mean that ranked the trials
        naive = _fmt(row["naive"]) + (" (pooled out-of-fold)" if row.get("method") == "bbc-cv" else "")
        cells = [row["task"], row["metric"], str(int(row["configurations"])), row["best"], naive, corrected, same]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])


def _beside_markdown(report: Report, cohort: str) -> str:
    """Our cells beside the paper's numbers (all of them in ``beside_paper.csv``, the printed ones in the summary),
    then beside CT-Bench's and the endoscopy paper's: other datasets, for scale."""
    paper = reference.beside_paper(report.cells, reference.load_reference(), cohort)
    report.save(paper, "beside_paper")
    beside = reference.beside_paper_markdown(paper[paper.filter(like="paper: ").notna().any(axis=1)])
    related = reference.load_related()
    for other in (reference.beside_related_markdown, reference.beside_endoscopy_markdown):
        section = other(report.cells, related)
        if section:
            beside += "\n" + section
    return beside


def _chance_directions(cells: pd.DataFrame) -> pd.DataFrame:
    """A chance level is its task's primary metric (of a predictor that never looks at the patient): better in that
    metric's direction, which a task of one's own may give as lower (an error in mL), not by its name."""
    chance = cells["metric"] == CHANCE
    cells.loc[chance, "higher_is_better"] = [
        higher_is_better(headline_metric(t)) if isinstance(t, str) else True for t in cells.loc[chance, "task"]
    ]
    return cells


def schema_comparisons(
    runs: pd.DataFrame,
    tracking_uri: str,
    baseline: str = BASELINE,
    n_resamples: int = 1000,
    margins: dict[str, float] | float | None = None,
    primary: list[str] | None = None,
) -> list[dict]:
    """Every schema against ``baseline`` on each task's headline metric (:func:`stats.paired_arms`), paired on seeds
    and test patients: a two-level bootstrap over patients and seeds (:mod:`gx_ray.analysis.study`), with its TOST
    verdict where the space gives the task a margin (``analysis.margin``) and the smallest difference the design
    could detect. The bootstrap needs every trial's test predictions, else it falls back to Wilcoxon over seeds.
    Each row's ``family``: its Holm family (:func:`stats.families` of the space's ``analysis.primary``)."""

    scorer = _trial_scorers(tracking_uri)
    pairs = list(stats.paired_arms(runs, baseline, headline_only=True))
    labels, sizes = stats.families([cell["schema_a"] for cell, _, _ in pairs], primary)
    jobs = [
        BootstrapJob(
            [_units(scorer, frame["run_id"], cell["task"], cell["metric"]) for frame in (arm, base)],
            margin=_margin(margins, cell["task"]),
            higher_is_better=higher_is_better(cell["metric"]),
            family=size,
        )
        for (cell, arm, base), size in zip(pairs, sizes, strict=True)
    ]
    comparisons = []
    for (cell, arm, base), label, result in zip(pairs, labels, _family_bootstraps(jobs, n_resamples), strict=True):
        if result is None:
            result = stats.wilcoxon_over_seeds(arm["value"].to_numpy(), base["value"].to_numpy())
        comparisons.append({**cell, "family": label, **result})
    return comparisons


def _family_bootstraps(jobs: list[BootstrapJob], n_resamples: int) -> list[dict | None]:
    """:func:`bootstrap_jobs` of each Holm family with the replicates its size needs (its p floor:
    :func:`stats.family_resamples`), in the jobs' order."""
    results: list[dict | None] = [None] * len(jobs)
    for size in dict.fromkeys(job.family for job in jobs):
        index = [i for i, job in enumerate(jobs) if job.family == size]
        found = bootstrap_jobs([jobs[i] for i in index], stats.family_resamples(size, n_resamples))
        for i, result in zip(index, found, strict=True):
            results[i] = result
    return results


def cell_intervals(cells: pd.DataFrame, runs: pd.DataFrame, tracking_uri: str, n_resamples: int = 1000) -> pd.DataFrame:
    """Each cell's headline metric with the two-level bootstrap's 95 % interval over test patients and seeds
    (``boot_low``/``boot_high``; its ``interval`` says which interval the headline table shows: that one where the
    trials logged their predictions, else Student's t over seeds)."""
    scorer = _trial_scorers(tracking_uri)
    keys = ["task", "model", "fusion", "schema"]
    test = runs[runs["split"] == "test"]
    found, jobs = [], []
    for key, group in test.groupby(keys, dropna=False):
        metric = headline_metric(key[0])
        seeds = stats.per_seed(group[group["metric"] == metric])
        if len(seeds):
            found.append((*key, metric))
            jobs.append(BootstrapJob([_units(scorer, seeds["run_id"], key[0], metric)]))
    results = bootstrap_jobs(jobs, n_resamples)
    extra = {k: (r["ci_low"], r["ci_high"]) for k, r in zip(found, results, strict=True) if r is not None}
    index = list(zip(*(cells[k] for k in [*keys, "metric"]), strict=True))
    cells = cells.copy()
    cells["boot_low"] = [extra.get(k, (math.nan, math.nan))[0] for k in index]
    cells["boot_high"] = [extra.get(k, (math.nan, math.nan))[1] for k in index]
    cells["interval"] = ["two-level bootstrap" if k in extra else "t over seeds" for k in index]
    return cells


def out_of_fold(
    runs: pd.DataFrame,
    tracking_uri: str,
    baseline: str = BASELINE,
    n_resamples: int = 1000,
    margins: dict[str, float] | float | None = None,
    primary: list[str] | None = None,
) -> tuple[pd.DataFrame, list[dict]]:
    """Cross-validated sweeps: each cell's headline metric on its out-of-fold predictions (each patient predicted once
    a seed, by the fold model that did not train on it) with the two-level bootstrap's interval, and each schema
    against ``baseline`` on them, in the Holm families of ``primary`` (as :func:`schema_comparisons`). Empty for
    sweeps without cross-validation."""
    test = runs[(runs["split"] == "test") & runs["fold"].notna()] if "fold" in runs else runs.iloc[0:0]
    if test.empty:
        return pd.DataFrame(), []

    @functools.cache
    def scorer(run_id: str, task: str, metric: str) -> CaseScorer | None:
        records = test_records(tracking_uri, run_id, split="val")
        return case_scorer(task, records, metric) if records else None

    keys = ["task", "model", "fusion", "schema"]
    arms: dict[tuple, list[list[CaseScorer | None]]] = {}
    for key, group in test.groupby(keys, dropna=False):
        metric = headline_metric(key[0])
        rows = group[group["metric"] == metric].sort_values(["seed", "fold"])
        if rows.duplicated(["seed", "fold"]).any():  # a search over other parameters: no one model per fold
            continue
        arms[(*key, metric)] = [[scorer(r, key[0], metric) for r in seed["run_id"]] for _, seed in rows.groupby("seed")]
    cells = [dict(zip([*keys, "metric"], key, strict=True)) for key in arms]
    jobs = [BootstrapJob([arm], out_of_fold=True) for arm in arms.values()]
    pairs = [(k, (*k[:3], baseline, k[4])) for k in arms if k[3] != baseline and (*k[:3], baseline, k[4]) in arms]
    labels, sizes = stats.families([a[3] for a, _ in pairs], primary)
    paired = [
        BootstrapJob([arms[a], arms[b]], _margin(margins, a[0]), higher_is_better(a[4]), size, out_of_fold=True)
        for (a, b), size in zip(pairs, sizes, strict=True)
    ]
    results = bootstrap_jobs(jobs, stats.family_resamples(len(pairs), n_resamples))
    table = pd.DataFrame([{**c, **(r or {})} for c, r in zip(cells, results, strict=True)])
    comparisons = [
        {"task": a[0], "model": a[1], "fusion": a[2], "metric": a[4], "schema_a": a[3], "schema_b": b[3]}
        | {"family": label, **r}
        for (a, b), label, r in zip(pairs, labels, _family_bootstraps(paired, n_resamples), strict=True)
        if r is not None
    ]
    return table, comparisons


def _units(scorer: Callable, run_ids: pd.Series, task: str, metric: str) -> list:
    """One bootstrap unit per seed: a trial's scorer, or a cross-validated seed's fold models' scorers."""
    return [
        [scorer(r, task, metric) for r in run_id] if isinstance(run_id, list) else scorer(run_id, task, metric)
        for run_id in run_ids
    ]


def _margin(margins: dict[str, float] | float | None, task: str) -> float | None:
    from gx_ray.tasks import task_of

    if isinstance(margins, dict):
        return margins.get(task_of(task))
    return margins


def _shards(tracking_uri: str, parent_run_id: str | None) -> str | None:
    """The cohort the sweep ran on, as its parent run keeps it (``data``)."""
    if not parent_run_id:
        return None
    return MlflowClient(tracking_uri).get_run(parent_run_id).data.params.get("data")


def space_margins(tracking_uri: str, parent_run_id: str | None) -> dict[str, float] | float | None:
    """The space's equivalence margin(s) (``analysis.margin``)."""
    return space_analysis(tracking_uri, parent_run_id, "margin")


def distractor_comparisons(runs: pd.DataFrame, tracking_uri: str, n_resamples: int = 1000) -> list[dict]:
    """Lesion QA: every distractor kind against ``random`` ones for the same family, schema, model and fusion, on the
    headline metric, paired on seeds and test patients (each patient has one question of each kind): CT-Bench's
    finding is that random distractors are too easy. Rows as :func:`schema_comparisons`' with the kinds as
    ``schema_a``/``schema_b`` (``task`` the family, ``schema`` the inputs); empty for sweeps without two kinds."""
    from gx_ray.tasks import label_options

    test = runs[(runs["split"] == "test") & runs["task"].astype(str).str.startswith("lesion_qa.")].copy()
    if test.empty:
        return []

    scorer = _trial_scorers(tracking_uri)
    options = test["task"].map(label_options)
    test["family"], test["kind"] = (
        options.map(lambda o: f"lesion_qa.{o['family']}"),
        options.map(lambda o: o["distractors"]),
    )
    cells, jobs = [], []
    keys = ["family", "schema", "model", "fusion", "metric"]
    for (family, schema, model, fusion, metric), group in test.groupby(keys, dropna=False):
        if metric != headline_metric(family + ".random"):
            continue
        arms = {kind: stats.per_seed(frame) for kind, frame in group.groupby("kind")}
        if "random" not in arms or not all(len(frame) for frame in arms.values()):
            continue
        for kind in sorted(set(arms) - {"random"}):
            seeds = sorted(set(arms[kind].index) & set(arms["random"].index))
            if not seeds:
                continue
            pair = [arms[kind].loc[seeds], arms["random"].loc[seeds]]
            jobs.append(BootstrapJob([_units(scorer, frame["run_id"], family, metric) for frame in pair]))
            cell = {"task": family, "schema": schema, "model": model, "fusion": fusion, "metric": metric}
            cells.append(({**cell, "schema_a": kind, "schema_b": "random"}, pair))
    comparisons = []
    n_resamples = stats.family_resamples(len(cells), n_resamples)
    for (cell, pair), result in zip(cells, bootstrap_jobs(jobs, n_resamples), strict=True):
        result = result or stats.wilcoxon_over_seeds(pair[0]["value"].to_numpy(), pair[1]["value"].to_numpy())
        comparisons.append({**cell, **result})
    return comparisons


def _trial_scorers(tracking_uri: str) -> Callable[[str, str, str], CaseScorer | None]:
    """``scorer(run_id, task, metric)``: a trial's test metric as a function of its patients, read from its predictions
    once (a baseline's or the random arm's trials take part in several comparisons); None without predictions."""

    @functools.cache
    def scorer(run_id: str, task: str, metric: str) -> CaseScorer | None:
        records = test_records(tracking_uri, run_id)
        return case_scorer(task, records, metric) if records else None

    return scorer


def _fmt(value: float, digits: int = 1) -> str:
    return tables.number(value, digits)


def _headline_markdown(cells: pd.DataFrame) -> str:
    lines = [
        "| task | model | schema | metric | test mean ± sd | 95 % CI | interval | chance | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = ["task", "model", "schema"]
    chance = cells[cells["metric"] == CHANCE].set_index(keys)["mean"].to_dict()
    headline = cells[cells["metric"] == cells["task"].map(headline_metric)]
    order = {schema: i for i, schema in enumerate(tables.schema_order(headline["schema"]))}
    tasks = {task: i for i, task in enumerate(tables.task_order(headline["task"]))}
    headline = headline.assign(task_rank=headline["task"].map(tasks), schema_rank=headline["schema"].map(order))
    headline = headline.sort_values(["task_rank", "model", "schema_rank"])
    headline["shown_low"], headline["shown_high"] = tables.shown_interval(headline)
    for _, row in headline.iterrows():
        arrow = "↑" if higher_is_better(row["metric"]) else "↓"
        spread = f" ± {_fmt(row['sd'])}" if row["n"] > 1 else ""
        low, high = row["shown_low"], row["shown_high"]
        lines.append(
            f"| {row['task']} | {row['model']} | {row['schema']} | {row['metric']} {arrow} | "
            f"{_fmt(row['mean'])}{spread} | [{_fmt(low)}, {_fmt(high)}] | {row.get('interval', 't over seeds')} | "
            f"{_fmt(chance.get(tuple(row[keys]), math.nan))} | {row['n']} |"
        )
    return "\n".join(lines)


SMALL_TEST_SET = 20
"""Below this many test patients a bootstrap over patients understates the spread (it resamples too few)."""


def _significance_markdown(table: pd.DataFrame | None, baseline: str) -> str:
    if table is None or table.empty:
        return f"No schema could be compared with {baseline} (it needs the same seeds in both)."
    caution = ""
    if "n_cases" in table and table["n_cases"].min() < SMALL_TEST_SET:
        caution = (
            f"\n\n*Caution: as few as {int(table['n_cases'].min())} test patients. With fewer than about "
            f"{SMALL_TEST_SET}, resampling them understates the spread: read these p-values as indicative.*"
        )
    lines = [
        f"| task | metric | schema vs {baseline} | difference [95 % CI] | p | p (Holm) | significant | "
        "equivalence | MDE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    family = table["family"] if "family" in table else pd.Series("all", index=table.index)
    for (_, row), size in zip(table.iterrows(), family.map(family.value_counts()), strict=True):
        lines.append(
            f"| {row['task']} | {row['metric']} | {row['schema_a']} | {_verdict(row, size)} | "
            f"{row.get('equivalence') if isinstance(row.get('equivalence'), str) else '—'} | "
            f"{_mde(row)} |"
        )
    methods = "; ".join(table["method"].drop_duplicates())  # said once: a column of it made the page too wide
    return _families_markdown(table, family, baseline) + "\n".join(lines) + f"\n\nMethod: {methods}." + caution


def _families_markdown(table: pd.DataFrame, family: pd.Series, baseline: str) -> str:
    """Where the space declared a primary family: which rows are in it, and that each family is Holm-corrected alone."""
    if (family == "all").all():
        return ""
    primary = ", ".join(dict.fromkeys(table.loc[family == "primary", "schema_a"])) or "none compared"
    return (
        f"**Two Holm families**, declared in the space before the results (`analysis.primary`), each Holm-corrected "
        f"alone (not across every comparison): the *primary* (confirmatory) family, {primary} against {baseline} "
        f"({tables.plural(int((family == 'primary').sum()), 'row')}), and the *exploratory* family, every other row "
        f"({(family == 'exploratory').sum()}).\n\n"
    )


def _mde(row: pd.Series) -> str:
    """The smallest detectable difference, or the words that say why there is none (``mde_note``)."""
    note = row.get("mde_note")
    if isinstance(note, str):
        return note
    return _fmt(row.get("mde"), 2) if _present(row.get("mde")) else "—"


def _present(value: object) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _verdict(row: pd.Series, family: int = 1) -> str:
    """A comparison's table cells: difference [95 % CI] | p | p (Holm) | significant. A bootstrap p-value at its
    floor is shown as a bound with its replicates (it would read as a borderline result); a difference that is not
    significant is "not shown", never "no difference"."""
    interval = f" [{_fmt(row.get('ci_low'), 2)}, {_fmt(row.get('ci_high'), 2)}]" if _present(row.get("ci_low")) else ""
    significant = "**yes**" if row["significant"] else "not shown"
    replicates = row.get("n_resamples")
    if _present(replicates):  # a bootstrap: its resolution floor applies
        p, p_holm = format_p(row["p_value"], int(replicates)), format_p(row["p_holm"], int(replicates), family)
    else:
        p, p_holm = f"{row['p_value']:.3g}", f"{row['p_holm']:.3g}"
    return f"{_fmt(row['diff'], 2)}{interval} | {p} | {p_holm} | {significant}"


def _out_of_fold_markdown(report: Report, baseline: str) -> str:
    """Cross-validated sweeps: the cells and comparisons on the out-of-fold predictions."""
    cells = report.out_of_fold
    if cells is None or cells.empty:
        return ""
    lines = [
        "## Cross-validation: out-of-fold",
        "Every training and validation patient is predicted once a seed, by the fold model that did not train on it. "
        "Intervals: two-level bootstrap (patients resampled within their fold, a seed's fold models one unit); a "
        "seed's score weighs its folds by their patients.",
        "| task | model | schema | metric | out-of-fold mean [95 % CI] | patients | seeds | folds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, row in cells.iterrows():
        if not _present(row.get("estimate")):
            continue
        lines.append(
            f"| {row['task']} | {row['model']} | {row['schema']} | {row['metric']} | {_fmt(row['estimate'])} "
            f"[{_fmt(row['ci_low'])}, {_fmt(row['ci_high'])}] | {int(row['n_cases'])} | {int(row['n_seeds'])} | "
            f"{int(row['n_folds'])} |"
        )
    comparisons = _significance_markdown(report.out_of_fold_significance, baseline)
    return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n\n" + comparisons


def _distractors_markdown(table: pd.DataFrame | None) -> str:
    """Lesion QA's distractor kinds against random ones (CT-Bench: random distractors are too easy)."""
    if table is None or table.empty:
        return ""
    lines = [
        "## Distractor kinds: each against random ones",
        "Lesion QA, paired on seeds and test patients (each patient is asked once with each kind); a negative "
        "difference means the kind is harder than random distractors. p-values Holm-corrected across these rows.",
        "| family | schema | metric | kind vs random | difference [95 % CI] | p | p (Holm) | significant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, row in table.iterrows():
        lines.append(f"| {row['task']} | {row['schema']} | {row['metric']} | {row['schema_a']} | {_verdict(row)} |")
    return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])


def _lesion_qa_overall_markdown(runs: pd.DataFrame) -> str:
    """Lesion QA pooled over its families and seeds, per condition: every test question asked, its accuracy and
    Wilson 95 % interval (CT-Bench's overall figure); nothing for a sweep without lesion QA."""
    from gx_ray.metrics.mcq import wilson_interval

    test = runs[(runs["status"] == "FINISHED") & (runs["split"] == "test")]
    test = test[test["task"].astype(str).str.startswith("lesion_qa.") & test["metric"].isin(["accuracy", "questions"])]
    if test.empty:
        return ""
    trials = test.pivot_table(index=["run_id", "schema"], columns="metric", values="value", aggfunc="first")
    trials = trials.dropna(subset=[c for c in ("accuracy", "questions") if c in trials]).reset_index()
    if not {"accuracy", "questions"} <= set(trials.columns) or trials.empty:
        return ""
    lines = [
        "## Lesion QA overall",
        "Every family and seed pooled, per condition: the test questions asked and answered right, with Wilson's 95 % "
        "interval (chance 25 %).",
        "| schema | right / asked | accuracy [95 % CI] |",
        "|---|---|---|",
    ]
    for schema, group in trials.groupby("schema"):
        right = int((group["accuracy"] * group["questions"] / 100).round().sum())
        asked = int(group["questions"].sum())
        if not asked:
            continue
        low, high = wilson_interval(right, asked)
        lines.append(
            f"| {schema} | {right} / {asked} | {_fmt(100 * right / asked)} [{_fmt(100 * low)}, {_fmt(100 * high)}] |"
        )
    return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])


def _inputs_markdown(runs: pd.DataFrame) -> str:
    """What each schema gave the model, once per schema (per task where the tasks differ, e.g. detection's cues)."""
    if "inputs" not in runs or runs.empty:
        return ""
    lines = ["What each schema gave the model:"]
    trials = runs.drop_duplicates("run_id").dropna(subset=["inputs"])
    for schema, group in trials.groupby("schema", sort=False):
        forms = group.groupby("inputs", sort=False)["task"].unique()
        for inputs, tasks in forms.items():
            which = f" ({', '.join(sorted(tasks))})" if len(forms) > 1 else ""
            lines.append(f"- **{schema}**{which}: {inputs}")
    return "\n".join(lines) if len(lines) > 1 else ""


def _summary(sweep_id: str, runs: pd.DataFrame, report: Report, cohort: str, baseline: str, paper: str) -> str:
    trials = runs.drop_duplicates("run_id")
    counts = trials["status"].value_counts().to_dict()
    cohort_line = (
        "**Cohort: the built-in synthetic demo cohort.** Its numbers show the pipeline works; they are not "
        "comparable with the paper's, which come from the Gastric-X test set."
        if cohort == DEMO_COHORT
        else f"Cohort: {cohort or 'the data the sweep was given'}."
    )
    figures = [p for p in report.files if p.suffix == ".png"]
    tables_md = sorted(p for p in report.files if p.suffix == ".md" and p.parent.name == "tables")
    parts = [
        f"# Sweep {sweep_id}",
        cohort_line,
        f"Trials: {len(trials)} ({', '.join(f'{n} {s.lower()}' for s, n in sorted(counts.items()))}).",
        "## Headline metric per cell (test split, over seeds)",
        "*Chance*: the same metric for a predictor that never looks at the patient and knows only the training "
        "split (its stage frequencies, a guess among each question's training answers, the median tumour box, "
        "the most typical training report, a random ranking, a uniform guess among four options). A cell whose "
        "interval does not clear it has not shown that it learnt anything. *95 % CI*: where the trials logged their "
        "test predictions, a two-level bootstrap over test patients and seeds (both sources of variation: another "
        "test set, another training run); else Student's t over the seeds (training randomness on this test set "
        "only). The *interval* column says which.",
        _headline_markdown(report.cells),
        _inputs_markdown(runs),
        f"## Which inputs help: each schema against {baseline}",
        "Paired on seeds and test patients (two-level bootstrap: the same patients and seed draws for both arms); "
        "p-values Holm-corrected across every comparison below; a p-value at the bootstrap's floor is shown as a "
        'bound. *Significant*: "not shown" means the data cannot tell the schemas apart, not that they are alike. '
        "*Equivalence*: TOST against the space's margin (`analysis.margin`, in the metric's units): equivalent, "
        "non-inferior, worse or not shown; without a margin, not tested. *MDE*, smallest detectable: the difference "
        "this design (its patients, seeds and family of comparisons) would detect with 80 % power.",
        _significance_markdown(report.significance, baseline),
        _out_of_fold_markdown(report, baseline),
        _selection_markdown(report.selection),
        _distractors_markdown(report.distractors),
        _lesion_qa_overall_markdown(runs),
        "## Figures",
        "`summary.html` shows every figure and per-task table in place.",
        *(f"![{p.stem}]({p.relative_to(report.folder).as_posix()})" for p in figures),
        "## Tables per task (all metrics)",
        *(f"- [{p.stem}]({p.relative_to(report.folder).as_posix()})" for p in tables_md),
        "## Beside the paper",
        paper,
    ]
    return "\n\n".join(parts) + "\n"


def _write_summary(folder: Path, markdown: str) -> list[Path]:
    """``summary.md`` and ``summary.html``: the same summary as one self-contained page (figures embedded, the
    per-task tables inline). MLflow's Markdown view resolves no path relative to the artifact (it prints such an
    image as its source text; such a link opens a missing page): the Markdown names those files as paths."""
    md, page = folder / "summary.md", folder / "summary.html"
    md.write_text(re.sub(r"!?\[[^\]]*\]\(([^):#]+)\)", r"`\1`", markdown), encoding="utf-8")
    page.write_text(_markdown_to_html(markdown, folder), encoding="utf-8")
    return [md, page]


def _markdown_to_html(markdown: str, folder: Path) -> str:
    """The summary as one HTML page (CommonMark with tables): each figure as a data URI, each linked Markdown table
    rendered in place of its link."""
    from markdown_it import MarkdownIt

    def inline_tables(match: re.Match) -> str:
        path = folder / match.group(2)
        return f"### {match.group(1)}\n\n{path.read_text(encoding='utf-8')}" if path.is_file() else match.group(0)

    def embed(match: re.Match) -> str:
        path = folder / html.unescape(match.group(1))
        if not path.is_file():
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"'

    markdown = re.sub(r"^- \[([^\]]+)\]\(([^)]+\.md)\)$", inline_tables, markdown, flags=re.MULTILINE)
    style = (  # a table wider than the page scrolls in its own box, its cells wrapped but never a letter a line
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}th{background:#f3f3f3}img{max-width:100%}"
        "table{display:block;overflow-x:auto;border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;overflow-wrap:anywhere;min-width:3em}"
    )
    body = MarkdownIt("commonmark").enable("table").render(markdown)
    body = re.sub(r'src="([^"]+\.png)"', embed, body)
    return f"<!doctype html>\n<meta charset='utf-8'>\n<style>{style}</style>\n{body}"


def cohort_of(manifest: dict) -> str:
    """``"demo"`` for shards of the built-in synthetic cohort, else the source folder's name."""
    if manifest.get("demo_cohort"):
        return DEMO_COHORT
    return Path(str(manifest.get("source", ""))).name


@dataclass
class SweepStore:
    """Where a sweep's runs are: its MLflow tracking URI, id, parent run, cohort and output folder."""

    uri: str
    sweep_id: str
    parent: Any
    cohort: str
    folder: Path


@contextmanager
def open_sweep(sweep: str, mlflow_uri: str | None = None, output: Path | None = None) -> Iterator[SweepStore]:
    """A finished (or interrupted) sweep, named by its output folder (its ``sweep.json``) or by its id (needs
    ``mlflow_uri``; folder ``output``, default ``outputs/sweeps/ID``), with its MLflow store open: a sweep's own local
    store (``OUTPUT/mlflow``) is served again for the block when no ``mlflow_uri`` is given."""
    import json

    from gx_ray.data.shards import read_manifest
    from gx_ray.tracking.server import LocalMlflowServer

    folder = Path(sweep)
    document = json.loads((folder / "sweep.json").read_text(encoding="utf-8")) if folder.is_dir() else None
    if folder.is_dir() and document is None:
        raise FileNotFoundError(f"{folder} is not a sweep's output folder: it has no sweep.json")
    server = None
    if mlflow_uri is None and document is not None and (folder / "mlflow" / "mlflow.db").exists():
        server = LocalMlflowServer(folder / "mlflow").start()
    uri = mlflow_uri or (server.uri if server else document and document["tracking_uri"])
    if not uri:
        raise ValueError(f"{sweep!r} is not an output folder; give the MLflow server with --mlflow-uri")
    try:
        sweep_id = document["sweep_id"] if document else sweep
        parent = sweep_parent(uri, sweep_id)
        if parent is None:
            raise ValueError(f"no sweep {sweep_id!r} on the MLflow server {uri}")
        try:
            cohort = cohort_of(read_manifest(parent.data.params["data"], verify=False))
        except (KeyError, OSError, ValueError):
            cohort = ""
        destination = folder if document else Path(output or Path("outputs/sweeps") / sweep_id)
        yield SweepStore(uri=uri, sweep_id=sweep_id, parent=parent, cohort=cohort, folder=destination)
    finally:
        if server:
            server.stop()


def report_sweep(sweep: str, mlflow_uri: str | None = None, output: Path | None = None) -> Report:
    """The report of a finished (or interrupted) sweep, named by its output folder or by its id (:func:`open_sweep`);
    it goes to the output folder (a sweep id's: ``output``, default ``outputs/sweeps/ID``)."""
    with open_sweep(sweep, mlflow_uri, output) as store:
        return write_report(store.uri, store.sweep_id, store.folder, store.parent.info.run_id, store.cohort)


__all__ = [
    "Report",
    "SweepStore",
    "cohort_of",
    "open_sweep",
    "report_sweep",
    "schema_comparisons",
    "space_margins",
    "write_report",
]
