"""`python jobs/benchmark.py search`: what each search costs to come within 1 % of a grid's best, in one run.

Three sweeps of one space (default ``lr_sweep``: stage classification's learning rate, text-encoder multiplier and
warm-up) on the same cohort, one after another on the same machine, each through
:func:`~gx_ray.sweep.driver.run_sweep`:

- **grid**: the space's ``sample`` section made a grid (``optimiser.lr`` at ``lrs`` log-spaced points, every
  categorical choice, each other sampled key at its range's middle), no scheduler: the reference.
- **ASHA + TPE**: the space itself (Optuna's TPE, ASHA stopping the weak early).
- **PBT**: the space's ``pbt`` preset (a random population, exploited and mutated every ``pbt.interval`` epochs).

Each trial reports its validation metric and its cost so far (``cpu_seconds`` or ``gpu_seconds``, the ledger of
:mod:`gx_ray.train.ledger`) every epoch. A search's timeline is its reports in the order their wall clock gives: at
each, the best validation so far and the device-hours spent so far (every trial's latest cost, summed). The figure
is the device-hours at the first report within ``within`` (relative) of the grid's best validation, beside the test
metric of the search's best-validated trial that was tested. Validation only decides; test is shown, never used.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.sweep.spaces import space_path
from gx_ray.tracking import child_runs

METHODS = ("grid", "asha_tpe", "pbt")


@dataclass(frozen=True)
class SearchBenchmarkConfig:
    space: str = "lr_sweep"
    lrs: int = 5
    """Grid points over ``optimiser.lr``'s range, log-spaced."""
    within: float = 0.01
    """How close to the grid's best validation counts as found (relative)."""
    presets: tuple[str, ...] = ()
    """Presets applied to all three (``smoke`` for a quick check)."""
    methods: tuple[str, ...] = METHODS
    cost: str = "cpu_seconds"
    """``cpu_seconds`` on CPUs, ``gpu_seconds`` where the space's trials take GPUs (``--preset gpu``)."""
    demo_cases: int = SweepOptions.demo_cases


def run_search_benchmark(out: Path, config: SearchBenchmarkConfig = SearchBenchmarkConfig()) -> dict[str, Any]:
    out = Path(out)
    shutil.rmtree(out / "sweeps", ignore_errors=True)  # an earlier run's: scratch, and its ids would be refused
    out.mkdir(parents=True, exist_ok=True)
    spaces = {"grid": (grid_space(out, config), ()), "asha_tpe": (config.space, ()), "pbt": (config.space, ("pbt",))}
    result: dict[str, Any] = {"config": asdict(config), "methods": {}}
    for method in config.methods:
        space, extra = spaces[method]
        options = SweepOptions(
            str(space), out / "sweeps" / method, presets=(*config.presets, *extra), demo_cases=config.demo_cases
        )
        sweep = run_sweep(options)
        result["methods"][method] = method_figures(MlflowClient(sweep.store_uri), sweep.parent_run_id, config.cost)
        result["methods"][method]["wall_seconds"] = sweep.timings.get("tune_seconds", math.nan)
    grid = result["methods"].get("grid", {})
    if grid:
        target = grid["best_val"] - config.within * abs(grid["best_val"])
        for figures in result["methods"].values():
            figures["hours_to_target"] = hours_to(figures["timeline"], target)
            figures["epochs_to_target"] = epochs_to(figures["timeline"], target)
        result["target_val"] = target
    (out / "search_benchmark.json").write_text(json.dumps(result, indent=1, default=float) + "\n", encoding="utf-8")
    return result


def grid_space(out: Path, config: SearchBenchmarkConfig) -> Path:
    """The space's ``sample`` section as a grid: the reference a search is measured against."""
    document = yaml.safe_load(space_path(config.space).read_text(encoding="utf-8"))
    grid = dict(document.get("grid") or {})
    fixed = dict(document.get("fixed") or {})
    for key, spec in (document.pop("sample", None) or {}).items():
        if spec["type"] == "categorical":
            grid[key] = list(spec["choices"])
        elif spec["type"] == "loguniform" and key == "optimiser.lr":
            grid[key] = [float(f"{v:.3g}") for v in np.geomspace(float(spec["low"]), float(spec["high"]), config.lrs)]
        elif spec["type"] == "loguniform":
            fixed[key] = float(np.sqrt(float(spec["low"]) * float(spec["high"])))
        else:
            middle = (float(spec["low"]) + float(spec["high"])) / 2
            fixed[key] = round(middle) if spec["type"] == "int" else middle
    document.update(grid=grid, fixed=fixed, searcher="grid", scheduler="none", budget={"samples": 1})
    for preset in (document.get("presets") or {}).values():  # a preset's search settings are not the grid's
        for key in ("searcher", "scheduler", "sample", "budget", "pbt", "bohb"):
            preset.pop(key, None)
    document["description"] = f"{config.space}'s sample section as a grid (the search benchmark's reference)"
    path = out / f"{config.space}_grid.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


def method_figures(client: MlflowClient, parent: str, cost: str) -> dict[str, Any]:
    """One search's trials: its timeline of reports, its best validation, that trial's test metric, its cost."""
    runs = child_runs(client, parent)
    reports = []
    for run in runs:
        vals = {m.step: m for m in client.get_metric_history(run.info.run_id, "val_primary")}
        costs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, cost)}
        for step, val in vals.items():
            if step in costs and math.isfinite(val.value):  # NaN is never scored
                reports.append({"trial": run.info.run_id, "at": val.timestamp, "val": val.value, "cost": costs[step]})
    tested = [r for r in runs if math.isfinite(r.data.metrics.get("test_primary", math.nan))]
    best = max(tested, key=lambda r: r.data.metrics.get("best_val_primary", math.nan), default=None)
    spent = sum(max((r["cost"] for r in reports if r["trial"] == run.info.run_id), default=0.0) for run in runs)
    line = timeline(reports)
    return {
        "trials": len(runs),
        "epochs": len(reports),
        "hours": spent / 3600,
        "best_val": max((r["val"] for r in reports), default=math.nan),
        "test_of_best_tested": best.data.metrics["test_primary"] if best else math.nan,
        "timeline": line,
    }


def timeline(reports: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """``(hours spent so far, best validation so far, epochs trained so far)`` at each report in wall-clock order:
    every trial's latest reported cost, summed. Epochs do not depend on how loaded the machine was; hours do."""
    latest: dict[str, float] = {}
    best, line = -math.inf, []
    for epochs, report in enumerate(sorted(reports, key=lambda r: r["at"]), start=1):
        latest[report["trial"]] = max(latest.get(report["trial"], 0.0), report["cost"])
        best = max(best, report["val"])
        line.append((sum(latest.values()) / 3600, best, epochs))
    return line


def hours_to(line: list[tuple[float, float, int]], target: float) -> float:
    """The hours spent at the first report whose best so far reaches ``target``; NaN where none does."""
    return next((hours for hours, best, _ in line if best >= target), math.nan)


def epochs_to(line: list[tuple[float, float, int]], target: float) -> float:
    """The epochs trained (every trial's) at the first report whose best so far reaches ``target``; NaN where none."""
    return next((float(epochs) for _, best, epochs in line if best >= target), math.nan)


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The run's figures without the timelines (those stay in ``search_benchmark.json``)."""
    methods = {m: {k: v for k, v in f.items() if k != "timeline"} for m, f in result["methods"].items()}
    return {**result, "methods": methods}


def format_search_result(result: dict[str, Any]) -> str:
    config, methods = result["config"], result["methods"]
    unit = "GPU-h" if config["cost"] == "gpu_seconds" else "CPU-h"
    lines = [
        f"search benchmark on {config['space']}{' +' + '+'.join(config['presets']) if config['presets'] else ''}: "
        f"device-hours to come within {config['within']:.0%} of the grid's best validation "
        f"({result.get('target_val', math.nan):.2f} or better)",
        f"{'search':<10}{'trials':>7}{'epochs':>7}{unit + ' in all':>13}{'to target: ' + unit:>18}{'epochs':>7}"
        f"{'best val':>10}{'its test':>10}{'wall s':>8}",
    ]
    for method, f in methods.items():
        lines.append(
            f"{method:<10}{f['trials']:>7}{f['epochs']:>7}{f['hours']:>13.3f}"
            f"{f.get('hours_to_target', math.nan):>18.3f}{f.get('epochs_to_target', math.nan):>7.0f}"
            f"{f['best_val']:>10.2f}{f['test_of_best_tested']:>10.2f}{f['wall_seconds']:>8.0f}"
        )
    return "\n".join(lines)
