"""`python jobs/benchmark.py startup`: launch → the first optimiser step of one trial, part by part.

Launches ``python jobs/sweep.py`` as a user does (a new process tree: its own Ray and MLflow server) on the demo cohort,
with a one-trial space of tiny models (``tests/common.py``'s ``small_stage_space``: a 3D ResNet and BERT-tiny, two
steps). Every part is read from a wall clock of the process it ran in, the driver's (``sweep.json``'s
``timings_seconds``) or the trial's (its run's metrics). The parts tile launch → first step, one's end the next one's
start, and are printed beside their sum and the launch → first step (the trial's clock at its first step less the
launch), so that no time hides between parts. The first launch is cold (the cohort prepared,
the benchmark's own ``XDG_CACHE_HOME`` empty: no GPU plan, no empty MLflow store), the others warm.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.tracking import child_runs

ROOT = Path(__file__).resolve().parents[1]
SPACE = {
    "description": "one tiny trial: launch → first step (python jobs/benchmark.py startup)",
    "fixed": {
        "task": "stage_classification",
        "model.vision": "resnet18_3d",
        "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]},
        "model.text": "bert_tiny",
        "model.hidden": 32,
        "schedule.epochs": 1,
        "schedule.max_steps_per_epoch": 2,
        "data.effective_batch": 2,
    },
    "grid": {"seed": [0]},
}
"""``tests/common.py``'s ``small_stage_space`` with one seed and one epoch."""
PARTS = (
    ("python and the driver's imports", "driver"),
    ("Ray's start", "driver"),
    ("the cohort (prepared, or checked)", "driver"),
    ("the driver's checks, trial inputs, parent run, Tune", "driver"),
    ("MLflow's start, beyond the above", "driver"),
    ("the trial process: Ray starts it", "trial"),
    ("the trial process: its imports", "trial"),
    ("Tune's trial set-up", "trial"),
    ("the trial's start (MLflow run, config)", "trial"),
    ("the cohort's open (training rows)", "trial"),
    ("the model's build", "trial"),
    ("the data streams and optimiser", "trial"),
    ("the first batch", "trial"),
    ("the first optimiser step", "trial"),
)


@dataclass(frozen=True)
class StartupBenchmarkConfig:
    launches: int = 3
    """The first cold, the rest warm."""
    demo_cases: int = 200
    timeout_s: float = 600.0
    gpu: bool = False
    """The trial on one GPU (``resources.gpus_per_worker: 1``, 4 CPUs), as a GPU sweep's trials run."""


def launch_parts(launched: float, timings: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """Launch → first step in :data:`PARTS`, in seconds, from the driver's ``timings`` (``sweep.json``'s) and the trial
    run's ``metrics``; ``launched`` is when the command was started (``time.time()``). Imports done before Tune's
    start (a process started ahead) count only for what is left of them after it."""
    driver_at = metrics["first_step_at"] - timings["first_step_seconds"]  # the driver's own launch, in its clock
    ray_at = driver_at + timings["ray_seconds"]
    data_at = ray_at + timings["data_seconds"]
    tune_at = driver_at + timings["tune_started_seconds"]
    began, imported = max(metrics["import_started_at"], tune_at), max(metrics["imported_at"], tune_at)
    setup_at = metrics["setup_started_at"]
    setup_end = setup_at + metrics["setup_seconds"]
    seconds = [
        driver_at - launched,
        timings["ray_seconds"],
        timings["data_seconds"],
        tune_at - data_at - timings.get("mlflow_seconds", 0.0),
        timings.get("mlflow_seconds", 0.0),
        began - tune_at,
        max(0.0, metrics["imported_at"] - began),
        metrics["trial_started_at"] - imported,
        setup_at - metrics["trial_started_at"],
        metrics["cohort_seconds"],
        metrics["build_seconds"] - metrics["cohort_seconds"],
        metrics["setup_seconds"] - metrics["build_seconds"],
        metrics["first_batch_at"] - setup_end,
        metrics["first_step_at"] - metrics["first_batch_at"],
    ]
    return dict(zip((name for name, _ in PARTS), seconds, strict=True))


def summed(parts: dict[str, float], total: float) -> dict[str, float]:
    """The parts' sum beside the launch → first step measured on its own, and what lies between them."""
    total_of_parts = float(sum(parts.values()))
    return {"sum_of_parts": total_of_parts, "launch_to_first_step": total, "unaccounted": total - total_of_parts}


def _launch(folder: Path, space: Path, config: StartupBenchmarkConfig, cwd: Path) -> dict[str, Any]:
    """One ``jobs/sweep.py`` launch into ``folder`` from ``cwd`` (whose ``outputs/demo`` holds the demo cohort); its
    parts, the command's wall time and the trial's figures."""
    output = folder / "sweeps"
    command = [sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", str(space), "--output", str(output),
               "--demo-cases", str(config.demo_cases), "--address", "local"]  # fmt: skip
    launched, started = time.time(), time.perf_counter()
    env = {**os.environ, "XDG_CACHE_HOME": str(cwd / "cache")}  # the benchmark's own caches: cold at its first launch
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=config.timeout_s)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the launch failed ({done.returncode}): {done.stderr[-2000:]}")
    sweep_dir = next(output.glob("*/sweep.json")).parent
    sweep = json.loads((sweep_dir / "sweep.json").read_text(encoding="utf-8"))
    timings = sweep["timings_seconds"]
    client = MlflowClient(f"sqlite:///{sweep_dir / 'mlflow' / 'mlflow.db'}")  # its server has stopped: its store
    (run,) = child_runs(client, sweep["parent_run_id"])
    metrics = run.data.metrics
    parts = launch_parts(launched, timings, metrics)
    total = metrics["first_step_at"] - launched
    kept = ("val_primary", "test_primary", "train_loss")
    return {
        "parts": parts,
        **summed(parts, total),
        "command_seconds": wall,
        "startup_share": total / wall,
        "figures": {k: metrics[k] for k in kept if k in metrics},
    }


def run_startup_benchmark(out: Path, config: StartupBenchmarkConfig = StartupBenchmarkConfig()) -> dict[str, Any]:
    """``config.launches`` launches into ``out``: the first cold (``out`` emptied, the demo cohort prepared afresh), the
    rest warm; each launch's parts, and the warm launches' medians."""
    out = Path(out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    space = out / "startup.yaml"
    resources = {"resources": {"workers": 1, "cpus_per_worker": 4, "gpus_per_worker": 1}} if config.gpu else {}
    space.write_text(yaml.safe_dump({**SPACE, **resources}), encoding="utf-8")
    # run from ``out``: jobs/sweep.py's default demo folder, outputs/demo, is prepared there by the first launch
    launches = [_launch(out / f"launch-{i}", space, config, out) for i in range(config.launches)]
    warm = launches[1:]
    result = {"config": config.__dict__, "cold": launches[0], "warm": warm}
    if warm:
        result["warm_median"] = {
            "parts": {name: float(np.median([w["parts"][name] for w in warm])) for name, _ in PARTS},
            **{k: float(np.median([w[k] for w in warm])) for k in ("launch_to_first_step", "sum_of_parts",
                                                                    "unaccounted", "command_seconds", "startup_share")},
        }  # fmt: skip
    (out / "startup_benchmark.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def format_startup_result(result: dict[str, Any]) -> str:
    cold, median = result["cold"], result.get("warm_median")
    header = f"{'part':<54}{'cold s':>8}" + (f"{'warm s':>8}" if median else "")
    lines = ["launch → first optimiser step of one tiny trial (python jobs/sweep.py, demo cohort)", header]
    for name, side in PARTS:
        row = f"{side + ': ' + name:<54}{cold['parts'][name]:>8.1f}"
        lines.append(row + (f"{median['parts'][name]:>8.1f}" if median else ""))
    for key, label in (("sum_of_parts", "sum of the parts"), ("launch_to_first_step", "launch → first step"),
                       ("unaccounted", "between the parts"), ("command_seconds", "the whole command")):  # fmt: skip
        row = f"{label:<54}{cold[key]:>8.1f}"
        lines.append(row + (f"{median[key]:>8.1f}" if median else ""))
    share = f"start-up share of the command: cold {cold['startup_share']:.0%}"
    if median:
        share += f", warm {median['startup_share']:.0%} (median of {len(result['warm'])})"
    figures = ", ".join(f"{k} {v:.4f}" for k, v in cold["figures"].items() if math.isfinite(v))
    return "\n".join([*lines, share, f"the trial's figures: {figures}"])
