"""A trial's checkpoint: what it holds (the latest state, the best weights so far, where within an epoch a pre-empted
node stopped it), writing it with a report, and restoring a trial from it. ``state.pt`` holds plain types and tensors
only (loaded with ``weights_only=True``: a checkpoint on shared storage is not a program anyone may plant), so the
dataclasses here travel as ``to_dict()``/``from_dict()``.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_FILE = "state.pt"
CONFIG_FILE = "config.json"
"""Beside a checkpoint's state: the flat config that trained it (a trial restored from it compares its own)."""


@dataclass
class Best:
    """The best validated epoch so far: its primary score in the metric's own direction (NaN where undefined) and,
    where they will be tested, its weights."""

    score: float = math.nan
    epoch: int = -1
    state: dict[str, torch.Tensor] | None = None

    def beaten_by(self, score: float, mode: str) -> bool:
        """Whether ``score`` is better than this one for a task of ``mode`` ("max"/"min"): NaN is never better than
        a number, and a later NaN replaces an earlier one."""
        if self.epoch < 0 or math.isnan(self.score):
            return True
        if math.isnan(score):
            return False
        return score > self.score if mode == "max" else score < self.score

    def to_dict(self) -> dict[str, Any]:
        return {"score": self.score, "epoch": self.epoch, "state": self.state}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Best:
        return cls(score=float(saved["score"]), epoch=int(saved["epoch"]), state=saved["state"])


@dataclass
class ResumePoint:
    """How far into ``epoch`` a pre-empted attempt had trained: a resumed one skips these steps' batches."""

    epoch: int
    micro_steps: int = 0
    samples: int = 0
    rates: list[float] = field(default_factory=list)
    """The learning rate of each optimiser step taken so far in the epoch."""
    loss_sum: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> ResumePoint:
        return cls(**saved)


@dataclass(frozen=True)
class Trainables:
    """What a checkpoint's state is taken from and restored into."""

    model: torch.nn.Module
    optimiser: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass(frozen=True)
class Restored:
    """Where a restored trial goes on: its first epoch, its best so far and, within that epoch, its resume point."""

    start_epoch: int
    best: Best
    resume: ResumePoint | None
    epoch: int
    """The epoch the checkpoint was written after."""
    written_by: dict[str, Any]
    """The flat config that wrote the checkpoint (empty for an older one)."""


def random_state() -> dict[str, Any]:
    """Every random generator a trial draws from (Python's, NumPy's global, torch's CPU and CUDA ones), in what a
    ``weights_only`` checkpoint holds: a trial resumed with :func:`restore_random_state` draws what the uninterrupted
    one would have (its dropout masks among them)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }  # fmt: skip


def restore_random_state(state: dict[str, Any]) -> None:
    """The generators as :func:`random_state` saved them; a checkpoint without one (older) leaves them as seeded."""
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def load(checkpoint: Any, parts: Trainables) -> Restored:
    """Load Ray's ``checkpoint`` into ``parts`` and the random generators; returns where the trial goes on."""
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        config_file = Path(folder) / CONFIG_FILE
        written_by = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    parts.model.load_state_dict(state["model"])
    parts.optimiser.load_state_dict(state["optimiser"])
    parts.scheduler.load_state_dict(state["scheduler"])
    if "random" in state:
        restore_random_state(state["random"])
    resume = ResumePoint.from_dict(state["partial"]) if state.get("partial") else None
    start = resume.epoch if resume else state["epoch"] + 1
    best = Best.from_dict(state["best"])
    return Restored(start_epoch=start, best=best, resume=resume, epoch=state["epoch"], written_by=written_by)


@dataclass(frozen=True)
class Report:
    """One report of the loop: the epoch's metrics and, where ``config`` is given, a checkpoint of this state."""

    metrics: dict[str, Any]
    parts: Trainables
    epoch: int
    best: Best
    config: Any = None
    """The :class:`~gx_ray.train.config.TrialConfig` that trained it; None reports the metrics alone."""
    resume: ResumePoint | None = None


def report(ctx: Any, r: Report) -> None:
    """Report the epoch through ``ctx.report``; from rank 0 and with a config, with a checkpoint (of the class
    ``ctx.checkpoint_class``) holding the latest state, the best weights so far and the config that trained them."""
    if ctx.rank != 0 or r.config is None:
        ctx.report(r.metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as folder:
        state = {
            "model": r.parts.model.state_dict(),
            "optimiser": r.parts.optimiser.state_dict(),
            "scheduler": r.parts.scheduler.state_dict(),
            "epoch": r.epoch,
            "best": r.best.to_dict(),
            "random": random_state(),  # a retried trial goes on drawing where this one stopped
            **({"partial": r.resume.to_dict()} if r.resume else {}),
        }
        torch.save(state, Path(folder) / CHECKPOINT_FILE)
        (Path(folder) / "metrics.json").write_text(json.dumps(r.metrics, default=float), encoding="utf-8")
        (Path(folder) / CONFIG_FILE).write_text(json.dumps(r.config.to_flat(), default=str), encoding="utf-8")
        ctx.report(r.metrics, checkpoint=checkpoint_class(ctx).from_directory(folder))


def checkpoint_class(ctx: Any) -> type:
    """The context's own Checkpoint class (Tune's reporter warns on Train's), Ray Train's by default."""
    if ctx.checkpoint_class is not None:
        return ctx.checkpoint_class
    from ray.train import Checkpoint

    return Checkpoint


def preempt(ctx: Any, metrics: dict, parts: Trainables, best: Best, config: Any, at: ResumePoint) -> None:
    """Checkpoint the trial where it is within epoch ``at.epoch`` (reported with the last whole epoch's metrics,
    marked ``preempted``) and end this attempt: Tune restarts the trial from here on a node that is not draining."""
    from gx_ray.preemption import NodePreempted

    reported = {**metrics, "val_primary": metrics.get("val_primary", math.nan), "preempted": 1.0}
    report(ctx, Report(metrics=reported, parts=parts, epoch=at.epoch - 1, best=best, config=config, resume=at))
    raise NodePreempted(f"node {ctx.drain.node_id} is draining: checkpointed at step {len(at.rates)} of epoch "
                        f"{at.epoch}, to go on elsewhere")  # fmt: skip
