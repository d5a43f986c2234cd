"""A space's searcher and scheduler as Tune objects, built here alone (the sweep and the search benchmark both run
them through :func:`gx_ray.sweep.driver.run_sweep`), and what keeps them safe: the checks made before the trials
start, the replay of a PBT schedule, and the record a trial writes when it is restored from a checkpoint.

- ``searcher: random`` draws ``budget.samples`` configs from ``sample`` (Tune's variant generator); ``bohb`` is
  TuneBOHB with Tune's HyperBandForBOHB, which pauses a bracket's trials at each rung and resumes the best.
- ``scheduler: pbt`` is Tune's PopulationBasedTraining, synchronous: every ``pbt.interval`` epochs the bottom quantile
  is restored from the top quantile's checkpoints and its optimiser keys mutated; synchronous so that a donor's
  checkpoint is of the epoch the trial had reached (a run logs every epoch once; a replay finds the epochs).
- Time is ``training_iteration``, the epochs trained: the loop reports once an epoch, and a checkpoint restores it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.search import Searcher

from gx_ray import storage
from gx_ray.compat import DonorCheckpointPBT, ScheduleReplay, resumable_bohb
from gx_ray.sweep.spaces import SearchSpace, SpaceError
from gx_ray.train.config import TrialConfig

# imported by every trial process before Tune restores a trial in it: a paused PBT/BOHB trial's thread gets 2 s to end
# (at its next report) before Tune fails it, too short on a loaded machine; and each restore is logged at INFO for
# every trial at every PBT interval, which the trial's run records anyway
os.environ.setdefault("TUNE_FUNCTION_THREAD_TIMEOUT_S", "120")
logging.getLogger("ray.tune.trainable.trainable").setLevel(logging.WARNING)

METRIC = "val_primary"
TIME_ATTR = "training_iteration"
MUTABLE = ("optimiser.lr", "optimiser.weight_decay", "optimiser.text_lr_multiplier", "optimiser.grad_clip")
"""What PBT may change in a trial as it trains: what the loop re-applies to a restored optimiser. Other sampled keys
are drawn once for the first population and inherited from the donor with its weights."""
PAUSING = ("pbt", "bohb")
"""Schedulers that pause trials and restore them from checkpoints."""


def trained_to_the_end(trial_id: str, result: dict[str, Any]) -> bool:
    """Tune's stopper under a pausing scheduler: a trial's last report (its test metrics, ``best_epoch``) ends it
    before the scheduler sees it, so that no exploit or rung pauses a trial that has nothing left to train."""
    return "best_epoch" in result


def tune_domain(spec: dict[str, Any]) -> Any:
    """A ``sample`` entry as Tune's distribution."""
    kind = spec["type"]
    if kind == "uniform":
        return tune.uniform(spec["low"], spec["high"])
    if kind == "loguniform":
        return tune.loguniform(float(spec["low"]), float(spec["high"]))
    if kind == "int":
        return tune.randint(int(spec["low"]), int(spec["high"]) + 1)
    return tune.choice(spec["choices"])


class ResumableHyperBand(tune.schedulers.HyperBandForBOHB):
    """Tune's HyperBandForBOHB that survives ``--resume``: Tune adds a resumed sweep's new scheduler every saved trial,
    ended ones too, and a bracket waiting for an ended trial to reach its next rung waited forever. Ended trials are
    left out; the unfinished fill new brackets (so not those an uninterrupted sweep would have had)."""

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        if trial.status in ("TERMINATED", "ERROR"):  # ended before the resume: no rung waits for it
            return
        super().on_trial_add(tune_controller, trial)


def scheduler_for(space: SearchSpace) -> Any:
    """The space's Tune scheduler (None for ``none``); each stops or exploits on the primary validation metric."""
    options = space.scheduler_options
    if space.scheduler == "asha":  # stops on the primary metric, also when Optuna searches several objectives
        return tune.schedulers.ASHAScheduler(time_attr="epoch", metric=METRIC, mode="max", grace_period=1,
                                             reduction_factor=2)  # fmt: skip
    if space.scheduler == "pbt":
        # a trial exploited before it wrote results of its own has no results file to restore: Tune warns, none is lost
        logging.getLogger("ray.tune.logger.logger").addFilter(lambda r: "Remote file not found" not in r.getMessage())
        return DonorCheckpointPBT(
            time_attr=TIME_ATTR, metric=METRIC, mode="max", perturbation_interval=options["interval"],
            hyperparam_mutations=mutations(space), quantile_fraction=options["quantile"],
            resample_probability=options["resample_probability"], synch=True,
        )  # fmt: skip
    if space.scheduler == "bohb":
        return ResumableHyperBand(
            time_attr=TIME_ATTR, metric=METRIC, mode="max", max_t=_epochs(space),
            reduction_factor=options["reduction_factor"],
        )  # fmt: skip
    return None


def searcher_for(space: SearchSpace, seed: int) -> Any:
    """The space's Tune searcher where it is not Optuna's (the driver keeps Optuna's study): TuneBOHB for ``bohb``,
    :class:`ListedCells` for a grid with ``exclude`` rules, None for the other grids and ``random`` (Tune's variant
    generator)."""
    if space.searcher == "grid" and space.exclude:
        return ListedCells(space.cells(), space.samples)
    if space.searcher != "bohb":
        return None
    return resumable_bohb(METRIC, "max", seed)


class ListedCells(Searcher):
    """A grid's cells given to Tune one by one, ``samples`` times each: a grid that leaves cells out (Tune's
    ``grid_search`` is every combination of its axes). Its place in the list is saved with Tune's state, so a
    resumed sweep goes on from the next cell."""

    def __init__(self, cells: list[dict[str, Any]], samples: int = 1):
        super().__init__()
        self.cells, self.given = [cell for cell in cells for _ in range(samples)], 0

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        return True  # the metric is the sweep's (it ranks nothing here); the cells are the whole space

    def suggest(self, trial_id: str) -> dict[str, Any] | str:
        if self.given == len(self.cells):
            return Searcher.FINISHED
        self.given += 1
        return dict(self.cells[self.given - 1])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        pass

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text(json.dumps({"cells": self.cells, "given": self.given}), encoding="utf-8")

    def restore(self, checkpoint_path: str) -> None:
        state = json.loads(Path(checkpoint_path).read_text(encoding="utf-8"))
        self.cells, self.given = state["cells"], state["given"]


def mutations(space: SearchSpace) -> dict[str, Any]:
    """PBT's mutations: the sampled keys it may change mid-training; a categorical one moves to a neighbouring choice
    (a list), a number is scaled by 0.8 or 1.2 or drawn again."""
    return {key: spec["choices"] if spec["type"] == "categorical" else tune_domain(spec)
            for key, spec in space.sample.items() if key in MUTABLE}  # fmt: skip


def _configs(space: SearchSpace) -> list[TrialConfig]:
    """Every cell's trial config, sampled keys at their lowest value (what decides epochs and checkpoints)."""
    probe = {k: s["choices"][0] if s["type"] == "categorical" else s["low"] for k, s in space.sample.items()}
    return [TrialConfig.from_flat(space.resolve({**probe, **cell})) for cell in space.cells()]


def _epochs(space: SearchSpace) -> int:
    return max(c.schedule.epochs for c in _configs(space))


def bohb_brackets(epochs: int, eta: int) -> list[tuple[int, list[int]]]:
    """HyperBand's brackets as Tune builds them for ``max_t=epochs``: each one's trials and its rungs (the epochs at
    which its trials are paused and halved), the largest bracket first."""
    s_max_1 = int(round(math.log(epochs) / math.log(eta))) + 1
    brackets = []
    for s in reversed(range(s_max_1)):
        r = int(epochs * eta ** (-s))
        if r == 0:
            continue
        rungs = [r]
        for _ in range(s):
            rungs.append(int(min(rungs[-1] * eta, epochs)))
        brackets.append((int(math.ceil(s_max_1 / (s + 1) * eta**s)), rungs))
    return brackets


def check_schedule(space: SearchSpace) -> None:
    """Before Ray starts: a PBT interval or a BOHB rung that falls between two checkpoints (an exploit or a resumed
    trial would restore an older state than the one scored), a PBT that can never perturb, and trials that train
    under a TorchTrainer (whose checkpoints Tune's exploits do not reach) are refused, naming the key."""
    if space.scheduler not in PAUSING:
        return
    path, name, options = space.path, space.scheduler, space.scheduler_options
    configs = _configs(space)
    if any(c.resources.workers > 1 or c.resources.torch_trainer for c in configs):
        raise SpaceError(
            path,
            "resources.workers",
            f"scheduler {name} restores trials from Tune's checkpoints, which "
            "a trial under a TorchTrainer (several workers) does not read: one worker per trial",
        )
    if name == "pbt":
        if not mutations(space):
            raise SpaceError(path, "sample", f"PBT mutates only {', '.join(MUTABLE)} while a trial trains; sample at "
                             "least one of them")  # fmt: skip
        interval = options["interval"]
        for config in configs:
            every, epochs = config.schedule.checkpoint_every, config.schedule.epochs
            if interval % every:
                raise SpaceError(path, "pbt.interval", f"{interval} epochs is not a multiple of "
                                 f"schedule.checkpoint_every ({every}): an exploit would restore a donor's checkpoint "
                                 "older than the epoch it was scored at")  # fmt: skip
            if interval >= epochs:
                raise SpaceError(path, "pbt.interval", f"{interval} epochs: no trial of schedule.epochs {epochs} "
                                 "would ever be perturbed; give an interval below it")  # fmt: skip
        return
    epochs = {c.schedule.epochs for c in configs}
    if len(epochs) > 1:
        raise SpaceError(path, "schedule.epochs", f"BOHB's budget is one number of epochs; the cells train {epochs}")
    eta, (epochs,) = options["reduction_factor"], epochs
    if epochs < eta:
        raise SpaceError(path, "bohb.reduction_factor", f"{eta} is more than schedule.epochs ({epochs}): no bracket "
                         "would stop a trial early; lower it or train longer")  # fmt: skip
    for config in configs:
        every = config.schedule.checkpoint_every
        rungs = sorted({r for _, bracket in bohb_brackets(epochs, eta) for r in bracket})
        if off := [r for r in rungs if r % every and r != epochs]:
            raise SpaceError(
                path,
                "schedule.checkpoint_every",
                f"{every} epochs: BOHB pauses trials at epochs "
                f"{rungs}, and {off} fall between checkpoints (a resumed trial would train them again)",
            )


def check_cluster(space: SearchSpace, at_once: int, nodes: list[dict[str, float]], trial: dict[str, float]) -> None:
    """Once the cluster's resources are known: a trial that fits no node waits forever (for any scheduler), and a
    BOHB bracket must be filled and run on it. HyperBandForBOHB pauses a bracket's trials at each rung until all of
    them are there: a bracket larger than ``budget.samples`` is never filled (its trials wait for ones that never
    come), and the halving at a rung compares only the trials that ran. Prints the brackets it will run."""
    wanted = {"CPU": trial.get("cpu", 0.0), "GPU": trial.get("gpu", 0.0), "memory": trial.get("memory", 0.0)}
    if not any(all(node.get(k, 0.0) >= v for k, v in wanted.items()) for node in nodes):
        top = {k: max((node.get(k, 0.0) for node in nodes), default=0.0) for k in wanted}
        asks, has = (f"{n['CPU']:g} CPU and {n['GPU']:g} GPU with {n['memory'] / 2**30:.1f} GiB" for n in (wanted, top))
        raise SpaceError(space.path, "resources", f"a trial asks for {asks}; the largest node has {has}: none starts")
    if space.scheduler != "bohb":
        return
    eta = space.scheduler_options["reduction_factor"]
    brackets = bohb_brackets(_epochs(space), eta)
    largest = max(n for n, _ in brackets)
    if largest > space.samples:
        raise SpaceError(space.path, "budget.samples", f"{space.samples}: BOHB's largest bracket holds {largest} "
                         f"trials (schedule.epochs {_epochs(space)}, bohb.reduction_factor {eta}) and would never be "
                         f"filled; give at least {largest} samples or a larger reduction factor")  # fmt: skip
    plan = "; ".join(f"{n} trials paused at epochs {', '.join(map(str, rungs))}" for n, rungs in brackets)
    print(f"BOHB brackets: {plan}; {at_once} trials at a time", file=sys.stderr)


def policy_file(replay: str, state: Path | None) -> Path:
    """The PBT policy a ``--replay`` names: a policy file, or a trial (its number, as in the runs' ``gx_ray.trial``
    tag, or its Tune id) of the sweep whose Tune state is ``state``."""
    given = Path(replay).expanduser()
    if given.is_file():
        return given
    found = sorted(state.glob(f"pbt_policy_*{replay.rsplit('_', 1)[-1]}.txt")) if state and state.is_dir() else []
    if len(found) != 1:
        where = f"in {state}" if state else "(no such file)"
        raise FileNotFoundError(f"--replay {replay}: no PBT policy of that trial {where}; give a pbt_policy_*.txt file "
                                "or the number of a trial that was exploited")  # fmt: skip
    return found[0]


def replay_sweep(space: SearchSpace, sweep_id: str, replay: str, state: str) -> tuple[SearchSpace, str, Path]:
    """The sweep that replays a PBT schedule: one trial of ``space``, starting from the policy's first config (its grid
    cell among them), named ``<sweep id>-replay-<policy hash>``; ``state`` is the PBT sweep's Tune state."""
    policy = policy_file(replay, storage.local_path(state))
    initial = replay_scheduler(policy)[1]
    grid = {key: [initial[key]] for key in space.grid if key in initial}
    replayed = dataclasses.replace(space, searcher="random", scheduler="none", scheduler_options={}, sample={},
                                   samples=1, grid=grid)  # fmt: skip
    return replayed, f"{sweep_id}-replay-{hashlib.sha1(policy.read_bytes()).hexdigest()[:8]}", policy


def replay_scheduler(policy: Path) -> tuple[Any, dict[str, Any]]:
    """Tune's PopulationBasedTrainingReplay over ``policy`` and the config its trial starts from."""
    scheduler = ScheduleReplay(str(policy))
    return scheduler, dict(scheduler.config)


def restore_record(
    restored: dict[str, Any], config: dict[str, Any], trial_id: str, trial_dir: str
) -> dict[str, Any] | None:
    """What a trial records when it is restored from a checkpoint another trial wrote (a PBT exploit) or with another
    config than the one that wrote it (a mutation, a replayed schedule): the donor, the epochs, the values changed
    and the SHA-256 of the weights restored. None for a trial resumed from its own checkpoint unchanged."""
    folder = Path(restored["path"]).parent.name
    donor = None if folder == Path(trial_dir).name else f"{trial_id.rsplit('_', 1)[0]}_{folder.split('-')[0]}"
    now = json.loads(json.dumps(config, default=str))
    before = restored.get("config") or {}
    changed = {k: [before.get(k), v] for k, v in now.items() if k in before and before[k] != v}
    if donor is None and not changed:
        return None
    return {
        "epoch": restored["epoch"] + 1,  # the first epoch trained from the restored weights
        "restored_epoch": restored["epoch"],
        "donor_trial": donor,
        "changed": changed,
        "weights_sha256": restored["weights_sha256"],
        "checkpoint": restored["path"],
    }
