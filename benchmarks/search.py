"""`python jobs/benchmark.py search`: each search measured against the truth, in one run.

Sweeps of one space (default ``lr_sweep``: stage classification's learning rate, text-encoder multiplier and warm-up)
on the same demo cohort, one after another on the same machine, each through :func:`~gx_ray.sweep.driver.run_sweep`:

- **grid**: the space's ``sample`` section made a grid (``optimiser.lr`` at ``lrs`` log-spaced points, every
  categorical choice, each other sampled key at its range's middle), no scheduler: the reference for cost;
- **random**: the space's samples drawn at random, no scheduler;
- **asha_tpe**: the space itself (Optuna's TPE, ASHA stopping the weak early);
- **bohb** and **pbt**: the space's ``bohb`` and ``pbt`` presets;

each once on the single split and, with ``folds``, once more with a cross-validated objective (the space given
``cv: {folds: k}``: a searcher's trial trains its k folds side by side; the grid gains the ``data.fold`` axis).

**The truth set**: :data:`TRUTH_SEED`'s demo patients (``truth_cases`` of them, the cohort's own generator and
preprocessing, a seed no sweep uses), prepared once after the sweeps and read only here. Every finished
configuration's model (its first seed's trial as it was tested; a cross-validated one's fold models as the ensemble
``finalize`` would register) predicts the truth set once: its **true score**.

Per search: the configuration ``finalize`` would choose (validation only) with its true score, its naive validation
score and its selection-corrected estimate with interval (:mod:`gx_ray.analysis.selection`), whether that interval
covers the true score; and the device-hours and epochs spent (every trial's latest cost, every fold's epochs) at the
first report where the configuration leading on validation so far has a true score within ``within`` (relative) of
the best true score any search found. The target: some search reaches it in at most half the grid's device-hours.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.analysis.report import open_sweep
from gx_ray.analysis.runs import higher_is_better
from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.prepare import PrepareConfig, prepare_data
from gx_ray.data.shards import MANIFEST_FILE, read_manifest, read_shard, split_files
from gx_ray.data.splits import SPLITS
from gx_ray.deploy.bundle import Member, Predictor, preprocess_of, save_bundle
from gx_ray.deploy.finalize import (
    NOT_A_SETTING,
    FinalizeOptions,
    candidate_table,
    chosen_configuration,
    member_of,
    score_records,
    tested_weights,
    training_inputs,
    trial_config,
)
from gx_ray.deploy.predict import ONE_SPLIT
from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.sweep.spaces import space_path
from gx_ray.tracking import child_runs

METHODS = ("grid", "random", "asha_tpe", "bohb", "pbt")
TRUTH_SEED = 20_181_107
"""The truth set's demo seed: no sweep, test or validation cohort draws from it (theirs is 0 or a small number)."""
SEARCH_KEYS = ("searcher", "scheduler", "sample", "budget", "pbt", "bohb")


@dataclass(frozen=True)
class SearchBenchmarkConfig:
    space: str = "lr_sweep"
    lrs: int = 5
    """Grid points over ``optimiser.lr``'s range, log-spaced."""
    within: float = 0.01
    """How close to the best true score counts as found (relative)."""
    presets: tuple[str, ...] = ()
    """Presets applied to every sweep (``smoke`` for a quick check)."""
    methods: tuple[str, ...] = METHODS
    cost: str = "cpu_seconds"
    """``cpu_seconds`` on CPUs, ``gpu_seconds`` where the space's trials take GPUs (``--preset gpu``)."""
    demo_cases: int = SweepOptions.demo_cases
    folds: int = 5
    """The cross-validated objective's folds; 0: single-split sweeps only."""
    epochs: int | None = None
    """Every trial's epochs where the space or a preset sets them (a smoke check's BOHB needs 3); None: as set."""
    samples: int | None = None
    """Every search's trials (not the grid's; BOHB's largest bracket needs as many as its reduction factor); None: the
    space's and presets' budgets."""
    truth_cases: int = 1000
    n_resamples: int = 1000
    """Bootstrap resamples of the selection-corrected estimate and of each true score's interval."""


def truth_demo(cases: int) -> DemoConfig:
    """The truth set: the demo cohort's generator and settings, :data:`TRUTH_SEED`'s patients."""
    return DemoConfig(cases=cases, seed=TRUTH_SEED)


def run_search_benchmark(out: Path, config: SearchBenchmarkConfig = SearchBenchmarkConfig()) -> dict[str, Any]:
    out = Path(out)
    shutil.rmtree(out / "sweeps", ignore_errors=True)  # an earlier run's: scratch, and its ids would be refused
    out.mkdir(parents=True, exist_ok=True)
    methods: dict[str, Any] = {}
    result: dict[str, Any] = {"config": asdict(config), "methods": methods}
    truth = ""
    for folds in (0, config.folds) if config.folds else (0,):
        for method in config.methods:
            name = f"{method}+cv{folds}" if folds else method
            path, extra = method_space(out, config, method, folds)
            options = SweepOptions(str(path), out / "sweeps" / name, presets=(*config.presets, *extra),
                                   demo_cases=config.demo_cases, demo_dir=out / "demo")  # fmt: skip
            sweep = run_sweep(options)
            truth = truth or prepare_truth(out, config)  # once the first sweep has prepared the cohort it copies
            methods[name] = evaluate_sweep(sweep, truth, config)  # between sweeps: no sweep's time carries it
            result.update(targets(methods, config.within))  # written after each sweep: a later failure keeps it
            text = json.dumps(result, indent=1, default=float) + "\n"
            (out / "search_benchmark.json").write_text(text, encoding="utf-8")
    return result


def method_space(out: Path, config: SearchBenchmarkConfig, method: str, folds: int) -> tuple[Path, tuple[str, ...]]:
    """The space file a search sweeps (written under ``out``) and the presets it adds."""
    document = yaml.safe_load(space_path(config.space).read_text(encoding="utf-8"))
    extra: tuple[str, ...] = ()
    if method == "grid":
        document = grid_document(document, config.lrs)
    elif method == "random":
        document.update(searcher="random", scheduler="none")
    elif method in ("bohb", "pbt"):
        extra = (method,)
    elif method != "asha_tpe":
        raise ValueError(f"unknown search {method!r}; valid: {', '.join(METHODS)}")
    if folds:
        document["cv"] = {"folds": folds}
    for part in (document, *(document.get("presets") or {}).values()):
        if config.epochs and "schedule.epochs" in (part.get("fixed") or {}):
            part["fixed"]["schedule.epochs"] = config.epochs
        if config.samples and method != "grid" and "budget" in part:
            part["budget"] = {**part["budget"], "samples": config.samples}
    document["description"] = f"{config.space} searched by {method} (the search benchmark's)"
    path = out / f"{config.space}_{method}{f'_cv{folds}' if folds else ''}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path, extra


def grid_document(document: dict[str, Any], lrs: int) -> dict[str, Any]:
    """The space's ``sample`` section as a grid: the reference a search's cost is measured against."""
    grid = dict(document.get("grid") or {})
    fixed = dict(document.get("fixed") or {})
    for key, spec in (document.pop("sample", None) or {}).items():
        if spec["type"] == "categorical":
            grid[key] = list(spec["choices"])
        elif spec["type"] == "loguniform" and key == "optimiser.lr":
            grid[key] = [float(f"{v:.3g}") for v in np.geomspace(float(spec["low"]), float(spec["high"]), lrs)]
        elif spec["type"] == "loguniform":
            fixed[key] = float(np.sqrt(float(spec["low"]) * float(spec["high"])))
        else:
            middle = (float(spec["low"]) + float(spec["high"])) / 2
            fixed[key] = round(middle) if spec["type"] == "int" else middle
    document.update(grid=grid, fixed=fixed, searcher="grid", scheduler="none", budget={"samples": 1})
    for preset in (document.get("presets") or {}).values():  # a preset's search settings are not the grid's
        for key in SEARCH_KEYS:
            preset.pop(key, None)
    return document


# --- the truth set ------------------------------------------------------------------------------------------------


def prepare_truth(out: Path, config: SearchBenchmarkConfig) -> str:
    """The truth set's shards, prepared (once) as the sweeps' demo cohort was: its preprocessing and frame size."""
    manifest = read_manifest(str(out / "demo" / "shards"))
    prepare = PrepareConfig(preprocess=preprocess_of({"inputs": manifest}),
                            endoscopy_size=int(manifest["endoscopy_shape"][-1]), fractions=ONE_SPLIT)  # fmt: skip
    folder, demo = out / "truth", truth_demo(config.truth_cases)
    stamp, wanted = folder / "truth.json", json.dumps([asdict(demo), asdict(prepare)], default=str, sort_keys=True)
    shards = folder / "shards"
    if not (stamp.is_file() and stamp.read_text(encoding="utf-8") == wanted and (shards / MANIFEST_FILE).is_file()):
        prepare_data("demo", folder, prepare, demo)
        stamp.write_text(wanted, encoding="utf-8")
    return str(shards)


def predicted(members: list[Member], truth: str) -> list[dict[str, Any]]:
    """The members' predictions (an ensemble's combined) for every truth patient, as ``predict`` makes them."""
    with tempfile.TemporaryDirectory(prefix="gx-truth-") as folder:
        inputs = training_inputs(members[0].config.data.shards)
        predictor = Predictor(save_bundle(Path(folder), members, inputs), "cpu")
        return [r for split in SPLITS for path in split_files(truth, split) for r in predictor.predict_table(
            read_shard(path))]  # fmt: skip


def truth_scores(client: MlflowClient, state_root: str, sweep_id: str, candidates: pd.DataFrame, truth: str,
                 n_resamples: int) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each finished configuration's true score, by each of its runs: its first seed's trials (fold models as an
    ensemble) on the truth set, with a patient bootstrap interval."""
    scores: dict[str, dict[str, Any]] = {}
    for _, trials in candidates.groupby("key"):
        first = trials[trials["seed"] == trials["seed"].min()].sort_values("fold", na_position="first")
        members = []
        for t in first.itertuples():
            fold = None if pd.isna(t.fold) else int(t.fold)
            weights = tested_weights(state_root, sweep_id, t.trial, fold)
            members.append(member_of(trial_config(client, t.run_id), weights, {"run_id": t.run_id, "fold": fold}))
        score = score_records(trials["label"].iloc[0], predicted(members, truth), trials["metric"].iloc[0], n_resamples)
        scores.update(dict.fromkeys(trials["run_id"], score))
    return scores


# --- one search's figures -------------------------------------------------------------------------------------------


def evaluate_sweep(sweep: Any, truth: str, config: SearchBenchmarkConfig) -> dict[str, Any]:
    """One search (a :class:`~gx_ray.sweep.driver.SweepResult`): its cost, its choice against the truth, its timeline
    of validation leaders with their true scores."""
    task = yaml.safe_load(space_path(config.space).read_text(encoding="utf-8"))["fixed"]["task"]
    with open_sweep(str(sweep.output)) as store:
        client = MlflowClient(store.uri)
        candidates = candidate_table(client, store.uri, store.sweep_id, task, None)
        document = json.loads((store.folder / "sweep.json").read_text(encoding="utf-8"))
        state_root = document.get("storage") or str(store.folder / "ray")
        truth_of = truth_scores(client, state_root, store.sweep_id, candidates, truth, config.n_resamples)
        chosen = chosen_configuration(client, store, FinalizeOptions(str(sweep.output), task,
                                                                     n_resamples=config.n_resamples))  # fmt: skip
        runs, reports = sweep_reports(client, store.parent.info.run_id, config.cost)
    higher = higher_is_better(candidates["metric"].iloc[0])
    by_config = {configuration_of(r): truth_of[r.info.run_id]["value"] for r in runs if r.info.run_id in truth_of}
    true = truth_of[chosen.seed_trials["run_id"].iloc[0]]
    selection = chosen.choice["selection"]
    return {
        "runs": len(runs), "configurations": len(by_config), "epochs": len(reports),
        "hours": sum(max((r["cost"] for r in reports if r["run"] == run.info.run_id), default=0.0)
                     for run in runs) / 3600,
        "wall_seconds": sweep.timings.get("tune_seconds", math.nan), "higher_is_better": higher,
        "chosen": chosen.choice["description"], "truth": true["value"], "truth_low": _number(true["low"]),
        "truth_high": _number(true["high"]), "best_truth": max((v for v in by_config.values() if math.isfinite(v)),
                                                   key=lambda v: v if higher else -v, default=math.nan),
        "naive": _number(selection.get("naive", chosen.choice["score"])),
        **{k: _number(selection.get(k)) for k in ("corrected", "low", "high")},
        "estimate": selection.get("method", selection.get("note", "")),
        "covers": covers(_number(selection.get("low")), _number(selection.get("high")), true["value"]),
        "timeline": timeline(reports, by_config, higher),
    }  # fmt: skip


def _number(value: Any) -> float:
    """A figure of the choice's JSON form (None there: undefined) as a float."""
    return math.nan if value is None else float(value)


def covers(low: float, high: float, value: float) -> bool | None:
    """Whether ``[low, high]`` holds ``value``; None where either is undefined."""
    if not all(isinstance(v, float | int) and math.isfinite(v) for v in (low, high, value)):
        return None
    return bool(low <= value <= high)


def configuration_of(run: Any) -> str:
    """A run's configuration: its params but the seed and the fold (a cross-validated trial's folds are one)."""
    return json.dumps({k: v for k, v in run.data.params.items() if k not in NOT_A_SETTING}, sort_keys=True)


def sweep_reports(client: MlflowClient, parent: str, cost: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """A sweep's runs and every epoch each reported: its configuration, run, epoch, time, validation score, cost."""
    runs = child_runs(client, parent)
    reports = []
    for run in runs:
        config, run_id = configuration_of(run), run.info.run_id
        vals = {m.step: m for m in client.get_metric_history(run_id, "val_primary")}
        costs = {m.step: m.value for m in client.get_metric_history(run_id, cost)}
        for step, val in vals.items():
            if step in costs and math.isfinite(val.value):  # NaN is never scored
                reports.append({"config": config, "run": run_id, "step": step, "at": val.timestamp, "val": val.value,
                                "cost": costs[step]})  # fmt: skip
    return runs, reports


def timeline(reports: list[dict[str, Any]], truth: dict[str, float],
             higher: bool = True) -> list[tuple[float, int, float, float]]:  # fmt: skip
    """``(hours spent so far, epochs trained so far, leader's validation, leader's true score)`` at each report in
    wall-clock order. Hours: every run's latest reported cost, summed; epochs: every run's (a fold's too). A
    configuration's validation at an epoch is the mean over its runs (folds, seeds) that reported that epoch, its
    score the best of those; the leader is the configuration with the best score so far, its true score NaN where it
    has none (it never finished)."""
    sign = 1.0 if higher else -1.0
    latest: dict[str, float] = {}
    seen: dict[str, dict[int, dict[str, float]]] = {}
    line = []
    for epochs, report in enumerate(sorted(reports, key=lambda r: r["at"]), start=1):
        latest[report["run"]] = max(latest.get(report["run"], 0.0), report["cost"])
        seen.setdefault(report["config"], {}).setdefault(report["step"], {})[report["run"]] = report["val"]
        scores = {c: max(sign * float(np.mean(list(at.values()))) for at in by_step.values())
                  for c, by_step in seen.items()}  # fmt: skip
        leader = max(scores, key=scores.__getitem__)
        line.append((sum(latest.values()) / 3600, epochs, sign * scores[leader], truth.get(leader, math.nan)))
    return line


def to_target(line: list[tuple[float, int, float, float]], target: float,
              higher: bool = True) -> tuple[float, float]:  # fmt: skip
    """The hours and epochs spent at the first report whose leader's true score reaches ``target``; NaN where none."""
    sign = 1.0 if higher else -1.0
    return next(((hours, float(epochs)) for hours, epochs, _, true in line if sign * true >= sign * target),
                (math.nan, math.nan))  # fmt: skip


def targets(methods: dict[str, dict[str, Any]], within: float) -> dict[str, Any]:
    """The best true score any search found, the target within ``within`` of it, each search's hours and epochs to
    it, and which searches met the benchmark's target (at most half the grid's device-hours, grid of the same
    objective) and whose corrected interval covered its choice's true score."""
    if not methods:
        return {}
    higher = next(iter(methods.values()))["higher_is_better"]
    best = (max if higher else min)(
        (f["best_truth"] for f in methods.values() if math.isfinite(f["best_truth"])), default=math.nan
    )  # a metric undefined on the truth set: no target
    target = best - within * abs(best) if higher else best + within * abs(best)
    met = []
    for name, figures in methods.items():
        figures["hours_to_target"], figures["epochs_to_target"] = to_target(figures["timeline"], target, higher)
        grid = methods.get("grid" + name.partition("+")[1] + name.partition("+")[2])
        figures["met"] = bool(grid and grid is not figures and figures["hours_to_target"] <= grid["hours"] / 2)
        met += [name] if figures["met"] else []
    return {"best_truth": best, "target_truth": target, "met_target": met,
            "all_covered": all(f["covers"] for f in methods.values())}  # fmt: skip


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The run's figures without the timelines (those stay in ``search_benchmark.json``)."""
    methods = {m: {k: v for k, v in f.items() if k != "timeline"} for m, f in result["methods"].items()}
    return {**result, "methods": methods}


def format_search_result(result: dict[str, Any]) -> str:
    config, methods = result["config"], result["methods"]
    unit = "GPU-h" if config["cost"] == "gpu_seconds" else "CPU-h"
    lines = [
        f"search benchmark on {config['space']}{' +' + '+'.join(config['presets']) if config['presets'] else ''}, "
        f"truth set of {config['truth_cases']} patients: best true score {result.get('best_truth', math.nan):.2f}; "
        f"device-hours to a leader within {config['within']:.0%} of it ({result.get('target_truth', math.nan):.2f})",
        f"{'search':<14}{'runs':>5}{'epochs':>7}{unit:>8}{'to target':>10}{'epochs':>7}{'chosen: true':>13}"
        f"{'naive':>7}{'corrected [95 %]':>22}{'covers':>7}{'wall s':>7}",
    ]
    for name, f in methods.items():
        interval = f"{f['corrected']:.1f} [{f['low']:.1f}, {f['high']:.1f}]"
        lines.append(
            f"{name:<14}{f['runs']:>5}{f['epochs']:>7}{f['hours']:>8.3f}{f.get('hours_to_target', math.nan):>10.3f}"
            f"{f.get('epochs_to_target', math.nan):>7.0f}{f['truth']:>13.2f}{f['naive']:>7.1f}{interval:>22}"
            f"{_covers(f['covers']):>7}{f['wall_seconds']:>7.0f}"
        )
    met = result.get("met_target") or []
    lines.append(f"target (within {config['within']:.0%} in at most half the grid's {unit}): "
                 f"{'met by ' + ', '.join(met) if met else 'met by none'}; every corrected interval covers its "
                 f"choice's true score: {'yes' if result.get('all_covered') else 'no'}")  # fmt: skip
    return "\n".join(lines)


def _covers(value: bool | None) -> str:
    return "n/a" if value is None else "yes" if value else "NO"
