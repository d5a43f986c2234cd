"""From a sweep's answer to a registered model, in steps: choose the configuration (:func:`chosen_configuration`),
make its final model (:func:`final_model`), test it once on the held-out patients, and register it in MLflow's model
registry as ``gx-ray-<task>@champion`` (docs/how-to/finalize-and-predict.md).

**The choice** uses validation scores only: the task's finished trials grouped into configurations (everything but
the seed and the fold), each scored by its mean best validation score over seeds (a cross-validated sweep: over seeds
of the mean over folds); configurations within :data:`TIE` points of the best are a tie that goes to the smaller mean
trial time, or (``select: one_se``) the cheapest within one standard error of the best. Beside it, the naive best
validation score and its selection-corrected estimate (:func:`~gx_ray.analysis.selection.selection_corrected` over
every configuration's validation predictions). **The final model** is, by default, nnU-Net's: a cross-validated
sweep's fold models of the chosen configuration's first seed as an ensemble (the weights each tested); a single-split
sweep's configuration trained again on the training and validation patients (``data.refit``) for the epochs its seeds
validated best at (``select: best`` or ``one_se``) or its full schedule (``last``); ``refit=True`` refits a
cross-validated sweep's too. **The test** scores the final model's test predictions with the task's metrics and a
patient bootstrap (:func:`score_records`), as ``predict`` scores a new cohort. **The card**
(:mod:`~gx_ray.deploy.card`) is the registered version's description.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from mlflow.tracking import MlflowClient

from gx_ray import storage
from gx_ray.analysis.cases import case_scorer
from gx_ray.analysis.report import SweepStore, cohort_of, open_sweep
from gx_ray.analysis.runs import higher_is_better, load_runs, test_records
from gx_ray.analysis.selection import (
    SelectionEstimate,
    describe,
    one_standard_error,
    selection_estimate,
    shared_settings,
)
from gx_ray.analysis.study import Resampling, two_level_bootstrap
from gx_ray.data.prepare import QC_JSON
from gx_ray.data.shards import MANIFEST_FILE, read_manifest
from gx_ray.data.splits import SPLIT_FILE
from gx_ray.data.stream import split_rows
from gx_ray.deploy.bundle import (
    Member,
    check_predictable,
    config_from_flat,
    fingerprint_ranges,
    learnt_state,
    save_bundle,
)
from gx_ray.deploy.card import answers_given, degenerate, fitted, model_card, one_se_sentence
from gx_ray.tasks import build_task, task_of
from gx_ray.tracking import TrialTracker, log_metrics, log_params
from gx_ray.train.build import build_trial
from gx_ray.train.config import TrialConfig
from gx_ray.train.folds import FOLD_FOLDER
from gx_ray.train.loop import CHECKPOINT_FILE, WorkerContext, run_loop

TIE = 0.05
"""Validation means closer than this (in the metric's points) are a tie, broken by cost."""
NOT_A_SETTING = ("seed", "data.fold", "data.folds_file", "data.shards")
"""Trial params that do not make another configuration: the seed and the fold are repeats of one."""
FINALIZE_KIND = "finalize"
SELECT = ("best", "last", "one_se")
"""``best``/``last``: a refit's epochs (those its seeds validated best at, or its whole schedule); ``one_se``: the
one-standard-error rule's configuration, with ``best``'s epochs."""
PARAM_SHOWN = 250
"""A chosen setting longer than this is cut in the run's params (whole in its ``choice.json``): params stay readable."""
RUN_NOTE_LIMIT = 8000
"""A run tag's limit (the card as the finalize run's description, ``mlflow.note.content``)."""


@dataclass(frozen=True)
class FinalizeOptions:
    sweep: str
    """The sweep's output folder (or its id, with ``mlflow_uri``)."""
    task: str
    schema: str | None = None
    """Choose among this schema's configurations only (default: every schema the task ran with)."""
    select: str = "best"
    """One of :data:`SELECT`."""
    refit: bool | None = None
    """Train one model on training + validation patients; None: a cross-validated sweep keeps its fold models."""
    mlflow_uri: str | None = None
    name: str | None = None
    """The registered model's name; default ``gx-ray-<task>``."""
    alias: str = "champion"
    n_resamples: int = 1000


@dataclass
class FinalizeResult:
    model_uri: str
    """``models:/gx-ray-<task>@champion``."""
    version: str
    run_id: str
    """The finalize run: it holds the model, its test predictions and its card."""
    bundle: Path
    """A copy of the model's files under the sweep's output folder (``finalized/<task>/model``)."""
    choice: dict[str, Any]
    test: dict[str, Any]
    seconds: float
    predict: str
    """The predict command for a new cohort, naming the MLflow store that holds the model (:func:`predict_command`)."""

    def summary(self) -> str:
        test, choice = self.test, self.choice
        interval = f" [{test['low']:.1f}, {test['high']:.1f}]" if test.get("low") is not None else ""
        chance = f" (chance {test['chance']:.1f})" if test.get("chance") is not None else ""
        lines = [
            f"{choice['label']}: {choice['description']}",
            f"  chosen by validation {choice['metric']} {choice['score']:.1f} (n = {choice['repeats']}); "
            f"test {test['metric']} {test['value']:.1f}{interval}{chance} on {test['cases']} patients",
        ]
        if one_se := choice.get("one_se"):
            lines.append(f"  {one_se_sentence(one_se)}")
        if selection := choice.get("selection"):
            lines.append(f"  {selection_line(selection)}")
        lines += [f"  WARNING: {said}" for said in degenerate(test)]
        lines += [
            f"  registered {self.model_uri} (version {self.version}) in {self.seconds:.0f} s; files: {self.bundle}",
            f"  predict with: {self.predict}",
        ]
        return "\n".join(lines)


def selection_line(selection: dict[str, Any]) -> str:
    """The naive best validation score beside its selection-corrected estimate, in a line (or why there is none)."""
    if "corrected" not in selection:
        return selection.get("note", "no selection-corrected estimate")
    same = selection["indistinguishable"]
    # BBC-CV's naive score is of the pooled out-of-fold predictions: not the folds' mean the choice above reads
    pooled = " (pooled out-of-fold)" if selection["method"] == "bbc-cv" else ""
    return (
        f"selection: naive best validation{pooled} {selection['naive']:.1f}, corrected {selection['corrected']:.1f} "
        f"[{selection['low']:.1f}, {selection['high']:.1f}] ({selection['method']}, {selection['configurations']} "
        f"configurations, {selection['patients']} patients); indistinguishable from the best: {len(same)} "
        f"({'; '.join(same[:5])}{' ...' if len(same) > 5 else ''})"
    )


# --- the choice -------------------------------------------------------------------------------------------------


def candidate_table(client: MlflowClient, uri: str, sweep_id: str, task: str, schema: str | None) -> pd.DataFrame:
    """One row per finished trial of ``task``: its configuration key, seed, fold, validation score and trial time."""
    runs = load_runs(uri, sweep_id)
    chosen = runs[(runs["status"] == "FINISHED") & (runs["split"] == "val")]
    chosen = chosen[chosen["task"].map(lambda label: label == task or (label and task_of(label) == task))]
    if schema:
        chosen = chosen[chosen["schema"] == schema]
    if chosen.empty:
        where = f" with schema {schema}" if schema else ""
        tasks = sorted({t for t in runs["task"].dropna()})
        raise ValueError(f"no finished {task} trials{where} in sweep {sweep_id}; its tasks: {', '.join(tasks)}")
    labels = sorted(set(chosen["task"]))
    if len(labels) > 1:
        raise ValueError(f"{task} ran as several questions ({', '.join(labels)}): name one with --task")
    rows = []
    for row in chosen.itertuples():
        run = client.get_run(row.run_id)
        params = {k: v for k, v in run.data.params.items() if k not in NOT_A_SETTING}
        fold = None if row.fold is None or (isinstance(row.fold, float) and math.isnan(row.fold)) else int(row.fold)
        rows.append({
            "run_id": row.run_id, "trial": run.data.tags.get("gx_ray.trial", row.trial), "label": row.task,
            "schema": row.schema, "seed": row.seed, "fold": fold, "metric": row.metric, "val": row.value,
            "seconds": run.data.metrics.get("trial_seconds", math.nan),
            "best_epoch": run.data.metrics.get("best_epoch", math.nan),
            "key": json.dumps({**params, "schema": row.schema}, sort_keys=True),
        })  # fmt: skip
    return pd.DataFrame(rows)


def choose(candidates: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The configurations ranked (best first: mean validation score over seeds, ties by cost) and the chosen one's
    trials. A seed's score under cross-validation is its folds' mean."""
    metric = candidates["metric"].iloc[0]
    sign = 1.0 if higher_is_better(metric) else -1.0
    per_seed = candidates.groupby(["key", "seed"], dropna=False).agg(val=("val", "mean"), folds=("fold", "count"))
    per_seed = per_seed.reset_index()
    configs = per_seed.groupby("key").agg(score=("val", "mean"), sd=("val", "std"), repeats=("val", "count"))
    configs["seconds"] = candidates.groupby("key")["seconds"].mean()
    configs["folds"] = per_seed.groupby("key")["folds"].max()
    configs = configs.dropna(subset=["score"]).reset_index()
    if configs.empty:
        raise ValueError(f"no configuration has a validation {metric}: every trial's score was undefined (NaN)")
    best = configs["score"].max() if sign > 0 else configs["score"].min()
    configs["tied"] = (configs["score"] - best).abs() <= TIE
    cost = configs["seconds"].where(configs["tied"], 0.0)  # within the tie cost decides, outside it the score
    configs = configs.assign(cost=cost).sort_values(["tied", "cost", "score"], ascending=[False, True, sign < 0])
    chosen = candidates[candidates["key"] == configs["key"].iloc[0]]
    return configs.reset_index(drop=True), chosen


def one_se_choice(
    configs: pd.DataFrame, metric: str, estimate: SelectionEstimate | None, note: str = ""
) -> tuple[int, dict[str, Any]]:
    """The row of ``configs`` the one-standard-error rule chooses (:func:`one_standard_error`, costs: mean trial
    seconds) and why. The standard error: across seeds where a configuration has two or more, else its bootstrap one
    over the validation patients (``estimate``)."""
    higher = higher_is_better(metric)
    scores, repeats = configs["score"].to_numpy(float), configs["repeats"].to_numpy()
    boot = np.asarray(estimate.standard_errors, dtype=float) if estimate else np.full(len(configs), np.nan)
    errors = np.where(repeats >= 2, configs["sd"].to_numpy(float) / np.sqrt(np.maximum(repeats, 1)), boot)
    best = int(np.nanargmax(scores) if higher else np.nanargmin(scores))
    if not math.isfinite(errors[best]):
        why = note.removeprefix("no selection-corrected estimate: ") or "its bootstrap one is undefined"
        raise ValueError(f"--select one_se needs the best configuration's standard error: it ran one seed, and {why}")
    costs = configs["seconds"].fillna(math.inf).to_numpy(float)
    index = one_standard_error(scores, errors, costs, higher_is_better=higher)
    shared = shared_settings(configs["key"])
    se_from = (f"across its {repeats[best]} seeds" if repeats[best] >= 2
               else f"bootstrap over {estimate.patients} validation patients")  # fmt: skip
    return index, {
        "chosen": describe(configs["key"].iloc[index], shared), "score": float(scores[index]),
        "seconds": float(costs[index]), "best": describe(configs["key"].iloc[best], shared),
        "best_score": float(scores[best]), "best_seconds": float(costs[best]), "se": float(errors[best]),
        "se_from": se_from,
    }  # fmt: skip


# --- the final model ---------------------------------------------------------------------------------------------


def trial_config(client: MlflowClient, run_id: str) -> TrialConfig:
    """The trial's whole config as it ran (its ``config.json`` artifact)."""
    with tempfile.TemporaryDirectory() as folder:
        path = client.download_artifacts(run_id, "config.json", folder)
        return config_from_flat(json.loads(Path(path).read_text(encoding="utf-8")))


def tested_weights(state_root: str, sweep_id: str, trial: str, fold: int | None = None) -> dict[str, torch.Tensor]:
    """The weights trial ``trial`` (its counter, the run's ``gx_ray.trial`` tag) tested: its last checkpoint's model
    (Tune keeps the latest checkpoint whatever its score); of a trial that trained its folds side by side
    (:mod:`gx_ray.train.folds`), fold ``fold``'s."""
    folder = storage.join(state_root, sweep_id)
    trials = [name for name in storage.listdir(folder) if name.split("-", 1)[0] == trial]
    if len(trials) != 1:
        raise FileNotFoundError(f"trial {trial}'s checkpoints are not under {folder} (found {trials})")
    trial_folder = storage.join(folder, trials[0])
    checkpoints = sorted(n for n in storage.listdir(trial_folder) if n.startswith("checkpoint_"))
    inner = FOLD_FOLDER.format(fold)  # a fold group's checkpoint holds a folder a fold
    if fold is not None and checkpoints and inner in storage.listdir(storage.join(trial_folder, checkpoints[-1])):
        checkpoints = [storage.join(name, inner) for name in checkpoints]
    for name in reversed(checkpoints):
        metrics = json.loads(storage.read_text(storage.join(trial_folder, name, "metrics.json")))
        if "test_primary" in metrics:  # the final epoch's: the model as tested
            data = io.BytesIO(storage.read_bytes(storage.join(trial_folder, name, CHECKPOINT_FILE)))
            return torch.load(data, map_location="cpu", weights_only=True)["model"]
    raise FileNotFoundError(f"trial {trial} has no final checkpoint under {trial_folder}: did it finish?")


def member_of(config: TrialConfig, weights: dict[str, torch.Tensor], source: dict[str, Any]) -> Member:
    """A member whose task learnt from its own training rows (its fold's, or training + validation for a refit)."""
    task, model, _ = build_trial(config, torch.device("cpu"))
    model.load_state_dict(weights)  # the weights fit the config they came with: strict
    return Member(config, weights, learnt_state(task), source)


def refit(config: TrialConfig, tracking_uri: str, run_id: str) -> tuple[Member, dict[str, float]]:
    """Train ``config`` (a refit) in this process, logging to ``run_id``; the trained member and its final metrics."""
    kept: dict[str, Any] = {}

    def report(metrics: dict[str, Any], checkpoint: Any = None) -> None:
        if checkpoint is not None and "test_primary" in metrics:
            with checkpoint.as_directory() as folder:
                state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
                kept["weights"] = state["model"]

    device = torch.device("cuda" if config.resources.use_gpu and torch.cuda.is_available() else "cpu")
    tracker = TrialTracker(tracking_uri, run_id)
    metrics = run_loop(config, WorkerContext(rank=0, world_size=1, device=device, report=report,
                                             latest_checkpoint=None, tracker=tracker))  # fmt: skip
    return member_of(config, kept["weights"], {"run_id": run_id, "seed": config.seed, "fold": None}), metrics


def refit_config(config: TrialConfig, select: str, best_epochs: list[float]) -> TrialConfig:
    """The chosen config trained on training + validation patients: for as many epochs as its repeats validated best
    at (median, ``select: best``) or its whole schedule (``last``); the last epoch's weights either way."""
    epochs = config.schedule.epochs
    if select == "best":
        known = [e for e in best_epochs if math.isfinite(e)]
        epochs = max(1, math.ceil(statistics.median(known) + 1)) if known else epochs
    data = dataclasses.replace(config.data, refit=True, fold=None, folds_file="")
    schedule = dataclasses.replace(config.schedule, epochs=epochs, select="last")
    return dataclasses.replace(config, data=data, schedule=schedule)


# --- the test -----------------------------------------------------------------------------------------------------


def score_records(
    task: str, records: list[dict[str, Any]], metric: str, n_resamples: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """``metric`` on ``records`` with the report's 95 % percentile bootstrap over patients (its per-case scorer and
    :func:`~gx_ray.analysis.study.two_level_bootstrap` for one model); no interval where the task has no scorer."""
    scorer = case_scorer(task_of(task), records, metric)
    if scorer is None:
        return {"metric": metric, "value": math.nan, "low": None, "high": None, "cases": len(records)}
    n = len(scorer.case_ids)
    value = scorer.score(np.arange(n))
    if n < 2 or not math.isfinite(value):  # nothing to resample: too few patients, or undefined (one class's AUC)
        return {"metric": metric, "value": float(value), "low": math.nan, "high": math.nan, "cases": n, "resamples": 0}
    options = Resampling(n_resamples=n_resamples, seed=seed, seed_level="none")
    boot = two_level_bootstrap([scorer.score], None, n, options=options)
    return {"metric": metric, "value": float(value), "low": float(boot.ci_low), "high": float(boot.ci_high),
            "cases": n, "resamples": int(boot.n_resamples)}  # fmt: skip


def tested(client: MlflowClient, chosen: Chosen, records: list[dict[str, Any]], runs: list[str],
           n_resamples: int) -> dict[str, Any]:  # fmt: skip
    """The final model's test: each metric the trials were tested with on ``records`` (the stored predictions, at
    full precision), the primary metric's chance level (the first of ``runs`` that logged ``test_chance``: the refit,
    else the members' trials) and the answers it gave (:func:`~gx_ray.deploy.card.answers_given`)."""
    metrics = _test_metrics(client, chosen.seed_trials["run_id"].iloc[0], chosen.metric)
    scores = {m: score_records(chosen.label, records, m, n_resamples) for m in metrics}
    # a metric the records cannot give (VQA's yes/no AUC is scored in the loop only) is left out, not "n/a"
    scores = {m: v for m, v in scores.items() if v["low"] is not None or m == chosen.metric}
    chances = (client.get_run(r).data.metrics.get("test_chance") for r in runs)
    chance = next((float(c) for c in chances if c is not None and math.isfinite(c)), None)
    return {**scores[chosen.metric], "metrics": scores, "chance": chance, "answers": answers_given(records)}


def log_choice(client: MlflowClient, run_id: str, choice: dict[str, Any]) -> None:
    """The chosen configuration as the finalize run's params (a long value cut, whole in ``choice.json``) and its
    selection-corrected estimate as its metrics."""
    cut = {k: v if len(v := str(value)) <= PARAM_SHOWN else v[: PARAM_SHOWN - 3] + "..."
           for k, value in choice["settings"].items()}  # fmt: skip
    log_params(client, run_id, {**cut, "finalize.select": choice["select"], "finalize.model": choice["final_model"]})
    client.log_dict(run_id, choice, "choice.json")
    selection = choice["selection"]
    if "corrected" in selection:
        figures = {f"selection_{k}": selection[k] for k in ("naive", "corrected", "low", "high", "configurations")}
        log_metrics(client, run_id, {**figures, "selection_indistinguishable": len(selection["indistinguishable"])}, 0)


# --- the whole route ------------------------------------------------------------------------------------------


def training_inputs(shards: str) -> dict[str, Any]:
    """What a new cohort must be prepared like (from the shards' manifest), and the training patients' fingerprint
    ranges (from the cohort's QC report beside the shards, where it is)."""
    manifest = read_manifest(shards)
    inputs = {k: manifest[k] for k in ("preprocess", "ct_shape", "endoscopy_shape", "lab_names")}
    ranges = None
    qc_path = storage.join(shards.rstrip("/").rsplit("/", 1)[0], QC_JSON)  # prepare_data writes it beside shards/
    if storage.exists(qc_path):
        cases = json.loads(storage.read_text(qc_path)).get("cases", {})
        split = json.loads(storage.read_text(storage.join(shards, SPLIT_FILE)))
        trained = set(split.get("train", [])) | set(split.get("val", []))
        by_patient = {r["case_id"]: r["patient_id"] for s in ("train", "val") for r in split_rows(shards, s)}
        ranges = fingerprint_ranges(
            {c: qc["fingerprint"] for c, qc in cases.items() if by_patient.get(c) in trained and "fingerprint" in qc}
        )
    return {"inputs": inputs, "training_fingerprint": ranges}


def cohort_info(shards: str, store: SweepStore) -> dict[str, Any]:
    """Which cohort trained the model: its name, whether it is the demo's synthetic one, the sweep's presets (the
    smoke preset's one short epoch), its patients per split, and the SHA-256 of its shard manifest (what every trial
    run's ``gx_ray.manifest_sha256`` tag names) and of its data fingerprint."""
    manifest = read_manifest(shards)
    split = json.loads(storage.read_text(storage.join(shards, SPLIT_FILE)))
    return {
        "name": store.cohort or cohort_of(manifest), "synthetic": bool(manifest.get("demo_cohort")),
        "presets": [p for p in store.parent.data.params.get("presets", "").split(",") if p],
        "patients": {s: len(split.get(s, [])) for s in ("train", "val", "test")},
        "manifest_sha256": hashlib.sha256(storage.read_bytes(storage.join(shards, MANIFEST_FILE))).hexdigest(),
        "fingerprint_sha256": (manifest.get("fingerprint") or {}).get("sha256", ""),
    }  # fmt: skip


def input_example(shards: str) -> pd.DataFrame | None:
    """One test patient of the training cohort as a manifest row with absolute paths (the registered model's input
    example: MLflow predicts on it as it logs the model); None where the raw cohort is no longer where it was."""
    from gx_ray.data.manifest import read_manifest_frame, write_manifest_for

    source = read_manifest(shards).get("source")
    if not source or not Path(source).exists():
        return None
    test = set(json.loads(storage.read_text(storage.join(shards, SPLIT_FILE))).get("test", []))
    with tempfile.TemporaryDirectory() as folder:
        frame, _ = read_manifest_frame(write_manifest_for(source, Path(folder) / "manifest.csv"))
        chosen = frame[frame["patient_id"].isin(test)].head(1) if "patient_id" in frame else frame.head(1)
        return chosen.map(lambda cell: _absolute(cell, Path(folder))).reset_index(drop=True)


def _absolute(cell: Any, folder: Path) -> Any:
    """A manifest cell that names a file relative to ``folder`` as an absolute path; any other cell as it is."""
    if not isinstance(cell, str) or not cell or "\n" in cell or len(cell) > 255:  # text, not a file name
        return cell
    try:
        return str((folder / cell).resolve()) if (folder / cell).exists() else cell
    except OSError:
        return cell


@dataclass(frozen=True)
class Chosen:
    """The configuration chosen by validation: its trials (every seed's), its first seed's in fold order (an
    ensemble's fold models), the first one's config as it ran, and whether the final model is a refit."""

    label: str
    metric: str
    trials: pd.DataFrame
    seed_trials: pd.DataFrame
    config: TrialConfig
    refitting: bool
    choice: dict[str, Any]


def finalize(options: FinalizeOptions) -> FinalizeResult:
    """Choose, make, test and register the final model of ``options.task`` (module docstring)."""
    started = time.perf_counter()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per small file is noise
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # the summary prints the model's URI
    if options.select not in SELECT:
        raise ValueError(f"--select is one of {', '.join(SELECT)}, got {options.select!r}")
    with open_sweep(options.sweep, options.mlflow_uri) as store:
        client = MlflowClient(store.uri)
        chosen = chosen_configuration(client, store, options)
        experiment = client.get_run(store.parent.info.run_id).info.experiment_id
        run = client.create_run(experiment, run_name=f"finalize {chosen.label}", tags={
            "gx_ray.kind": FINALIZE_KIND, "gx_ray.finalized_from": store.sweep_id, "task": chosen.config.task,
            "schema": chosen.config.schema.name, "gx_ray.primary_metric": chosen.metric,
        })  # fmt: skip
        run_id = run.info.run_id
        try:
            log_choice(client, run_id, chosen.choice)
            epochs = "last" if options.select == "last" else "best"  # one_se: the chosen configuration's best epochs
            members, records = final_model(client, store, chosen, epochs, run_id)
            test = tested(client, chosen, records, [run_id, *chosen.seed_trials["run_id"]], options.n_resamples)
            uri, version, bundle = _register(client, store, chosen, options, run_id, members, test)
            client.set_terminated(run_id, "FINISHED")
        except BaseException:
            client.set_terminated(run_id, "FAILED")
            raise
        command = predict_command(uri, store, options.mlflow_uri)
    seconds = time.perf_counter() - started
    return FinalizeResult(model_uri=uri, version=version, run_id=run_id, bundle=bundle, choice=chosen.choice, test=test,
                          seconds=seconds, predict=command)  # fmt: skip


def chosen_configuration(client: MlflowClient, store: SweepStore, options: FinalizeOptions) -> Chosen:
    """The task's configuration chosen by validation (:func:`choose`, or with ``select: one_se`` :func:`one_se_choice`)
    with its selection-corrected estimate, and whether its final model is a refit (a single-split sweep's always, a
    cross-validated one's with ``refit``); refused where it cannot predict."""
    candidates = candidate_table(client, store.uri, store.sweep_id, options.task, options.schema)
    configs, _ = choose(candidates)
    metric = candidates["metric"].iloc[0]
    records_of = functools.partial(test_records, store.uri, split="val")
    estimate, note = selection_estimate(records_of, candidates, list(configs["key"]), options.n_resamples)
    index, one_se = one_se_choice(configs, metric, estimate, note) if options.select == "one_se" else (0, None)
    trials = candidates[candidates["key"] == configs["key"].iloc[index]]
    label = trials["label"].iloc[0]
    seed_trials = trials[trials["seed"] == trials["seed"].min()].sort_values("fold", na_position="first")
    config = trial_config(client, seed_trials["run_id"].iloc[0])
    cross_validated = bool(seed_trials["fold"].notna().any())
    refitting = options.refit if options.refit is not None else not cross_validated
    check_predictable(config, ensemble=not refitting)
    choice = _choice(configs, index, label, metric, cross_validated, refitting, options.select)
    choice["one_se"] = one_se
    choice["selection"] = _selection_of(estimate, note, choice["ranked"])
    return Chosen(label=label, metric=metric, trials=trials, seed_trials=seed_trials, config=config,
                  refitting=refitting, choice=choice)  # fmt: skip


def final_model(client: MlflowClient, store: SweepStore, chosen: Chosen, select: str,
                run_id: str) -> tuple[list[Member], list[dict[str, Any]]]:  # fmt: skip
    """The final model's members and their test predictions: a refit trained here (logged to ``run_id``), or the
    first seed's fold models, whose test predictions combine as the task says."""
    config, seed_trials = chosen.config, chosen.seed_trials
    if chosen.refitting:
        final_config = refit_config(config, select, list(chosen.trials["best_epoch"]))
        client.log_dict(run_id, final_config.to_flat(), "config.json")
        member, _ = refit(final_config, store.uri, run_id)
        return [member], test_records(store.uri, run_id) or []
    if select == "last" and config.schedule.select != "last":
        raise ValueError(
            "the fold models were kept at their best epochs (schedule.select: best): --select last needs --refit"
        )
    document = json.loads((store.folder / "sweep.json").read_text(encoding="utf-8"))
    state_root = document.get("storage") or str(store.folder / "ray")  # where the sweep's Tune state is
    seed = int(seed_trials["seed"].iloc[0])
    members = [
        member_of(trial_config(client, t.run_id), tested_weights(state_root, store.sweep_id, t.trial, int(t.fold)),
                  {"run_id": t.run_id, "trial": t.trial, "seed": seed, "fold": int(t.fold)})
        for t in seed_trials.itertuples()
    ]  # fmt: skip
    # in case order: the fold models' test predictions line up case by case
    by_case = [sorted(test_records(store.uri, t.run_id) or [], key=lambda r: str(r["case_id"]))
               for t in seed_trials.itertuples()]  # fmt: skip
    records = build_task(config.task, **config.task_options).combine(by_case)
    client.log_dict(run_id, records, "predictions/test.json")
    return members, records


def _register(client: MlflowClient, store: SweepStore, chosen: Chosen, options: FinalizeOptions, run_id: str,
              members: list[Member], test: dict[str, Any]) -> tuple[str, str, Path]:  # fmt: skip
    """Save the model's files under the sweep's folder, log its card and register it: its URI, version and files."""
    import mlflow

    from gx_ray.deploy.pyfunc import log_pyfunc

    config, label = chosen.config, chosen.label
    cohort = cohort_info(config.data.shards, store)
    info = {
        "task": config.task, "label": label, "metric": chosen.metric, "sweep_id": store.sweep_id,
        "choice": chosen.choice, "test": test, "cohort": cohort, **training_inputs(config.data.shards),
    }  # fmt: skip
    bundle = save_bundle(store.folder / "finalized" / label / "model", members, info)
    card = model_card(chosen.choice, test, info, [m.source for m in members])
    client.log_text(run_id, card, "model_card.md")
    client.set_tag(run_id, "mlflow.note.content", fitted(card, RUN_NOTE_LIMIT))
    mlflow.set_tracking_uri(store.uri)
    name = options.name or f"gx-ray-{label}"
    version = log_pyfunc(client, run_id, bundle, name, fitted(card), options.alias, input_example(config.data.shards))
    tags = {"task": label, "schema": config.schema.name, "sweep": store.sweep_id, "cohort": cohort["name"],
            "cohort_fingerprint": cohort["fingerprint_sha256"] or cohort["manifest_sha256"],
            "cohort_manifest_sha256": cohort["manifest_sha256"], "select": options.select}  # fmt: skip
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    return f"models:/{name}@{options.alias}", version, bundle


def predict_command(model_uri: str, store: SweepStore, mlflow_uri: str | None) -> str:
    """``jobs/predict.py`` for the registered model: its registry is the sweep's own MLflow store (``--sweep``), served
    only while finalize ran, unless finalize was given a server or the sweep logged to one (``--mlflow-uri``)."""
    own = mlflow_uri is None and (store.folder / "mlflow" / "mlflow.db").exists()  # as open_sweep serves it
    where = ["--sweep", str(store.folder)] if own else ["--mlflow-uri", mlflow_uri or store.uri]
    return shlex.join(["python", "jobs/predict.py", "--model", model_uri, *where, "--data", "NEW_COHORT", "--out",
                       "outputs/predictions/NEW_COHORT"])  # fmt: skip


def _test_metrics(client: MlflowClient, run_id: str, primary: str) -> list[str]:
    """The metrics the trials scored the test split with (primary first): what the final model is tested with."""
    logged = client.get_run(run_id).data.metrics
    names = {k.removeprefix("test_") for k in logged if k.startswith("test_")} - {"primary", "chance", primary}
    return [primary, *sorted(names)]


def _choice(configs: pd.DataFrame, index: int, label: str, metric: str, cross_validated: bool, refitting: bool,
            select: str) -> dict[str, Any]:  # fmt: skip
    shared = shared_settings(configs["key"])
    ranked = [
        {"description": describe(row.key, shared), "score": float(row.score), "sd": float(row.sd),
         "repeats": int(row.repeats), "folds": int(row.folds), "seconds": float(row.seconds), "tied": bool(row.tied)}
        for row in configs.itertuples()
    ]  # fmt: skip
    rule = "mean validation score over seeds" + (" (each the mean over its folds)" if cross_validated else "")
    rule = f"one standard error of the best {rule}" if select == "one_se" else f"best {rule}; ties within {TIE} by time"
    return {
        "label": label, "metric": metric, "rule": rule,
        "description": ranked[index]["description"], "score": ranked[index]["score"],
        "repeats": ranked[index]["repeats"], "settings": json.loads(configs["key"].iloc[index]), "ranked": ranked,
        "final_model": "refitted on training + validation patients" if refitting else "the fold models' ensemble",
        "select": select, "cross_validated": cross_validated,
    }  # fmt: skip


def _selection_of(estimate: SelectionEstimate | None, note: str, ranked: list[dict[str, Any]]) -> dict[str, Any]:
    """The estimate as the choice holds it: configurations by their description, not their row."""
    if estimate is None:
        return {"note": note}
    return {**estimate.to_dict(), "chosen": ranked[estimate.chosen]["description"],
            "indistinguishable": [ranked[i]["description"] for i in estimate.indistinguishable]}  # fmt: skip
