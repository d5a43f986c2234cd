"""Every private name of Ray and Tune that gx-ray uses (:mod:`gx_ray.compat`), still there and still doing what the
module relies on: a Ray or Optuna upgrade that breaks one fails here, by name, rather than in a sweep."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import ray
from ray import tune
from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

from gx_ray import compat


def test_ray_started_here_reads_the_address_the_last_ray_start_left(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert compat.ray_started_here() is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6390")
    assert compat.ray_started_here() == "127.0.0.1:6390"


def test_ray_init_still_takes_a_local_cluster_s_system_config():
    assert 'kwargs.pop("_system_config"' in inspect.getsource(ray.init)  # one of ray.init's private keywords
    assert compat.system_config({"num_workers_soft_limit": 12}) == {"_system_config": {"num_workers_soft_limit": 12}}
    assert compat.system_config({}) == {}  # nothing to set: ray.init's own default


def test_the_drain_state_is_read_and_a_drain_asked_as_ray_s_own_cli_does(ray_cluster):
    from ray.core.generated import autoscaler_pb2

    assert compat.draining_nodes() == {}  # a dict by node id; nobody drains the test cluster
    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    assert callable(gcs.drain_node)  # what `ray drain-node` calls (the preemption tests drain nodes with it)


def test_pbt_s_private_hooks_are_those_donor_checkpoint_pbt_overrides():
    names = {
        "_exploit": ["self", "tune_controller", "trial", "trial_to_clone"],
        "_quantiles": ["self"],
        "_log_config_on_step": ["self", "trial_state", "new_state", "trial", "trial_to_clone", "new_config"],
    }
    for name, parameters in names.items():
        assert list(inspect.signature(getattr(PopulationBasedTraining, name)).parameters) == parameters, name
    pbt = compat.DonorCheckpointPBT(time_attr="training_iteration", metric="m", mode="max", perturbation_interval=2,
                                    hyperparam_mutations={"lr": [1, 2]}, synch=True)  # fmt: skip
    assert pbt._trial_state == {} and pbt._perturbation_interval == 2 and pbt._next_perturbation_sync == 2
    manager = Trial("__fake", config={}, stub=True).run_metadata.checkpoint_manager
    assert manager._latest_checkpoint_result is None and manager.latest_checkpoint_result is None
    manager._latest_checkpoint_result = donor = object()  # what choose_trial_to_run points a trial at
    assert manager.latest_checkpoint_result is donor


def test_the_schedule_replay_pauses_its_trial_with_the_next_config_at_each_step_of_the_policy(tmp_path):
    first, second = {"lr": 1.0}, {"lr": 2.0}
    policy = tmp_path / "pbt_policy_x_00001.txt"
    policy.write_text(json.dumps(["a", "b", 2, 2, first, second]) + "\n", encoding="utf-8")
    replay = compat.ScheduleReplay(str(policy))
    assert replay.config == first
    trial = SimpleNamespace(config=dict(first))
    trial.set_config = lambda config: setattr(trial, "config", config)
    assert replay.on_trial_result(None, trial, {"training_iteration": 1}) == TrialScheduler.CONTINUE
    assert replay.on_trial_result(None, trial, {"training_iteration": 2}) == TrialScheduler.PAUSE
    assert trial.config == second and replay.on_trial_result(None, trial, {"training_iteration": 3}) == "CONTINUE"


def test_bohb_takes_the_results_of_a_trial_its_saved_state_does_not_know():
    searcher = compat.resumable_bohb("val_primary", "max", seed=0)
    searcher.set_search_properties("val_primary", "max", {"lr": tune.uniform(0.0, 1.0)})
    result = {"config/lr": 0.5, "val_primary": 1.0, "training_iteration": 1}
    searcher.on_trial_result("suggested-before-the-save", result)
    assert searcher.trial_to_params["suggested-before-the-save"] == {"lr": 0.5}
    searcher.on_trial_complete("suggested-before-the-save", result)


def test_optuna_takes_a_trial_finished_in_its_study_being_reported_again():
    searcher = compat.ResumableOptunaSearch(space={"lr": tune.uniform(0.0, 1.0)}, metric="val_primary", mode="max")
    assert 0.0 <= searcher.suggest("t1")["lr"] <= 1.0
    searcher.on_trial_complete("t1", {"val_primary": 1.0})
    # a resumed sweep runs the trial again from its checkpoint: Optuna itself refuses a finished trial's values
    searcher.on_trial_result("t1", {"val_primary": 1.0, "training_iteration": 1})
    searcher.on_trial_complete("t1", {"val_primary": 1.0})
    assert len(searcher._ot_study.trials) == 1 and searcher._ot_study.trials[0].value == 1.0


KILLED_BY_THE_MONITOR = """
import json, sys, time, psutil, ray
from ray import tune
from gx_ray.compat import memory_kills_fail_trials
free = psutil.virtual_memory()
# the memory monitor's threshold 3 GiB above what the machine uses now: Ray's own processes fit under it, the hog not
threshold = min(0.95, (free.total - free.available + 3 * 2**30) / free.total)
ray.init(address="local", num_cpus=2, include_dashboard=False,
         _system_config={"memory_usage_threshold": threshold, "memory_monitor_refresh_ms": 100})
memory_kills_fail_trials()

def trainable(config):
    if config["hog"]:  # grows past the threshold, 100 MiB at a time, until the monitor kills it
        held = [bytearray(100 * 2**20) for _ in range(60) if not time.sleep(0.02)]
        time.sleep(10)
    tune.report({"score": 1.0})

tuner = tune.Tuner(tune.with_resources(trainable, {"cpu": 1}), param_space={"hog": tune.grid_search([False, True])},
                   run_config=tune.RunConfig(storage_path=sys.argv[1], verbose=0,
                                             failure_config=tune.FailureConfig(max_failures=1)))
tries = lambda r: open(f"{r.path}/error.txt").read().count("Failure #") if r.error else 0  # noqa: E731
print(json.dumps([[r.config["hog"], str(r.error) if r.error else None, r.metrics.get("score"), tries(r)]
                  for r in tuner.fit()]))
"""


def test_a_trial_killed_by_ray_s_memory_monitor_fails_and_the_sweep_goes_on(tmp_path):
    """A real kill: a Ray node whose memory monitor kills above what the machine uses now plus 3 GiB, and a trial
    that allocates past it. Without :func:`compat.memory_kills_fail_trials` Tune's fit raises "Caught unexpected
    exception: 1 worker(s) were killed due to the node running low on memory"; with it the trial is retried once (the
    FailureConfig) and reported failed with the reason, and the other trial finishes."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", KILLED_BY_THE_MONITOR, str(tmp_path)], capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (calm, calm_error, score, _), (hog, error, _, tries) = json.loads(done.stdout.strip().splitlines()[-1])
    assert (calm, calm_error, score, hog, tries) == (False, None, 1.0, True, 2)  # failed twice: tried and retried
    assert re.match(r"killed for memory: needed ~[\d.]+ GB, node had [\d.]+ GB\n", error), error
    assert "running low on memory" in error  # Ray's own message follows


def test_tune_s_actor_manager_still_raises_on_an_out_of_memory_error_it_does_not_know():
    """What :func:`compat.memory_kills_fail_trials` wraps: Ray's actor manager hands a trial's dead actor to Tune only
    for a ``RayActorError`` (``KilledForMemory`` is one) and raises on any other error, ``OutOfMemoryError`` included
    (ray#28937 made an actor killed for memory raise it). The day Tune handles it, this fails: drop the wrapper."""
    from ray.air.execution._internal.actor_manager import RayActorManager

    def ray_s(name: str) -> Any:  # the method as Ray defines it, wrapped or not (a sweep in this process wraps it)
        return getattr(getattr(RayActorManager, name), "wrapped", getattr(RayActorManager, name))

    source = inspect.getsource(ray_s("_actor_task_failed"))
    assert "Caught unexpected exception" in source and "OutOfMemoryError" not in source
    for name in ("_actor_task_failed", "_actor_start_failed"):  # called with the exception by keyword
        assert list(inspect.signature(ray_s(name)).parameters)[-1] == "exception"
    killed = compat.KilledForMemory("was 20.1GB used / 23.54GB limit ... pid=7, actual memory used=9.03GB, worker ID=a")
    assert isinstance(killed, ray.exceptions.RayActorError) and not killed.preempted  # one of max_failures
    assert str(killed).splitlines()[0] == "killed for memory: needed ~9.03 GB, node had 23.54 GB"


def test_tune_s_subclasses_are_built_on_first_use_and_pickle_by_their_names():
    """Importing :mod:`gx_ray.compat` imports no Tune (a model compiled with :func:`compat.import_inductor` needs
    none); each subclass, built when first asked for, is the module's attribute of its name, as pickles find it."""
    code = "import sys; from gx_ray import compat; assert 'ray.tune' not in sys.modules, 'Tune imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    for name in ("DonorCheckpointPBT", "ScheduleReplay", "ResumableOptunaSearch"):
        built = getattr(compat, name)
        assert pickle.loads(pickle.dumps(built)) is built is getattr(compat, name), name


def test_torch_s_inductor_imports_under_an_ascii_locale_through_compat():
    """``torch._inductor.compile_fx`` is still there, and :func:`compat.import_inductor` imports it under an ASCII
    locale (``LC_ALL=C`` without Python's UTF-8 mode, as CI ran): imported there directly, torch reads its UTF-8
    kernel templates as ASCII and fails. :func:`gx_ray.models.registry.compile_in_place` compiles after it."""
    code = "import sys; from gx_ray import compat; compat.import_inductor(); assert 'torch._inductor' in sys.modules"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}, check=True)


def test_is_compiled_sees_a_module_compiled_in_place_and_not_its_deep_copy():
    """What :func:`compat.is_compiled` reads (torch's private ``_compiled_call_impl``): fails when torch renames it."""
    import copy

    import torch

    model = torch.nn.Linear(2, 2)
    assert not compat.is_compiled(model)
    model.compile()
    assert compat.is_compiled(model) and not compat.is_compiled(copy.deepcopy(model))
