"""An Optuna search's study kept where it outlives the driver (``gx_ray/sweep/study.py``): the default journal in the
sweep's state, databases by URL, two drivers searching one study (every trial asked once, each learning from the
other's), a searcher saved and restored as Tune does on ``--resume``, a sweep's study read back by a fresh reader, and
optuna-dashboard showing it in a real browser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
import yaml
from ray.tune.search.optuna import OptunaSearch

from gx_ray.sweep.study import JOURNAL_FILE, driver_seed, optuna_storage, study_location
from tests.common import small_stage_space

SPACE = {"lr": optuna.distributions.FloatDistribution(1e-5, 1e-1, log=True)}


def test_the_default_study_is_a_journal_in_the_sweeps_state_and_a_database_is_named_by_url(tmp_path):
    assert study_location(None, str(tmp_path), "sw-1") == str(tmp_path / "sw-1" / JOURNAL_FILE)
    assert study_location("postgresql://u@db/optuna", str(tmp_path), "sw-1") == "postgresql://u@db/optuna"
    assert study_location(None, "s3://bucket/state", "sw-1") is None  # an object store holds no journal
    assert isinstance(optuna_storage(str(tmp_path / "j" / JOURNAL_FILE)), optuna.storages.JournalStorage)
    assert isinstance(optuna_storage(f"sqlite:///{tmp_path / 'o.db'}"), optuna.storages.RDBStorage)
    with pytest.raises(ValueError, match="a database URL .* or a journal file path"):
        optuna_storage("s3://bucket/study")
    assert driver_seed("s", tmp_path / "a") == driver_seed("s", tmp_path / "a") != driver_seed("s", tmp_path / "b")


def _searcher(location: str, seed: int) -> OptunaSearch:
    return OptunaSearch(
        SPACE, metric="val", mode="max", study_name="shared", storage=optuna_storage(location), seed=seed
    )


def test_two_drivers_search_one_study_each_trial_asked_once(tmp_path):
    location = str(tmp_path / JOURNAL_FILE)
    drivers = [_searcher(location, driver_seed("shared", tmp_path / name)) for name in ("a", "b")]
    asked = []
    for step in range(4):  # interleaved, as two drivers' trials start and end
        for i, driver in enumerate(drivers):
            trial_id = f"{'ab'[i]}{step}"
            config = driver.suggest(trial_id)
            asked.append(config["lr"])
            driver.on_trial_complete(trial_id, {"val": -abs(config["lr"] - 1e-3)})
    study = optuna.load_study(study_name="shared", storage=optuna_storage(location))
    numbers = [t.number for t in study.trials]
    assert numbers == list(range(8)) and all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert len(set(asked)) == 8  # different seeds: no point proposed twice
    assert sorted(t.params["lr"] for t in study.trials) == sorted(asked)


def test_a_searcher_saved_and_restored_continues_the_same_persistent_study(tmp_path):
    location = str(tmp_path / JOURNAL_FILE)
    first = _searcher(location, 0)
    for i in range(2):
        first.suggest(f"t{i}")
        first.on_trial_complete(f"t{i}", {"val": float(i)})
    first.save(str(tmp_path / "searcher.pkl"))  # what Tune's experiment checkpoint keeps
    restored = OptunaSearch()
    restored.restore(str(tmp_path / "searcher.pkl"))
    restored.suggest("t2")
    restored.on_trial_complete("t2", {"val": 5.0})
    study = optuna.load_study(study_name="shared", storage=optuna_storage(location))  # a fresh reader of the store
    assert [t.value for t in study.trials] == [0.0, 1.0, 5.0] and study.best_value == 5.0


@pytest.mark.slow
def test_a_sweeps_study_persists_and_shows_in_optuna_dashboard(ray_cluster, demo_prepared, tmp_path):
    from playwright.sync_api import sync_playwright

    from gx_ray.sweep.driver import SweepOptions, run_sweep
    from gx_ray.tracking.server import free_port

    path = small_stage_space(tmp_path / "search.yaml", 1, [0], "a persistent study")
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    document.update(searcher="optuna", grid={}, budget={"samples": 2},
                    sample={"optimiser.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2}})  # fmt: skip
    document["fixed"]["seed"] = 0
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    data = str(demo_prepared.shard_dir)
    first = run_sweep(SweepOptions(space=str(path), output=tmp_path / "a", data=data))
    assert (first.finished, first.failed) == (2, 0)
    # the default store: a journal in the sweep's state, named by the sweep id; a fresh reader finds every trial,
    # each with the learning rate its MLflow run trained with (two drivers sharing it: the interleaved test above)
    journal = tmp_path / "a" / first.sweep_id / "ray" / first.sweep_id / JOURNAL_FILE
    study = optuna.load_study(study_name=first.sweep_id, storage=optuna_storage(str(journal)))
    assert [t.number for t in study.trials] == [0, 1]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(first.store_uri)
    runs = client.search_runs([first.experiment_id], f"tags.`mlflow.parentRunId` = '{first.parent_run_id}'")
    trained = sorted(float(r.data.params["optimiser.lr"]) for r in runs)
    assert sorted(t.params["optimiser.lr"] for t in study.trials) == pytest.approx(trained)

    port = free_port()
    dashboard = subprocess.Popen(
        [shutil.which("optuna-dashboard") or f"{Path(sys.executable).parent}/optuna-dashboard", str(journal),
         "--host", "127.0.0.1", "--port", str(port), "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline, listed = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                listed = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5).read())
                break
            except OSError:
                time.sleep(0.5)
        assert [s["study_name"] for s in listed["study_summaries"]] == [first.sweep_id]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/dashboard")
            page.get_by_text(first.sweep_id).first.wait_for(timeout=30_000)  # the studies list
            page.get_by_text(first.sweep_id).first.click()
            page.wait_for_url("**/studies/0**", timeout=30_000)  # the study's own page opens
            browser.close()
    finally:
        os.killpg(dashboard.pid, 15)
        dashboard.wait(30)


def test_a_resume_naming_another_study_is_refused_naming_it(demo_prepared, tmp_path):
    from gx_ray.sweep.resume import ResumeError, check_resumable, record_inputs, sweep_inputs
    from gx_ray.sweep.spaces import load_space

    path = small_stage_space(tmp_path / "search.yaml", 1, [0], "a named study")
    space, shards = load_space(str(path)), str(demo_prepared.shard_dir)
    started = {"store": "postgresql://gx@db/optuna", "name": "lr-team"}
    (tmp_path / "out" / "sw").mkdir(parents=True)
    record_inputs(tmp_path / "out" / "sw", sweep_inputs(space, shards, started))
    check_resumable(tmp_path / "out", "sw", sweep_inputs(space, shards, started))  # the same study: resumes
    with pytest.raises(ResumeError, match='study.name: "lr-team" → "other"'):
        check_resumable(tmp_path / "out", "sw", sweep_inputs(space, shards, {**started, "name": "other"}))
    # resumed with the sweep's own study instead of the named one
    with pytest.raises(ResumeError, match='study: .*lr-team.* → "<absent>"'):
        check_resumable(tmp_path / "out", "sw", sweep_inputs(space, shards))
