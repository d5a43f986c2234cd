"""Every private name of Ray and Tune that gx-ray uses (:mod:`gx_ray.compat`), still there and still doing what the
module relies on: a Ray or Optuna upgrade that breaks one fails here, by name, rather than in a sweep."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

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
