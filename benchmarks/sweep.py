"""`python jobs/benchmark.py sweep`: where the wall time of a sweep goes.

Runs a sweep (by default the main command: ``modality_ablation`` on the demo cohort) into a fresh output folder
and splits its wall time into demo-cohort preparation, Ray and MLflow start-up, the report, and per trial: the
slot a trial holds (Tune's wall time × concurrency ÷ trials), the part of it spent outside training (actor start,
imports, MLflow run, dataset and model set-up: the start-up) and the training loop itself (epochs, validation,
test).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from mlflow.tracking import MlflowClient

from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.tracking import child_runs


def run_sweep_benchmark(options: SweepOptions) -> dict[str, Any]:
    result = run_sweep(options)
    runs = child_runs(MlflowClient(result.store_uri), result.parent_run_id)
    train = np.array([r.data.metrics.get("train_seconds", np.nan) for r in runs])
    inside = np.array([r.data.metrics.get("trial_seconds", np.nan) for r in runs])
    timings = result.timings
    slot = timings["tune_seconds"] * timings["concurrency"] / max(1, len(runs))
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
        "trial_function_seconds": float(np.nanmean(inside)),
        "trial_training_seconds": float(np.nanmean(train)),
        "trial_startup_seconds": slot - float(np.nanmean(train)),
        "startup_share": (slot - float(np.nanmean(train))) / slot,
    }
    (result.output / "sweep_benchmark.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def format_sweep_result(report: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"sweep {report['sweep_id']}: {report['trials']} trials ({report['failed']} failed), "
            f"{report['concurrency']} at a time, {report['total_seconds'] / 60:.1f} min in all",
            f"  demo cohort (generate + preprocess)  {report['demo_data_seconds']:7.1f} s",
            f"  Ray start                            {report['ray_start_seconds']:7.1f} s",
            f"  MLflow server start (beyond Ray+data){report['mlflow_start_seconds']:7.1f} s",
            f"  Tune (all trials)                    {report['tune_seconds']:7.1f} s",
            f"  report (tables, figures, statistics) {report['report_seconds']:7.1f} s",
            f"  per trial: slot {report['trial_slot_seconds']:.1f} s = start-up {report['trial_startup_seconds']:.1f} s"
            f" + training {report['trial_training_seconds']:.1f} s  (start-up share {report['startup_share']:.0%},"
            " target ≤ 25 %)",
        ]
    )
