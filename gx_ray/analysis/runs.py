"""The tidy table of a sweep's runs: one row per (trial, split, metric), the contract of :mod:`gx_ray.analysis`.

Columns (:data:`RUN_COLUMNS`): ``sweep_id``, ``run_id``, ``trial`` (name), ``status`` (MLflow's), ``stopped_early``
(ended by the scheduler before its last epoch: validation values, no test values), ``start_time`` (ms since the
epoch), ``task``, ``schema``, ``model`` (e.g. ``swin3d+minilm``; ``vlm:<vlm.name>``, fusion ``vlm``, for a VLM),
``vision``, ``text``, ``fusion``, ``seed``, ``fold`` (validated on; None without cross-validation), ``inputs`` (the
schema's inputs in words: :func:`inputs_of`), ``split`` (``val``: the best epoch's; ``test``: the best checkpoint's),
``metric`` (e.g. ``auc``) and ``value`` (NaN where undefined on the split), then one column per searched parameter,
named by its flat config key (``optimiser.lr``) and listed in ``table.attrs["searched"]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gx_ray.tracking import SWEEP_TAG, TRIAL_TAG

RUN_COLUMNS = (
    "sweep_id",
    "run_id",
    "trial",
    "status",
    "stopped_early",
    "start_time",
    "task",
    "schema",
    "model",
    "vision",
    "text",
    "fusion",
    "seed",
    "fold",
    "inputs",
    "split",
    "metric",
    "value",
)
LOWER_IS_BETTER_SUFFIXES = ("median_rank", "mean_rank")


def inputs_of(params: dict[str, Any]) -> str:
    """A run's model inputs in words, from its ``schema.*`` params: a schema's name says which inputs, this says in
    what form (the demo gives the table as numbers where the paper gives text, say)."""
    phases = _listed(params.get("schema.phases"))
    parts = [f"CT ({len(phases)} phase{'' if len(phases) == 1 else 's'})"]
    if str(params.get("schema.endoscopy")) == "True":
        parts.append("endoscopy image")
    if params.get("schema.table") in ("numeric", "text"):
        parts.append(f"lab table as {'numbers' if params['schema.table'] == 'numeric' else 'text'}")
    if params.get("schema.boxes") in ("channels", "overlay"):
        form = "mask channels" if params["schema.boxes"] == "channels" else "outlines drawn into the CT"
        levels = ", ".join(level.replace("_", " ") for level in _listed(params.get("schema.box_levels")))
        parts.append(f"boxes as {form} ({levels})")
    if reports := _listed(params.get("schema.reports")):
        parts.append("reports: " + ", ".join(reports))
    return ", ".join(parts)


def _listed(value: Any) -> list:
    """A list-valued param as MLflow keeps it (JSON text) or as given."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return [value]
    return list(value or [])


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is better: every metric but the retrieval ranks (MedR, MnR) and those a
    plug-in task scores lower-is-better (its ``min`` primary metric, its ``lower_is_better``: an error in mL), known
    once this process has resolved the task, as :func:`load_runs` does for every task it reads."""
    if metric.endswith(LOWER_IS_BETTER_SUFFIXES):
        return False
    tasks = sys.modules.get("gx_ray.tasks")  # no plug-in was resolved where the tasks were never imported (no torch)
    return tasks is None or metric not in tasks.lower_is_better_metrics()


def headline_metric(task: str) -> str:
    """The task's primary metric (the one sweeps optimise), e.g. ``auc`` for stage classification."""
    from gx_ray.tasks import primary_metric

    return primary_metric(task)


def _task_label(task: str | None, params: dict[str, Any]) -> str | None:
    """The run's task as its cells know it: with lesion QA's family and distractors (never pooled); a plug-in's by
    its ``name`` (its tag holds the reference it was run by, which this resolves and so registers)."""
    from gx_ray.tasks import task_label

    options = {k.removeprefix("task_options."): v for k, v in params.items() if k.startswith("task_options.")}
    return task_label(task, options) if task else task


def lesion_qa_cells(cells: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """The lesion QA rows of a cells table for ``metric``, with the options their task label holds as columns
    (``family``, ``distractors``) and ``question``: the label without the task (``img2txt.matched``)."""
    from gx_ray.tasks import label_options, task_of

    qa = cells[(cells["task"].astype(str).map(task_of) == "lesion_qa") & (cells["metric"] == metric)].copy()
    options = pd.DataFrame([label_options(t) for t in qa["task"]], index=qa.index, columns=["family", "distractors"])
    qa["question"] = qa["task"].astype(str).str.removeprefix("lesion_qa.")
    return qa.join(options)


def _parse(value: str) -> Any:
    """An MLflow param (always a string) back to the number or None it was; anything else stays a string."""
    if value == "None":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


NOT_SEARCHED = ("task", "seed", "schema", "schema.name", "data.shards", "data.fold", "data.folds_file")
"""Config keys that are the ablation's axes (or where the data lives), never "searched parameters"."""


def child_runs(client: MlflowClient, sweep_id: str) -> list[Run]:
    """Every trial run of the sweep (not its parent), all pages."""
    experiment_ids = [e.experiment_id for e in client.search_experiments()]
    query = f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{TRIAL_TAG}` != ''"
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=query, max_results=1000, page_token=token)
        runs += [r for r in page if TRIAL_TAG in r.data.tags]
        token = page.token
        if not token:
            return sorted(runs, key=lambda r: r.info.start_time or 0)


def sweep_parent(tracking_uri: str, sweep_id: str) -> Run | None:
    """The sweep's parent run (its params: the space's fixed values, grid axes and ``analysis``); None where none."""
    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(experiments, f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`gx_ray.kind` = 'sweep'")
    return parents[0] if parents else None


def space_analysis(tracking_uri: str, parent_run_id: str | None, key: str) -> Any:
    """The space's ``analysis.<key>`` (:data:`gx_ray.sweep.spaces.ANALYSIS_KEYS`), as the sweep's parent run keeps it;
    None where it has none."""
    if not parent_run_id:
        return None
    value = MlflowClient(tracking_uri).get_run(parent_run_id).data.params.get(f"analysis.{key}")
    return json.loads(value) if value else None


def load_runs(tracking_uri: str, sweep_id: str) -> pd.DataFrame:
    """The sweep's trial runs as the tidy table of this module's docstring (empty, with the columns, if none): ``test``
    rows for every ``test_*`` metric logged, ``val`` rows for the headline metric at the best epoch."""
    runs = child_runs(MlflowClient(tracking_uri), sweep_id)
    params = [{k: _parse(v) for k, v in r.data.params.items()} for r in runs]
    searched = _searched(runs, params)
    rows = []
    for run, param in zip(runs, params, strict=True):
        tags, metrics = run.data.tags, run.data.metrics
        vision, text, fusion = param.get("model.vision"), param.get("model.text"), param.get("model.fusion")
        model = f"{vision}+{text}"
        if param.get("model.family") == "vlm":  # one model, named by its hub name or folder; no encoder parts
            vision, text, fusion = param.get("vlm.name"), None, "vlm"
            model = f"vlm:{vision}"
        base = {
            "sweep_id": sweep_id,
            "run_id": run.info.run_id,
            "trial": run.info.run_name,
            "status": run.info.status,
            "stopped_early": tags.get("gx_ray.stopped_early") == "true",
            "start_time": run.info.start_time,
            "task": _task_label(tags.get("task"), param),
            "schema": tags.get("schema"),
            "model": model,
            "vision": vision,
            "text": text,
            "fusion": fusion,
            "seed": int(tags.get("seed", param.get("seed", 0))),
            "fold": param.get("data.fold"),
            "inputs": inputs_of(param),
            **{key: param.get(key) for key in searched},
        }
        for name, value in metrics.items():
            if name.startswith("test_") and name != "test_primary":
                rows.append({**base, "split": "test", "metric": name.removeprefix("test_"), "value": value})
        if "best_val_primary" in metrics and base["task"]:
            rows.append(
                {**base, "split": "val", "metric": headline_metric(base["task"]), "value": metrics["best_val_primary"]}
            )
    table = pd.DataFrame(rows, columns=[*RUN_COLUMNS, *searched])
    table.attrs["searched"] = searched
    return table


def _searched(runs: list[Run], params: list[dict[str, Any]]) -> list[str]:
    """Config keys that take more than one value among trials of the same task and schema: what was searched (keys
    that vary only between tasks, per-task overrides such as the detection box cues, are not)."""
    groups: dict[tuple, dict[str, set]] = {}
    for run, param in zip(runs, params, strict=True):
        values = groups.setdefault((run.data.tags.get("task"), run.data.tags.get("schema")), {})
        for key, value in param.items():
            values.setdefault(key, set()).add(str(value))
    varying = {k for values in groups.values() for k, seen in values.items() if len(seen) > 1}
    return sorted(varying - set(NOT_SEARCHED))


def test_records(tracking_uri: str, run_id: str, split: str = "test") -> list[dict[str, Any]] | None:
    """The trial's full test predictions (``predictions/test.json``; ``split="val"``: its tested model's on the
    validation patients, a cross-validation trial's out-of-fold predictions), or None when it logged none."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per small file is noise
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = MlflowClient(tracking_uri).download_artifacts(run_id, f"predictions/{split}.json", folder)
        except (MlflowException, OSError):
            return None
        return json.loads(Path(path).read_text(encoding="utf-8"))
