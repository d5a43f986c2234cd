"""`python jobs/benchmark.py sweep`: where the wall time of a sweep goes.

Runs a sweep (by default the main command: ``modality_ablation`` on the demo cohort) into a fresh output folder
and splits its wall time into demo-cohort preparation, Ray and MLflow start-up, the report, and per trial: the
slot a trial holds (Tune's wall time × concurrency ÷ trials), the part of it spent outside training (actor start,
imports, MLflow run, dataset and model set-up: the start-up) and the training loop itself (epochs, validation,
test).

With ``--cpu-hours`` or ``--gpu-hours`` the sweep also forecasts its cost before the trials
(:mod:`gx_ray.sweep.budget`); the figures then set that forecast beside what the ledger says each trial spent: how
far a budget's forecast is from the cost it forecasts, measured in the same run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.tracking import MlflowClient

from gx_ray.sweep.budget import read_ledger
from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.tracking import child_runs


def run_sweep_benchmark(options: SweepOptions) -> dict[str, Any]:
    result = run_sweep(options)
    runs = child_runs(MlflowClient(result.store_uri), result.parent_run_id)
    train = np.array([r.data.metrics.get("train_seconds", np.nan) for r in runs])
    inside = np.array([r.data.metrics.get("trial_seconds", np.nan) for r in runs])
    timings = result.timings
    slot = timings["tune_seconds"] * timings["concurrency"] / max(1, len(runs))
    startup = slot - float(np.mean(train))  # NaN where a scheduler stopped a trial
    report = {
        "sweep_id": result.sweep_id,
        "trials": len(runs),
        "failed": result.failed,
        "total_seconds": timings["total_seconds"],
        "demo_data_seconds": timings["data_seconds"],
        "ray_start_seconds": timings["ray_seconds"],
        "mlflow_start_seconds": timings.get("mlflow_seconds", 0.0),
        "tune_seconds": timings["tune_seconds"],
        "report_seconds": timings.get("report_seconds", float("nan")),
        "concurrency": timings["concurrency"],
        "trial_slot_seconds": slot,
        "trials_without_training_seconds": int(np.isnan(train).sum()),  # a scheduler stopped them before their test
        "trial_function_seconds": float(np.nanmean(inside)),
        "trial_training_seconds": float(np.nanmean(train)),
        # the slot is every trial's; training known for some only would split it into a start-up of nothing
        "trial_startup_seconds": startup,
        "startup_share": startup / slot,
    }
    if budget := result.costs.get("budget"):
        report["forecast"] = forecast_against_ledger(budget, result.output)
    (result.output / "sweep_benchmark.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def forecast_against_ledger(budget: dict[str, Any], output: Path) -> dict[str, Any]:
    """The ``budget``'s forecast (``sweep.json``'s ``costs.budget``) beside what the trials spent (``ledger.csv``), in
    all and per trial. The forecast lists the trials in the sweep's order and the ledger in the order they started;
    the two agree for a grid without a scheduler, the case the per-trial ratios are for (a stopped or early-stopped
    trial spent less than forecast)."""
    forecast, metric = budget["forecast_seconds"], budget["metric"]
    rows = [r for r in read_ledger(output) if r["status"] != "ABANDONED"]
    spent = [float(r[metric]) for r in rows]
    pairs = zip(forecast["per_trial"], spent, rows, strict=False)  # a sweep stopped by its budget ran fewer trials
    whole = [f / s for f, s, r in pairs if r["status"] == "FINISHED" and s > 0]
    return {
        "metric": metric,
        "forecast_seconds": forecast["total"],
        "spent_seconds": round(sum(spent), 1),
        "ratio": forecast["total"] / sum(spent) if sum(spent) else float("nan"),
        "trial_ratio_median": float(np.median(whole)) if whole else float("nan"),
        "trial_ratio_min": min(whole, default=float("nan")),
        "trial_ratio_max": max(whole, default=float("nan")),
        "trials_compared": len(whole),
    }


def format_sweep_result(report: dict[str, Any]) -> str:
    slot, unsplit = report["trial_slot_seconds"], report["trials_without_training_seconds"]
    if unsplit:
        split = f"slot {slot:.1f} s; not split, since {unsplit} trials were stopped early (no training seconds)"
    else:
        startup, training = report["trial_startup_seconds"], report["trial_training_seconds"]
        share = report["startup_share"]
        split = f"slot {slot:.1f} s = start-up {startup:.1f} s + training {training:.1f} s  (start-up share {share:.0%}"
        split += ", target ≤ 25 %)"
    lines = [
        f"sweep {report['sweep_id']}: {report['trials']} trials ({report['failed']} failed), "
        f"{report['concurrency']} at a time, {report['total_seconds'] / 60:.1f} min in all",
        f"  demo cohort (generate + preprocess)  {report['demo_data_seconds']:7.1f} s",
        f"  Ray start                            {report['ray_start_seconds']:7.1f} s",
        f"  MLflow server start (beyond Ray+data){report['mlflow_start_seconds']:7.1f} s",
        f"  Tune (all trials)                    {report['tune_seconds']:7.1f} s",
        f"  report (tables, figures, statistics) {report['report_seconds']:7.1f} s",
        f"  per trial: {split}",
    ]
    if forecast := report.get("forecast"):
        lines.append(
            f"  budget forecast {forecast['forecast_seconds']:.1f} {forecast['metric']} against "
            f"{forecast['spent_seconds']:.1f} spent (forecast/spent {forecast['ratio']:.2f}; per finished trial "
            f"median {forecast['trial_ratio_median']:.2f}, {forecast['trial_ratio_min']:.2f}-"
            f"{forecast['trial_ratio_max']:.2f} over {forecast['trials_compared']})"
        )
    return "\n".join(lines)
