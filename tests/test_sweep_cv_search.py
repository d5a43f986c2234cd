"""A search over cross-validated configurations, end to end (issue #47: "a CV objective through TPE + ASHA and PBT in a
smoke sweep"): each Tune trial trains its configuration on every fold, keeps a run per fold as a grid's fold has, and
reports the folds' mean, which TPE models, ASHA stops on and PBT exploits (every fold from the donor's same fold)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.data.stream import split_rows
from gx_ray.deploy import finalize  # not its tested_weights by name: pytest would collect it
from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.tracking import FOLD_TAG, KIND_TAG, SWEEP_TAG, TRIAL_TAG
from gx_ray.tracking.server import LocalMlflowServer
from gx_ray.train.folds import FOLD_FOLDER
from gx_ray.train.loop import weights_sha256
from tests.common import small_stage_space

FOLDS, EPOCHS = 2, 2
LR = {"optimiser.lr": {"type": "loguniform", "low": 1.0e-4, "high": 1.0e-2}}
SEARCHES = {
    "tpe+asha": {"searcher": "optuna", "scheduler": "asha"},
    "pbt": {"searcher": "random", "scheduler": "pbt", "pbt": {"interval": 1}},
}


def _space(tmp_path: Path, name: str) -> Path:
    path = small_stage_space(tmp_path / f"{name.replace('+', '_')}.yaml", EPOCHS, [0], "cv search", {"samples": 2})
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    document.pop("grid")  # one seed, fixed: Optuna takes no grid axes
    document["fixed"]["seed"] = 0
    path.write_text(yaml.safe_dump({**document, **SEARCHES[name], "sample": LR, "cv": {"folds": FOLDS}}))
    return path


def _tune_results(output: Path, sweep_id: str) -> dict[str, list[dict]]:
    """Each Tune trial's reports (its ``result.json``), by trial id."""
    found = {}
    for file in (output / "ray" / sweep_id).glob("*/result.json"):
        reports = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        found[reports[0]["trial_id"]] = reports
    return found


def _schedule_records(client: MlflowClient, run) -> list[dict]:
    records = []
    for artifact in client.list_artifacts(run.info.run_id, "schedule"):
        records.append(json.loads(Path(client.download_artifacts(run.info.run_id, artifact.path)).read_text()))
    return records


@pytest.mark.slow
def test_tpe_with_asha_and_pbt_search_the_folds_mean_with_a_run_per_fold(ray_cluster, demo_prepared, tmp_path):
    shards = str(demo_prepared.shard_dir)
    training = {r["case_id"] for split in ("train", "val") for r in split_rows(shards, split)}
    with LocalMlflowServer(tmp_path / "mlflow") as server:
        client = MlflowClient(server.uri)
        for name in SEARCHES:
            options = SweepOptions(space=str(_space(tmp_path, name)), output=tmp_path / name, data=shards,
                                   mlflow_uri=server.uri, max_concurrent=2)  # fmt: skip
            result = run_sweep(options)
            assert result.failed == 0 and result.finished + result.stopped_early == 2, name
            assert result.report is not None, name  # the report reads a run per fold as a grid's folds
            runs = [r for r in client.search_runs([result.experiment_id], f"tags.`{SWEEP_TAG}` = '{result.sweep_id}'")
                    if r.data.tags.get(KIND_TAG) == "trial"]  # fmt: skip
            reports = _tune_results(result.output, result.sweep_id)
            assert len(reports) == 2 and len(runs) == 2 * FOLDS, name
            for trial, trial_reports in reports.items():
                folds = sorted(
                    (r for r in runs if r.data.tags[TRIAL_TAG] == trial), key=lambda r: r.data.tags[FOLD_TAG]
                )
                assert [(r.data.tags[FOLD_TAG], r.data.params["data.fold"]) for r in folds] == [("0", "0"), ("1", "1")]
                history = [{m.step: m.value for m in client.get_metric_history(r.info.run_id, "val_primary")}
                           for r in folds]  # fmt: skip
                for report in trial_reports:  # what the searcher and scheduler saw: the folds' mean, every epoch
                    epoch = report["epoch"]
                    assert report["val_primary"] == pytest.approx(sum(h[epoch] for h in history) / FOLDS), name
                # the trial's one CPU counted once: each fold's run holds its share, the trial their sum
                spent = [r.data.metrics["cpu_seconds"] for r in folds]
                assert trial_reports[-1]["cpu_seconds"] == pytest.approx(sum(spent)), name
                if name == "tpe+asha":  # (a PBT trial restored from its donor goes on from its own earlier costs)
                    assert sum(spent) < 1.5 * trial_reports[-1]["time_total_s"], name
                if all(r.info.status == "FINISHED" for r in folds):  # every training patient predicted once
                    # finalize's fold ensemble takes each fold's own tested weights from the trial's checkpoint
                    tested = {weights_sha256(finalize.tested_weights(str(result.output / "ray"), result.sweep_id,
                                                            r.data.tags["gx_ray.trial"], int(r.data.tags[FOLD_TAG])))
                              for r in folds}  # fmt: skip
                    assert len(tested) == FOLDS, name
                    predicted = []
                    for run in folds:
                        local = client.download_artifacts(run.info.run_id, "predictions/val.json", str(tmp_path))
                        predicted += [p["case_id"] for p in json.loads(Path(local).read_text(encoding="utf-8"))]
                    assert sorted(predicted) == sorted(training), name
        # PBT's one exploit (a population of two, perturbed after epoch 0): each fold of the exploiting trial loaded
        # its own fold's weights from the donor's checkpoint
        exploited = [
            (run, record) for run in runs for record in _schedule_records(client, run) if record["donor_trial"]
        ]
        assert len(exploited) == FOLDS and len({r.data.tags[TRIAL_TAG] for r, _ in exploited}) == 1
        for run, record in exploited:
            folder = Path(record["checkpoint"]) / FOLD_FOLDER.format(run.data.tags[FOLD_TAG])
            saved = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
            assert record["weights_sha256"] == weights_sha256(saved["model"]) and record["restored_epoch"] == 0
        assert exploited[0][1]["weights_sha256"] != exploited[1][1]["weights_sha256"]
