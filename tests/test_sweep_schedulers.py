"""PBT and BOHB as a space's scheduler (``gx_ray/sweep/schedulers.py``): the pairs a space may name, the checks made
before the trials start, a mutation taking effect on a restored optimiser, and a real PBT sweep whose every exploit
restored exactly the weights of its donor's checkpoint (hashed here from the checkpoint's files), whose schedule is
recorded on the trial's MLflow run and replayed by ``--replay``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from gx_ray.sweep.schedulers import bohb_brackets, check_cluster, check_schedule
from gx_ray.sweep.spaces import SpaceError, load_space
from gx_ray.train.config import TrialConfig
from tests.common import small_stage_space

LR = {"optimiser.lr": {"type": "loguniform", "low": 1.0e-4, "high": 1.0e-3}}  # none diverges


def _space(tmp_path: Path, epochs: int = 3, samples: int = 2, name: str = "sched", **document) -> Path:
    """A tiny stage-classification space (one seed) with ``document``'s top-level keys on top."""
    path = small_stage_space(tmp_path / f"{name}.yaml", epochs, [0], "schedulers", {"samples": samples})
    base = yaml.safe_load(path.read_text(encoding="utf-8"))
    fixed = document.pop("fixed", {})
    base["fixed"].update(fixed)
    if document.get("searcher") == "bohb":
        base.pop("grid")
        base["fixed"]["seed"] = 0
    path.write_text(yaml.safe_dump({**base, "sample": LR, **document}), encoding="utf-8")
    return path


PBT = {"searcher": "random", "scheduler": "pbt", "pbt": {"interval": 1}}
BOHB = {"searcher": "bohb", "scheduler": "bohb", "bohb": {"reduction_factor": 3}}


@pytest.mark.parametrize(
    ("document", "key", "says"),
    [
        ({"searcher": "bohb"}, "scheduler", "give searcher: bohb and scheduler: bohb"),
        ({"scheduler": "bohb", "searcher": "random"}, "searcher", "give searcher: bohb and scheduler: bohb"),
        ({"searcher": "optuna", "scheduler": "pbt", "grid": None}, "searcher", "give searcher: random"),
        ({**PBT, "pbt": {"interval": 0}}, "pbt.interval", "a whole number of epochs"),
        ({**PBT, "pbt": {"quantile": 0.7}}, "pbt.quantile", r"a fraction in \(0, 0.5\]"),
        ({**PBT, "pbt": {"every": 2}}, "pbt.every", "unknown key; valid: interval, quantile, resample_probability"),
        ({"searcher": "random", "scheduler": "asha", "pbt": {"interval": 2}}, "pbt", "needs scheduler: pbt"),
        ({"searcher": "grid"}, "sample", "need searcher: random, optuna or bohb"),
    ],
)
def test_a_space_names_only_pairs_tune_runs_each_error_naming_the_file_and_key(tmp_path, document, key, says):
    path = _space(tmp_path, **document)
    if document.get("grid", 1) is None:  # optuna takes no grid axes
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        raw.pop("grid")
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(SpaceError, match=says) as raised:
        load_space(str(path))
    assert raised.value.key == key and str(path) in str(raised.value)


@pytest.mark.parametrize(
    ("document", "key", "says"),
    [
        # an exploit between two checkpoints would restore a state older than the one PBT scored
        ({**PBT, "pbt": {"interval": 3}, "fixed": {"schedule.checkpoint_every": 2}}, "pbt.interval",
         r"3 epochs is not a multiple of schedule.checkpoint_every \(2\)"),
        ({**PBT, "pbt": {"interval": 1}, "fixed": {"schedule.checkpoint_every": 2}}, "pbt.interval", "not a multiple"),
        ({**PBT, "pbt": {"interval": 3}}, "pbt.interval", "would ever be perturbed"),
        ({**PBT, "sample": {"schedule.warmup_fraction": {"type": "uniform", "low": 0, "high": 0.2}}}, "sample",
         "PBT mutates only optimiser.lr"),
        ({**PBT, "fixed": {"resources.torch_trainer": True}}, "resources.workers", "one worker per trial"),
        # 9 epochs halved by 3 pause trials at epochs 1 and 3: every second epoch's checkpoint misses them
        ({**BOHB, "fixed": {"schedule.epochs": 9, "schedule.checkpoint_every": 2}}, "schedule.checkpoint_every",
         r"BOHB pauses trials at epochs \[1, 3, 9\]"),
        ({**BOHB, "bohb": {"reduction_factor": 4}}, "bohb.reduction_factor", "no bracket would stop a trial early"),
    ],
)  # fmt: skip
def test_the_pre_flight_check_refuses_a_perturbation_or_rung_between_checkpoints(tmp_path, document, key, says):
    with pytest.raises(SpaceError, match=says) as raised:
        check_schedule(load_space(str(_space(tmp_path, **document))))
    assert raised.value.key == key


def test_a_perturbation_at_a_checkpoint_passes(tmp_path):
    check_schedule(load_space(str(_space(tmp_path, epochs=5, **{**PBT, "pbt": {"interval": 2}},
                                         fixed={"schedule.checkpoint_every": 2}))))  # fmt: skip
    check_schedule(load_space("lr_sweep", ("demo", "pbt")))
    check_schedule(load_space("lr_sweep", ("demo", "bohb")))


def test_bohb_brackets_are_tunes_and_must_fit_the_budget_and_the_cluster(tmp_path):
    from ray.tune.schedulers import HyperBandForBOHB

    for epochs, eta in ((4, 3), (9, 3), (20, 3), (16, 2), (5, 2)):
        tune_s = HyperBandForBOHB(time_attr="training_iteration", max_t=epochs, reduction_factor=eta)
        brackets = [(tune_s._get_n0(s), tune_s._get_r0(s)) for s in reversed(range(tune_s._s_max_1))]
        assert [(n, rungs[0]) for n, rungs in bohb_brackets(epochs, eta)] == [b for b in brackets if b[1] > 0]
    nine = load_space(str(_space(tmp_path, samples=2, **BOHB, fixed={"schedule.epochs": 9})))
    node = {"CPU": 2.0, "GPU": 0.0}
    with pytest.raises(SpaceError, match="largest bracket holds 9 trials .* give at least 9 samples") as raised:
        check_cluster(nine, 2, [node], {"cpu": 1.0, "gpu": 0.0})
    assert raised.value.key == "budget.samples"
    with pytest.raises(SpaceError, match="asks for 4 CPU .* the largest node has 2") as raised:
        check_cluster(load_space(str(_space(tmp_path, **PBT))), 1, [node], {"cpu": 4.0, "gpu": 0.0})
    assert raised.value.key == "resources"
    with pytest.raises(SpaceError, match="asks for 1 CPU and 0 GPU with 9.0 GiB; the largest node has .* 8.0 GiB"):
        check_cluster(nine, 1, [{**node, "memory": 8.0 * 2**30}], {"cpu": 1.0, "gpu": 0.0, "memory": 9.0 * 2**30})


def _weights_hash(state_dict: dict[str, torch.Tensor]) -> str:
    """The test's own SHA-256 of a model's weights (names and bytes in name order), to compare with the loop's."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_a_restored_optimiser_takes_a_mutated_learning_rate_and_keeps_its_schedule(
    ray_cluster, demo_prepared, tmp_path
):
    """A trial restored with another learning rate (a PBT mutation) trains at it: every later step's rate is the
    uninterrupted run's times the ratio (warm-up and decay go on), and the restore reports the weights it loaded."""
    from mlflow.tracking import MlflowClient
    from ray.train import Checkpoint

    from gx_ray.tracking import TrialTracker
    from gx_ray.train import loop

    flat = {"task": "stage_classification", "data.shards": str(demo_prepared.shard_dir), "schedule.epochs": 2,
            "schedule.max_steps_per_epoch": 2, "data.effective_batch": 2, "model.vision": "resnet10_3d",
            "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.text": "bert_tiny",
            "model.fusion": "concat", "model.hidden": 32, "optimiser.lr": 1e-3,
            "schedule.warmup_fraction": 0.3}  # fmt: skip
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("rates", artifact_location=str(tmp_path / "artifacts"))

    def run(config: TrialConfig, latest: Checkpoint | None) -> tuple[list[float], list[dict]]:
        run_id = client.create_run(experiment).info.run_id
        restored: list[dict] = []

        def report(metrics: dict, checkpoint: Checkpoint | None = None) -> None:
            if checkpoint is not None and metrics["epoch"] == 0:
                checkpoint.to_directory(str(tmp_path / "epoch0"))

        worker = loop.WorkerContext(rank=0, world_size=1, device=torch.device("cpu"), report=report,
                                    latest_checkpoint=latest, tracker=TrialTracker(client.tracking_uri, run_id),
                                    on_restore=restored.append)  # fmt: skip
        loop.run_loop(config, worker)
        rates = sorted(client.get_metric_history(run_id, "lr"), key=lambda m: m.step)
        return [m.value for m in rates], restored

    whole, _ = run(TrialConfig.from_flat(flat), None)
    doubled, restored = run(TrialConfig.from_flat({**flat, "optimiser.lr": 2e-3}), Checkpoint(str(tmp_path / "epoch0")))
    assert len(whole) == 4 and len(doubled) == 2  # two steps an epoch; epoch 1 after the restore
    # warm-up over the first two steps, decay over the last two: the restored run decays from twice the rate
    assert doubled == pytest.approx([2 * r for r in whole[2:]], rel=1e-6) and len(set(whole)) == 4
    state = torch.load(tmp_path / "epoch0" / loop.CHECKPOINT_FILE, map_location="cpu", weights_only=True)
    assert restored[0]["weights_sha256"] == _weights_hash(state["model"]) and restored[0]["epoch"] == 0
    assert restored[0]["config"]["optimiser.lr"] == 1e-3  # the config that wrote the checkpoint


def test_pbt_ranks_a_diverged_trial_last_and_replaces_it_from_the_top():
    """Tune's PBT ranks finite scores only: a trial whose validation became NaN would train on, never exploited.
    On 300 random populations (2–8 trials, some diverged, both quantile fractions): every diverged trial is in the
    bottom set, the top set is the best finite scores (the one finite trial when only one is left), none is in both,
    and a population with no NaN gets exactly Tune's quantiles."""
    import math
    import random

    from ray.tune.experiment import Trial
    from ray.tune.schedulers import PopulationBasedTraining
    from ray.tune.schedulers.pbt import _PBTTrialState

    from gx_ray.sweep.schedulers import METRIC, TIME_ATTR, DonorCheckpointPBT

    rng, mutations = random.Random(0), {"optimiser.lr": [1e-4, 1e-3]}
    for case in range(300):
        options = dict(time_attr=TIME_ATTR, metric=METRIC, mode="max", perturbation_interval=1, synch=True,
                       hyperparam_mutations=mutations, quantile_fraction=rng.choice([0.25, 0.5]))  # fmt: skip
        ours, tunes = DonorCheckpointPBT(**options), PopulationBasedTraining(**options)
        trials = [Trial("__fake", config={}, stub=True) for _ in range(rng.randint(2, 8))]
        scores = {t: math.nan if rng.random() < 0.3 else rng.random() for t in trials}
        for scheduler in (ours, tunes):
            for trial in trials:
                scheduler._trial_state[trial] = _PBTTrialState(trial)
                scheduler._save_trial_state(
                    scheduler._trial_state[trial], 1, {METRIC: scores[trial], TIME_ATTR: 1}, trial
                )
        lower, upper = ours._quantiles()
        diverged = {t for t in trials if math.isnan(scores[t])}
        finite = sorted((t for t in trials if t not in diverged), key=scores.get, reverse=True)
        if not diverged or not finite:
            assert (lower, upper) == tunes._quantiles(), case
            continue
        assert diverged <= set(lower) and not set(lower) & set(upper), case
        assert upper and set(upper) == set(finite[: len(upper)]), case


# --- a real PBT sweep --------------------------------------------------------------------------------------------


def _exploits(client, runs) -> dict[str, list[dict]]:
    """Per trial counter: the schedule records its run holds (gx_ray.sweep.trial.record_restore)."""
    found = {}
    for run in runs:
        records = []
        for artifact in client.list_artifacts(run.info.run_id, "schedule"):
            local = client.download_artifacts(run.info.run_id, artifact.path)
            records.append(json.loads(Path(local).read_text(encoding="utf-8")))
        found[run.data.tags["gx_ray.trial"]] = sorted(records, key=lambda r: r["epoch"])
    return found


@pytest.mark.slow
def test_every_pbt_exploit_restores_its_donors_latest_weights_and_the_schedule_replays(
    ray_cluster, demo_prepared, tmp_path
):
    """A population of two, three epochs, perturbed after each of the first two: PBT's own log (pbt_global.txt)
    names each exploit's trial and donor; the trial's run records that donor, the donor's checkpoint of the epoch it
    was scored at (not an older one), and the SHA-256 of the weights the loop loaded, which equals the hash of that
    checkpoint's weights read here from its files. Then ``--replay`` trains the exploited trial's schedule again as
    one trial, starting from the policy's first config and changing it at the epochs the policy gives."""
    from mlflow.tracking import MlflowClient

    from gx_ray.sweep.driver import SweepOptions, run_sweep
    from gx_ray.tracking import KIND_TAG, SWEEP_TAG
    from gx_ray.tracking.server import LocalMlflowServer

    space = _space(tmp_path, epochs=3, samples=2, **PBT)
    with LocalMlflowServer(tmp_path / "mlflow") as server:
        options = SweepOptions(space=str(space), output=tmp_path / "out", data=demo_prepared.shard_dir,
                               mlflow_uri=server.uri, max_concurrent=2)  # fmt: skip
        result = run_sweep(options)
        assert result.finished == 2 and result.failed == 0
        client = MlflowClient(server.uri)
        runs = [r for r in client.search_runs([result.experiment_id]) if r.data.tags.get(KIND_TAG) == "trial"]
        records = _exploits(client, runs)
        state = tmp_path / "out" / result.sweep_id / "ray" / result.sweep_id
        logged = [json.loads(line) for line in (state / "pbt_global.txt").read_text(encoding="utf-8").splitlines()]
        assert len(logged) == 2  # one exploit at each perturbation: a population of two has one trial below
        for target, donor, target_epochs, at, _, new_config in logged:
            target, donor = (f"{int(tag.split('_', 1)[0]):05d}" for tag in (target, donor))
            assert target_epochs == at  # synchronous: both at the perturbation's epoch
            record = next(r for r in records[target] if r["epoch"] == at)
            assert record["donor_trial"].endswith(f"_{donor}")
            assert Path(record["checkpoint"]).parent.name.startswith(donor)
            assert record["restored_epoch"] == at - 1  # the donor's latest, at the epoch it was scored
            saved = torch.load(Path(record["checkpoint"]) / "state.pt", map_location="cpu", weights_only=True)
            assert saved["epoch"] == record["restored_epoch"]
            assert record["weights_sha256"] == _weights_hash(saved["model"])
            assert record["changed"]["optimiser.lr"][1] == pytest.approx(new_config["optimiser.lr"])
        for run in runs:  # each epoch once, in spite of the pauses and exploits; the run's params as it started
            steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_primary")]
            assert sorted(steps) == [0, 1, 2] and run.info.status == "FINISHED"
        exploited = next(t for t, r in records.items() if any(x["donor_trial"] for x in r))

        replay = run_sweep(dataclasses.replace(options, replay=exploited))
        assert replay.finished == 1 and replay.sweep_id.startswith(f"{result.sweep_id}-replay-")
        (run,) = [r for r in client.search_runs([replay.experiment_id], f"tags.`{SWEEP_TAG}` = '{replay.sweep_id}'")
                  if r.data.tags.get(KIND_TAG) == "trial"]  # fmt: skip
        policy_file = next(state.glob(f"pbt_policy_*{exploited}.txt"))
        policy = [json.loads(line) for line in policy_file.read_text(encoding="utf-8").splitlines()]
        assert float(run.data.params["optimiser.lr"]) == pytest.approx(policy[0][4]["optimiser.lr"])
        replayed = {r["epoch"]: r for r in _exploits(client, [run])["00000"]}
        for _, _, _, step, _, config in policy:  # the config changed at the step the policy gives, to its values
            assert replayed[step]["changed"]["optimiser.lr"][1] == pytest.approx(config["optimiser.lr"])
            assert replayed[step]["donor_trial"] is None  # its own checkpoint, with the schedule's next config
        # from the last exploit on, the replay trains what PBT found, loss for loss (bit for bit on the CPU)
        found = next(r for r in runs if r.data.tags["gx_ray.trial"] == exploited)
        since = policy[-1][3]
        losses = [{m.step: m.value for m in client.get_metric_history(r.info.run_id, "train_loss")}
                  for r in (found, run)]  # fmt: skip
        assert [losses[0][e] for e in range(since, 3)] == [losses[1][e] for e in range(since, 3)]
