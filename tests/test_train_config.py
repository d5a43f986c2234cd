"""The trial config (:mod:`gx_ray.train.config`): values that would train silently on nonsense (a negative learning
rate reports NaN metrics as a finished trial) or fail only after Ray has started are refused up front, naming the key;
the batch and resource keys agree with each other and make up the effective batch."""

from __future__ import annotations

import math

import pytest

from gx_ray.sweep.spaces import load_space
from gx_ray.train.config import TrialConfig
from gx_ray.train.loop import optimiser_steps


@pytest.mark.parametrize(
    "key, value",
    [
        ("optimiser.lr", -1e-4),
        ("optimiser.lr", 0.0),
        ("optimiser.lr", math.nan),
        ("optimiser.lr", math.inf),
        ("optimiser.weight_decay", -0.1),
        ("optimiser.grad_clip", 0.0),
        ("schedule.epochs", 0),
        ("schedule.warmup_fraction", 1.0),
        ("schedule.max_steps_per_epoch", 0),
        ("seed", 2.5),
        ("seed", -1),
        ("seed", True),
        ("data.effective_batch", 0),
        ("data.shuffle_buffer", -1),
        ("data.eval_batch_size", 0),
        ("data.in_memory", "yes"),
        ("resources.workers", 0),
        ("resources.cpus_per_worker", 0.0),
    ],
)
def test_invalid_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"^{key.replace('.', '[.]')} = .* is not valid"):
        TrialConfig.from_flat({"task": "stage_classification", key: value})


def test_the_defaults_and_every_shipped_space_stay_valid():
    TrialConfig.from_flat({"task": "stage_classification"})
    for name in ("modality_ablation", "lr_sweep", "fusion", "model_zoo", "full"):
        load_space(name)


# --- batch keys -------------------------------------------------------------------------------------------


def test_the_old_ambiguous_batch_key_is_refused_with_what_to_write_instead():
    with pytest.raises(ValueError, match="data.effective_batch .* data.micro_batch"):
        TrialConfig.from_flat({"task": "vqa", "data.batch_size": 8})
    with pytest.raises(ValueError, match="data.grad_accum"):
        TrialConfig.from_flat({"task": "vqa", "data.grad_accum": 2})


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"data.effective_batch": 32, "data.micro_batch": 5}, "positive divisor of the per-rank batch 32"),
        ({"data.effective_batch": 6, "resources.workers": 4}, "multiple of resources.workers 4"),
        ({"data.effective_batch": 0}, "data.effective_batch = 0 is not valid"),
        ({"resources.workers": 2, "resources.gpus_per_worker": 0.5}, "whole GPUs"),
        ({"resources.gpus_per_worker": "most"}, "must be auto"),
    ],
)
def test_inconsistent_batch_and_resource_keys_fail_naming_the_values(keys, message):
    with pytest.raises(ValueError, match=message):
        TrialConfig.from_flat({"task": "stage_classification", **keys})


def test_accumulation_makes_up_the_effective_batch():
    config = TrialConfig.from_flat(
        {"task": "vqa", "data.effective_batch": 32, "data.micro_batch": 4, "resources.workers": 2}
    )
    assert config.data.per_rank_batch(2) == 16 and config.data.accumulation(2, 4) == 4
    assert optimiser_steps(100, 4, 4, config) == 6  # whole effective batches per rank only
