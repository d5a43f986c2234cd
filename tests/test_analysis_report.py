"""The report from runs in a real MLflow server, with a planted difference between schemas: the loader, the paired
bootstrap over logged test predictions, Holm, and the files on disk and on the parent run."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from gx_ray.analysis.report import schema_comparisons, write_report
from gx_ray.analysis.runs import load_runs
from gx_ray.schema import STAGE_GROUPS
from gx_ray.tracking import child_run, log_metrics, parent_run
from gx_ray.tracking.server import LocalMlflowServer
from tests.analysis_fixture import make_runs

SWEEP = "planted-0001"
SKILL = {"image_only": 0.0, "image_table": 3.0, "image_bbox": 0.0}
"""How strongly each schema's predicted probabilities point at the true stage: image_table alone is informative."""


def _records(schema: str, seed: int, patients: int = 60) -> list[dict]:
    rng = np.random.default_rng([seed, list(SKILL).index(schema)])
    labels = np.arange(patients) % 4
    logits = rng.normal(size=(patients, 4)) + SKILL[schema] * np.eye(4)[labels]
    probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return [
        {"case_id": f"P{i:03d}", "prediction": STAGE_GROUPS[int(p.argmax())], "target": STAGE_GROUPS[labels[i]],
         "probabilities": p.round(4).tolist()}
        for i, p in enumerate(probabilities)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def planted_sweep(tmp_path_factory):
    """A sweep of stage classification, three schemas x three seeds, logged as the driver logs trials."""
    from gx_ray.metrics.classification import classification_metrics

    with LocalMlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        client = MlflowClient(server.uri)
        parent = parent_run(client, "gx-ray", SWEEP, {"space": "planted"})
        for schema in SKILL:
            for seed in range(3):
                model = {"model.vision": "resnet10_3d", "model.text": "bert_tiny", "model.fusion": "concat"}
                params = {**model, "optimiser.lr": 1e-3, "schema": schema, "seed": seed, "task": "stage_classification"}
                tags = {"task": "stage_classification", "schema": schema, "seed": str(seed)}
                run_id = child_run(client, parent, f"{schema}-{seed}", f"trial-{schema}-{seed}", tags, params).run_id
                records = _records(schema, seed)
                probabilities = np.array([r["probabilities"] for r in records])
                labels = np.array([STAGE_GROUPS.index(r["target"]) for r in records])
                test = classification_metrics(probabilities, labels)
                log_metrics(client, run_id, {f"test_{k}": v for k, v in test.items()}, step=0)
                log_metrics(client, run_id, {"best_val_primary": test["auc"]}, step=0)
                client.log_dict(run_id, records, "predictions/test.json")
                client.set_terminated(run_id, "FINISHED")
        yield server, parent


def test_the_runs_table_of_a_sweep(planted_sweep):
    server, _ = planted_sweep
    runs = load_runs(server.uri, SWEEP)
    assert runs["run_id"].nunique() == 9 and set(runs["schema"]) == set(SKILL)
    assert set(runs[runs["split"] == "test"]["metric"]) == {"precision", "recall", "f1", "accuracy", "auc"}
    assert runs.attrs["searched"] == []  # lr is the same in every trial
    assert sorted(runs.drop_duplicates("run_id")["seed"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_the_report_finds_the_planted_difference_and_only_it(planted_sweep, tmp_path):
    server, parent = planted_sweep
    report = write_report(server.uri, SWEEP, tmp_path, parent, cohort="demo", n_resamples=400)
    table = report.significance.set_index("schema_a")
    assert set(table["method"]) == {"paired bootstrap over patients"} and set(table["n_cases"]) == {60}
    assert table.at["image_table", "significant"] and table.at["image_table", "better"] == "image_table"
    assert table.at["image_table", "ci_low"] > 0
    assert (
        not table.at["image_bbox", "significant"]
        and table.at["image_bbox", "ci_low"] < 0 < table.at["image_bbox", "ci_high"]
    )
    # the observed difference is the difference of the logged test AUCs, averaged over seeds
    runs = load_runs(server.uri, SWEEP)
    auc = runs[(runs["split"] == "test") & (runs["metric"] == "auc")].groupby("schema")["value"].mean()
    assert table.at["image_table", "diff"] == pytest.approx(auc["image_table"] - auc["image_only"], abs=0.05)
    on_disk = pd.read_csv(tmp_path / "report" / "significance.csv")
    assert len(on_disk) == 2 and on_disk["p_holm"].ge(on_disk["p_value"]).all()
    summary = (tmp_path / "report" / "summary.md").read_text(encoding="utf-8")
    assert "| stage_classification | auc | image_table |" in summary and "**yes**" in summary
    logged = {a.path for a in MlflowClient(server.uri).list_artifacts(parent, "report")}
    assert {"report/summary.md", "report/summary.html", "report/significance.csv"} <= logged


def test_a_schema_searched_over_other_parameters_is_not_compared(planted_sweep):
    server, _ = planted_sweep
    runs = make_runs(tasks=("stage_classification",))
    searched = runs[runs["schema"] == "image_table"].assign(run_id=lambda r: r["run_id"] + "-lr2")
    comparisons = schema_comparisons(pd.concat([runs, searched], ignore_index=True), server.uri)
    # these runs logged no predictions: the seeds are the pairing unit
    assert {c["schema_a"] for c in comparisons} == {"image_bbox", "image_table_bbox"}
    assert {c["method"] for c in comparisons} == {"Wilcoxon signed-rank over seeds"}
