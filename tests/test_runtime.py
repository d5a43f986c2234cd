"""The local Ray runtime that sweeps start (:func:`gx_ray.runtime.init_ray`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time

import psutil
import pytest
import ray


@ray.remote(num_cpus=1)
def _hold(seconds: float) -> None:
    time.sleep(seconds)


@ray.remote(num_cpus=1)
def _read_epochs(epochs: int, pause: float) -> list[set[int]]:
    """Each 'epoch' reads four blocks with zero-CPU tasks, as a trial's split streams do; the worker ids per epoch."""
    seen = []
    for _ in range(epochs):
        dataset = ray.data.from_items(list(range(4)), override_num_blocks=4).map_batches(
            lambda batch: {"pid": [os.getpid()] * len(batch["item"])},
            batch_size=1,
            num_cpus=0,
            compute=ray.data.TaskPoolStrategy(size=2),
        )
        seen.append({row["pid"] for row in dataset.take_all()})
        time.sleep(pause)  # training and validation between two reads of the split
    return seen


def test_read_workers_outlive_the_gap_between_epochs(ray_cluster):
    """With every CPU held by a trial, Ray's default kept no idle worker beyond one per CPU for more than 1 s: each
    epoch's reads started fresh worker processes (~2 s of CPU each, 4.5 s per epoch on two cores). The sweep's
    runtime keeps them, so a later epoch reads with the workers of an earlier one."""
    holder = _hold.remote(60)  # the other CPU, as the second of two trials holds it
    try:
        seen = ray.get(_read_epochs.remote(3, 2.0), timeout=120)
    finally:
        ray.cancel(holder, force=True)
    assert seen[0] & seen[2], f"every epoch read with new workers: {seen}"


def test_the_runtime_keeps_tunes_missing_results_warning_off_the_console(ray_cluster):
    """Tune warns "Failed to fetch metrics" with a traceback-like line per trial a time budget ended before its
    first report; the sweep's summary already counts those as unfinished. Its other loggers keep their warnings."""
    assert not logging.getLogger("ray.tune.analysis.experiment_analysis").isEnabledFor(logging.WARNING)
    assert logging.getLogger("ray.tune.analysis.experiment_analysis").isEnabledFor(logging.ERROR)
    assert logging.getLogger("ray.tune.tuner").isEnabledFor(logging.WARNING)


class _SignalledWhileFinalised:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # as Ray ends a worker while the garbage collector runs a finaliser
        time.sleep(1)  # Ray's SIGTERM handler runs here, inside the finaliser


@ray.remote(num_cpus=0)
class _Worker:
    def pid(self) -> int:
        return os.getpid()

    def drop_a_finalised_object(self) -> str:
        _SignalledWhileFinalised()  # dropped at once: its finaliser runs now
        time.sleep(20)
        return "the worker carried on"


def test_a_worker_ended_while_a_finaliser_runs_exits_without_a_traceback(ray_cluster, capfd):
    """Python cannot raise Ray's SIGTERM exit inside a finaliser: it printed "Exception ignored ... SystemExit" with a
    traceback on the sweep's console (a failed trial's teardown under load) and the worker carried on. Workers of the
    sweep's runtime exit once the finaliser has returned, without a word."""
    worker = _Worker.remote()
    pid = ray.get(worker.pid.remote(), timeout=60)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(worker.drop_a_finalised_object.remote(), timeout=60)
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # workers' output reaches the driver asynchronously
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "SystemExit" not in err, err[-3000:]
    assert not _running(pid)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_one_process_per_gpu_keeps_the_order_and_one_process_a_gpu():
    """Ray counts GPU resources, not cards: a separate local cluster declaring two GPUs shows the placement."""
    import subprocess
    import sys

    code = (
        "import json, os, ray\n"
        "from gx_ray.runtime import one_process_per_gpu\n"
        "ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)\n"
        "out = one_process_per_gpu(lambda i: (i * i, os.getpid()), list(range(7)))\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert [square for square, _ in out] == [i * i for i in range(7)]
    pids = [pid for _, pid in out]
    assert len(set(pids)) == 2 and pids[0::2] == [pids[0]] * 4 and pids[1::2] == [pids[1]] * 3


# A running cluster, and a job started without --address (or with one): ray.init()'s own rules decide whether it
# joins, and init_ray must then pass nothing a joined cluster refuses ("_system_config must not be provided").
HEAD = "127.0.0.1:6380"  # inside a network namespace of the test's own: the port is free there


def _ray_joins(address: str | None) -> bool:
    """Ray 2.60's own answer, from the resolution ``ray.init`` runs: a bootstrap address, or None to start locally."""
    import ray._private.services as services

    services.find_gcs_addresses.cache_clear()
    try:
        return services.canonicalize_bootstrap_address(address) is not None
    except ConnectionError:  # "auto" and no cluster anywhere: ray.init refuses, it never starts one
        return True


@pytest.mark.parametrize("address", [None, "auto", HEAD, "local"])
@pytest.mark.parametrize("env", [None, HEAD, "local"])
@pytest.mark.parametrize("started", [False, True])
def test_running_cluster_agrees_with_rays_own_resolution(address, env, started, tmp_path, monkeypatch):
    """Every combination of an address given, RAY_ADDRESS and a `ray start` record on this machine (the file
    ``ray_current_cluster`` that ray.init() reads, in a temp dir of the test's own)."""
    from gx_ray.runtime import running_cluster

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    if started:
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6390")
    found = running_cluster(address)
    assert (found is not None) == _ray_joins(address), (address, env, started, found)
    if address is None and found:
        assert found == (env or "127.0.0.1:6390")


JOIN_CASES = [
    # (address, num_cpus, RAY_ADDRESS, a `ray start` record readable, joins)
    (None, None, None, True, True),  # a job run on the head of `ray start --head`
    (None, 2, None, True, True),  # num_cpus given: the cluster's own CPU stays
    (None, 2, HEAD, False, True),  # RAY_ADDRESS set
    ("auto", None, None, True, True),
    (HEAD, 2, None, False, True),
    ("local", 3, None, True, False),  # one runs, and one of this job's own is asked for: local, of num_cpus
]


def _join_cases(root: str) -> None:
    """In a network namespace of its own: a `ray start --head` of one CPU, then init_ray in each of JOIN_CASES;
    prints one JSON line a case. Run by the test below in a process of its own."""
    import subprocess
    from pathlib import Path

    from gx_ray.runtime import init_ray
    from tests.netns import enter_loopback_namespace

    enter_loopback_namespace()
    folder = Path(root)
    log = open(folder / "head.log", "ab")  # noqa: SIM115 - the head outlives this statement
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", f"--port={HEAD.split(':')[1]}",
         "--num-cpus=1", "--num-gpus=0", f"--temp-dir={folder / 'head' / 'ray'}", "--include-dashboard=false",
         "--disable-usage-stats"],
        stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    warnings: list[str] = []
    logging.getLogger("gx_ray.runtime").addHandler(_Collect(warnings))

    @ray.remote(num_cpus=0)
    def where() -> str:
        import gx_ray

        return gx_ray.__file__

    try:
        deadline = time.monotonic() + 60
        while not (folder / "head" / "ray" / "ray_current_cluster").exists():
            assert head.poll() is None and time.monotonic() < deadline, (folder / "head.log").read_text()[-3000:]
            time.sleep(0.2)
        for i, (address, num_cpus, env, started, _) in enumerate(JOIN_CASES):
            (folder / str(i)).mkdir()
            os.environ["RAY_TMPDIR"] = str(folder / ("head" if started else str(i)))
            os.environ.pop("RAY_ADDRESS", None) if env is None else os.environ.update(RAY_ADDRESS=env)
            warnings.clear()
            try:
                init_ray(address, num_cpus=num_cpus)
                result = {
                    "gcs": ray.get_runtime_context().gcs_address,
                    "cpus": ray.cluster_resources().get("CPU"),
                    "gx_ray": ray.get(where.remote(), timeout=120),
                }
            except Exception as error:  # noqa: BLE001 - the test names it
                result = {"error": f"{type(error).__name__}: {error}"}
            finally:
                ray.shutdown()
            print(json.dumps({**result, "warnings": warnings}), flush=True)
    finally:  # not `ray stop`: it stops every Ray on the machine. SIGTERM to the whole group would end the GCS
        # first, and the raylet would wait 30 s for it to drain the node
        head.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)


class _Collect(logging.Handler):
    def __init__(self, into: list[str]):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def test_init_ray_joins_a_running_cluster_or_starts_its_own(tmp_path_factory):
    """A job run where `ray start --head` runs (no --address) died with "When connecting to an existing cluster,
    _system_config must not be provided". It joins that cluster now, keeping the cluster's CPUs and taking gx-ray to
    its workers (py_modules), and says so; with nothing running, or with "local", it starts its own of num_cpus."""
    import secrets
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="gxj-"))  # short: the head's sockets live under it
    code = f"from tests.test_runtime import _join_cases; _join_cases({str(root)!r})"
    # token authentication, as `ray start` has it by default: read by Ray as it is imported, so set before
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env=env)
        log = (root / "head.log").read_text(errors="replace")[-2000:] if (root / "head.log").exists() else ""
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(results) == len(JOIN_CASES), done.stderr[-4000:] + log
    for (address, num_cpus, env_address, started, joins), result in zip(JOIN_CASES, results, strict=True):
        case = f"address={address} num_cpus={num_cpus} RAY_ADDRESS={env_address} ray start record={started}"
        assert "error" not in result, f"{case}: {result['error']}"
        if joins:
            assert result["gcs"] == HEAD and result["cpus"] == 1, f"{case}: {result}"
            assert "runtime_resources" in result["gx_ray"], f"{case}: gx-ray did not travel: {result['gx_ray']}"
        else:
            assert result["gcs"] != HEAD and result["cpus"] == num_cpus, f"{case}: {result}"
        told = [w for w in result["warnings"] if w.startswith("joining the Ray cluster at")]
        assert bool(told) == (joins and address is None), f"{case}: {result['warnings']}"
        if told and num_cpus:
            assert f"num_cpus={num_cpus} is not applied" in told[0] and "--address local" in told[0], told


def test_the_sessions_ray_cluster_and_servers_listen_on_loopback_only(ray_cluster):
    """The session runs in a loopback-only network namespace (conftest.py): its Ray nodes are 127.0.0.1 and this
    process sees no interface but loopback, so no test server is reachable from the network, or reaches out."""
    import socket

    import ray

    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    assert [name for _, name in socket.if_nameindex()] == ["lo"]
