"""Logging one trial to its MLflow run: batched metrics, params, sample predictions and figures.

Every client is built with the tracking URI that the sweep passes in the trial config, never MLflow's default.
"""

from __future__ import annotations

import time
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

MAX_PARAM_LENGTH = 6000  # MLflow 3 stores param values up to 6000 characters
PREDICTION_SAMPLE = 50


def log_params(client: MlflowClient, run_id: str, params: dict[str, Any]) -> None:
    items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in sorted(params.items())]
    for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=items[start : start + 100])


def log_metrics(client: MlflowClient, run_id: str, metrics: dict[str, float], step: int) -> None:
    """One batched request for all metrics of a step. An undefined metric (AUC of a one-class split) is NaN."""
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
    for start in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[start : start + 1000])


def set_tags(client: MlflowClient, run_id: str, tags: dict[str, str]) -> None:
    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


class TrialTracker:
    """The MLflow run of one trial, as rank 0 of its training loop sees it."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.client, self.run_id = MlflowClient(tracking_uri), run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        log_metrics(self.client, self.run_id, metrics, step)

    def log_predictions(self, records: list[dict[str, Any]], task: Any) -> None:
        """Every test prediction (what the analysis's paired bootstrap rescoring reads), a readable sample of
        them (reports, answers, boxes ..., without embeddings) and the task's figures, as artifacts."""
        self.client.log_dict(self.run_id, records, "predictions/test.json")
        sample = [{k: v for k, v in r.items() if not k.endswith("_embedding")} for r in records[:PREDICTION_SAMPLE]]
        self.client.log_dict(self.run_id, sample, "predictions/test_sample.json")
        for name, figure in getattr(task, "figures", lambda r: {})(records).items():
            self.client.log_figure(self.run_id, figure, f"figures/{name}.png")
            figure.clf()
