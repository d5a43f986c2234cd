"""The local Ray runtime that sweeps start (:func:`gx_ray.runtime.init_ray`)."""

from __future__ import annotations

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
