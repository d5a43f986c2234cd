"""A search space small enough for end-to-end sweeps on 2 cores: stage classification with a tiny 3D ResNet and
BERT-tiny, two steps an epoch; the fault and multi-node tests hurt sweeps of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def small_stage_space(path: Path, epochs: int, seeds: list[int], description: str, **fixed: Any) -> Path:
    """Write the space (one trial per seed, ``fixed`` on top of the small model) to ``path``; returns it."""
    document = {
        "description": description,
        "fixed": {
            "task": "stage_classification",
            "model.vision": "resnet18_3d",
            "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]},
            "model.text": "bert_tiny",
            "model.hidden": 32,
            "schedule.epochs": epochs,
            "schedule.max_steps_per_epoch": 2,
            "data.effective_batch": 2,
            **fixed,
        },
        "grid": {"seed": list(seeds)},
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path
