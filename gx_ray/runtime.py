"""Starting or joining the Ray cluster that every gx-ray job runs on: local by default, `--address` for a cluster;
and running a function on each of its GPUs."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import gx_ray

ALLOC_CONF = "expandable_segments:True"
MLFLOW_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
}
"""An unreachable MLflow server is retried for about 30 s (1 + 2 + 4 + 8 + 16 s), long enough for a sweep's own server
to be restarted, and then fails the call (MLflow's default waits ~4 minutes per call, each call of each trial)."""


def mlflow_retries() -> dict[str, str]:
    """:data:`MLFLOW_RETRIES`, unless the environment sets its own; set in this process too."""
    chosen = {key: os.environ.get(key, value) for key, value in MLFLOW_RETRIES.items()}
    os.environ.update(chosen)
    return chosen


SOFT_LIMIT_ENV = "RAY_num_workers_soft_limit"
ADDRESS_ENV = "RAY_ADDRESS"
logger = logging.getLogger(__name__)


def init_ray(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Connect to ``address`` (``"auto"`` or ``host:port``) or start a local cluster; no-op when connected. Without
    ``address``, as ``ray.init()`` (:func:`running_cluster`): join the cluster ``RAY_ADDRESS`` names or ``ray start``
    left running here (a job run on a head node is expected on that cluster), else start a local one;
    ``address="local"`` asks for a second cluster. A joined cluster's nodes keep their own CPUs, GPUs and settings
    (``num_cpus``/``num_gpus`` are not applied, with a warning), and the package travels in the runtime environment,
    since its workers may not have gx-ray installed. Ray Data progress bars are kept only for a terminal."""
    if ray.is_initialized():
        return
    from gx_ray import compat  # Tune's classes with it: not for the processes that import this module to read data

    found = running_cluster(address)
    if found and not address:
        sizes = ", ".join(f"{k}={v}" for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus)) if v is not None)
        how = "that RAY_ADDRESS names" if os.environ.get(ADDRESS_ENV) else "that `ray start` left running here"
        logger.warning(
            "joining the Ray cluster at %s %s, as ray.init() does; its nodes keep their own resources%s. For a local "
            "cluster of this job's own: --address local (or RAY_ADDRESS=local), or `ray stop` that one first.",
            found,
            how,
            f" ({sizes} is not applied)" if sizes else "",
        )
    runtime_env = {"py_modules": [str(Path(gx_ray.__file__).parent)]} if found else {}
    runtime_env["worker_process_setup_hook"] = "gx_ray.runtime.exit_quietly_on_sigterm"
    # packed trials share a GPU: an allocator that grows segments in place fragments less, so measured fits hold
    runtime_env["env_vars"] = {
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF),
        **mlflow_retries(),
        **{key: value for key, value in os.environ.items() if key.startswith("GX_RAY_")},  # gx-ray's own settings
    }
    # "token authentication is enabled ... RAY_AUTH_MODE=disabled to opt out": on by design, not for the user to act on
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # "Failed to fetch metrics for N trial(s) ... result.json and progress.csv were not found" for a trial that a
    # time budget ended before its first report: the sweep's own summary counts it as unfinished, with --resume
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    # Ray keeps idle workers up to one per CPU and kills the rest after 1 s. Trials hold the workers of every CPU,
    # so each epoch's read tasks started fresh workers (~2 s of CPU each): 4.5 s per epoch with two trials on two
    # cores, 0.1 s with the readers kept. A local cluster keeps more; RAY_num_workers_soft_limit, where set, wins
    # (-1 is Ray's one per CPU). A cluster's nodes take it at `ray start`.
    soft_limit = None if found or SOFT_LIMIT_ENV in os.environ else 4 * (num_cpus or os.cpu_count() or 1) + 4
    ray.init(
        address=address,
        num_cpus=None if found else num_cpus,
        num_gpus=None if found else num_gpus,
        runtime_env=runtime_env,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=True,
        logging_level="WARNING",
        **compat.system_config({"num_workers_soft_limit": soft_limit} if soft_limit else {}),
    )
    quiet_data_context()


def running_cluster(address: str | None) -> str | None:
    """The cluster ``ray.init(address)`` joins, by Ray 2.60's own rules (``ray.init``'s docstring), or None where it
    starts a local one: ``address`` itself, unless it is ``"local"``; for none or ``"auto"``, ``RAY_ADDRESS`` where
    set; for none, the address of the last ``ray start`` on this machine (``ray_current_cluster`` in Ray's temp dir,
    ``RAY_TMPDIR`` or ``/tmp``), should that file exist. ``"auto"`` with nothing found is Ray's to refuse."""
    if address in (None, "auto") and os.environ.get(ADDRESS_ENV):
        address = os.environ[ADDRESS_ENV]
    if address is None:
        from gx_ray.compat import ray_started_here  # as in init_ray

        return ray_started_here()
    return None if address == "local" else address


def exit_quietly_on_sigterm() -> None:
    """Every Ray worker's ``worker_process_setup_hook``. Ray ends a worker with SIGTERM, whose handler raises
    SystemExit; landing in a finaliser (a ``__del__``, a weakref callback), Python prints "Exception ignored in ...
    SystemExit" with a traceback to the sweep's console and the worker carries on until Ray's SIGKILL. Here the exit
    is put off instead: a thread sends the signal again a moment later, once the finaliser has returned."""
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, SystemExit):
            # not from here: the handler would run at once, inside this hook
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        else:
            default(unraisable)

    sys.unraisablehook = hook


def nodes_without(folder: str | Path) -> list[str]:
    """The addresses of the alive Ray nodes (with CPUs, where tasks run) on which the local ``folder`` (or file: a
    cohort's manifest CSV) does not exist: empty on one node, on several nodes of one machine, or on a filesystem every
    node mounts at the same path."""
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    if len(nodes) <= 1:
        return []
    checks = [
        _exists.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(str(folder))
        for n in nodes
    ]
    return sorted({n["NodeManagerAddress"] for n, seen in zip(nodes, ray.get(checks), strict=True) if not seen})


@ray.remote(num_cpus=0)
def _exists(folder: str) -> bool:
    return Path(folder).exists()


def quiet_data_context() -> None:
    """Ray Data progress bars only on a terminal, no INFO line per execution or per checkpoint saved; call in every
    process that reads or reports (trials, Train workers)."""
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.train").setLevel(logging.WARNING)  # "Checkpoint successfully created" every epoch
    # "Progress bars disabled. To enable, set ...": disabled on purpose, off a terminal
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = os.isatty(2)
    context.print_on_execution_start = False


def tolerant_console() -> None:
    """Summaries use ±, → and box rules; on an ASCII console (``LC_ALL=C``) escape them instead of crashing."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


@ray.remote(num_gpus=1, num_cpus=1)
class GpuProcess:
    def run(self, fn: Callable[[Any], Any], item: Any) -> Any:
        return fn(item)


def one_process_per_gpu(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``fn(item)`` for every item, on the cluster's GPUs: one process per GPU takes its items in turn, so the
    imports, CUDA's start, cuDNN's kernel choice and compilation are paid once a GPU, not once an item (compiled code
    is reused by the next instance of a module in the same process). Results in the order of ``items``."""
    gpus = max(1, min(len(items), int(ray.cluster_resources().get("GPU", 1))))
    workers = [GpuProcess.remote() for _ in range(gpus)]
    try:
        return ray.get([workers[i % gpus].run.remote(fn, item) for i, item in enumerate(items)])
    finally:
        for worker in workers:
            ray.kill(worker)
