"""Trial config values that would train silently on nonsense (a negative learning rate reports NaN metrics as a
finished trial) or fail only after Ray has started are refused up front, naming the key."""

from __future__ import annotations

import math

import pytest
import yaml

from gx_ray.sweep.spaces import SpaceError, load_space, space_path
from gx_ray.train.config import TrialConfig


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


def test_a_bad_value_in_a_space_fails_before_ray_naming_file_and_key(tmp_path):
    document = yaml.safe_load(space_path("modality_ablation").read_text(encoding="utf-8"))
    document["fixed"]["optimiser.lr"] = -5.0e-5
    path = tmp_path / "negative_lr.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    assert str(path) in str(info.value) and "optimiser.lr = -5e-05 is not valid" in str(info.value)
