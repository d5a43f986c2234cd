"""From a sweep's answer to predictions on new patients (``gx_ray/deploy``): the choice by validation (never test),
ties broken by cost, the refit on training + validation patients, bundles that load with ``weights_only``, fingerprint
flags, the ensemble's combination; and end to end, a sweep finalized, registered, loaded by a fresh process, served,
and predicting on a cohort prepared apart with its external evaluation and its bad cases skipped."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from gx_ray.data.stream import DataConfig, split_pieces, split_rows
from gx_ray.deploy.bundle import fingerprint_ranges, learnt_state, outside_training
from gx_ray.deploy.finalize import choose, refit_config, score_records
from gx_ray.schema import STAGE_GROUPS
from gx_ray.tasks import build_task
from gx_ray.train.config import TrialConfig
from tests.common import ROOT, command_module, small_stage_space

# --- the choice -------------------------------------------------------------------------------------------------


def _candidates(rows: list[tuple[str, int, int | None, float, float]]) -> pd.DataFrame:
    """(configuration, seed, fold, validation score, trial seconds) rows as finalize's candidate table."""
    return pd.DataFrame(
        [
            {"run_id": f"r{i}", "trial": str(i), "label": "stage_classification", "schema": "image_only", "seed": s,
             "fold": f, "metric": "auc", "val": v, "seconds": t, "best_epoch": 1.0, "key": json.dumps({"lr": k})}
            for i, (k, s, f, v, t) in enumerate(rows)
        ]
    )  # fmt: skip


def test_the_choice_is_the_best_mean_validation_score_over_seeds_not_one_lucky_seed():
    # "a" has the single best seed, "b" the better mean
    table = _candidates(
        [("a", 0, None, 90, 10), ("a", 1, None, 50, 10), ("b", 0, None, 75, 10), ("b", 1, None, 74, 10)]
    )
    configs, trials = choose(table)
    assert json.loads(configs["key"].iloc[0]) == {"lr": "b"} and set(trials["run_id"]) == {"r2", "r3"}
    assert configs["score"].iloc[0] == pytest.approx(74.5) and configs["repeats"].iloc[0] == 2


def test_a_tie_goes_to_the_cheaper_configuration_and_a_cross_validated_seed_scores_its_folds_mean():
    table = _candidates([("slow", 0, 0, 80.0, 100), ("slow", 0, 1, 70.0, 100),
                         ("fast", 0, 0, 75.02, 10), ("fast", 0, 1, 74.99, 10)])  # fmt: skip
    configs, trials = choose(table)
    assert list(configs["score"]) == pytest.approx([75.005, 75.0])  # the folds' mean, one value per seed
    assert json.loads(configs["key"].iloc[0]) == {"lr": "fast"} and bool(configs["tied"].iloc[1])
    assert sorted(trials["fold"]) == [0, 1]


def test_within_the_tie_the_cheaper_configuration_wins_even_scoring_lower_and_just_outside_it_the_score_wins():
    # 75.00 at 10 s against 75.03 at 100 s: a tie (0.03 <= TIE), so the cheaper one, though it scores lower
    configs, trials = choose(_candidates([("slow", 0, None, 75.03, 100), ("fast", 0, None, 75.0, 10)]))
    assert list(configs["key"].map(lambda k: json.loads(k)["lr"])) == ["fast", "slow"]
    assert list(configs["tied"]) == [True, True] and set(trials["run_id"]) == {"r1"}
    # 75.00 at 10 s against 75.06 at 100 s: no tie, the higher score wins whatever it costs
    configs, _ = choose(_candidates([("slow", 0, None, 75.06, 100), ("fast", 0, None, 75.0, 10)]))
    assert list(configs["key"].map(lambda k: json.loads(k)["lr"])) == ["slow", "fast"]
    assert list(configs["tied"]) == [True, False]
    # lower is better: the tie is just as close below the best
    table = _candidates([("slow", 0, None, 3.0, 100), ("fast", 0, None, 3.04, 10), ("worse", 0, None, 3.1, 1)])
    table["metric"] = "median_rank"
    configs, _ = choose(table)
    assert list(configs["key"].map(lambda k: json.loads(k)["lr"])) == ["fast", "slow", "worse"]


def test_a_lower_is_better_metric_chooses_the_smallest_and_nan_scores_never_win():
    table = _candidates([("a", 0, None, 5.0, 1), ("b", 0, None, 3.0, 1), ("c", 0, None, math.nan, 1)])
    table["metric"] = "median_rank"
    configs, _ = choose(table)
    assert json.loads(configs["key"].iloc[0]) == {"lr": "b"} and "c" not in "".join(configs["key"])


def test_one_se_chooses_the_cheapest_configuration_within_one_standard_error_of_the_best():
    from gx_ray.analysis.selection import NO_VALIDATION_PREDICTIONS as NO_PREDICTIONS
    from gx_ray.analysis.selection import SelectionEstimate
    from gx_ray.deploy.finalize import one_se_choice

    # "best" 80 +- 2 over 3 seeds (SE 1.15) at 100 s; "near" 79 at 10 s is within it, "far" 78 at 1 s is not
    rows = [("best", s, None, v, 100) for s, v in enumerate((78.0, 80.0, 82.0))]
    rows += [("near", s, None, v, 10) for s, v in enumerate((79.0, 78.0, 80.0))]
    rows += [("far", s, None, v, 1) for s, v in enumerate((77.0, 78.0, 79.0))]
    configs, _ = choose(_candidates(rows))
    index, why = one_se_choice(configs, "auc", None)
    assert json.loads(configs["key"].iloc[index]) == {"lr": "near"}
    assert why["se"] == pytest.approx(2 / math.sqrt(3)) and why["se_from"] == "across its 3 seeds"
    assert (why["chosen"], why["best"], why["score"], why["best_score"]) == ("lr=near", "lr=best", 79.0, 80.0)
    assert (why["seconds"], why["best_seconds"]) == (10.0, 100.0)
    # one seed each: the best's bootstrap SE over validation patients decides (2.5 takes in "far" too, 0.5 neither)
    single = choose(_candidates([("best", 0, None, 80.0, 100), ("near", 0, None, 79.0, 10),
                                 ("far", 0, None, 78.0, 1)]))[0]  # fmt: skip
    order = [json.loads(k)["lr"] for k in single["key"]]

    def estimate(errors: dict[str, float]) -> SelectionEstimate:
        return SelectionEstimate(method="select-then-score", chosen=0, naive=80.0, corrected=77.0, low=70.0,
                                 high=84.0, indistinguishable=(0,), standard_errors=tuple(errors[k] for k in order),
                                 patients=24, configurations=3, resamples=1000)  # fmt: skip

    index, why = one_se_choice(single, "auc", estimate({"best": 2.5, "near": 9.0, "far": 9.0}))
    assert order[index] == "far" and why["se"] == 2.5 and "bootstrap over 24 validation patients" in why["se_from"]
    index, _ = one_se_choice(single, "auc", estimate({"best": 0.5, "near": 9.0, "far": 9.0}))
    assert order[index] == "best"
    with pytest.raises(ValueError, match="one_se needs the best configuration's standard error.*no validation pred"):
        one_se_choice(single, "auc", None, NO_PREDICTIONS)
    # lower is better: within one SE above the smallest
    table = _candidates([("best", s, None, v, 100) for s, v in enumerate((2.0, 3.0, 4.0))]
                        + [("near", s, None, v, 10) for s, v in enumerate((3.0, 3.5, 4.0))])  # fmt: skip
    table["metric"] = "median_rank"
    configs, _ = choose(table)
    index, _ = one_se_choice(configs, "median_rank", None)
    assert json.loads(configs["key"].iloc[index]) == {"lr": "near"}


def _logged_validation(uri: str, skill: dict[str, float], folds: int | None) -> pd.DataFrame:
    """One run per configuration (and fold) of ``skill`` (how far its stage probabilities lean to the truth) in the
    MLflow store ``uri``, holding hand-made ``predictions/val.json``: finalize's candidate table of them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.create_experiment(f"selection {len(client.search_experiments())}")
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 4, 40)
    rows = []
    for lr, lean in skill.items():
        for fold in range(folds) if folds else [None]:
            patients = [i for i in range(40) if fold is None or i % folds == fold]  # each fold validates its share
            p = rng.dirichlet(np.ones(4), size=40) + (math.nan if lr == "diverged" else lean) * np.eye(4)[labels]
            records = [{"case_id": f"c{i}", "prediction": STAGE_GROUPS[int(p[i].argmax())],
                        "target": STAGE_GROUPS[labels[i]], "probabilities": list(p[i] / p[i].sum())}
                       for i in patients]  # fmt: skip
            run = client.create_run(experiment).info.run_id
            if lr != "silent":  # an older trial: no validation predictions logged
                client.log_dict(run, records[:-1] if lr == "short" else records, "predictions/val.json")
            rows.append((lr, 0, fold, 70.0, 10.0, run))
    return _candidates([row[:5] for row in rows]).assign(run_id=[row[5] for row in rows])


def test_the_selection_corrected_estimate_pools_a_seeds_folds_and_scores_the_patients_every_configuration_predicted(
    tmp_path,
):
    from gx_ray.analysis.runs import test_records
    from gx_ray.analysis.selection import NO_VALIDATION_PREDICTIONS
    from gx_ray.analysis.selection import selection_estimate as estimated

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def selection_estimate(uri: str, table: pd.DataFrame, configs: pd.DataFrame, n_resamples: int):
        """As finalize calls it: the trials' logged predictions/val.json, the configurations in choose()'s order."""
        records_of = functools.partial(test_records, uri, split="val")
        return estimated(records_of, table, list(configs["key"]), n_resamples)

    table = _logged_validation(uri, {"good": 0.25, "fair": 0.1, "short": 0.0}, folds=2)
    configs, _ = choose(table)
    order = [json.loads(k)["lr"] for k in configs["key"]]
    estimate, why = selection_estimate(uri, table, configs, n_resamples=200)
    assert why == "" and estimate.method == "bbc-cv" and estimate.configurations == 3
    assert estimate.patients == 38  # two folds pooled (40 patients), less the one "short" left out of each fold
    assert order[estimate.chosen] == "good" and estimate.low <= estimate.corrected <= estimate.high
    assert estimate.corrected <= estimate.naive and estimate.resamples > 100
    assert order.index("good") in estimate.indistinguishable and order.index("short") not in estimate.indistinguishable
    table = _logged_validation(uri, {"good": 0.25, "fair": 0.1}, folds=None)
    estimate, _ = selection_estimate(uri, table, choose(table)[0], n_resamples=200)
    assert estimate.method == "select-then-score" and estimate.patients == 40
    table = _logged_validation(uri, {"good": 0.25, "silent": 0.1}, folds=None)
    assert selection_estimate(uri, table, choose(table)[0], n_resamples=200) == (None, NO_VALIDATION_PREDICTIONS)
    table = _logged_validation(uri, {"good": 0.25, "diverged": 0.1}, folds=None)  # NaN probabilities: said, no crash
    estimate, why = selection_estimate(uri, table, choose(table)[0], n_resamples=200)
    assert estimate is None and why.startswith("no selection-corrected estimate: ") and "nan" in why


def test_a_refit_trains_on_training_and_validation_patients_for_the_epochs_its_seeds_validated_best_at():
    config = TrialConfig.from_flat({"task": "stage_classification", "schedule.epochs": 10, "data.fold": 1,
                                    "data.folds_file": "f.json"})  # fmt: skip
    best = refit_config(config, "best", [2.0, 4.0, 3.0])
    assert (best.schedule.epochs, best.schedule.select, best.data.refit, best.data.fold) == (4, "last", True, None)
    assert refit_config(config, "last", [2.0]).schedule.epochs == 10


def test_refit_rows_are_the_training_and_validation_patients_and_refuse_a_fold(demo_prepared):
    shards = str(demo_prepared.shard_dir)
    rows = split_rows(shards, "train", refit=True)
    expected = {r["case_id"] for s in ("train", "val") for r in split_rows(shards, s)}
    assert {r["case_id"] for r in rows} == expected and {r["split"] for r in rows} == {"train"}
    pieces = split_pieces(DataConfig(shards=shards, refit=True), "train")
    assert sum(p["rows"] for p in pieces) == len(expected)
    assert not {r["case_id"] for r in split_rows(shards, "test")} & expected  # the test patients stay out
    with pytest.raises(ValueError, match="takes no data.fold"):
        split_pieces(DataConfig(shards=shards, refit=True, fold=0, folds_file="x"), "train")


# --- bundles, flags, ensembles ------------------------------------------------------------------------------------


def test_what_a_task_learnt_survives_a_weights_only_round_trip(tmp_path):
    vqa = build_task("vqa")
    vqa.prepare([{"split": "train", "vqa": [{"question": "q", "answer": a, "category": "c"}]} for a in "ba"])
    detection = build_task("lesion_detection")
    detection.anchor_shapes = ((4.0, 5.0, 6.0), (8.0, 9.0, 10.0))
    for task in (vqa, detection):
        state = learnt_state(task)
        torch.save(state, tmp_path / "state.pt")
        loaded = torch.load(tmp_path / "state.pt", weights_only=True)
        assert loaded == state and state  # tuples stay tuples: the head is built from them
    assert learnt_state(vqa)["answers"] == vqa.answers


def test_a_case_outside_the_training_spacing_or_intensity_is_flagged_and_a_training_case_never_is():
    rng = np.random.default_rng(0)
    training = {
        f"c{i}": {"source_spacing_zyx": [float(rng.uniform(2, 5)), 0.7, 0.7],
                  "intensity_hu": {"venous": {"mean": float(rng.uniform(30, 80))}}}
        for i in range(50)
    }  # fmt: skip
    ranges = fingerprint_ranges(training)
    assert all(outside_training(fp, ranges) == [] for fp in training.values())
    odd = {"source_spacing_zyx": [7.5, 0.7, 0.7], "intensity_hu": {"venous": {"mean": 250.0}}}
    flags = outside_training(odd, ranges)
    assert len(flags) == 2 and "spacing z 7.5 mm" in flags[0] and "venous mean 250 HU" in flags[1]


def test_a_stage_ensemble_averages_its_members_and_reports_their_spread():
    rng = np.random.default_rng(1)
    members = []
    for _ in range(3):
        p = rng.dirichlet(np.ones(4), size=5)
        members.append([{"case_id": f"c{i}", "prediction": "I", "target": "II", "probabilities": list(p[i])}
                        for i in range(5)])  # fmt: skip
    combined = build_task("stage_classification").combine(members)
    stacked = np.array([[r["probabilities"] for r in m] for m in members])
    for i, record in enumerate(combined):
        assert record["probabilities"] == pytest.approx(stacked[:, i].mean(0), abs=1e-4)
        assert record["spread"] == pytest.approx(stacked[:, i].std(0), abs=1e-4)
        assert record["prediction"] == STAGE_GROUPS[int(stacked[:, i].mean(0).argmax())]
    with pytest.raises(ValueError, match="disagree on the case"):
        build_task("stage_classification").combine([members[0], members[1][::-1], members[2]])


def test_the_external_interval_is_the_patient_bootstrap_of_the_reports_own_scorer():
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 4, 120)
    probabilities = rng.dirichlet(np.ones(4), size=120) + 0.3 * np.eye(4)[labels]
    records = [{"case_id": f"c{i}", "target": STAGE_GROUPS[y], "probabilities": list(p / p.sum())}
               for i, (p, y) in enumerate(zip(probabilities, labels, strict=True))]  # fmt: skip
    from gx_ray.metrics.classification import classification_metrics

    score = score_records("stage_classification", records, "auc", n_resamples=300)
    expected = classification_metrics(np.array([r["probabilities"] for r in records]), labels)["auc"]
    assert score["value"] == pytest.approx(expected) and score["low"] < expected < score["high"]
    assert score["cases"] == 120 and score["high"] - score["low"] < 20


# --- end to end --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    from gx_ray.tracking.server import free_port

    return free_port()


def _absolute(cell: object, folder: Path) -> object:
    """A manifest cell naming a file relative to ``folder`` as an absolute path; text and numbers as they are."""
    try:
        return str((folder / cell).resolve()) if isinstance(cell, str) and cell and (folder / cell).exists() else cell
    except OSError:  # report text, too long for a file name
        return cell


def _probabilities(records: list[dict]) -> dict[str, list[float]]:
    return {str(r["case_id"]): r["probabilities"] for r in records}


@pytest.mark.slow
def test_a_finalized_sweep_is_registered_loaded_served_and_predicts_on_new_patients(
    ray_cluster, demo_raw, demo_prepared, tmp_path, capsys
):
    import mlflow

    from gx_ray.analysis.runs import test_records
    from gx_ray.data.demo.cohort import generate_cohort
    from gx_ray.data.manifest import read_manifest_frame, write_manifest_for
    from gx_ray.deploy.finalize import FinalizeOptions, finalize
    from gx_ray.sweep.driver import SweepOptions, run_sweep
    from gx_ray.tracking.server import LocalMlflowServer
    from tests.common import tiny_cohort

    space = small_stage_space(tmp_path / "space.yaml", 2, [0], "finalize, end to end")
    document = space.read_text(encoding="utf-8").replace("grid:\n", "grid:\n  schema: [image_only, image_table]\n")
    space.write_text(document, encoding="utf-8")
    shards = str(demo_prepared.shard_dir)
    # the user's route: the sweep keeps its own MLflow store, which finalize and predict serve again for themselves
    sweep = run_sweep(SweepOptions(space=str(space), output=tmp_path / "out", data=shards))
    assert (sweep.finished, sweep.failed) == (2, 0)
    result = finalize(FinalizeOptions(str(sweep.output), "stage_classification"))
    test_cases = {r["case_id"] for r in split_rows(shards, "test")}

    with LocalMlflowServer(sweep.output / "mlflow") as server:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(server.uri)
        # chosen by validation: the configuration whose trial validated best
        trials = client.search_runs([client.get_run(sweep.parent_run_id).info.experiment_id],
                                    f"tags.`mlflow.parentRunId` = '{sweep.parent_run_id}'")  # fmt: skip
        best = max(trials, key=lambda r: r.data.metrics["best_val_primary"])
        assert result.choice["settings"]["schema"] == best.data.tags["schema"]
        version = client.get_model_version_by_alias("gx-ray-stage_classification", "champion")
        assert version.version == result.version and "Rule: best mean validation score" in version.description
        # the card's sections, its tables (not JSON), the version's tags and the chosen configuration as params
        for section in ("## Intended use", "### Out-of-scope use", "## Training data", "## Evaluation",
                        "## Limitations", "## Preprocessing"):  # fmt: skip
            assert f"\n{section}\n" in version.description
        assert "Not a medical device" in version.description and "synthetic patients" in version.description
        assert "| setting | value |" in version.description and "| fingerprint | min | max |" in version.description
        manifest = json.loads((demo_prepared.shard_dir / "manifest.json").read_text(encoding="utf-8"))
        tags = {
            "task": "stage_classification", "schema": best.data.tags["schema"], "sweep": sweep.sweep_id,
            "cohort": "demo", "cohort_fingerprint": manifest["fingerprint"]["sha256"],
            "cohort_manifest_sha256": best.data.tags["gx_ray.manifest_sha256"], "select": "best",
        }  # fmt: skip
        assert {k: version.tags.get(k) for k in tags} == tags
        source = client.get_run(version.run_id)
        assert source.info.run_id == result.run_id and source.data.params["schema"] == best.data.tags["schema"]
        assert {k: source.data.params[k] for k in result.choice["settings"]} == {
            k: str(v) for k, v in result.choice["settings"].items()}  # fmt: skip
        assert source.data.params["finalize.select"] == "best"
        # the selection-corrected estimate from the trials' validation predictions: 2 validation patients leave at
        # most one out-of-bag patient, whom no AUC can score, so the card says why there is none, not a number
        assert all(test_records(server.uri, t.info.run_id, split="val") for t in trials)
        selection = result.choice["selection"]
        assert "corrected" not in selection and selection["note"].startswith("no selection-corrected estimate: ")
        assert selection["note"] in result.summary() and selection["note"] in version.description
        own = _probabilities(test_records(server.uri, result.run_id))  # the refit's own test predictions
        assert set(own) == test_cases
        assert any(round(p, 4) != p for ps in own.values() for p in ps)  # stored at full precision, not 4 decimals

        # the pyfunc on manifest rows from the raw files: the same preprocessing, the same predictions; a bad row is
        # skipped with its reason, never predicted
        manifest = write_manifest_for(demo_raw, tmp_path / "manifest" / "cohort.csv")
        frame, _ = read_manifest_frame(manifest)
        frame = frame[frame["case_id"].isin(test_cases)].reset_index(drop=True)
        frame = frame.map(lambda cell: _absolute(cell, manifest.parent))  # a request names files absolutely
        broken = frame.iloc[[0]].assign(case_id="broken", patient_id="broken", venous="/nowhere/venous.nii.gz")
        request = pd.concat([frame, broken], ignore_index=True)
        mlflow.set_tracking_uri(server.uri)
        answer = mlflow.pyfunc.load_model(result.model_uri).predict(request)
        predicted_rows = answer[answer["status"] == "predicted"]
        assert set(predicted_rows["case_id"]) == test_cases
        for row in predicted_rows.itertuples():
            assert json.loads(row.probabilities) == pytest.approx(own[row.case_id], abs=1e-4)
        (skipped,) = answer[answer["status"] == "skipped"].itertuples()
        assert skipped.case_id == "broken" and "venous" in skipped.reason

        # served: a real request to `mlflow models serve`
        port = _free_port()
        env = {**os.environ, "MLFLOW_TRACKING_URI": server.uri}
        serve = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", result.model_uri, "--env-manager", "local",
             "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        try:
            body = json.dumps({"dataframe_split": frame.to_dict(orient="split")}).encode()
            deadline, reply = time.monotonic() + 180, None
            while reply is None and time.monotonic() < deadline and serve.poll() is None:
                try:
                    post = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                                  {"Content-Type": "application/json"})  # fmt: skip
                    reply = json.loads(urllib.request.urlopen(post, timeout=60).read())
                except OSError:
                    time.sleep(1)
            assert reply is not None, serve.stderr.read().decode() if serve.poll() is not None else "no answer"
            # a fresh process loaded the registered model: the refit's own test predictions, patient by patient
            served = {row["case_id"]: row for row in reply["predictions"]}
            assert set(served) == test_cases and {row["status"] for row in served.values()} == {"predicted"}
            for case_id, probabilities in own.items():
                assert json.loads(served[case_id]["probabilities"]) == pytest.approx(probabilities, abs=1e-4)
        finally:
            os.killpg(serve.pid, 15)
            serve.wait(30)

    # a cohort prepared apart, with labels and one broken case (its venous phase gone): per-case outputs, the case
    # skipped with its reason, the external evaluation beside the model's own test
    raw = tmp_path / "hospital_b"
    generate_cohort(raw, dataclasses.replace(tiny_cohort(), cases=6, seed=99))
    gone = sorted((raw / "imaging").iterdir())[0]
    venous = next(p for p in gone.iterdir() if p.name.split(".")[0] == "venous")  # a file, or a DICOM folder
    shutil.rmtree(venous) if venous.is_dir() else venous.unlink()
    out = tmp_path / "hospital_b_predicted"  # the model fetched from the sweep's own store, served for the command
    # the command in this process (a fresh process loaded the model above, served): a fresh interpreter's imports and
    # a Ray cluster of its own for the preparation cost ~25 s of CPU on 2 cores
    command = command_module(ROOT / "jobs" / "predict.py")
    capsys.readouterr()  # what the sweep and finalize printed
    code = command.main(["--model", result.model_uri, "--sweep", str(sweep.output), "--data", str(raw), "--out",
                         str(out)])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    assert "external" in printed.out
    rows = pd.read_csv(out / "predictions.csv")
    assert len(rows) == 5 and gone.name not in set(rows["case_id"])
    skipped = pd.read_csv(out / "skipped.csv")
    assert list(skipped["case_id"]) == [gone.name] and skipped["reason"].iloc[0]
    evaluation = {e["metric"]: e for e in json.loads((out / "evaluation.json").read_text(encoding="utf-8"))}
    assert evaluation["auc"]["external"]["cases"] == 5 and evaluation["auc"]["internal"]["cases"] == len(test_cases)
    assert "| auc |" in (out / "evaluation.md").read_text(encoding="utf-8")


def test_finalize_prints_the_whole_predict_command_naming_the_store_that_holds_the_model(tmp_path):
    from gx_ray.analysis.report import SweepStore
    from gx_ray.deploy.finalize import FinalizeResult, predict_command
    from jobs.predict import build_parser

    own = tmp_path / "own"  # a sweep that kept its own MLflow store, served again only while finalize ran
    (own / "mlflow").mkdir(parents=True)
    (own / "mlflow" / "mlflow.db").touch()
    uri = "models:/gx-ray-stage_classification@champion"
    cases = [  # (the sweep's folder, its tracking URI, finalize's --mlflow-uri) -> the store predict must be given
        (own, "http://127.0.0.1:40123", None, ("sweep", str(own))),
        (own, "http://mlflow:5000", "http://mlflow:5000", ("mlflow_uri", "http://mlflow:5000")),
        (tmp_path / "logged", "http://tracking:5000", None, ("mlflow_uri", "http://tracking:5000")),
    ]
    choice = {"label": "stage_classification", "description": "lr=0.1", "metric": "auc", "score": 75.0, "repeats": 2}
    test = {"metric": "auc", "value": 80.0, "low": 70.0, "high": 90.0, "cases": 48}
    for folder, tracking, mlflow_uri, (flag, value) in cases:
        command = predict_command(uri, SweepStore(tracking, "demo", None, "", folder), mlflow_uri)
        result = FinalizeResult(uri, "1", "run", folder / "model", choice, test, 1.0, command)
        (line,) = [line for line in result.summary().splitlines() if "jobs/predict.py" in line]
        words = shlex.split(line)
        assert words[words.index("jobs/predict.py") - 1] == "python"
        args = build_parser().parse_args(words[words.index("jobs/predict.py") + 1 :])  # every flag is predict's
        assert args.model == uri and getattr(args, flag) == value and args.data and args.out
        assert (args.sweep, args.mlflow_uri).count(None) == 1


def test_predict_refuses_a_model_uri_it_cannot_find_in_one_line_naming_where_to_look(tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(store).search_experiments()  # an empty local store, its tables made here
    command = [sys.executable, str(ROOT / "jobs/predict.py"), "--model", "models:/gx-ray-stage_classification@champion",
               "--data", str(tmp_path / "cohort"), "--out", str(tmp_path / "out")]  # fmt: skip
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    done = subprocess.run(command, capture_output=True, encoding="utf-8", cwd=tmp_path, env=env, timeout=300)
    said = (done.stdout + done.stderr).strip()
    assert done.returncode != 0 and "Traceback" not in said and len(said.splitlines()) == 1, said
    assert "--sweep" in said and "--mlflow-uri" in said and "gx-ray-stage_classification" in said
    assert not (tmp_path / "out").exists()  # nothing left behind by a refused run


def test_what_cannot_predict_on_new_patients_is_refused_before_anything_is_trained():
    from gx_ray.deploy.bundle import check_predictable

    with pytest.raises(ValueError, match="lesion_qa builds its questions from each split's material"):
        check_predictable(TrialConfig.from_flat({"task": "lesion_qa"}))
    with pytest.raises(ValueError, match="vqa does not say how an ensemble's predictions combine.*--refit"):
        check_predictable(TrialConfig.from_flat({"task": "vqa"}), ensemble=True)
    check_predictable(TrialConfig.from_flat({"task": "vqa"}))  # one refitted model: fine
    check_predictable(TrialConfig.from_flat({"task": "stage_classification"}), ensemble=True)
