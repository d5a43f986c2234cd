"""A real multi-node Ray cluster on this machine: a head without CPUs and worker nodes started with ``ray start``, each
in a working directory, home and temp dir of its own, so trials run away from the head and the driver. Shards and the
sweep's state live in an S3-protocol object store started by the test: moto's standalone server, which speaks S3's
wire protocol and stands in here for S3 or MinIO (no real bucket is reachable from CI).

Nodes, servers and drivers run in a network namespace of the test's own whose one interface is loopback
(:mod:`tests.netns`): every node is 127.0.0.1 and nothing outside reaches them. Every node on one host's loopback
reaches a loopback MLflow, so the sweep's own server is accepted (as one on 127.0.0.1 given with ``--mlflow-uri`` is in
tests/test_sweep_share.py); a node at another address (one more address of the namespace's loopback, standing in for
another machine) gets it refused.

The data are prepared onto the bucket by tasks on a worker node, the sweep reads them there and keeps Tune's and
Train's state there; a worker node killed mid-trial (its raylet) is survived: the trial resumes from its last
checkpoint on a node that joined mid-sweep, nothing lost or logged twice."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from gx_ray.sweep.driver import EXPERIMENT
from gx_ray.tracking import KIND_TAG, TRIAL_TAG
from gx_ray.tracking.server import PID_FILE, free_port
from gx_ray.train.loop import CHECKPOINT_FILE
from tests.common import small_stage_space
from tests.netns import loopback_namespace

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
ELSEWHERE = "10.200.0.1"
"""A node's address that is neither loopback nor the driver's: another machine's, as far as the sweep can tell."""


class RayNodes:
    """``ray start --block`` per node, each a process group with its own cwd, HOME and ``--temp-dir``."""

    def __init__(self):
        # short: a node's sockets live under its temp dir, and a socket path has at most 107 bytes
        self.root, self.ip, self.port = Path(tempfile.mkdtemp(prefix="gxn-")), "127.0.0.1", free_port()
        self.nodes: dict[str, subprocess.Popen] = {}

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def folder(self, name: str) -> Path:
        return self.root / name

    def start(self, name: str, cpus: int, head: bool = False, ip: str = "127.0.0.1", under: tuple = ()) -> None:
        """``under``: a command the node runs under (the preemption watcher, ``python -m gx_ray.preemption``)."""
        folder = self.folder(name)
        (folder / "home").mkdir(parents=True, exist_ok=True)
        command = [
            *under, "ray", "start", "--block", f"--num-cpus={cpus}", "--num-gpus=0", f"--temp-dir={folder / 'tmp'}",
            "--disable-usage-stats", f"--resources={json.dumps({f'gx_node_{name}': 1})}", f"--node-ip-address={ip}",
        ]  # fmt: skip
        command += (
            ["--head", f"--port={self.port}", "--include-dashboard=false"] if head else [f"--address={self.address}"]
        )
        log = open(folder / "ray.log", "ab")  # noqa: SIM115 - the node outlives this call
        # the head's GCS declares a silent node dead after ~3 s instead of ~30 s (Ray's health check settings)
        env = {**os.environ, "HOME": str(folder / "home"), **HEALTH_CHECK}
        self.nodes[name] = subprocess.Popen(
            command, cwd=folder, env=env, stdout=log, stderr=log, start_new_session=True
        )
        # each look at the cluster is a driver of its own (~3 s of a CPU on 2 cores): none before the node runs
        deadline = time.monotonic() + 60
        while self.nodes[name].poll() is None and time.monotonic() < deadline:
            if "Ray runtime started" in (folder / "ray.log").read_text(errors="replace"):
                break
            time.sleep(0.2)
        self.wait_for(lambda nodes: name in nodes, f"node {name} to join")

    def alive(self) -> dict[str, str]:
        """Node name → Ray node ID of the alive nodes, from a driver of its own (the test process keeps its Ray)."""
        head = self.nodes["head"]
        assert head.poll() is None, (self.folder("head") / "ray.log").read_text(errors="replace")[-3000:]
        script = (
            f"import json, ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
            "print(json.dumps({k[len('gx_node_'):]: n['NodeID'] for n in ray.nodes() if n['Alive'] "
            "for k in n['Resources'] if k.startswith('gx_node_')}))"
        )
        try:
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return {}
        # Ray may print its own lines after ours ("raylet has lagging heartbeats ..." on a loaded machine)
        printed = [line for line in done.stdout.splitlines() if line.startswith("{")]
        return json.loads(printed[-1]) if done.returncode == 0 and printed else {}

    def wait_for(self, condition: Callable[[dict[str, str]], bool], what: str, timeout: float = 120) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = self.alive()
            if condition(nodes):
                return nodes
            time.sleep(1)
        logs = {name: (self.folder(name) / "ray.log").read_text(errors="replace")[-2000:] for name in self.nodes}
        raise AssertionError(f"no {what} within {timeout:.0f} s; the nodes' logs:\n{logs}")

    def kill_raylet(self, name: str) -> None:
        """SIGKILL the node's raylet, as a machine lost would: its workers die with it; nothing is told to stop."""
        raylets = [p for p in psutil.Process(self.nodes[name].pid).children(recursive=True) if p.name() == "raylet"]
        assert raylets, f"node {name} has no raylet"
        for raylet in raylets:
            raylet.kill()

    def stop(self) -> None:
        for process in self.nodes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        # the test is over: nodes that have not stopped within a few seconds of the signal are not waited for, one
        # deadline for all of them (they stop side by side); a wait of its own per node added 3 s a node to each
        # teardown, as a running node never stopped within them
        deadline = time.monotonic() + 3
        for process in self.nodes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # its raylet and workers are in its process group
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def loopback() -> Iterator[None]:
    """The test, and every process and thread it starts, in a network namespace whose one interface is loopback,
    with :data:`ELSEWHERE` as one more of its addresses."""
    with loopback_namespace(ELSEWHERE):
        yield


@pytest.fixture
def s3(loopback, monkeypatch) -> Iterator[object]:
    """moto's S3 server (a stand-in for S3/MinIO) on 127.0.0.1, the endpoint every node is given as MinIO users give
    it (``AWS_ENDPOINT_URL``); a bucket for the data and one for the sweeps' state."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for key, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "gx-test",
        "AWS_SECRET_ACCESS_KEY": "gx-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3", endpoint_url=endpoint)
    for bucket in ("gx-data", "gx-state"):
        client.create_bucket(Bucket=bucket)
    yield client
    server.stop()


@pytest.fixture
def nodes(s3, monkeypatch) -> Iterator[RayNodes]:
    # token authentication on, as every recipe runs it: nodes and drivers share one token (each node's HOME differs,
    # so not through ~/.ray/auth_token). Needed in any case: the session's own ray.init() has set RAY_AUTH_MODE=token
    # in this process's environment, and nodes that inherit it without a token never come up
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    cluster = RayNodes()
    try:
        cluster.start("head", cpus=0, head=True)  # the head runs the driver's actors only: no trial lands there
        yield cluster
    finally:
        cluster.stop()


def _objects(client, bucket: str) -> dict[str, tuple[str, int]]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"]: (o["ETag"], o["Size"]) for page in pages for o in page.get("Contents", [])}


def _space(folder: Path, epochs: int, seeds: int) -> Path:
    description = "small stage-classification trials on a multi-node cluster"
    return small_stage_space(folder / "space.yaml", epochs, list(range(seeds)), description)


def _run(command: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _prepare(nodes: RayNodes, tmp_path: Path) -> None:
    log = tmp_path / "prepare.log"
    # six cases: training rows for the trials' two steps an epoch, and a case each to validate and test
    command = [
        sys.executable, str(ROOT / "jobs" / "prepare_data.py"), "--source", "demo", "--cases", "6",
        "--endoscopy-size", "32", "--out", "s3://gx-data/cohort", "--address", nodes.address,
    ]  # fmt: skip
    assert _run(command, tmp_path / "driver", log).wait(timeout=600) == 0, log.read_text(errors="replace")[-3000:]


def _sweep_command(nodes: RayNodes, space: Path, mlflow_uri: str | None, *extra: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", str(space), "--address", nodes.address,
        "--data", "s3://gx-data/cohort", "--storage", "s3://gx-state/sweeps", "--output", "out",
        *(["--mlflow-uri", mlflow_uri] if mlflow_uri else []), *extra,
    ]  # fmt: skip


def _trials(client: MlflowClient) -> list:
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    return [r for r in runs if r.data.tags.get(KIND_TAG) == "trial"]


def _live_trials(driver: Path) -> list:
    """The trial runs of the sweep run from ``driver``, through its own server while it runs ([] until it answers)."""
    records = list(driver.glob(f"out/*/mlflow/{PID_FILE}"))
    if not records:
        return []
    uri = f"http://127.0.0.1:{json.loads(records[0].read_text(encoding='utf-8'))['port']}"
    try:
        urllib.request.urlopen(f"{uri}/health", timeout=5).close()
    except OSError:  # not up yet
        return []
    return _trials(MlflowClient(uri))


def _assert_epochs_once(client: MlflowClient, run, epochs: int) -> None:
    for key in ("epoch", "val_primary", "train_loss"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(epochs)), f"{key} of {run.info.run_name}: steps {steps} (lost or logged twice)"


def test_a_sweep_on_several_nodes_keeps_everything_in_the_object_store_and_survives_a_lost_node(nodes, s3, tmp_path):
    """One cluster (a head without CPUs, a worker node), the cohort prepared onto the bucket by tasks on the worker:
    a sweep reads it there and keeps its state there, with its own loopback MLflow; it loses its node mid-trial and
    resumes on a node that joined, nothing lost or logged twice; and a node at another address makes a loopback
    MLflow refused before any work."""
    nodes.start("worker1", cpus=2)
    _prepare(nodes, tmp_path)  # preprocessing tasks run on the worker: the head has no CPU
    data = _objects(s3, "gx-data")
    assert "cohort/shards/manifest.json" in data and "cohort/qc_report.md" in data
    assert any(key.endswith(".parquet") for key in data)
    assert not any(key.startswith("cohort/raw") for key in data), "the raw demo cohort is not part of the data"

    # no --mlflow-uri: the sweep's own server on the driver's loopback, which trials on every node of this host reach.
    # worker1 is the only node with CPUs; lost mid-trial, its trial resumes on worker3, which joins
    epochs = 4
    space, driver, log = _space(tmp_path, epochs=epochs, seeds=2), tmp_path / "driver", tmp_path / "sweep.log"
    process = _run([*_sweep_command(nodes, space, None), "--max-concurrent", "1"], driver, log)
    deadline = time.monotonic() + 600
    while not any(r.info.status == "RUNNING" and r.data.metrics.get("epoch", -1) >= 1 for r in _live_trials(driver)):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
        time.sleep(0.5)
    nodes.kill_raylet("worker1")  # lost mid-trial, after a checkpoint reached the bucket
    nodes.start("worker3", cpus=2)  # joins mid-sweep: the only node left with CPUs
    ids = nodes.wait_for(lambda alive: "worker1" not in alive and "worker3" in alive, "worker1 seen lost")
    assert process.wait(timeout=900) == 0, log.read_text(errors="replace")[-4000:]

    sweep_id = next(iter(driver.glob("out/*/sweep.json"))).parent.name
    client = MlflowClient(f"sqlite:///{driver / 'out' / sweep_id / 'mlflow' / 'mlflow.db'}")  # the sweep's own store
    trials = _trials(client)
    assert len(trials) == 2, f"{len(trials)} trial runs for 2 cells: one was run twice or lost"
    assert {r.info.status for r in trials} == {"FINISHED"}
    assert len({r.data.tags[TRIAL_TAG] for r in trials}) == 2
    for run in trials:  # never the head, which has no CPU
        assert run.data.tags["gx_ray.node_id"] == ids["worker3"], "the joined node took over the sweep's trials"
        _assert_epochs_once(client, run, epochs)
    resumed = [r for r in trials if "resumed_from_epoch" in r.data.metrics]
    assert len(resumed) == 1 and resumed[0].data.metrics["resumed_from_epoch"] >= 1, "not resumed from a checkpoint"
    assert _objects(s3, "gx-data") == data, "the sweep wrote into --data (it is read-only to a sweep)"
    state = _objects(s3, "gx-state")
    assert any(k.startswith(f"sweeps/{sweep_id}/") and "experiment_state" in k for k in state), sorted(state)[:20]
    checkpoints = [k for k in state if "/checkpoint_" in k and k.endswith(CHECKPOINT_FILE)]
    assert len({k.split("/checkpoint_")[0] for k in checkpoints}) == 2, "each trial keeps its checkpoints in the bucket"
    assert f"sweeps/{sweep_id}/driver/sweep.json" in state and f"sweeps/{sweep_id}/driver/report/summary.md" in state
    assert not (driver / "out" / sweep_id / "ray").exists(), "Tune's state went to the driver's disk"
    for name in ("worker1", "worker3"):  # nothing a trial writes lands in a worker's working directory
        assert sorted(p.name for p in nodes.folder(name).iterdir()) == ["home", "ray.log", "tmp"]

    # a node at another address: trials there could not reach the driver's loopback, refused before any work
    nodes.start("elsewhere", cpus=0, ip=ELSEWHERE)
    apart = {"s3://gx-state/sweeps": "s3://gx-state/refused", "out": "refused"}  # not the sweep that ran
    command = [apart.get(c, c) for c in _sweep_command(nodes, space, None)]
    refused = subprocess.run(command, cwd=driver, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "3 nodes" in refused.stderr and ELSEWHERE in refused.stderr and "--mlflow-uri" in refused.stderr


def test_two_nodes_one_host_runs_a_command_on_two_loopback_nodes(tmp_path):
    """jobs/cluster/two_nodes_one_host.sh on this machine, ``nvidia-smi`` stubbed with two GPUs (Ray counts the GPUs it
    is told of): the command sees two nodes at 127.0.0.1 of one GPU each, and both nodes are gone once it ends."""
    stub = tmp_path / "bin" / "nvidia-smi"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\n[ "$1" = -L ] && printf "GPU 0: stub\\nGPU 1: stub\\n"\n')
    stub.chmod(0o755)
    folder = Path(tempfile.mkdtemp(prefix="gx2-"))  # short: the nodes' sockets live under it
    command = "import json, ray; ray.init(); print(json.dumps([[n['NodeManagerAddress'], n['Resources'].get('GPU')] "
    command += "for n in ray.nodes() if n['Alive']]))"
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "GX_TWO_NODES_DIR": str(folder)}
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run(
            ["bash", str(ROOT / "jobs" / "cluster" / "two_nodes_one_host.sh"), sys.executable, "-c", command],
            env=env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        if done.returncode != 0 and "unshare" in done.stderr:
            pytest.skip(f"no network namespace here: {done.stderr.strip()[-300:]}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == [["127.0.0.1", 1.0], ["127.0.0.1", 1.0]]
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(folder) in " ".join(p.info["cmdline"] or [])]
        assert not left, f"the nodes outlived the command: {left}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
