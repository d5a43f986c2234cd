"""Every use gx-ray makes of a private name of Ray, Tune, MLflow or torch, in one module: where Ray 2.60 or torch 2.13
gives no public way. Each says what it waits on; ``tests/test_compat.py`` fails when an upgrade breaks one. Tune's
subclasses are built on first use (``__getattr__``): a process that only reads data or compiles a model need not pay
the seconds of importing Tune.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import ray

# --- Ray core --------------------------------------------------------------------------------------------------------


def ray_started_here() -> str | None:
    """The address of the cluster the last ``ray start`` on this machine left running (``ray_current_cluster`` in
    Ray's temp dir), as ``ray.init()`` finds it, or None. Ray 2.60 has no public API for it (``ray.init`` reads it
    through ``ray._private.services``)."""
    import ray._private.services

    return ray._private.services.find_bootstrap_address(None)


def system_config(settings: dict[str, Any]) -> dict[str, Any]:
    """``ray.init``'s keyword for a local cluster's raylet settings (``_system_config``, Ray 2.60's only way to give one
    to a cluster ``ray.init`` starts, short of ``RAY_<name>`` variables that would outlive the call); none: nothing."""
    return {"_system_config": settings} if settings else {}


def draining_nodes() -> dict[str, int]:
    """The nodes the GCS has told to drain, by node id, each with its deadline (ms since the epoch; 0: none). Ray 2.60
    reads it this way itself (Ray Train's preemption watcher, ``ray.train.v2._internal.execution.preemption``); the
    public state API has no drain state (ray#42982 added the deadline, for applications, to this private call)."""
    return ray._private.state.state.get_draining_nodes()


def drain_node(node_id: str, gcs_address: str, deadline_ms: int, message: str) -> tuple[bool, str]:
    """Drain ``node_id`` for preemption with a deadline, as ``ray drain-node`` does (the public way; it calls this,
    and a process per drain would cost the grace period seconds of imports): accepted, and why not."""
    from ray.core.generated import autoscaler_pb2

    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    return ray._raylet.GcsClient(address=gcs_address).drain_node(node_id, reason, message, deadline_ms)


class KilledForMemory(ray.exceptions.RayActorError):
    """A trial process Ray's memory monitor killed, as a dead actor: what it used and the node had, then Ray's words."""

    def __init__(self, message: str):
        used, limit = (re.search(p, message) for p in (r"memory used=([\d.]+)GB", r"/ ([\d.]+)GB limit"))
        reason = f"killed for memory: needed ~{used[1] if used else '?'} GB, node had {limit[1] if limit else '?'} GB"
        super().__init__(error_msg=f"{reason}\n{message}")


def memory_kills_fail_trials() -> None:
    """A trial killed by Ray's memory monitor fails (Tune retries it per the FailureConfig) instead of ending the sweep.
    Ray 2.60 raises ``OutOfMemoryError`` for such an actor (ray#28937), no ``RayActorError``, and Tune's private actor
    manager raises "Caught unexpected exception" on it: its ``_actor_task_failed`` and ``_actor_start_failed`` get a
    ``KilledForMemory`` instead. Waits on Tune's actor manager handling ``OutOfMemoryError``."""
    from ray.air.execution._internal.actor_manager import RayActorManager

    def failed(method: Any) -> Any:
        def handle(self: Any, exception: Exception, **tracked: Any) -> None:  # Ray calls both by keyword
            memory = isinstance(exception, ray.exceptions.OutOfMemoryError)
            method(self, exception=KilledForMemory(str(exception)) if memory else exception, **tracked)

        handle.wrapped = method
        return handle

    for name in ("_actor_task_failed", "_actor_start_failed"):
        method = getattr(RayActorManager, name)
        setattr(RayActorManager, name, method if hasattr(method, "wrapped") else failed(method))


# --- Tune's schedulers and searchers, changed where they have no hook ------------------------------------------------


@functools.cache
def _donor_checkpoint_pbt() -> type:
    from ray.tune.schedulers import PopulationBasedTraining

    class DonorCheckpointPBT(PopulationBasedTraining):
        """Tune's PBT, holding an exploited trial to its donor's checkpoint until it reports again. In synchronous PBT
        a trial that reached the perturbation epoch first is paused with a save of its own; should that save register
        after the trial was exploited (trials arriving together), Tune would restore the trial's own, stale weights
        under the donor's config. The trial is pointed at the donor's checkpoint again whenever it is chosen to run.
        Private hooks of Ray 2.60's PBT (``_exploit``, ``_quantiles``, ``_log_config_on_step``, ``_trial_state``, the
        synchronisation point) and of its checkpoint manager: PBT has no public extension points."""

        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self._donor_checkpoints: dict[Any, Any] = {}

        def _exploit(self, tune_controller: Any, trial: Any, trial_to_clone: Any) -> None:
            super()._exploit(tune_controller, trial, trial_to_clone)
            self._donor_checkpoints[trial] = trial.run_metadata.checkpoint_manager.latest_checkpoint_result

        def choose_trial_to_run(self, tune_controller: Any) -> Any:
            trial = super().choose_trial_to_run(tune_controller)
            trials = tune_controller.get_trials()
            waiting = [self._trial_state[t].last_train_time for t in trials if t.status in ("PENDING", "PAUSED")]
            if trial is None and waiting and not any(t.status == "RUNNING" for t in trials):
                # every trial paused past the next synchronisation point: a resumed sweep's scheduler is built anew, its
                # first point at the first interval, and Tune moves it to the epoch reached rather than past it
                self._next_perturbation_sync = min(waiting) + self._perturbation_interval
                trial = super().choose_trial_to_run(tune_controller)
            if trial in self._donor_checkpoints:
                trial.run_metadata.checkpoint_manager._latest_checkpoint_result = self._donor_checkpoints[trial]
            return trial

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
            self._donor_checkpoints.pop(trial, None)  # restored: it trains from the donor's weights
            return super().on_trial_result(tune_controller, trial, result)

        def _quantiles(self) -> tuple[list[Any], list[Any]]:
            """Tune's quantiles, with the diverged trials (a NaN validation score) at the bottom: Tune ranks only finite
            scores, so a trial whose weights became NaN would never be exploited and would train on, scoring nothing.
            Each is replaced by a trial of the top quantile (the one finite trial, when only one is left)."""
            lower, upper = super()._quantiles()
            states = self._trial_state.items()
            live = [(t, s.last_score) for t, s in states if s.last_score is not None and not t.is_finished()]
            diverged = [t for t, score in live if math.isnan(score)]
            finite = [t for t, score in live if not math.isnan(score)]
            if not diverged or not finite:  # nothing to replace, or no trial to replace it from
                return lower, upper
            upper = upper or [max(finite, key=lambda t: self._trial_state[t].last_score)]
            return diverged + [t for t in lower if t not in upper], upper

        def _log_config_on_step(self, trial_state: Any, new_state: Any, trial: Any, trial_to_clone: Any,
                                new_config: dict) -> None:  # fmt: skip
            """Tune's policy files (``pbt_global.txt``, ``pbt_policy_<trial>.txt``: a trial's schedule, the donor's
            before its own), each exploit at the perturbation's epoch. Tune logs the trials' last counted results, one
            epoch behind for the trial whose result PBT is handling, and a replay would change its config too early."""
            from ray.tune.utils.util import SafeFallbackEncoder

            at = new_state.last_train_time  # in synchronous PBT, every trial's at the perturbation
            row = [trial_state.orig_tag, new_state.orig_tag, at, at, trial_to_clone.config, new_config]
            line = json.dumps(row, cls=SafeFallbackEncoder) + "\n"
            folder = Path(trial.local_experiment_path)
            with open(folder / "pbt_global.txt", "a", encoding="utf-8") as log:
                log.write(line)
            donors = folder / f"pbt_policy_{trial_to_clone.trial_id}.txt"
            history = donors.read_text(encoding="utf-8") if donors.is_file() else ""
            (folder / f"pbt_policy_{trial.trial_id}.txt").write_text(history + line, encoding="utf-8")

    return _named(DonorCheckpointPBT)


@functools.cache
def _schedule_replay() -> type:
    from ray.tune.schedulers import PopulationBasedTrainingReplay, TrialScheduler

    class ScheduleReplay(PopulationBasedTrainingReplay):
        """Tune's PBT replay, each change made the way synchronous PBT pauses a trial: the config set and a PAUSE
        returned, so Tune saves, stops and restarts the trial from that checkpoint with the new config. Tune's own
        replay saves and stops in one step: the save, finishing after the stop, fails the trial, and the retry is
        refused as a second one. Its place in the policy is private to Ray 2.60's ``PopulationBasedTrainingReplay``."""

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
            step = result.get("training_iteration")
            if step is None or not self._next_policy or step < self._next_policy[0]:
                return TrialScheduler.CONTINUE
            self.current_config = self._next_policy[1]
            trial.set_config(self.current_config)
            self._current_step, self._num_perturbations = step, self._num_perturbations + 1
            self._next_policy = next(self._policy_iter, None)
            return TrialScheduler.PAUSE

    return _named(ScheduleReplay)


def resumable_bohb(metric: str, mode: str, seed: int) -> Any:
    """TuneBOHB that survives ``--resume``: its saved state may predate trials it suggested (ray#39900), whose results
    then fail it; such a trial is known again from the config its results carry (TuneBOHB's private ``_space``).
    Built here on first use: TuneBOHB imports hpbandster."""
    from ray.tune.search.bohb import TuneBOHB

    class ResumableBOHB(TuneBOHB):
        def on_trial_result(self, trial_id: str, result: dict) -> None:
            if trial_id not in self.trial_to_params:
                given = {k.removeprefix("config/"): v for k, v in result.items() if k.startswith("config/")}
                self.trial_to_params[trial_id] = {k: v for k, v in given.items() if k in self._space}
            super().on_trial_result(trial_id, result)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            self.trial_to_params.setdefault(trial_id, {})
            super().on_trial_complete(trial_id, result, error)

    return ResumableBOHB(metric=metric, mode=mode, seed=seed)


def __getattr__(name: str) -> Any:
    """Tune's subclasses, each built on first use, keeping Tune's and Optuna's imports out of processes that only drain
    or compile (a saved sweep's searcher or scheduler unpickles by its name, which builds it)."""
    built = {"DonorCheckpointPBT": _donor_checkpoint_pbt, "ScheduleReplay": _schedule_replay,
             "ResumableOptunaSearch": _resumable_optuna_search}  # fmt: skip
    if name in built:
        return built[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _named(cls: type) -> type:
    """``cls`` as this module's attribute of its name, so that pickles name it (and :func:`__getattr__` rebuilds it)."""
    cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return cls


@functools.cache
def _resumable_optuna_search() -> type:
    from ray.tune.search.optuna import OptunaSearch

    class ResumableOptunaSearch(OptunaSearch):
        """Tune's Optuna searcher over a study that outlives the driver. A driver killed after a trial ended but before
        Tune saved its searcher leaves the trial finished in the study while the resumed sweep runs it again: its
        results and end are not told a second time (Optuna's ``UpdateFinishedTrialError`` ended the resumed sweep).
        Ray 2.60's OptunaSearch keeps its study and trials private, and Optuna its storage."""

        def on_trial_result(self, trial_id: str, result: dict) -> None:
            if not self._finished_in_study(trial_id):
                super().on_trial_result(trial_id, result)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            if self._finished_in_study(trial_id):
                self._completed_trials.add(trial_id)
                return
            super().on_trial_complete(trial_id, result, error)

        def _finished_in_study(self, trial_id: str) -> bool:
            asked = self._ot_trials.get(trial_id)
            if asked is None or self._ot_study is None:
                return False
            # the store's state of the trial, not the copy this searcher was saved with
            return self._ot_study._storage.get_trial(asked._trial_id).state.is_finished()

    return _named(ResumableOptunaSearch)


# --- torch -----------------------------------------------------------------------------------------------------------


def import_inductor() -> None:
    """Import torch's inductor under C.UTF-8 (the locale restored at once), for ``torch.compile`` under an ASCII locale
    (``LC_ALL=C``, as CI and minimal containers run): on its first import it reads its kernel templates, which hold
    UTF-8, with the locale's encoding (``torch._inductor.utils.load_template`` gives none), and fails. Compiling needs
    nothing more of it. Waits on torch reading its templates as UTF-8."""
    import locale

    previous = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        import torch._inductor.compile_fx  # noqa: F401
    except locale.Error:  # no C.UTF-8 here: the import when compiling may still succeed under a UTF-8 locale
        pass
    finally:
        locale.setlocale(locale.LC_CTYPE, previous)


def is_compiled(module: Any) -> bool:
    """Whether ``nn.Module.compile()`` was called on ``module`` (torch 2.13 keeps it only in the private
    ``_compiled_call_impl``, which ``copy.deepcopy`` drops). Waits on a public flag of ``nn.Module``."""
    return getattr(module, "_compiled_call_impl", None) is not None
