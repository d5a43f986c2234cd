"""MLflow for a sweep: a local tracking server when none is given, one parent run per sweep, one child run per trial.

The tracking URI is always explicit: every client here is built with it, and it travels to every worker in the
trial config. MLflow's default store is a ``mlflow.db`` in the working directory, which inside a Tune trial is
a throwaway per-trial folder, so a run logged without a URI would silently vanish.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from gx_ray.train.tracker import log_params

SWEEP_TAG, TRIAL_TAG = "gx_ray.sweep_id", "gx_ray.trial_id"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests child runs under it


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalMlflowServer:
    """``mlflow server`` on the loopback interface, backed by SQLite and an artifact folder under ``root``."""

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 180.0):
        self.root, self.host, self.port = Path(root).resolve(), host, port or free_port(host)
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def backend_uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    def ui_command(self) -> str:
        """What a user runs later to browse the runs without the sweep."""
        return f"mlflow ui --backend-store-uri {self.backend_uri} --artifacts-destination {self.root / 'artifacts'}"

    def start(self) -> LocalMlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - lives as long as the server
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", self.backend_uri,
            "--artifacts-destination", str(self.root / "artifacts"),
            "--host", self.host, "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        # a session of its own, so stopping it stops gunicorn/uvicorn workers too and Ctrl-C on the sweep is ours
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"mlflow server did not answer on {self.uri} within {self.start_timeout_s:.0f} s")

    def _log_tail(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> LocalMlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _experiment_id(client: MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def _find_run(client: MlflowClient, experiment_id: str, tag: str, value: str) -> str | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=2)
    return runs[0].info.run_id if runs else None


def parent_run(client: MlflowClient, experiment: str, sweep_id: str, params: dict[str, Any]) -> str:
    """The sweep's parent run, created once and found again on resume."""
    experiment_id = _experiment_id(client, experiment)
    if run_id := _find_run(client, experiment_id, SWEEP_TAG, sweep_id):
        if (run := client.get_run(run_id)) and run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        return run_id
    run = client.create_run(experiment_id, run_name=sweep_id, tags={SWEEP_TAG: sweep_id, "gx_ray.kind": "sweep"})
    log_params(client, run.info.run_id, params)
    return run.info.run_id


def child_run(
    client: MlflowClient, parent_run_id: str, trial_id: str, run_name: str, tags: dict[str, str], params: dict[str, Any]
) -> str:
    """A trial's child run, nested under the sweep's parent; the same run again when a trial is retried or resumed."""
    parent = client.get_run(parent_run_id)
    experiment_id = parent.info.experiment_id
    if run_id := _find_run(client, experiment_id, TRIAL_TAG, trial_id):
        client.update_run(run_id, status="RUNNING")
        return run_id
    all_tags = {**tags, TRIAL_TAG: trial_id, PARENT_TAG: parent_run_id, SWEEP_TAG: parent.data.tags[SWEEP_TAG]}
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    log_params(client, run.info.run_id, params)
    return run.info.run_id


def close_stopped_runs(client: MlflowClient, parent_run_id: str, trial_ids: list[str]) -> None:
    """End the runs of trials the scheduler stopped early (their loop never reached its own end): KILLED, tagged."""
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    for trial_id in trial_ids:
        if run_id := _find_run(client, experiment_id, TRIAL_TAG, trial_id):
            client.set_tag(run_id, "gx_ray.stopped_early", "true")
            client.set_terminated(run_id, "KILLED")
