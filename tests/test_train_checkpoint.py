"""A trial's checkpoint (:mod:`gx_ray.train.checkpoint`): the best-so-far compared in the metric's own direction, the
state's plain-type round trip, and the Checkpoint class its context names (not the reporter's module)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gx_ray.train import checkpoint
from gx_ray.train.checkpoint import Best, Report, ResumePoint, Trainables


@pytest.mark.parametrize(
    ("mode", "scores", "kept"),
    [
        ("max", [50.0, 60.0, 55.0], (60.0, 1)),
        ("min", [50.0, 60.0, 40.0, 45.0], (40.0, 2)),  # a minimised metric keeps its lowest, as reported
        ("max", [math.nan, 10.0, math.nan], (10.0, 1)),  # NaN never better than a number
        ("min", [math.nan, math.nan], (math.nan, 1)),  # a later NaN replaces an earlier one
        ("min", [-5.0, -7.0, -6.0], (-7.0, 1)),  # no sign flip: negative scores compare as themselves
    ],
)
def test_the_best_so_far_is_compared_in_the_metrics_own_direction(mode, scores, kept):
    best = Best()
    for epoch, score in enumerate(scores):
        if best.beaten_by(score, mode):
            best = Best(score, epoch)
    assert best.epoch == kept[1]
    assert (math.isnan(best.score) and math.isnan(kept[0])) or best.score == kept[0]


def _parts() -> Trainables:
    model = torch.nn.Linear(2, 1)
    optimiser = torch.optim.AdamW(model.parameters(), lr=0.1)
    return Trainables(model, optimiser, torch.optim.lr_scheduler.LinearLR(optimiser, total_iters=4))


def _context(report, checkpoint_class=None) -> SimpleNamespace:
    return SimpleNamespace(rank=0, report=report, checkpoint_class=checkpoint_class)


def test_the_state_round_trips_through_a_weights_only_load(tmp_path):
    """What a report's checkpoint holds loads with ``weights_only=True`` and restores the best and the resume point."""
    from ray.train import Checkpoint

    parts, got = _parts(), {}

    def report(metrics, checkpoint=None):
        got["metrics"], got["checkpoint"] = metrics, checkpoint
        checkpoint.to_directory(str(tmp_path / "kept"))

    best = Best(-3.5, 2, {k: v.clone() for k, v in parts.model.state_dict().items()})
    at = ResumePoint(4, micro_steps=6, samples=12, rates=[0.1, 0.05], loss_sum=1.25)
    config = SimpleNamespace(to_flat=lambda: {"task": "t", "optimiser.lr": 0.1})
    checkpoint.report(_context(report), Report({"epoch": 3}, parts, 3, best, config, resume=at))
    assert type(got["checkpoint"]) is Checkpoint  # no class named: Ray Train's
    again = _parts()
    restored = checkpoint.load(Checkpoint.from_directory(str(tmp_path / "kept")), again)
    assert restored.resume == at and restored.start_epoch == 4 and restored.epoch == 3
    assert (restored.best.score, restored.best.epoch) == (-3.5, 2)
    assert restored.written_by == {"task": "t", "optimiser.lr": 0.1}
    for name, tensor in parts.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor)
        assert torch.equal(restored.best.state[name], best.state[name])
    assert set(torch.load(Path(tmp_path / "kept") / checkpoint.CHECKPOINT_FILE, weights_only=True)) >= {
        "model", "optimiser", "scheduler", "epoch", "best", "random", "partial"
    }  # fmt: skip


def test_the_checkpoint_class_is_the_contexts_whatever_the_reporter():
    """A plain reporter (no ``functools.wraps`` of Tune's) handed Tune's class gets Tune's Checkpoint."""
    from ray import tune

    got = []
    checkpoint.report(
        _context(lambda metrics, checkpoint=None: got.append(checkpoint), tune.Checkpoint),
        Report({"epoch": 0}, _parts(), 0, Best(), SimpleNamespace(to_flat=dict)),
    )
    assert type(got[0]) is tune.Checkpoint
    plain = _context(lambda metrics, checkpoint=None: got.append(checkpoint))
    checkpoint.report(plain, Report({}, _parts(), 0, Best()))
    assert got[1] is None  # between checkpoint epochs: the metrics alone
