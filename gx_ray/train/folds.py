"""Cross-validation inside one trial: a configuration's k folds trained side by side, epoch by epoch, so that each of
the trial's reports carries the folds' mean validation score. That mean is what a searcher models (TPE, BOHB), what
ASHA stops on and what PBT exploits when a space sets ``cv`` with a searcher or scheduler; one fold's score would be a
noisier objective. Each fold is a :class:`~gx_ray.train.loop.TrainingRecipe` of its own (its MLflow run, its test,
its out-of-fold predictions), as a fold of a grid's ``data.fold`` axis is; the trial's checkpoint holds each fold's
in a folder ``fold-<i>``, written at the epochs every fold checkpoints at (a fold group is not checkpointed within an
epoch: a draining node's trial goes on from its last whole checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gx_ray.train.config import TrialConfig
from gx_ray.train.ledger import COSTS
from gx_ray.train.loop import TrainingRecipe

FOLD_FOLDER = "fold-{}"
KEPT_FROM_FIRST = ("epoch", "best_epoch", "parameters")
"""Numbers every fold reports alike (or that are no score): the trial reports fold 0's, not a mean."""


def fold_config(config: TrialConfig, fold: int) -> TrialConfig:
    """``config`` trained on fold ``fold`` (its other folds' patients; the fold's are its validation split)."""
    return dataclasses.replace(config, data=dataclasses.replace(config.data, fold=fold))


def fold_checkpoint(latest: Any, fold: int) -> Any:
    """Fold ``fold``'s checkpoint inside the trial's checkpoint ``latest`` (Tune's, on any storage), or None where
    there is none (a fresh trial)."""
    if latest is None:
        return None
    return type(latest)(path=f"{str(latest.path).rstrip('/')}/{FOLD_FOLDER.format(fold)}", filesystem=latest.filesystem)


def fold_mean(per_fold: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of the folds' reports: each score every fold reports averaged (NaN where any fold's is NaN: an
    undefined score is never averaged away), their costs summed (each fold's ledger holds its share of the trial's
    resources), each fold's ``val_primary`` as ``fold<i>_val_primary``, the rest as fold 0 reports it."""
    merged = dict(per_fold[0])
    for key in set.intersection(*(set(m) for m in per_fold)) - set(KEPT_FROM_FIRST):
        values = [m[key] for m in per_fold]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            merged[key] = math.fsum(values) if key in COSTS else math.fsum(values) / len(values)
    merged.update({f"fold{i}_val_primary": m["val_primary"] for i, m in enumerate(per_fold) if "val_primary" in m})
    return merged


class FoldGroup:
    """The folds of one trial trained in lock-step. Each fold's recipe reports into :meth:`collector` (its metrics, and
    its checkpoint copied into the group's folder) and ends its run through :meth:`deferred`; after every fold has
    run an epoch, the trial reports their :func:`fold_mean`, with the folder as its checkpoint where one is due, and
    the folds' runs end just before the last report (at which a scheduler may stop the trial)."""

    def __init__(self, report: Callable[..., None], checkpoint_class: type, folds: int) -> None:
        self.report, self.checkpoint_class = report, checkpoint_class
        self.latest: list[dict[str, Any]] = [{} for _ in range(folds)]
        self.pending_ends: list[Callable[[], None]] = []
        self.folder = Path(tempfile.mkdtemp(prefix="gx-ray-folds-"))

    def collector(self, fold: int) -> Callable[..., None]:
        """Fold ``fold``'s ``report(metrics, checkpoint=None)``: kept for the trial's next report."""

        def collect(metrics: dict[str, Any], checkpoint: Any = None) -> None:
            if checkpoint is not None:  # copied now: the loop deletes its checkpoint's folder once reported
                target = self.folder / FOLD_FOLDER.format(fold)
                shutil.rmtree(target, ignore_errors=True)
                checkpoint.to_directory(str(target))
            self.latest[fold] = dict(metrics)

        return collect

    def deferred(self, end: Callable[[], None]) -> Callable[[], None]:
        """A fold's ``before_final_report``, held until every fold has tested: a trial killed between two folds' tests
        leaves no fold's run FINISHED, and goes on from its checkpoint as one."""
        return lambda: self.pending_ends.append(end)

    def train(self, recipes: list[TrainingRecipe]) -> dict[str, Any]:
        """Every epoch of every fold from where each was restored; returns the trial's last report."""
        starts = sorted({r.start_epoch for r in recipes})
        if len(starts) > 1:  # every fold checkpoints at the same epochs, into one checkpoint
            raise RuntimeError(f"the trial's checkpoint holds its folds at different epochs ({starts})")
        metrics: dict[str, Any] = {}
        try:
            for epoch in range(starts[0], recipes[0].config.schedule.epochs):
                for recipe in recipes:
                    recipe.run_epoch(epoch)
                metrics = fold_mean(self.latest)
                while self.pending_ends:
                    self.pending_ends.pop(0)()
                due = recipes[0].checkpoint_due(epoch)
                self.report(metrics, checkpoint=self.checkpoint_class.from_directory(str(self.folder)) if due else None)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        return metrics
