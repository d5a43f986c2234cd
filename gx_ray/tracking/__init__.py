"""MLflow for gx-ray, client side: one parent run per sweep, one child run per trial, and what a trial logs into
its run (batched metrics, params, predictions, figures).

The tracking URI is always explicit and travels to every worker in the trial config: MLflow's default store is a
``mlflow.db`` in the working directory, which in a Tune trial is a throwaway folder, so a run logged without a URI
would silently vanish. The local server a sweep starts lives in :mod:`gx_ray.tracking.server`, which trials never
import.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.tracking import MlflowClient

from gx_ray import storage

SWEEP_TAG, TRIAL_TAG, KIND_TAG = "gx_ray.sweep_id", "gx_ray.trial_id", "gx_ray.kind"
ABANDONED_TAG = "gx_ray.abandoned"
FOLD_TAG = "gx_ray.fold"
"""On each fold's run of a trial that cross-validates inside itself (:mod:`gx_ray.train.folds`): its fold."""
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests child runs under it
MAX_PARAM_LENGTH = 6000  # MLflow 3 stores param values up to 6000 characters
PREDICTION_SAMPLE = 50


def log_params(client: MlflowClient, run_id: str, params: dict[str, Any]) -> None:
    items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in sorted(params.items())]
    for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=items[start : start + 100])


def log_metrics(client: MlflowClient, run_id: str, metrics: dict[str, float], step: int) -> None:
    """One batched request for all metrics of a step. An undefined metric (AUC of a one-class split) is NaN."""
    now = int(time.time() * 1000)
    log_series(client, run_id, [(k, v, step, now) for k, v in sorted(metrics.items())])


def log_series(client: MlflowClient, run_id: str, points: list[tuple[str, float, int, int]]) -> None:
    """Time series points ``(key, value, step, timestamp_ms)`` (GPU utilisation over a trial), batched."""
    items = [Metric(key, float(value), int(timestamp), int(step)) for key, value, step, timestamp in points]
    for start in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[start : start + 1000])


def set_tags(client: MlflowClient, run_id: str, tags: dict[str, str]) -> None:
    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def logged_steps(client: MlflowClient, run_id: str) -> dict[str, set[int]]:
    """Every metric of a run and the steps it holds (one request per metric: for resumed runs only)."""
    keys = client.get_run(run_id).data.metrics
    return {key: {m.step for m in client.get_metric_history(run_id, key)} for key in keys}


class TrialTracker:
    """The MLflow run of one trial, as rank 0 of its training loop sees it. ``resumed``: logged into before; MLflow
    appends every value, so an epoch trained again would appear twice: the steps already there are kept."""

    def __init__(self, tracking_uri: str, run_id: str, resumed: bool = False):
        self.client, self.run_id = MlflowClient(tracking_uri), run_id
        self.logged = logged_steps(self.client, run_id) if resumed else {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        fresh = {k: v for k, v in metrics.items() if step not in self.logged.get(k, ())}
        if fresh:
            log_metrics(self.client, self.run_id, fresh, step)

    def log_points(self, key: str, first_step: int, values: list[float]) -> None:
        """One metric at consecutive steps from ``first_step`` (the learning rate of each optimiser step), one
        request; steps an earlier attempt logged are kept."""
        logged = self.logged.get(key, ())
        points = [(key, v, first_step + i, int(time.time() * 1000)) for i, v in enumerate(values)]
        log_series(self.client, self.run_id, [p for p in points if p[2] not in logged])

    def set_tags(self, tags: dict[str, str]) -> None:
        set_tags(self.client, self.run_id, tags)

    def log_predictions(self, records: list[dict[str, Any]], task: Any, split: str = "test") -> None:
        """Every prediction on ``split`` (the test split's: what the analysis's paired bootstrap rescoring reads; the
        validation patients': under cross-validation the fold's out-of-fold predictions), and for the test split a
        readable sample of them (reports, answers, boxes ..., without embeddings), the task's figures and its
        documents (a task's ``documents()``: artifact path → JSON-able data), as artifacts."""
        self.client.log_dict(self.run_id, records, f"predictions/{split}.json")
        if split != "test":
            return
        sample = [{k: v for k, v in r.items() if not k.endswith("_embedding")} for r in records[:PREDICTION_SAMPLE]]
        self.client.log_dict(self.run_id, sample, "predictions/test_sample.json")
        for name, figure in getattr(task, "figures", lambda r: {})(records).items():
            self.client.log_figure(self.run_id, figure, f"figures/{name}.png")
            import matplotlib.pyplot as plt

            plt.close(figure)  # pyplot keeps every figure it made until closed: a process predicting many times
        for path, document in getattr(task, "documents", dict)().items():  # e.g. the questions a task asked
            self.client.log_dict(self.run_id, document, path)


def _experiment_id(client: MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def _find_run(client: MlflowClient, experiment_id: str, tags: dict[str, str]) -> Any | None:
    """The first run carrying every one of ``tags`` (the first, should a store hold two)."""
    condition = " and ".join(f"tags.`{tag}` = '{value}'" for tag, value in tags.items())
    runs = client.search_runs([experiment_id], condition, order_by=["attributes.start_time ASC"], max_results=1)
    return runs[0] if runs else None


def parent_run(
    client: MlflowClient, experiment: str, sweep_id: str, params: dict[str, Any], tags: dict[str, str] | None = None
) -> str:
    """The sweep's parent run, created once and found again on resume (then RUNNING again)."""
    experiment_id = _experiment_id(client, experiment)
    # its trials carry the sweep tag too: the kind tag tells the parent apart
    if run := _find_run(client, experiment_id, {SWEEP_TAG: sweep_id, KIND_TAG: "sweep"}):
        if run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id
    all_tags = {**(tags or {}), SWEEP_TAG: sweep_id, KIND_TAG: "sweep"}
    run = client.create_run(experiment_id, run_name=sweep_id, tags=all_tags)
    log_params(client, run.info.run_id, params)
    return run.info.run_id


@dataclass(frozen=True)
class ChildRun:
    run_id: str
    status: str | None
    """None for a run created now; else the status the earlier attempt left (FINISHED: the cell is done)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the earlier attempt logged (latest values)."""


def child_run(
    client: MlflowClient, parent_run_id: str, trial_id: str, run_name: str, tags: dict[str, str], params: dict[str, Any]
) -> ChildRun:
    """A trial's child run (one of its folds', where ``tags`` has :data:`FOLD_TAG`), nested under the sweep's parent;
    the same run again when a trial is retried or resumed (RUNNING again, unless it had FINISHED)."""
    parent = client.get_run(parent_run_id)
    experiment_id = parent.info.experiment_id
    fold = {FOLD_TAG: tags[FOLD_TAG]} if FOLD_TAG in tags else {}
    if run := _find_run(client, experiment_id, {TRIAL_TAG: trial_id, **fold}):
        if run.info.status != "FINISHED":
            client.update_run(run.info.run_id, status="RUNNING")
        return ChildRun(run.info.run_id, run.info.status, dict(run.data.metrics))
    sweep_id = parent.data.tags[SWEEP_TAG]
    all_tags = {**tags, TRIAL_TAG: trial_id, PARENT_TAG: parent_run_id, SWEEP_TAG: sweep_id, KIND_TAG: "trial"}
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    log_params(client, run.info.run_id, params)
    return ChildRun(run.info.run_id, None)


def child_runs(client: MlflowClient, parent_run_id: str, abandoned: bool = False) -> list[Any]:
    """Every trial run of a sweep (the runs MLflow nests under its parent run); with ``abandoned``, also those
    :func:`abandon_unknown_runs` deleted (what they spent is spent)."""
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    view = ViewType.ALL if abandoned else ViewType.ACTIVE_ONLY
    return client.search_runs(
        [experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'", run_view_type=view
    )


def abandon_unknown_runs(client: MlflowClient, runs: list[Any], known_trials: set[str]) -> list[str]:
    """Delete (MLflow's soft delete) the trial runs whose Tune trial the sweep no longer has, saying why; their ids.
    A killed driver's trial drawn again under another id, or a failed trial ``--resume`` restarted under a new id:
    no table or count may see it twice, and the ledger keeps what it spent."""
    abandoned = []
    for run in runs:
        if run.data.tags.get(TRIAL_TAG) in known_trials:
            continue
        why = "its trial is not in the sweep's Tune experiment: a killed driver's or a restarted failed trial's run"
        client.set_tag(run.info.run_id, ABANDONED_TAG, why)
        if run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, "KILLED")
        client.delete_run(run.info.run_id)
        abandoned.append(run.info.run_id)
    return abandoned


def end_open_runs(client: MlflowClient, runs: list[Any], stopped_early: list[str]) -> None:
    """End the trial runs Tune no longer runs: those the scheduler stopped early (their loop never reached its own
    end) KILLED and tagged; any other still RUNNING (a signal stopped it) KILLED, until ``--resume`` opens it again."""
    for run in runs:
        if run.data.tags.get(TRIAL_TAG) in stopped_early:
            client.set_tag(run.info.run_id, "gx_ray.stopped_early", "true")
            client.set_terminated(run.info.run_id, "KILLED")
        elif run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, "KILLED")


PROVENANCE_PACKAGES = ("torch", "ray", "monai", "transformers", "mlflow", "optuna", "SimpleITK", "pyarrow")


def provenance(manifest: str | Path | None = None) -> dict[str, str]:
    """What a run's numbers came from: the code (git commit, ``-dirty`` with uncommitted changes, or the installed
    version), the library versions and the shard manifest's SHA-256. Tags, so that the UI and searches show them."""
    import gx_ray

    tags = {"gx_ray.code": _code_version(Path(gx_ray.__file__).parent), "gx_ray.python": platform.python_version()}
    for package in PROVENANCE_PACKAGES:
        try:
            tags[f"gx_ray.version.{package}"] = version(package)
        except PackageNotFoundError:
            tags[f"gx_ray.version.{package}"] = "absent"
    if manifest is not None:
        tags["gx_ray.manifest_sha256"] = hashlib.sha256(storage.read_bytes(manifest)).hexdigest()
    return tags


def _code_version(package_dir: Path) -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=package_dir, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=package_dir, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        return f"git:{commit}{'-dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):  # an installed package, or a copy without git
        try:
            return f"gx-ray {version('gx-ray')}"
        except PackageNotFoundError:
            return "unknown"


class UnreachableTrackingError(ValueError):
    """A tracking URI that trials on other nodes of the cluster could not reach."""


SHARED_VIEW_TAG = "mlflow.sharedViewState."
"""An experiment tag of this prefix and a key holds a shared runs-table view's state as JSON, which
``viewStateShareKey=<key>`` in the URL opens (as MLflow 3.17's "share" button; checked in a browser by a test)."""
TRIAL_COLUMNS = (
    "tags.`task`", "tags.`schema`", "tags.`seed`", "tags.`gx_ray.primary_metric`",
    "metrics.`test_primary`", "metrics.`test_chance`", "metrics.`best_val_primary`",
)  # fmt: skip
"""The columns a sweep's view shows: what each trial asked (task, inputs, seed) and scored (its primary metric on
the test split beside the chance level, and on validation)."""


def share_trials_view(client: MlflowClient, experiment_id: str, sweep_id: str) -> str:
    """A view of the runs table that shows one sweep's trials (not its parent, nor other sweeps of the experiment),
    by name (task, inputs, seed) with :data:`TRIAL_COLUMNS`: MLflow's own default shows no metric at all. Returns the
    view's key for :func:`runs_table_url`."""
    key = f"gx-ray-{sweep_id}"
    state = {
        "searchFilter": f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{KIND_TAG}` = 'trial'",
        "orderByKey": "tags.`mlflow.runName`",
        "orderByAsc": True,
        "selectedColumns": list(TRIAL_COLUMNS),
    }
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG + key, json.dumps(state))
    return key


def runs_table_url(tracking_uri: str, experiment_id: str, view: str | None = None) -> str:
    """The MLflow UI's runs table of an experiment (its ``workflowType`` opens the classic ML view, not the GenAI
    overview an experiment link lands on in MLflow 3), in the shared ``view`` if given."""
    url = f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    return f"{url}&viewStateShareKey={view}" if view else url


def on_one_host(node_ips: Sequence[str], own_ip: str) -> bool:
    """Whether the nodes at ``node_ips`` are all on one host, the driver's: all on loopback (127.0.0.0/8, ::1: a
    loopback address is reached from its own host only, so a cluster on it has one host), or all at the driver's own
    node address ``own_ip`` (several nodes of one machine on its network address)."""
    return all(_is_loopback(ip) for ip in node_ips) or all(ip == own_ip for ip in node_ips)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def check_reachable_from(tracking_uri: str, node_ips: Sequence[str], own_ip: str | None = None) -> None:
    """Refuse a tracking URI only this host reaches (a loopback server or a file/SQLite store) when one of the alive
    ``node_ips`` is on another host (:func:`on_one_host`; ``own_ip``: the driver's, default from Ray): every trial
    logs from wherever Ray places it."""
    parsed = urlparse(tracking_uri)
    host = (parsed.hostname or "").lower()
    local = parsed.scheme in ("", "file", "sqlite") or _is_loopback(host) or host in ("0.0.0.0", "::")
    if not local:
        return
    if own_ip is None:
        import ray

        own_ip = ray.util.get_node_ip_address()
    if on_one_host(node_ips, own_ip):
        return
    elsewhere = sorted({ip for ip in node_ips if ip != own_ip})
    raise UnreachableTrackingError(
        f"this Ray cluster has {len(node_ips)} nodes, and trials on those at {', '.join(elsewhere)} (not this host: "
        f"{own_ip}) cannot reach MLflow at {tracking_uri}: give --mlflow-uri a server every node reaches "
        "(jobs/cluster/README.md: the team MLflow set-up)"
    )
