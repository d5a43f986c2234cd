"""Fault injection for every searcher and scheduler (``tests/test_faults.py`` has the grid's): a sweep of small
trials (its own local Ray cluster and MLflow server, started by ``jobs/sweep.py``) has a trial worker killed, then
its driver, and is resumed. Every trial ends once, and nothing is counted twice. A file of its own so that CI's
processes share the fault tests."""

from __future__ import annotations

import os
import signal

import pytest
import yaml
from mlflow.entities import ViewType

from gx_ray.sweep.budget import read_ledger
from gx_ray.sweep.driver import EXPERIMENT
from gx_ray.tracking import ABANDONED_TAG, KIND_TAG, TRIAL_TAG
from tests.common import FAULT_EPOCHS, SweepProcess, fault_space, training, trial_runs, trial_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mlflow_polled_quickly")]


PAIRS = {
    # a population of two, exploited after each of the first two epochs
    "random+pbt": ({"searcher": "random", "scheduler": "pbt", "pbt": {"interval": 1}}, 2),
    # brackets of 3 trials halved after the first epoch, and of 2 that train all three
    "bohb+bohb": ({"searcher": "bohb", "scheduler": "bohb", "bohb": {"reduction_factor": 3}}, 3),
    # Optuna's study restored from Tune's searcher checkpoint; ASHA's rungs at epochs 1 and 2 built anew
    "optuna+asha": ({"searcher": "optuna", "scheduler": "asha"}, 3),
}
"""With the grid without a scheduler (``tests/test_faults.py``), every Tune class a space can name, each under a kill
and a resume: grid and random are both Tune's variant generator (``BasicVariantGenerator``), ``none`` is Tune's FIFO
scheduler. The other pairs (``optuna+none``, ``random+asha``, ``grid+asha``) recombine these classes, which a
resume restores apart (the searcher from its own checkpoint, the scheduler from the trials): a sweep each would add
2–3 minutes of CI and no class."""


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
    space = yaml.safe_load(fault_space(tmp_path).read_text(encoding="utf-8"))
    space["fixed"]["seed"] = space.pop("grid")["seed"][0]
    space["fixed"].pop("optimiser.lr")
    space.update(document, budget={"samples": samples},
                 sample={"optimiser.lr": {"type": "loguniform", "low": 1.0e-4, "high": 1.0e-3}})  # fmt: skip
    (tmp_path / "pair.yaml").write_text(yaml.safe_dump(space), encoding="utf-8")
    sweep = SweepProcess(tmp_path, demo_prepared.shard_dir, tmp_path / "pair.yaml", at_once=2)
    process = sweep.start()
    sweep.wait_for(lambda runs: training(runs, past_epoch=1), process, "a trial past its second epoch")
    for worker in trial_workers(process.pid):
        worker.kill()

    def going_on(runs: list) -> bool:  # every trial started, and one restored from a checkpoint since
        return len(trial_runs(runs)) == samples and any(
            "resumed_from_epoch" in r.data.metrics for r in trial_runs(runs)
        )

    sweep.wait_for(going_on, process, "every trial started and one restored")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert sweep.run("--resume") == 0, sweep.tail()
    client, runs = sweep.client(), sweep.runs()
    parents, trials = [r for r in runs if r.data.tags.get(KIND_TAG) == "sweep"], trial_runs(runs)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(trials) == samples and len({r.data.tags[TRIAL_TAG] for r in trials}) == samples
    for run in trials:
        stopped = run.data.tags.get("gx_ray.stopped_early") == "true"
        assert run.info.status == ("KILLED" if stopped else "FINISHED"), (run.info.status, run.data.tags)
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_primary"))
        # each epoch it trained once, from 0 on; a PBT exploit goes on from the donor's epoch, so the epochs the donor
        # trained are missing, and the run records the exploit at the first epoch it trained after it
        # (schedule/epoch-NNNN.json): a gap without that record is an epoch lost
        records = sweep.folder.glob(f"mlflow/artifacts/*/{run.info.run_id}/artifacts/schedule/epoch-*.json")
        exploits = {int(path.stem.removeprefix("epoch-")) for path in records}
        gaps = {s for s in steps if s > 0 and s - 1 not in steps}
        assert len(set(steps)) == len(steps) and steps[0] == 0 and gaps <= exploits, (steps, exploits)
        assert stopped or steps[-1] == FAULT_EPOCHS - 1, steps
        assert [m.step for m in client.get_metric_history(run.info.run_id, "test_primary")] == (
            [] if stopped else [FAULT_EPOCHS - 1]
        )
    assert any(r.info.status == "FINISHED" for r in trials)
    # a run whose trial the killed driver started after Tune last saved is deleted, saying why; its cost is kept
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    deleted = client.search_runs([experiment], run_view_type=ViewType.DELETED_ONLY)
    assert all(ABANDONED_TAG in r.data.tags for r in deleted)
    ledger = read_ledger(sweep.folder)
    assert sorted(r["trial_id"] for r in ledger if r["status"] != "ABANDONED") == sorted(
        r.data.tags[TRIAL_TAG] for r in trials
    )
    assert sorted(r["trial_id"] for r in ledger if r["status"] == "ABANDONED") == sorted(
        r.data.tags[TRIAL_TAG] for r in deleted
    )
