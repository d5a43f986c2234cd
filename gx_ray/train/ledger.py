"""A trial's cost in device-seconds, reported with every epoch: what Ray reserves for it (its GPU share, its CPUs) times
the wall seconds it has held them, summed over its attempts. A retried or resumed trial goes on from its MLflow run's
last values; an attempt's seconds after its last report (the epoch a kill cut short) are not in the ledger, the same
epoch trained again is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

COSTS = ("gpu_seconds", "cpu_seconds")
"""What every report carries: reserved GPUs × wall seconds, reserved CPUs × wall seconds (so that a CPU-only machine
exercises the same accounting)."""
SEARCH_COSTS = (*COSTS, "parameters")
"""What a multi-objective search may minimise beside its metric: the ledger's costs and the model's parameter count
(every report carries all three)."""


@dataclass(frozen=True)
class Ledger:
    gpus: float
    """GPUs reserved for the trial: its share of a card, times its workers."""
    cpus: float
    spent: dict[str, float] = field(default_factory=dict)
    """What earlier attempts spent (:data:`COSTS`), as the trial's run last logged it; empty for a first attempt."""
    started: float = field(default_factory=time.time)
    """When this attempt started (wall clock: a DDP trial's workers count from their trial's start)."""

    def costs(self) -> dict[str, float]:
        """The trial's cost so far, this attempt included."""
        wall = time.time() - self.started
        reserved = dict(zip(COSTS, (self.gpus, self.cpus), strict=True))
        return {name: self.spent.get(name, 0.0) + reserved[name] * wall for name in COSTS}

    def reporting(self, report: Callable[..., None], tracker: Any = None) -> Callable[..., None]:
        """``report`` (Tune's or Train's) with the trial's costs added to every result and logged to its run at the
        epoch's step (a resumed attempt's repeated epoch keeps the step its first attempt logged)."""

        def with_costs(metrics: dict[str, Any], checkpoint: Any = None) -> None:
            costs = self.costs()
            if tracker is not None:
                tracker.log_metrics(costs, step=int(metrics.get("epoch", 0)))
            report({**metrics, **costs}, checkpoint=checkpoint)

        return with_costs
