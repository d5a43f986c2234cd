"""Planning a study from a pilot sweep: how many seeds and test patients a paired comparison of two input schemas
needs to detect a difference of a given size with 80 % power, after Holm over the family of comparisons.

For each comparison (paired on seeds as the report pairs them), every seed's per-patient paired differences are the
jackknife pseudo-values of arm A's metric minus arm B's (``n θ − (n − 1) θ₋ᵢ``: a mean of cases gives each case's own
value; a corpus metric such as AUC, what the patient contributes to it), so :func:`gx_ray.analysis.power.plan_power`
resamples patients for any metric; the seed spread comes from the pilot's seeds. :func:`plan_study` writes
``plan/summary.md`` (every design's power, the smallest reaching 80 %), ``plan/plan.json`` and a power curve per
comparison. A cross-validated pilot is planned on its out-of-fold predictions, each fold model's pseudo-values within
its fold; the number of folds (it changes how much each model trains on) stays the pilot's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gx_ray.analysis import plots, power, stats
from gx_ray.analysis.cases import CaseScorer, case_scorer
from gx_ray.analysis.runs import load_runs, space_analysis, sweep_parent, test_records
from gx_ray.analysis.tables import plural

PLAN_FOLDER = "plan"


def pseudo_values(scorer: CaseScorer, case_ids: list[str]) -> np.ndarray:
    """Each patient's jackknife pseudo-value of the trial's metric over ``case_ids``: ``n θ − (n − 1) θ₋ᵢ``."""
    score = scorer.aligned(case_ids)
    n = len(case_ids)
    everyone = np.arange(n)
    theta = score(everyone)
    left_out = np.array([score(np.delete(everyone, i)) for i in range(n)])
    return n * theta - (n - 1) * left_out


def pilot_differences(
    arm: list[CaseScorer] | list[list[CaseScorer]], base: list[CaseScorer] | list[list[CaseScorer]]
) -> np.ndarray:
    """Per seed, per patient (both arms scored): arm's pseudo-value minus the baseline's, ``(seeds, patients)``. A
    seed is one trial's scorer, or a cross-validated seed's fold models' scorers (pseudo-values within each fold)."""
    arm = [s if isinstance(s, list) else [s] for s in arm]
    base = [s if isinstance(s, list) else [s] for s in base]
    folds = range(len(arm[0]))
    common = [sorted(set.intersection(*(set(seed[k].case_ids) for seed in [*arm, *base]))) for k in folds]
    common = [(k, ids) for k, ids in zip(folds, common, strict=True) if len(ids) >= 2]
    if sum(len(ids) for _, ids in common) < 3:
        raise ValueError(f"the pilot's arms share {sum(len(ids) for _, ids in common)} patients: too few to plan from")
    return np.array(
        [
            np.concatenate([pseudo_values(a[k], ids) - pseudo_values(b[k], ids) for k, ids in common])
            for a, b in zip(arm, base, strict=True)
        ]
    )


@dataclass(frozen=True, kw_only=True)
class PlannedComparison:
    """One comparison planned (:func:`plan_study`): its cell (as :func:`~gx_ray.analysis.stats.paired_arms` names
    it), the pilot's size and ``observed`` mean difference, the ``plan``, the power ``curve`` and its ``figure``."""

    task: str
    model: str
    fusion: str
    metric: str
    schema_a: str
    schema_b: str
    effect: float
    pilot_seeds: int
    pilot_patients: int
    pilot_folds: int
    observed: float
    plan: power.PowerPlan
    curve: dict
    figure: str

    def to_dict(self) -> dict[str, Any]:
        head = {k: v for k, v in vars(self).items() if k not in ("plan", "curve", "figure")}
        return {**head, **self.plan.to_dict(), "curve": self.curve, "figure": self.figure}


@dataclass(frozen=True)
class StudyPlan:
    comparisons: list[PlannedComparison]
    folder: Path

    def to_dict(self) -> dict[str, Any]:
        return {"comparisons": [c.to_dict() for c in self.comparisons], "folder": self.folder}


def plan_study(
    tracking_uri: str,
    sweep_id: str,
    effect: float | None,
    output: Path,
    settings: power.PowerSettings | None = None,
    metric: str | None = None,
    baseline: str = "image_only",
    comparisons: int | None = None,
) -> StudyPlan:
    """Plan every comparison of the pilot sweep ``sweep_id`` (each task's ``metric``, default its headline) for a
    difference of ``effect`` in the metric's units (None: each comparison's own pilot difference), with ``settings``'
    designs, over a family of ``comparisons`` (default: the pilot's own, or each comparison's Holm family where the
    pilot's space declared ``analysis.primary``: :func:`stats.families`); writes ``output/plan/``."""
    runs = load_runs(tracking_uri, sweep_id)
    finished = runs[runs["status"] == "FINISHED"]
    if metric is not None:
        finished = finished[finished["metric"] == metric]
    pairs = list(stats.paired_arms(finished, baseline, headline_only=metric is None))
    if not pairs:
        raise ValueError(f"sweep {sweep_id}: no schema can be compared with {baseline} on shared seeds")
    parent = sweep_parent(tracking_uri, sweep_id)
    primary = None if comparisons else space_analysis(tracking_uri, parent and parent.info.run_id, "primary")
    labels, sizes = stats.families([cell["schema_a"] for cell, _, _ in pairs], primary)
    folder = Path(output) / PLAN_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    planned = []
    for (cell, arm, base), size in zip(pairs, sizes, strict=True):
        scorers = [[_scorer(tracking_uri, r, cell["task"], cell["metric"]) for r in f["run_id"]] for f in (arm, base)]
        if any(s is None or (isinstance(s, list) and None in s) for side in scorers for s in side):
            continue  # a trial without predictions: no patients to resample
        folds = len(scorers[0][0]) if isinstance(scorers[0][0], list) else 0
        differences = pilot_differences(*scorers)
        options = replace(settings or power.PowerSettings(), comparisons=comparisons or size)
        if len(differences) < 2:  # one pilot seed: the spread over seeds is unknown, and planned as none
            options = replace(options, seed_sd=0.0)
        wanted = float(differences.mean()) if effect is None else effect
        plan = power.plan_power(differences, wanted, options)
        curve = power.power_curve(differences, wanted, options)
        figures = plots.power_curve_plot(curve, folder / f"power_{cell['task']}.{cell['schema_a']}")
        planned.append(PlannedComparison(
            **cell, effect=wanted, pilot_seeds=len(differences), pilot_patients=differences.shape[1], pilot_folds=folds,
            observed=float(differences.mean()), plan=plan, curve=curve, figure=figures[0].name))  # fmt: skip
    plan_json = json.dumps([p.to_dict() for p in planned], indent=1, default=float)
    (folder / "plan.json").write_text(plan_json + "\n", encoding="utf-8")
    family = f"a family of {comparisons or len(pairs)} comparisons"
    if primary:
        family = (f"its family, as the pilot's space declared them (`analysis.primary`): "
                  f"{plural(labels.count('primary'), 'primary comparison')} ({', '.join(primary)}), "
                  f"{labels.count('exploratory')} exploratory")  # fmt: skip
    (folder / "summary.md").write_text(_summary(sweep_id, planned, family, effect), encoding="utf-8")
    return StudyPlan(planned, folder)


def _scorer(tracking_uri: str, run_id: Any, task: str, metric: str) -> CaseScorer | list[CaseScorer | None] | None:
    """A trial's test scorer; for a cross-validated seed (its fold models' runs), each fold's out-of-fold scorer."""
    if isinstance(run_id, list):
        return [_scorer_of(test_records(tracking_uri, r, split="val"), task, metric) for r in run_id]
    return _scorer_of(test_records(tracking_uri, run_id), task, metric)


def _scorer_of(records: list[dict] | None, task: str, metric: str) -> CaseScorer | None:
    return case_scorer(task, records, metric) if records else None


def _summary(sweep_id: str, planned: list[PlannedComparison], family: str, effect: float | None) -> str:
    size = "the difference its pilot observed" if effect is None else f"a difference of **{effect:g}**"
    lines = [
        f"# Study plan from pilot sweep {sweep_id}",
        "",
        f"How many seeds and test patients each comparison needs to detect {size} (the "
        f"metric's units) with 80 % power, after Holm over {family}. Method: "
        f"{planned[0].plan.method if planned else '—'}; per-patient differences are jackknife pseudo-values of the "
        "pilot's test predictions"
        + (
            f" (cross-validated: its out-of-fold predictions, {planned[0].pilot_folds} folds, kept as the pilot's)."
            if planned and planned[0].pilot_folds
            else "."
        ),
        "",
        "| task | metric | schema vs baseline | pilot (seeds × patients) | pilot difference | seed SD | "
        "smallest design at 80 % |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in planned:
        best = p.plan.smallest
        design = "none of the designs tried"
        if best is not None:
            size = f"{plural(best.seeds, 'seed')} × {plural(best.patients, 'patient')}"
            design = f"{size} (power {100 * best.power:.0f} %)"
        lines.append(
            f"| {p.task} | {p.metric} | {p.schema_a} | {p.pilot_seeds} × {p.pilot_patients} | "
            f"{p.observed:.2f} | {p.plan.seed_sd:.2f} | {design} |"
        )
    for p in planned:
        lines += ["", f"## {p.task}: {p.schema_a} against {p.schema_b}", ""]
        lines += ["| seeds | patients | power | ± MC | minimum detectable effect (80 %) |", "|---|---|---|---|---|"]
        for d in p.plan.designs:
            lines.append(f"| {d.seeds} | {d.patients} | {100 * d.power:.1f} % | {100 * d.mc_error:.1f} | {d.mde:.2f} |")
        lines += ["", f"![power curve]({p.figure})"]
    return "\n".join(lines) + "\n"
