"""The learning-rate schedule: torch's own schedulers give transformers' linear warm-up and decay step for step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import get_linear_schedule_with_warmup

from gx_ray.train.loop import linear_warmup_decay


def _rates(make, total: int) -> list[float]:
    optimiser = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    scheduler = make(optimiser)
    rates = []
    for _ in range(total):  # the learning rate of each optimiser step a trial takes
        rates.append(optimiser.param_groups[0]["lr"])
        optimiser.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("seed", range(40))
def test_the_schedule_is_transformers_linear_warmup_and_decay(seed):
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 400))
    warmup = int(rng.integers(0, total + 2)) if seed % 4 else [0, 1, total, total - 1][seed // 4 % 4]
    ours = _rates(lambda o: linear_warmup_decay(o, warmup, total), total)
    theirs = _rates(lambda o: get_linear_schedule_with_warmup(o, warmup, total), total)
    np.testing.assert_allclose(ours, theirs, atol=1e-9)


def test_a_resumed_schedule_goes_on_where_it_stopped():
    optimiser = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = linear_warmup_decay(optimiser, 3, 10)
    for _ in range(5):
        optimiser.step()
        scheduler.step()
    state = scheduler.state_dict()
    again = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed = linear_warmup_decay(again, 3, 10)
    again.load_state_dict(optimiser.state_dict())
    resumed.load_state_dict(state)
    assert again.param_groups[0]["lr"] == pytest.approx(optimiser.param_groups[0]["lr"]) == pytest.approx(5 / 7)
