"""Several sweeps on one Ray cluster, sharing its CPUs and GPUs by weight (``--share W``).

Tune knows nothing of another driver's trials: two sweeps on one cluster race for every freed CPU and the one that
asked first keeps winning (Ray's placement-group queue); nor is Tune's scheduler a gate (its controller requests an
actor for every PENDING trial). What decides how many trials a sweep holds is how many its search algorithm created,
so :class:`SharedSearch` wraps that algorithm and creates a trial only when the cluster's registry grants its CPUs
and GPUs. The registry (:class:`ShareRegistry`, one detached named actor per cluster, heartbeated by every sharing
driver) decides grants one at a time, so two drivers never take the same free CPU:

- a trial is granted only when its resources are free (counted over the registered sweeps' granted trials);
- of the sweeps with a trial waiting, the one with the lowest dominant share (the larger of its GPU and CPU fractions)
  per ``--share`` weight goes next: weighted Dominant Resource Fairness, work-conserving (a sweep alone takes idle
  resources beyond its share) and never pre-emptive (a sweep over its share gives back as its trials end);
- a driver that stops heartbeating is forgotten after :data:`TTL_S`; its trials died with it.

A trial holds its grant until Tune completes it (errored and paused trials come back). Actors are not reused while
sharing: a finished trial's cached actor would keep its CPUs from the sweep the registry gave them to.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter, SearchAlgorithm, Searcher, SearchGenerator

REGISTRY = "gx_ray_share_registry"
NAMESPACE = "gx_ray"
TTL_S = float(os.environ.get("GX_RAY_SHARE_TTL_S", 15))
"""A sweep whose driver has not been heard of for this long is dropped from the registry."""
HEARTBEAT_S = 2.0
GRANTS_FILE = "gx_share_grants.json"
"""Beside Tune's search state: the trials granted and not yet complete, counted again by a resumed sweep."""
RESOURCES = ("CPU", "GPU")


class SweepAlreadyRunning(RuntimeError):
    """A live sweep of the same id is registered on the cluster."""


def dominant_share(usage: dict[str, float], total: dict[str, float]) -> float:
    """The larger of a sweep's fractions of the cluster's CPUs and GPUs."""
    return max((usage.get(r, 0.0) / total[r] for r in RESOURCES if total.get(r)), default=0.0)


def may_grant(sweeps: dict[str, dict[str, Any]], total: dict[str, float], key: str, need: dict[str, float]) -> bool:
    """Whether sweep ``key``'s waiting trial may take ``need`` now: it fits in what no sweep holds, and of the sweeps
    with a trial waiting, ``key`` holds the smallest dominant share per unit of weight (the earliest joined on a tie).
    ``sweeps`` is the registry's: each sweep's ``usage``, ``waiting``, ``weight`` and ``since``."""
    used = {r: sum(s["usage"].get(r, 0.0) for s in sweeps.values()) for r in RESOURCES}
    if any(need.get(r, 0.0) > total.get(r, 0.0) - used[r] + 1e-9 for r in RESOURCES):
        return False
    waiting = [k for k, s in sweeps.items() if s["waiting"]]
    first = min(waiting, key=lambda k: (dominant_share(sweeps[k]["usage"], total) / sweeps[k]["weight"],
                                        sweeps[k]["since"]))  # fmt: skip
    return first == key


@ray.remote(num_cpus=0, max_restarts=-1)
class ShareRegistry:
    """The cluster's sweeps that share it: weight, granted resources, whether a trial waits, last heard of."""

    def __init__(self, ttl_s: float = TTL_S):
        self.ttl_s = ttl_s
        self.sweeps: dict[str, dict[str, Any]] = {}
        self.history: list[dict[str, Any]] = []
        """Every grant: when, to whom, and every sweep's usage and waiting flag just before it."""
        self._total: tuple[float, dict[str, float]] = (0.0, {})

    def total(self) -> dict[str, float]:
        if time.time() - self._total[0] > 5:  # nodes come and go (spot workers): looked at again every few seconds
            cluster = ray.cluster_resources()
            self._total = (time.time(), {r: float(cluster.get(r, 0.0)) for r in RESOURCES})
        return self._total[1]

    def _expire(self) -> None:
        now = time.time()
        for key in [k for k, s in self.sweeps.items() if now - s["seen"] > self.ttl_s]:
            del self.sweeps[key]

    def register(self, key: str, owner: str, weight: float) -> None:
        """Join (again, after a restart of this actor: a heartbeat re-registers); a live sweep of the same key
        under another owner is refused."""
        self._expire()
        if (other := self.sweeps.get(key)) and other["owner"] != owner:
            raise SweepAlreadyRunning(
                f"sweep {key} is already running on this cluster (driver {other['owner']}); give this one --name, "
                "or wait for it to end"
            )
        entry = self.sweeps.setdefault(key, {"usage": {}, "waiting": False, "since": time.time()})
        entry.update(owner=owner, weight=weight, seen=time.time())

    def update(self, key: str, owner: str, weight: float, usage: dict[str, float], waiting: bool) -> None:
        """The heartbeat: what the sweep's driver holds and whether a trial of it waits."""
        self.register(key, owner, weight)
        self.sweeps[key].update(usage=usage, waiting=waiting)

    def acquire(self, key: str, owner: str, weight: float, usage: dict[str, float], need: dict[str, float]) -> bool:
        """Grant ``need`` to sweep ``key`` (which now holds ``usage`` and has this trial waiting), or not yet."""
        self.update(key, owner, weight, usage, True)
        total = self.total()
        if not may_grant(self.sweeps, total, key, need):
            return False
        self.history.append({
            "time": time.time(), "sweep": key, "need": need, "total": total,
            "sweeps": {k: {"usage": dict(s["usage"]), "waiting": s["waiting"], "weight": s["weight"]}
                       for k, s in self.sweeps.items()},
        })  # fmt: skip
        mine = self.sweeps[key]["usage"]
        self.sweeps[key]["usage"] = {r: mine.get(r, 0.0) + need.get(r, 0.0) for r in RESOURCES}
        return True

    def unregister(self, key: str, owner: str) -> None:
        if (entry := self.sweeps.get(key)) and entry["owner"] == owner:
            del self.sweeps[key]

    def snapshot(self) -> dict[str, Any]:
        self._expire()
        return {"sweeps": self.sweeps, "total": self.total(), "history": self.history}


def registry() -> Any:
    """The cluster's registry, started on first use; detached, so it outlives the driver that started it."""
    return ShareRegistry.options(name=REGISTRY, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()


def _this_driver() -> str:
    """This process, as the registry tells drivers apart (a pid alone may be reused)."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{psutil.Process().create_time():.0f}"


_ACTIVE: dict[str, SharedSearch] = {}
"""This driver's gate of each sweep it runs: the one the heartbeat speaks for (a resumed sweep's restored gate
replaces the one made before the restore)."""


class SharedSearch(SearchAlgorithm):
    """A sweep's search algorithm, creating a trial only when the registry grants its resources."""

    def __init__(self, inner: SearchAlgorithm, key: str, weight: float, footprint: Any):
        self.inner, self.key, self.weight, self.footprint = inner, key, weight, footprint
        self.owner = _this_driver()
        self.live: dict[str, dict[str, float]] = {}
        """Granted trials by id → their CPUs and GPUs, until Tune completes them."""
        self.held = None  # a trial the inner algorithm created that waits for its grant
        self.waiting = False
        self._asked = 0.0
        self._lock = threading.Lock()
        self._handle = None
        self._started = False

    def __getstate__(self) -> dict[str, Any]:  # saved with Tune's experiment state: no actor handle, lock, thread
        state = dict(self.__dict__)
        state.update(_lock=None, _handle=None, held=None, _started=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restored with Tune's experiment state (``--resume``): this driver's now, with the weight it was given."""
        self.__dict__.update(state)
        self._lock, self.owner = threading.Lock(), _this_driver()
        if made := _ACTIVE.get(self.key):
            self.weight, self._started = made.weight, made._started
            _ACTIVE[self.key] = self

    @property
    def usage(self) -> dict[str, float]:
        return {r: sum(n.get(r, 0.0) for n in self.live.values()) for r in RESOURCES}

    def start(self) -> SharedSearch:
        """Register now (a second live sweep of this id is refused here, before any trial) and heartbeat."""
        ray.get(self._registry().register.remote(self.key, self.owner, self.weight))
        self._started = True
        _ACTIVE[self.key] = self
        threading.Thread(target=_heartbeat, args=(self.key,), name="gx-share-heartbeat", daemon=True).start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # Ray already down: the entry expires
            ray.get(self._registry().unregister.remote(self.key, self.owner), timeout=5)

    def _registry(self) -> Any:
        if self._handle is None:
            self._handle = registry()
        return self._handle

    def beat(self) -> None:
        """Tell the registry what this sweep holds and whether a trial of it waits."""
        with self._lock:
            self._registry().update.remote(self.key, self.owner, self.weight, self.usage, self.waiting)

    # the gate
    def next_trial(self):
        if not self._started:  # restored with Tune's experiment state (--resume): registered again here
            self.start()
        if self.held is None:
            self.held = self.inner.next_trial()
        if self.held is None:
            if self.waiting:  # at once: another sweep's trial need not wait for this one's next heartbeat
                self.waiting = False
                with contextlib.suppress(Exception):
                    self.beat()
            return None
        if time.monotonic() - self._asked < 0.5:  # Tune asks every loop step: the registry hears of it twice a second
            return None
        self._asked = time.monotonic()
        need = self.footprint(self.held)
        with self._lock:
            granted = ray.get(self._registry().acquire.remote(self.key, self.owner, self.weight, self.usage, need))
            if granted:
                self.live[self.held.trial_id] = need
        self.waiting = not granted
        if not granted:
            return None
        trial, self.held = self.held, None
        return trial

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self.inner.on_trial_complete(trial_id, result=result, error=error)
        with self._lock:
            self.live.pop(trial_id, None)
            self.waiting = self.held is not None or not self.inner.is_finished()  # more to come: the slot is wanted
        with contextlib.suppress(Exception):  # at once: the freed resources go to whoever deserves them next
            self.beat()

    # everything else is the inner algorithm's
    @property
    def metric(self):
        return self.inner.metric

    @property
    def total_samples(self) -> int:
        return self.inner.total_samples

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return self.inner.set_search_properties(metric, mode, config, **spec)

    def add_configurations(self, experiments) -> None:
        self.inner.add_configurations(experiments)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self.inner.on_trial_result(trial_id, result)

    def is_finished(self) -> bool:
        return self.held is None and self.inner.is_finished()

    def set_finished(self) -> None:
        self.inner.set_finished()

    def has_checkpoint(self, dirpath: str) -> bool:
        return self.inner.has_checkpoint(dirpath)

    def save_to_dir(self, dirpath: str, **kwargs) -> None:
        self.inner.save_to_dir(dirpath, **kwargs)
        (Path(dirpath) / GRANTS_FILE).write_text(json.dumps(self.live), encoding="utf-8")

    def restore_from_dir(self, dirpath: str) -> None:
        """``--resume``: the inner algorithm's state, and the grants of the trials Tune restarts without asking."""
        self.inner.restore_from_dir(dirpath)
        if (grants := Path(dirpath) / GRANTS_FILE).is_file():
            self.live = json.loads(grants.read_text(encoding="utf-8"))


def _heartbeat(key: str) -> None:
    while ray.is_initialized():
        with contextlib.suppress(Exception):  # the registry restarting, or Ray ending: the next beat tries again
            _ACTIVE[key].beat()
        time.sleep(HEARTBEAT_S)


def share_cluster(config: tune.TuneConfig, sweep_id: str, share: float, footprint: Any) -> tune.TuneConfig:
    """``config`` with its search algorithm (as Tune would build it: the grid's generator, or a searcher under its
    concurrency limit) gated by the cluster's share registry, registered now; actors not reused."""
    if not share > 0:
        raise ValueError(f"--share must be a positive weight, not {share}")
    inner, limit = config.search_alg, config.max_concurrent_trials
    if inner is None:
        inner = BasicVariantGenerator(max_concurrent=limit or 0)
    elif isinstance(inner, Searcher):
        inner = SearchGenerator(ConcurrencyLimiter(inner, limit) if limit else inner)
    if isinstance(inner, BasicVariantGenerator):  # Tune keeps one trial pending for any other algorithm, this one
        os.environ.setdefault("TUNE_MAX_PENDING_TRIALS_PG", "16")  # included once wrapped: granted trials start at once
    shared = SharedSearch(inner, sweep_id, share, footprint).start()
    return dataclasses.replace(config, search_alg=shared, max_concurrent_trials=None, reuse_actors=False)


def trial_footprint(context: Any) -> Any:
    """A function of a Tune trial → the CPUs and GPUs it holds (a DDP trial's: its TorchTrainer workers')."""
    from gx_ray.sweep.trial import under_torch_trainer

    def footprint(trial: Any) -> dict[str, float]:
        setting = context.setting(trial.config)
        resources = setting.config.resources
        if under_torch_trainer(setting.config):
            gpus = resources.gpus_per_worker if resources.use_gpu else 0
            return {"CPU": resources.workers * resources.cpus_per_worker, "GPU": resources.workers * float(gpus)}
        return {"CPU": float(resources.cpus_per_worker), "GPU": setting.gpu_share if resources.use_gpu else 0.0}

    return footprint


def named(sweep_id: str, name: str | None) -> str:
    """The sweep's id with ``--name`` appended: two sweeps of one space and cohort kept apart (their Tune state,
    outputs, MLflow parent run and Optuna study), each found again by ``--resume`` with the same name."""
    return sweep_id if name is None else f"{sweep_id}-{sweep_name(name)}"


def sweep_name(text: str) -> str:
    """``--name``, checked: it becomes part of paths, an MLflow run name and Tune's experiment name."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", text):
        raise argparse.ArgumentTypeError(
            f"--name {text!r}: letters, digits, '_', '.' and '-', at most 64, a letter or digit first"
        )
    return text


def weight(text: str) -> float:
    """``--share``, checked: a positive weight."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--share {text!r}: a positive weight (1, 2, 0.5 ...)")
    return value


def refuse_a_live_twin(client: Any, experiment: str, sweep_id: str, tracking_uri: str) -> None:
    """Refuse to start a sweep whose id's parent run is RUNNING on this MLflow server: a live sweep of the same space
    and cohort (its trials would land under one parent run), or one whose driver died (then ``--resume`` it)."""
    from gx_ray.tracking import KIND_TAG, SWEEP_TAG

    found = client.get_experiment_by_name(experiment)
    if found is None:
        return
    runs = client.search_runs(
        [found.experiment_id],
        filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{KIND_TAG}` = 'sweep' and attributes.status = "
        "'RUNNING'",
    )
    if runs:
        raise SweepAlreadyRunning(
            f"MLflow {tracking_uri} has sweep {sweep_id} running (parent run {runs[0].info.run_id}): give this one "
            "--name to run beside it, or --resume if that sweep's driver is gone"
        )
