"""Fault injection: a sweep (its own local Ray cluster and MLflow server, started by ``jobs/sweep.py``) is hurt while
its trials train, then left to finish or resumed. Each test ends with every cell FINISHED exactly once: one MLflow run
per cell and no other run of it in any status, one parent, no run left RUNNING, epochs 0 … E−1 each logged once."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from gx_ray.tracking import KIND_TAG, SWEEP_TAG, TRIAL_TAG
from gx_ray.tracking.server import PID_FILE, LocalMlflowServer
from tests.common import (
    FAULT_EPOCHS,
    FAULT_SEEDS,
    ROOT,
    SweepProcess,
    command_module,
    process_alive,
    server_record,
    training,
    trial_runs,
    trial_workers,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mlflow_polled_quickly")]


def assert_every_cell_finished_once(sweep: SweepProcess) -> None:
    client, runs = sweep.client(), sweep.runs()
    parents = [r for r in runs if r.data.tags.get(KIND_TAG) == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [(p.info.status) for p in parents]
    trials = trial_runs(runs)
    assert len(runs) == 1 + len(FAULT_SEEDS), f"{len(runs)} runs: a cell was run twice or lost"
    assert sorted(r.data.tags["seed"] for r in trials) == [str(s) for s in FAULT_SEEDS]
    assert len({r.data.tags[TRIAL_TAG] for r in trials}) == len(FAULT_SEEDS)
    assert {r.info.status for r in runs} == {"FINISHED"}, "a run was left RUNNING, KILLED or FAILED"
    for run in trials:
        assert run.data.tags[SWEEP_TAG] == parents[0].data.tags[SWEEP_TAG]
        for key in ("epoch", "val_primary", "train_loss"):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert steps == list(range(FAULT_EPOCHS)), f"{key} of seed {run.data.tags['seed']}: steps {steps}"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "test_primary")] == [FAULT_EPOCHS - 1]
        # the learning rate of every optimiser step, numbered across epochs, each once (a retried epoch's too)
        lr_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "lr"))
        assert lr_steps == list(range(len(lr_steps))) and len(lr_steps) >= FAULT_EPOCHS, lr_steps


def test_a_sweep_hurt_four_ways_finishes_every_cell_once_with_the_numbers_of_one_left_alone(
    demo_prepared, tmp_path, capsys, monkeypatch
):
    """One sweep takes every fault in turn: its trial worker killed mid-epoch (the trial is retried from its last
    checkpoint), its MLflow server killed (restarted), Ctrl-C (exit 130, its state saved, its server stopped, no run
    left RUNNING), then the resumed sweep killed outright (its server left running, which the next resume stops). That
    one finishes every cell exactly once, the report command writes its report again, and every number trained is
    the one a sweep of the same cells left alone trains: a retried or resumed epoch goes on as if nothing had
    happened, and a lost server loses no metric."""
    (tmp_path / "hurt").mkdir()
    sweep = SweepProcess(tmp_path / "hurt", demo_prepared.shard_dir)
    process = sweep.start()
    # past its second epoch's end, so that Tune holds the first epoch's checkpoint (~2.5 s an epoch here)
    sweep.wait_for(lambda runs: training(runs, past_epoch=1), process, "a trial past its second epoch")
    workers = trial_workers(process.pid)
    assert workers, "no trial worker process found"
    for worker in workers:
        worker.kill()
    # the retried trial logs where it went on from (a retry from the start logs none), before any other fault
    sweep.wait_for(lambda runs: any("resumed_from_epoch" in r.data.metrics for r in trial_runs(runs)), process,
                   "a trial resumed from its checkpoint")  # fmt: skip
    killed = server_record(sweep)["pid"]
    os.killpg(killed, signal.SIGKILL)  # the server and its worker, while the retried trial trains
    # Ctrl-C in the terminal while the second cell trains, its server the restarted one
    sweep.wait_for(lambda runs: any(r.data.tags["seed"] == "1" for r in trial_runs(runs) if training([r])), process,
                   "the second cell training")  # fmt: skip
    assert server_record(sweep)["pid"] != killed
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=180) == 130, sweep.tail()
    assert "--resume" in sweep.tail() and "interrupted" in sweep.tail()
    record = json.loads((sweep.folder / "sweep.json").read_text(encoding="utf-8"))
    assert record["interrupted"] is True
    assert not (sweep.folder / "mlflow" / PID_FILE).exists(), "the MLflow server outlived the sweep"
    statuses = {r.info.status for r in sweep.runs()}
    assert "RUNNING" not in statuses  # the trials Ctrl-C stopped are KILLED until --resume opens them again

    process = sweep.start("--resume")
    sweep.wait_for(training, process, "the stopped cell training again")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    leftover = server_record(sweep)["pid"]
    assert process_alive(leftover), "expected the killed driver's MLflow server to be left running"
    assert sweep.run("--resume") == 0, sweep.tail()
    assert not process_alive(leftover), "the resumed sweep did not stop the leftover server"
    printed = sweep.whole()
    assert "a killed sweep left running" in printed, printed[-20000:]
    # the killed worker said in one line (which trial, why, what now), not as Tune's twenty-line Ray traceback
    assert "ActorDiedError" in printed and "retried from its last checkpoint" in printed, printed[-4000:]
    assert "Traceback" not in printed, printed[-4000:]
    assert "starting it again" in printed  # the killed server
    assert_every_cell_finished_once(sweep)
    assert_provenance(sweep, Path(demo_prepared.shard_dir) / "manifest.json")
    # the report command writes the report again from the sweep's folder alone (sweep.json names its store)
    (sweep.folder / "report" / "summary.html").unlink()
    command = command_module(ROOT / "analysis" / "report.py")  # in this process, as the sweep left alone below
    assert command.main(["--sweep", str(sweep.folder)]) == 0, capsys.readouterr().err[-3000:]
    assert "summary.md" in capsys.readouterr().out and (sweep.folder / "report" / "summary.html").is_file()

    # the sweep left alone: the same command in this process, on its Ray cluster (only its numbers are compared; a
    # driver process would import and start Ray again, ~15 s of CPU on 2 cores), its MLflow clients retrying
    (tmp_path / "alone").mkdir()
    alone = SweepProcess(tmp_path / "alone", demo_prepared.shard_dir)
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name)
    argv = [str(alone.output) if a == "out" else a for a in alone.command[2:]]
    assert command_module(ROOT / "jobs" / "sweep.py").main(argv) == 0, capsys.readouterr().err[-3000:]
    assert_every_cell_finished_once(alone)
    assert _trained(sweep) == _trained(alone)


def _trained(sweep: SweepProcess) -> dict[str, dict[str, list[float]]]:
    """Per seed: every epoch's training loss and validation score, and the test score (as text: NaN equals NaN)."""
    client = sweep.client()
    return {
        r.data.tags["seed"]: {
            key: [str(m.value) for m in sorted(client.get_metric_history(r.info.run_id, key), key=lambda m: m.step)]
            for key in ("train_loss", "val_primary", "test_primary")
        }
        for r in trial_runs(sweep.runs())
    }


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


def assert_provenance(sweep: SweepProcess, manifest: Path) -> None:
    """Every run (parent and trials) names the code, the libraries and the cohort; trials their device and batch."""
    for run in sweep.runs():
        tags = run.data.tags
        assert tags["gx_ray.code"].startswith(("git:", "gx-ray ")), tags["gx_ray.code"]
        for package in ("torch", "ray", "monai", "transformers", "mlflow"):
            assert tags[f"gx_ray.version.{package}"] not in ("", "absent")
        assert tags["gx_ray.manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    for run in trial_runs(sweep.runs()):
        assert run.data.tags["gx_ray.device"].startswith("cpu")
        assert run.data.tags["gx_ray.effective_batch"] == "2" and run.data.tags["gx_ray.micro_batch"] == "2"
