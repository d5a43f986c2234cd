"""Fault injection: a sweep (its own local Ray cluster and MLflow server, started by ``jobs/sweep.py``) is hurt while
its trials train, then left to finish or resumed. Each test ends with every cell FINISHED exactly once: one MLflow run
per cell and no other run of it in any status, one parent, no run left RUNNING, epochs 0 … E−1 each logged once."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from gx_ray.sweep.driver import EXPERIMENT
from gx_ray.tracking import ABANDONED_TAG, KIND_TAG, SWEEP_TAG, TRIAL_TAG
from gx_ray.tracking.server import PID_FILE, LocalMlflowServer
from tests.common import ROOT, process_alive, small_stage_space

EPOCHS, SEEDS = 3, (0, 1)
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _poll_quickly(monkeypatch):
    """The test's own polls of a server that may be down fail at once (the sweep's processes keep their retries)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def _space(tmp_path: Path) -> Path:
    description = "two small stage-classification trials, three epochs each"
    # the splits in memory, shuffled in windows smaller than the training share: a resumed epoch must draw the
    # uninterrupted epoch's batches although its process has not read the split before
    fixed = {"optimiser.lr": 1.0e-3, "data.in_memory": True, "data.shuffle_buffer": 2}
    return small_stage_space(tmp_path / "faults.yaml", EPOCHS, SEEDS, description, **fixed)


class Sweep:
    """``jobs/sweep.py`` in a process group of its own (as a terminal runs it), one trial at a time."""

    def __init__(self, tmp_path: Path, data: Path, space: Path | None = None, at_once: int = 1):
        self.cwd, self.output = tmp_path, tmp_path / "out"
        self.command = [  # a relative --output, as users type it (Tune's restore once refused one)
            sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", str(space or _space(tmp_path)),
            "--output", "out", "--data", str(data), "--max-concurrent", str(at_once),
        ]  # fmt: skip
        self.log = tmp_path / "sweep.log"

    def start(self, *extra: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}  # the sweep's own
        with open(self.log, "ab") as log:
            command = [*self.command, *extra]
            return subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd, env=env
            )

    def run(self, *extra: str, timeout: float = 600) -> int:
        process = self.start(*extra)
        return process.wait(timeout=timeout)

    def tail(self) -> str:
        return self.whole()[-4000:]

    def whole(self) -> str:
        """Everything the sweep's runs printed: a message asserted on must not fall out of a tail that later output
        (once, Tune's twenty-line report of a trial error) has filled."""
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    @property
    def folder(self) -> Path | None:
        folders = [p.parent.parent for p in self.output.glob("*/mlflow/mlflow.db")]
        return folders[0] if folders else None

    def client(self, live: bool = False) -> MlflowClient:
        """While the sweep runs, through its server (a second writer could race the server creating the store);
        once it has ended, the store itself."""
        if live:
            return MlflowClient(f"http://127.0.0.1:{_server_record(self)['port']}")
        return MlflowClient(f"sqlite:///{self.folder / 'mlflow' / 'mlflow.db'}")

    def runs(self, live: bool = False) -> list:
        client = self.client(live)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        return client.search_runs([experiment.experiment_id]) if experiment else []

    def wait_for(self, condition: Callable[[list], bool], process: subprocess.Popen, what: str) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert process.poll() is None, f"the sweep ended before {what}:\n{self.tail()}"
            try:
                if self.folder and condition(self.runs(live=True)):
                    return
            except Exception:  # the store is being created, or is busy
                pass
            time.sleep(0.3)
        raise AssertionError(f"no {what} within 300 s:\n{self.tail()}")


def _trials(runs: list) -> list:
    return [r for r in runs if r.data.tags.get(KIND_TAG) == "trial"]


def _training(runs: list, past_epoch: int = 0) -> bool:
    """A trial has logged epoch ``past_epoch`` (or a later one) and not yet finished: it is training."""
    return any(r.info.status == "RUNNING" and r.data.metrics.get("epoch", -1) >= past_epoch for r in _trials(runs))


def assert_every_cell_finished_once(sweep: Sweep) -> None:
    client, runs = sweep.client(), sweep.runs()
    parents = [r for r in runs if r.data.tags.get(KIND_TAG) == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [(p.info.status) for p in parents]
    trials = _trials(runs)
    assert len(runs) == 1 + len(SEEDS), f"{len(runs)} runs: a cell was run twice or lost"
    assert sorted(r.data.tags["seed"] for r in trials) == [str(s) for s in SEEDS]
    assert len({r.data.tags[TRIAL_TAG] for r in trials}) == len(SEEDS)
    assert {r.info.status for r in runs} == {"FINISHED"}, "a run was left RUNNING, KILLED or FAILED"
    for run in trials:
        assert run.data.tags[SWEEP_TAG] == parents[0].data.tags[SWEEP_TAG]
        for key in ("epoch", "val_primary", "train_loss"):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert steps == list(range(EPOCHS)), f"{key} of seed {run.data.tags['seed']}: steps {steps}"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "test_primary")] == [EPOCHS - 1]
        # the learning rate of every optimiser step, numbered across epochs, each once (a retried epoch's too)
        lr_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "lr"))
        assert lr_steps == list(range(len(lr_steps))) and len(lr_steps) >= EPOCHS, lr_steps


def _server_record(sweep: Sweep) -> dict:
    return json.loads((sweep.folder / "mlflow" / PID_FILE).read_text(encoding="utf-8"))


def test_ctrl_c_then_a_killed_driver_each_resume_to_every_cell_finished_once(demo_prepared, tmp_path):
    """Ctrl-C stops the sweep cleanly (exit 130, its state saved, its server stopped, no run left RUNNING); the resumed
    sweep, killed outright once a trial has finished, leaves its server running, which the next resume stops; that one
    finishes every cell exactly once, and the report command writes its report again."""
    sweep = Sweep(tmp_path, demo_prepared.shard_dir)
    process = sweep.start()
    sweep.wait_for(_training, process, "a trial training")
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal
    assert process.wait(timeout=180) == 130, sweep.tail()
    assert "--resume" in sweep.tail() and "interrupted" in sweep.tail()
    record = json.loads((sweep.folder / "sweep.json").read_text(encoding="utf-8"))
    assert record["interrupted"] is True
    assert not (sweep.folder / "mlflow" / PID_FILE).exists(), "the MLflow server outlived the sweep"
    statuses = {r.info.status for r in sweep.runs()}
    assert "RUNNING" not in statuses  # the trials Ctrl-C stopped are KILLED until --resume opens them again

    process = sweep.start("--resume")
    sweep.wait_for(lambda runs: any(r.info.status == "FINISHED" for r in _trials(runs)), process, "a finished trial")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    leftover = _server_record(sweep)["pid"]
    assert process_alive(leftover), "expected the killed driver's MLflow server to be left running"
    assert sweep.run("--resume") == 0, sweep.tail()
    assert not process_alive(leftover), "the resumed sweep did not stop the leftover server"
    assert "a killed sweep left running" in sweep.whole(), sweep.whole()[-20000:]
    assert_every_cell_finished_once(sweep)
    # the report command writes the report again from the sweep's folder alone (sweep.json names its store)
    (sweep.folder / "report" / "summary.html").unlink()
    report = subprocess.run(
        [sys.executable, str(ROOT / "analysis" / "report.py"), "--sweep", str(sweep.folder)],
        capture_output=True, encoding="utf-8", errors="replace", timeout=600,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    assert "summary.md" in report.stdout and (sweep.folder / "report" / "summary.html").is_file()


def _trial_workers(driver: int) -> list[psutil.Process]:
    """This sweep's trial workers only (its local Ray runs under its driver): another test's sweep may run beside it."""
    found = []
    for child in psutil.Process(driver).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
            if "ray::ImplicitFunc" in " ".join(child.cmdline()):
                found.append(child)
    return found


def _trained(sweep: Sweep) -> dict[str, dict[str, list[float]]]:
    """Per seed: every epoch's training loss and validation score, and the test score (as text: NaN equals NaN)."""
    client = sweep.client()
    return {
        r.data.tags["seed"]: {
            key: [str(m.value) for m in sorted(client.get_metric_history(r.info.run_id, key), key=lambda m: m.step)]
            for key in ("train_loss", "val_primary", "test_primary")
        }
        for r in _trials(sweep.runs())
    }


def test_a_killed_trial_worker_and_a_killed_mlflow_server_lose_nothing_and_change_no_number(demo_prepared, tmp_path):
    """Two sweeps of the same cells: one has its trial worker killed mid-epoch (the trial is retried from its last
    checkpoint), the other its MLflow server killed mid-sweep (restarted). Each finishes every cell once, and both
    trained the same numbers: a retried epoch goes on as if nothing had happened, and a lost server loses no metric.
    Should either go wrong, the two differ (they fail in different places)."""
    (tmp_path / "worker").mkdir()
    sweep = Sweep(tmp_path / "worker", demo_prepared.shard_dir)
    process = sweep.start()
    # past its second epoch's end, so that Tune holds the first epoch's checkpoint (~2.5 s an epoch here)
    sweep.wait_for(lambda runs: _training(runs, past_epoch=1), process, "a trial past its second epoch")
    workers = _trial_workers(process.pid)
    assert workers, "no trial worker process found"
    for worker in workers:
        worker.kill()
    assert process.wait(timeout=600) == 0, sweep.tail()
    assert_every_cell_finished_once(sweep)
    client = sweep.client()
    resumed = [m for r in _trials(sweep.runs()) for m in client.get_metric_history(r.info.run_id, "resumed_from_epoch")]
    assert resumed, "no trial resumed from a checkpoint"  # (a retry from the start logs none)
    # said in one line (which trial, why, what now), not as Tune's twenty-line Ray traceback
    printed = sweep.whole()
    assert "ActorDiedError" in printed and "retried from its last checkpoint" in printed, printed[-4000:]
    assert "Traceback" not in printed, printed[-4000:]
    assert_provenance(sweep, Path(demo_prepared.shard_dir) / "manifest.json")

    (tmp_path / "server").mkdir()
    other = Sweep(tmp_path / "server", demo_prepared.shard_dir)
    process = other.start()
    other.wait_for(_training, process, "a trial training")
    os.killpg(_server_record(other)["pid"], signal.SIGKILL)  # the server and its worker
    assert process.wait(timeout=600) == 0, other.tail()
    # the whole log: a trial whose request the kill cut mid-response fails once and is retried from its checkpoint,
    # and its traceback can fill the tail (seen on a slow 2-core machine)
    assert "starting it again" in other.whole()
    assert_every_cell_finished_once(other)
    assert _trained(sweep) == _trained(other)


def test_a_server_first_waited_for_past_its_start_timeout_is_still_asked(tmp_path):
    """The sweep launches its server beside the demo cohort's first preparation (minutes on two cores, a fresh clone's
    main command), so the first wait may begin after the launch's deadline: the server is asked, not given up on."""
    server = LocalMlflowServer(tmp_path / "mlflow", start_timeout_s=0.1).launch()
    try:
        time.sleep(0.5)  # the deadline has passed before anyone waits
        server.wait()
        with urllib.request.urlopen(f"{server.uri}/health", timeout=5) as response:
            assert response.status == 200
    finally:
        server.stop()


def assert_provenance(sweep: Sweep, manifest: Path) -> None:
    """Every run (parent and trials) names the code, the libraries and the cohort; trials their device and batch."""
    for run in sweep.runs():
        tags = run.data.tags
        assert tags["gx_ray.code"].startswith(("git:", "gx-ray ")), tags["gx_ray.code"]
        for package in ("torch", "ray", "monai", "transformers", "mlflow"):
            assert tags[f"gx_ray.version.{package}"] not in ("", "absent")
        assert tags["gx_ray.manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    for run in _trials(sweep.runs()):
        assert run.data.tags["gx_ray.device"].startswith("cpu")
        assert run.data.tags["gx_ray.effective_batch"] == "2" and run.data.tags["gx_ray.micro_batch"] == "2"


# --- the other searchers and schedulers -------------------------------------------------------------------------

PAIRS = {
    # a population of two, exploited after each of the first two epochs
    "random+pbt": ({"searcher": "random", "scheduler": "pbt", "pbt": {"interval": 1}}, 2),
    # brackets of 3 trials halved after the first epoch, and of 2 that train all three
    "bohb+bohb": ({"searcher": "bohb", "scheduler": "bohb", "bohb": {"reduction_factor": 3}}, 3),
    # Optuna's study restored from Tune's searcher checkpoint; ASHA's rungs at epochs 1 and 2 built anew
    "optuna+asha": ({"searcher": "optuna", "scheduler": "asha"}, 3),
    "optuna+none": ({"searcher": "optuna", "scheduler": "none"}, 3),
    "random+asha": ({"searcher": "random", "scheduler": "asha"}, 3),
}
"""With the grid without a scheduler above, every pair of Tune classes a space can name: grid and random are both
Tune's variant generator (``BasicVariantGenerator``), so ``grid+asha`` runs the classes of ``random+asha``, and
``random+none`` those of ``grid+none``."""


@pytest.mark.parametrize("pair", PAIRS)
def test_searchers_and_schedulers_survive_a_killed_worker_and_driver_with_every_trial_once(
    demo_prepared, tmp_path, pair
):
    """A trial worker killed mid-epoch is retried from its checkpoint; the driver killed outright is resumed with
    ``--resume`` (the searcher's state from Tune's searcher checkpoint, the trials from its experiment state). PBT
    and BOHB pause trials and restore them from checkpoints (another trial's, for PBT); ASHA and BOHB stop trials
    (BOHB's first bracket, before the kill). Every trial ends once: FINISHED, or stopped early by the scheduler
    (KILLED, tagged, counted as such: the parent is FINISHED); each epoch it trained logged once, no run left
    RUNNING, one parent."""
    document, samples = PAIRS[pair]
    space = yaml.safe_load(_space(tmp_path).read_text(encoding="utf-8"))
    space["fixed"]["seed"] = space.pop("grid")["seed"][0]
    space["fixed"].pop("optimiser.lr")
    space.update(document, budget={"samples": samples},
                 sample={"optimiser.lr": {"type": "loguniform", "low": 1.0e-4, "high": 1.0e-3}})  # fmt: skip
    (tmp_path / "pair.yaml").write_text(yaml.safe_dump(space), encoding="utf-8")
    sweep = Sweep(tmp_path, demo_prepared.shard_dir, tmp_path / "pair.yaml", at_once=2)
    process = sweep.start()
    sweep.wait_for(lambda runs: _training(runs, past_epoch=1), process, "a trial past its second epoch")
    for worker in _trial_workers(process.pid):
        worker.kill()

    def going_on(runs: list) -> bool:  # every trial started, and one restored from a checkpoint since
        return len(_trials(runs)) == samples and any("resumed_from_epoch" in r.data.metrics for r in _trials(runs))

    sweep.wait_for(going_on, process, "every trial started and one restored")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert sweep.run("--resume") == 0, sweep.tail()
    client, runs = sweep.client(), sweep.runs()
    parents, trials = [r for r in runs if r.data.tags.get(KIND_TAG) == "sweep"], _trials(runs)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(trials) == samples and len({r.data.tags[TRIAL_TAG] for r in trials}) == samples
    for run in trials:
        stopped = run.data.tags.get("gx_ray.stopped_early") == "true"
        assert run.info.status == ("KILLED" if stopped else "FINISHED"), (run.info.status, run.data.tags)
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_primary"))
        assert steps == list(range(len(steps))) and (stopped or len(steps) == EPOCHS), steps
        assert [m.step for m in client.get_metric_history(run.info.run_id, "test_primary")] == (
            [] if stopped else [EPOCHS - 1]
        )
    assert any(r.info.status == "FINISHED" for r in trials)
    # a run whose trial the killed driver started after Tune last saved is deleted, saying why; its cost is kept
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    deleted = client.search_runs([experiment], run_view_type=ViewType.DELETED_ONLY)
    assert all(ABANDONED_TAG in r.data.tags for r in deleted)
    with open(sweep.folder / "ledger.csv", encoding="utf-8") as file:
        ledger = list(csv.DictReader(file))
    assert sorted(r["trial_id"] for r in ledger if r["status"] != "ABANDONED") == sorted(
        r.data.tags[TRIAL_TAG] for r in trials
    )
    assert sorted(r["trial_id"] for r in ledger if r["status"] == "ABANDONED") == sorted(
        r.data.tags[TRIAL_TAG] for r in deleted
    )
