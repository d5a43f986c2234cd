"""Several sweeps on one Ray cluster (``--share``, ``--name``) and spot preemption (:mod:`gx_ray.preemption`).

The registry's rules on a real Ray actor; then, on a cluster of real Ray nodes on 127.0.0.1 (in a network namespace
of the test's own, as tests/test_multinode.py), two sweeps of one space and cohort weighted 2:1 with one MLflow
server, one ``--storage`` and one ``--output``: each keeps to its share while the other waits, neither starves,
nothing of one lands in the other's; and a worker node SIGTERMed mid-trial, whose trial checkpoints after the
signal and finishes on another node with every epoch logged once."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray
from mlflow.tracking import MlflowClient

from gx_ray.sweep.share import ShareRegistry, SweepAlreadyRunning, named
from gx_ray.tracking import KIND_TAG, SWEEP_TAG
from gx_ray.tracking.server import LocalMlflowServer
from tests.common import small_stage_space
from tests.netns import loopback_namespace
from tests.test_multinode import RayNodes, _assert_epochs_once

ROOT = Path(__file__).resolve().parents[1]


# --- the registry -----------------------------------------------------------------------------------------------


def test_a_name_gives_a_sweep_of_the_same_space_and_cohort_an_id_of_its_own():
    assert named("lr_sweep-demo-1a2b3c4d", None) == "lr_sweep-demo-1a2b3c4d"
    assert named("lr_sweep-demo-1a2b3c4d", "b") == named("lr_sweep-demo-1a2b3c4d", "b") != "lr_sweep-demo-1a2b3c4d"
    for bad in ("", "a b", "../x", "-x", "x" * 65):
        with pytest.raises(Exception, match="--name"):
            named("lr_sweep-demo-1a2b3c4d", bad)


def test_the_registry_shares_by_weight_refuses_a_twin_and_forgets_a_silent_driver(ray_cluster):
    registry = ShareRegistry.remote(ttl_s=3)
    cpus = ray.get(registry.total.remote())["CPU"]
    slot = {"CPU": cpus / 4}
    usage = {"heavy": {}, "light": {}}
    ray.get(registry.register.remote("heavy", "driver-1", 2.0))
    ray.get(registry.register.remote("light", "driver-2", 1.0))
    # both sweeps wait with trials; whoever the registry grants takes a slot, until the cluster is full
    while True:
        granted = False
        for key, weight in (("light", 1.0), ("heavy", 2.0)):
            owner = "driver-2" if key == "light" else "driver-1"
            if ray.get(registry.acquire.remote(key, owner, weight, usage[key], slot)):
                usage[key] = {"CPU": usage[key].get("CPU", 0.0) + slot["CPU"]}
                granted = True
        if not granted:
            break
    heavy, light = usage["heavy"].get("CPU", 0.0), usage["light"].get("CPU", 0.0)
    assert heavy + light == pytest.approx(cpus), "a slot left idle while both sweeps waited"
    assert light > 0, "the lighter sweep starved"
    assert heavy >= 2 * light, f"weights 2:1 gave {heavy}:{light} CPUs"

    with pytest.raises(SweepAlreadyRunning, match="--name"):  # the same sweep id from another driver, while live
        ray.get(registry.register.remote("heavy", "driver-3", 1.0))

    # the heavy sweep's driver dies without a word: after the TTL its CPUs go to the light one
    deadline = time.monotonic() + 30
    while "heavy" in ray.get(registry.snapshot.remote())["sweeps"]:
        ray.get(registry.update.remote("light", "driver-2", 1.0, usage["light"], True))  # the live one heartbeats
        assert time.monotonic() < deadline, "a silent driver's entry never expired"
        time.sleep(0.5)
    assert ray.get(registry.acquire.remote("light", "driver-2", 1.0, usage["light"], slot))
    ray.kill(registry)


# --- two sweeps and a preempted node on a real cluster ------------------------------------------------------------


@pytest.fixture
def cluster(monkeypatch) -> Iterator[RayNodes]:
    """A head without CPUs in a loopback namespace, nodes and drivers sharing one Ray token."""
    with loopback_namespace():
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        nodes = RayNodes()
        try:
            nodes.start("head", cpus=0, head=True)
            yield nodes
        finally:
            _stop_watched(nodes)
            nodes.stop()


def _stop_watched(nodes: RayNodes) -> None:
    """Nodes run under the watcher: SIGTERM it (it drains and stops its node, an idle one at once), then make sure
    the node's own process group, which the watcher started, is gone too."""
    for process in nodes.nodes.values():
        try:
            if not any("gx_ray.preemption" in a for a in psutil.Process(process.pid).cmdline()):
                continue
            children = psutil.Process(process.pid).children()
        except psutil.Error:  # the watcher has ended, and its node with it
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        for child in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)


def _sweep(nodes: RayNodes, space: Path, shards: Path, mlflow_uri: str, cwd: Path, log: Path, *extra: str):
    command = [
        sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", str(space), "--address", nodes.address,
        "--data", str(shards), "--storage", str(cwd / "state"), "--output", "out", "--mlflow-uri", mlflow_uri, *extra,
    ]  # fmt: skip
    cwd.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _runs(client: MlflowClient, kind: str) -> list:
    experiment = client.get_experiment_by_name("gx-ray")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    return [r for r in runs if r.data.tags.get(KIND_TAG) == kind]


def _running_at(intervals: list[tuple[int, int]], t: int) -> int:
    return sum(1 for start, end in intervals if start <= t < end)


@pytest.mark.slow
def test_two_weighted_sweeps_share_one_cluster_and_nothing_of_one_lands_in_the_other(
    cluster, demo_prepared, tmp_path
):
    """Weights 2:1 on three CPUs: the first sweep alone takes all three (idle capacity is used), gives one back
    as its trials end once the second waits, then each holds its share until one runs out of trials. The second is
    the same space and cohort under ``--name``; a third, the first's twin, is refused while the first runs."""
    cluster.start("worker", cpus=3)
    space = small_stage_space(tmp_path / "space.yaml", 1, list(range(4)), "two sweeps sharing one cluster")
    driver, shards = tmp_path / "driver", demo_prepared.shard_dir
    with LocalMlflowServer(tmp_path / "mlflow") as server:
        client = MlflowClient(server.uri)
        first = _sweep(cluster, space, shards, server.uri, driver, tmp_path / "first.log", "--share", "2")
        deadline = time.monotonic() + 300
        while sum(r.info.status == "RUNNING" for r in _runs(client, "trial")) < 3:  # alone: all three CPUs
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-4000:]
            time.sleep(0.5)
        second = _sweep(cluster, space, shards, server.uri, driver, tmp_path / "second.log", "--share", "1",
                        "--name", "b")  # fmt: skip
        # the first's twin (another --storage and --output, the same MLflow): refused, the first named
        twin = subprocess.run(
            [sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", str(space), "--address", cluster.address,
             "--data", str(shards), "--storage", str(tmp_path / "twin"), "--output", str(tmp_path / "twin"),
             "--mlflow-uri", server.uri, "--share"],
            cwd=driver, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-4000:]
        assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-4000:]
        parents = {r.data.tags[SWEEP_TAG]: r for r in _runs(client, "sweep")}
        trials = _runs(client, "trial")

    assert twin.returncode == 2 and "running" in twin.stderr and "--name" in twin.stderr, twin.stderr[-3000:]
    # two sweeps, two parent runs, two folders of Tune state and of outputs: nothing shared
    ids = sorted(parents)
    assert len(ids) == 2 and ids[1] == named(ids[0], "b"), ids
    by_sweep = {key: [t for t in trials if t.data.tags[SWEEP_TAG] == key] for key in ids}
    for key in ids:
        runs = by_sweep[key]
        assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}, key
        assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {parents[key].info.run_id}
        trial_dirs = {p.parent.parent.name for p in (driver / "state" / key).glob("*/checkpoint_*/state.pt")}
        assert len(trial_dirs) == 4, f"{key}: checkpoints of {sorted(trial_dirs)}"
        summary = json.loads((driver / "out" / key / "sweep.json").read_text())
        assert summary["sweep_id"] == key and summary["finished"] == 4
    assert not set(os.listdir(driver / "state" / ids[0])) & set(os.listdir(driver / "state" / ids[1])) - {
        "driver"
    }, "the two sweeps' Tune state shares a trial folder"

    # each sweep's trials as intervals of its runs' start and end (within what Ray held for them)
    first_id, second_id = ids
    spans = {key: sorted((r.info.start_time, r.info.end_time) for r in by_sweep[key]) for key in ids}
    second_first_start = spans[second_id][0][0]
    before = [t for t, _ in spans[first_id] if t < second_first_start]
    assert max(_running_at(spans[first_id], t) for t in before) == 3, "alone, the first sweep left CPUs idle"
    # from the second's first trial to the last trial either started, both had trials waiting
    window_end = min(spans[first_id][-1][0], spans[second_id][-1][0])
    assert second_first_start < spans[first_id][-1][0], "the second sweep waited for the first to end: starved"
    instants = [t for key in ids for s, e in spans[key] for t in (s, e) if second_first_start <= t <= window_end]
    for t in instants:
        assert _running_at(spans[first_id], t) <= 2, f"the first sweep over its 2 CPUs at {t} while the second waited"
        assert _running_at(spans[second_id], t) <= 1, f"the second sweep over its 1 CPU at {t} while the first waited"


@pytest.mark.slow
def test_a_node_told_to_go_checkpoints_its_trial_which_finishes_on_another(cluster, demo_prepared, tmp_path):
    """A trial on a node run under the watcher; the watcher SIGTERMed after the trial's first epoch: the node
    drains, the trial checkpoints within its epoch after the signal and goes on on the node that stays, from that
    checkpoint; every epoch and every optimiser step logged once, no failure counted, the drained node gone."""
    epochs = 4
    watcher = (sys.executable, "-m", "gx_ray.preemption", "--grace", "60")
    cluster.start("spot", cpus=1, under=watcher)
    space = small_stage_space(tmp_path / "space.yaml", epochs, [0], "a trial on a preempted node")
    driver = tmp_path / "driver"
    with LocalMlflowServer(tmp_path / "mlflow") as server:
        client = MlflowClient(server.uri)
        log = tmp_path / "sweep.log"
        process = _sweep(cluster, space, demo_prepared.shard_dir, server.uri, driver, log)
        deadline = time.monotonic() + 300
        while not any(r.data.metrics.get("epoch", -1) >= 0 for r in _runs(client, "trial")):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        told_at = time.time()
        os.kill(cluster.nodes["spot"].pid, signal.SIGTERM)  # the spot instance's notice, to the watcher
        cluster.start("standby", cpus=1)  # where the trial goes on (Tune waits for it)
        assert process.wait(timeout=600) == 0, log.read_text()[-4000:]
        assert cluster.nodes["spot"].wait(timeout=120) == 0, "the watcher did not end with its node"
        ids = cluster.wait_for(lambda alive: "spot" not in alive, "the drained node gone")
        (run,) = _runs(client, "trial")
        run = client.get_run(run.info.run_id)
        _assert_epochs_once(client, run, epochs)
        lr_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "lr"))

    assert run.info.status == "FINISHED" and run.data.tags["gx_ray.node_id"] == ids["standby"]
    assert lr_steps == list(range(len(lr_steps))) and len(lr_steps) >= epochs, f"optimiser steps {lr_steps}"
    results = [json.loads(line) for path in (driver / "state").glob("*/*/result.json") for line in path.open()]
    preempted = [r for r in results if r.get("preempted")]
    assert len(preempted) == 1, "the trial did not checkpoint on its node's notice"
    assert preempted[0]["timestamp"] >= int(told_at) and preempted[0].get("checkpoint_dir_name"), preempted[0]
    # the attempt after it went on from that checkpoint: the epoch it was in, not the one before
    restarted_in = preempted[0].get("epoch", -1) + 1
    assert run.data.metrics["resumed_from_epoch"] == restarted_in
    assert "gx_ray.error" not in run.data.tags
