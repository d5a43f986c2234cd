"""A cross-validated sweep end to end: every cell on every fold, the folds written and logged, every trial tagged
with their hash and keeping its out-of-fold predictions, every training patient predicted once a seed, the report's
out-of-fold section, a study planned from it as from a pilot, and its fold models finalized as one registered
ensemble."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.analysis.plan import plan_study
from gx_ray.analysis.power import PowerSettings
from gx_ray.analysis.runs import test_records as logged_records
from gx_ray.data.folds import cohort_splits
from gx_ray.data.shards import read_shard, split_files
from gx_ray.data.stream import split_rows
from gx_ray.deploy.bundle import Predictor
from gx_ray.deploy.finalize import FinalizeOptions, finalize
from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.tasks import build_task
from gx_ray.tracking.server import LocalMlflowServer
from tests.common import small_stage_space

FOLDS = 2


@pytest.mark.slow
def test_a_cross_validated_sweep_predicts_every_training_patient_once_a_seed(ray_cluster, demo_prepared, tmp_path):
    shards = str(demo_prepared.shard_dir)
    path = small_stage_space(tmp_path / "cv.yaml", 1, [0], "cross-validation, end to end")
    space = yaml.safe_load(path.read_text(encoding="utf-8"))
    space["grid"]["schema"] = ["image_only", "image_table"]
    space["cv"] = {"folds": FOLDS}
    path.write_text(yaml.safe_dump(space), encoding="utf-8")
    with LocalMlflowServer(tmp_path / "mlflow") as server:
        result = run_sweep(SweepOptions(space=str(path), output=tmp_path / "out", data=shards, mlflow_uri=server.uri))
        assert (result.finished, result.failed) == (2 * FOLDS, 0)
        client = MlflowClient(server.uri)
        parent = client.get_run(result.parent_run_id)
        folds_path = client.download_artifacts(parent.info.run_id, "folds.json", str(tmp_path))
        folds = json.loads(Path(folds_path).read_text(encoding="utf-8"))
        children = client.search_runs(
            [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
        )
        assert len(children) == 2 * FOLDS
        assert {c.data.tags["gx_ray.folds_sha256"] for c in children} == {parent.data.tags["gx_ray.folds_sha256"]}
        out_of_fold: dict[str, Counter] = {}
        for child in children:
            fold, schema = int(child.data.params["data.fold"]), child.data.tags["schema"]
            (tmp_path / child.info.run_id).mkdir()
            local = client.download_artifacts(
                child.info.run_id, "predictions/val.json", str(tmp_path / child.info.run_id)
            )
            cases = [r["case_id"] for r in json.loads(Path(local).read_text(encoding="utf-8"))]
            patients = {r["case_id"]: r["patient_id"] for r in split_rows(shards, "train") + split_rows(shards, "val")}
            assert {patients[c] for c in cases} == set(folds["fold_patients"][fold])  # its own fold, and only it
            out_of_fold.setdefault(schema, Counter()).update(cases)
        training = {p for p, s in cohort_splits(shards).items() if s in ("train", "val")}
        for schema, counts in out_of_fold.items():  # every training patient predicted exactly once per seed
            assert set(counts.values()) == {1} and {patients[c] for c in counts} == training, schema
        summary = result.report.read_text(encoding="utf-8")
        section = summary.split("## Cross-validation: out-of-fold")[1]
        assert "| stage_classification |" in section and f"| {len(training)} | 1 | {FOLDS} |" in section
        assert (result.output / "report" / "out_of_fold.csv").is_file()
        # planned from as a pilot: on its out-of-fold predictions, every patient cross-validated one column
        settings = PowerSettings(seeds=(3,), patients=(60,), studies=50)
        (plan,) = plan_study(server.uri, result.sweep_id, 10.0, tmp_path, settings).comparisons
        assert (plan.schema_a, plan.pilot_folds, plan.pilot_seeds) == ("image_table", FOLDS, 1)
        assert plan.pilot_patients == len(training)
        assert f"{FOLDS} folds, kept as the pilot's" in (tmp_path / "plan" / "summary.md").read_text(encoding="utf-8")

        # finalized: the chosen schema's fold models as one registered ensemble, which predicts on the test patients
        # what the fold trials' own test predictions combine to
        final = finalize(FinalizeOptions(str(result.output), "stage_classification", mlflow_uri=server.uri))
        assert final.choice["final_model"] == "the fold models' ensemble"
        chosen = [c for c in children if c.data.tags["schema"] == final.choice["settings"]["schema"]]
        members = [
            sorted(logged_records(server.uri, c.info.run_id), key=lambda r: r["case_id"])
            for c in sorted(chosen, key=lambda c: int(c.data.params["data.fold"]))
        ]
        expected = {r["case_id"]: r for r in build_task("stage_classification").combine(members)}
        bundle = Predictor(final.bundle, "cpu")
        assert len(bundle.members) == FOLDS
        table = pa.concat_tables([read_shard(path) for path in split_files(shards, "test")])
        for record in bundle.predict_table(table):
            assert record["probabilities"] == pytest.approx(expected[record["case_id"]]["probabilities"], abs=1e-4)
            assert record["spread"] == pytest.approx(expected[record["case_id"]]["spread"], abs=1e-4)
