"""The report's reporting appendix: the items of CLAIM 2024 (the checklist for AI in medical imaging) and TRIPOD+AI
(prediction models) that a sweep can fill from what it ran on and what it logged.

- **Flow of patients** (CLAIM 2024 item 33, TRIPOD+AI 20a): found, included, excluded by QC with reasons, per split.
- **Characteristics per split** (CLAIM 34, TRIPOD+AI 20b): stage groups, sex and age, from the cohort's fingerprint.
- **Sample size** (CLAIM 17, TRIPOD+AI 10): test patients, seeds, folds, comparisons, each one's detectable difference.
- **Metric definitions** (CLAIM 28, TRIPOD+AI 12e): each task's primary metric and its tested reference implementation.
- **Failure analysis** (CLAIM 39): per task, the test patients its best cell got most wrong (jackknife share).
- **Provenance** (CLAIM 22, TRIPOD+AI 18f): code, library versions, seeds, hardware, the cohort's and folds' hashes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from gx_ray import storage
from gx_ray.analysis import stats
from gx_ray.analysis.cases import CaseScorer
from gx_ray.analysis.plan import pseudo_values
from gx_ray.analysis.runs import child_runs, headline_metric, higher_is_better
from gx_ray.analysis.tables import number, plural
from gx_ray.data.fingerprint import read_fingerprint
from gx_ray.data.shards import read_manifest

QC_FILE = "qc_report.json"
WORST_CASES = 5
METRIC_DEFINITIONS = {
    "vqa": ("accuracy", "share of questions answered right", "scikit-learn accuracy_score"),
    "report_generation": ("rouge_l", "ROUGE-L F-measure, mean over reports", "rouge-score"),
    "retrieval": (
        "image_to_text_recall_at_5",
        "share of CTs whose own report ranks in the top 5",
        "a direct rank count",
    ),
    "stage_classification": (
        "auc",
        "one-vs-rest AUC, macro over the stage groups present",
        "scikit-learn roc_auc_score",
    ),
    "lesion_detection": ("ap_50", "COCO average precision at IoU 0.5 over 3D boxes", "pycocotools (MONAI's matching)"),
    "lesion_qa": ("accuracy", "share of multiple-choice questions answered right", "scikit-learn accuracy_score"),
    "endoscopy": ("accuracy", "share of frames classified right (captions: ROUGE-L)", "scikit-learn, rouge-score"),
}
"""Task → (primary metric, its definition, the reference implementation its tests compare it with)."""


def appendix_markdown(
    tracking_uri: str,
    sweep_id: str,
    runs: pd.DataFrame,
    significance: pd.DataFrame | None,
    shards: str | None,
    scorer: Callable[[str, str, str], CaseScorer | None],
) -> str:
    """The appendix's sections, as Markdown."""
    sections = [
        "## Reporting appendix (CLAIM 2024, TRIPOD+AI)",
        "The items of the two checklists that this sweep can fill from what it ran on and what it logged.",
        _flow(runs, shards),
        _characteristics(shards),
        _sample_size(runs, significance),
        _metrics(runs),
        _failures(runs, scorer),
        _provenance(tracking_uri, sweep_id, runs),
    ]
    return "\n\n".join(s for s in sections if s)


def _flow(runs: pd.DataFrame, shards: str | None) -> str:
    lines = ["### Flow of patients"]
    manifest = _manifest(shards)
    qc = _qc(shards)
    if qc:
        reasons = Counter(e["reason"] for e in qc.get("excluded", []))
        lines.append(
            f"Cases found: {qc.get('cases_found', '—')}; included: {qc.get('included', '—')}; excluded by quality "
            f"control: {len(qc.get('excluded', []))}"
            + (f" ({', '.join(f'{reason}: {n}' for reason, n in sorted(reasons.items()))})" if reasons else "")
            + "."
        )
    if manifest:
        rows = manifest.get("rows", {})
        lines.append("Per split (patients): " + ", ".join(f"{split} {n}" for split, n in rows.items()) + ".")
    folds = runs.dropna(subset=["fold"])["fold"].astype(int) if "fold" in runs else pd.Series(dtype=int)
    if len(folds):
        lines.append(
            f"Cross-validation: {folds.nunique()} folds over the training and validation patients (the test split "
            "untouched); the fold file is on the parent run (`folds.json`)."
        )
    return "\n\n".join(lines) if len(lines) > 1 else ""


def _characteristics(shards: str | None) -> str:
    manifest = _manifest(shards)
    fingerprint = read_fingerprint(shards, manifest) if manifest and shards else None
    if not fingerprint:
        return ""
    lines = [
        "### Characteristics per split",
        "| split | patients | stage groups | sex | age, median [5th–95th percentile] |",
        "|---|---|---|---|---|",
    ]
    for split, row in fingerprint["splits"].items():
        stages = ", ".join(f"{k}: {v}" for k, v in row["stage_groups"].items())
        sexes = ", ".join(f"{k}: {v}" for k, v in row["sex"].items())
        age = row.get("age")
        ages = f"{age['p50']:g} [{age['p5']:g}–{age['p95']:g}]" if age else "—"
        lines.append(f"| {split} | {row['cases']} | {stages} | {sexes} | {ages} |")
    return "\n".join(lines[:1]) + "\n\n" + "\n".join(lines[1:])


def _sample_size(runs: pd.DataFrame, significance: pd.DataFrame | None) -> str:
    test = runs[runs["split"] == "test"].drop_duplicates("run_id")
    if test.empty:
        return ""
    seeds = test["seed"].nunique()
    lines = [
        "### Sample size",
        f"{plural(seeds, 'seed')} per cell; the comparisons' test patients and their smallest detectable difference "
        "(80 % power, after Holm over the report's comparisons) are below. A difference smaller than that could not "
        "have been seen: plan the next study from this one with `python jobs/plan.py --pilot <this sweep's output "
        "folder> --effect <difference>`.",
    ]
    if significance is not None and not significance.empty and "mde" in significance:
        lines += ["| task | schema | test patients | seeds | smallest detectable |", "|---|---|---|---|---|"]
        for _, row in significance.iterrows():
            note = row.get("mde_note")
            if pd.notna(row.get("mde")) or isinstance(note, str):
                family = f" ({row['family']})" if row.get("family", "all") != "all" else ""  # a declared family
                lines.append(
                    f"| {row['task']} | {row['schema_a']}{family} | {int(row['n_cases'])} | {int(row['n_seeds'])} | "
                    f"{note if isinstance(note, str) else format(row['mde'], '.2f')} |"
                )
    return "\n\n".join(lines[:2]) + ("\n\n" + "\n".join(lines[2:]) if len(lines) > 2 else "")


def _metrics(runs: pd.DataFrame) -> str:
    from gx_ray.tasks import task_of

    tasks = sorted({task_of(str(t)) for t in runs["task"].dropna()})
    lines = ["### Metric definitions", "| task | primary metric | definition | tested against |", "|---|---|---|---|"]
    for task in tasks:
        if task in METRIC_DEFINITIONS:
            metric, definition, reference = METRIC_DEFINITIONS[task]
            lines.append(f"| {task} | `{metric}` | {definition} | {reference} |")
    return "\n".join(lines[:1]) + "\n\n" + "\n".join(lines[1:]) if len(lines) > 3 else ""


def _failures(runs: pd.DataFrame, scorer: Callable[[str, str, str], CaseScorer | None]) -> str:
    """Per task, its best cell's (by mean headline metric over seeds) test patients with the lowest jackknife share
    of the metric, averaged over the cell's seeds (each seed's fold models averaged under cross-validation)."""
    test = runs[(runs["split"] == "test") & (runs["status"] == "FINISHED")]
    lines = [
        "### Failure analysis",
        f"Per task, the {WORST_CASES} test patients its best cell got most wrong: each patient's jackknife share of "
        "the headline metric (for a mean of cases, its own score), averaged over the cell's seeds.",
        "| task | best cell | metric | patients most wrong (share of the metric) |",
        "|---|---|---|---|",
    ]
    for task, group in test.groupby("task"):
        metric = headline_metric(str(task))
        headline = group[group["metric"] == metric]
        if headline.empty:
            continue
        means = headline.groupby("schema")["value"].mean().dropna()
        if means.empty:  # the metric undefined on the test split (an AUC of one class)
            continue
        best = means.idxmax() if higher_is_better(metric) else means.idxmin()
        trials = stats.per_seed(headline[headline["schema"] == best])
        shares = _shares(trials["run_id"], str(task), metric, scorer)
        if shares is None:
            continue
        order = shares.sort_values(ascending=higher_is_better(metric)).head(WORST_CASES)
        worst = ", ".join(f"{case} ({number(value, 0)})" for case, value in order.items())
        lines.append(f"| {task} | {best} | {metric} | {worst} |")
    return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) if len(lines) > 4 else ""


def _shares(run_ids: pd.Series, task: str, metric: str, scorer: Callable) -> pd.Series | None:
    per_seed = []
    for run_id in run_ids:
        scorers = [scorer(r, task, metric) for r in (run_id if isinstance(run_id, list) else [run_id])]
        if any(s is None for s in scorers):
            return None
        common = sorted(set.intersection(*(set(s.case_ids) for s in scorers)))
        if len(common) < 3:
            return None
        per_seed.append(pd.Series(np.mean([pseudo_values(s, common) for s in scorers], axis=0), index=common))
    return pd.concat(per_seed, axis=1).mean(axis=1) if per_seed else None


def _provenance(tracking_uri: str, sweep_id: str, runs: pd.DataFrame) -> str:
    tags = [r.data.tags for r in child_runs(MlflowClient(tracking_uri), sweep_id)]
    if not tags:
        return ""

    def values(key: str) -> str:
        found = sorted({t[key] for t in tags if key in t})
        return ", ".join(found) if found else "—"

    versions = sorted({k.removeprefix("gx_ray.version.") for t in tags for k in t if k.startswith("gx_ray.version.")})
    lines = [
        "### Provenance",
        f"- code: {values('gx_ray.code')}; Python {values('gx_ray.python')}",
        "- libraries: " + ", ".join(f"{name} {values('gx_ray.version.' + name)}" for name in versions),
        f"- seeds: {', '.join(str(s) for s in sorted(runs['seed'].dropna().unique()))}",
        f"- hardware: {values('gx_ray.device')}",
        f"- cohort: shard manifest SHA-256 {values('gx_ray.manifest_sha256')}",
    ]
    if any("gx_ray.folds_sha256" in t for t in tags):
        lines.append(f"- folds: SHA-256 {values('gx_ray.folds_sha256')}")
    return "\n".join(lines[:1]) + "\n\n" + "\n".join(lines[1:])


def _manifest(shards: str | None) -> dict[str, Any] | None:
    try:
        return read_manifest(shards) if shards else None
    except (OSError, ValueError):
        return None


def _qc(shards: str | None) -> dict[str, Any] | None:
    """The quality-control report preparation wrote beside the shards' folder."""
    if not shards:
        return None
    location = storage.join(storage.normalize(shards).rstrip("/").rsplit("/", 1)[0], QC_FILE)
    try:
        return json.loads(storage.read_text(location))
    except (OSError, ValueError):
        return None
