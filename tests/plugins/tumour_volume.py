"""Tumour volume from the CT: a task from outside gx-ray, the worked example of docs/how-to/add-a-task.md.

Target: the log of the tumour box's volume in mL (the venous tumour box on the shards' grid times the grid's voxel
volume), standardised with the training split's mean and sd. Head: one linear layer on ``Encoded.pooled``; loss: MSE
on the standardised target. Predictions and metrics are in mL: ``mae_ml`` (primary, lower is better) and ``r2``.
The tumour box would give the volume away, so a schema with it is refused (``leaking_inputs``).

Run it: ``task: tests.plugins.tumour_volume:TumourVolume`` in a search space (tests/plugins/tumour_volume.yaml).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.data.shards import read_manifest
from gx_ray.modalities import ModelInputs
from gx_ray.modalities.boxes import tumour_boxes
from gx_ray.tasks import Task, TaskMetric, member_records
from gx_ray.tasks.base import Batch, Outputs, check_train_rows, concat


def log_voxels(boxes: Any, present: Any) -> tuple[np.ndarray, np.ndarray]:
    """Each case's log tumour-box volume in voxels, and whether it has a box (rows or a batch: ``tumour_boxes``)."""
    boxes, present = tumour_boxes(boxes, present)
    return np.log(np.prod(np.maximum(boxes[:, 3:] - boxes[:, :3], 1.0), axis=1)), present


def rows_log_voxels(rows: Iterable[Mapping[str, Any]]) -> np.ndarray:
    """The log volumes (voxels) of the shard rows' cases that have a tumour box."""
    pairs = [log_voxels(row["boxes"], row["box_present"]) for row in rows]
    return np.array([volumes[0] for volumes, present in pairs if present[0]])


@dataclass
class TumourVolume(Task):
    name = "tumour_volume"
    short_name = "volume"
    primary_metric = "mae_ml"
    primary_unit = "mL"
    mode = "min"
    leaking_inputs = {"boxes:tumour": "the tumour box's extent is the volume"}

    spacing_zyx_mm: tuple[float, float, float] | None = None
    """The shards' grid spacing; a sweep fills it in from their manifest (:meth:`sweep_inputs`)."""
    mean: float = field(default=0.0, init=False)
    std: float = field(default=1.0, init=False)

    @classmethod
    def sweep_inputs(cls, options: Mapping[str, Any], shards: str, root: str) -> dict[str, Any]:
        """The grid spacing of the cohort, read once before the trials (every trial gets it as a task option)."""
        if options.get("spacing_zyx_mm"):
            return {}
        return {"spacing_zyx_mm": read_manifest(shards)["preprocess"]["spacing_zyx_mm"]}

    @property
    def ml_per_voxel(self) -> float:
        if self.spacing_zyx_mm is None:
            raise ValueError("tumour_volume needs task_options.spacing_zyx_mm (a sweep reads it from the manifest)")
        return float(np.prod(self.spacing_zyx_mm)) / 1000.0

    def prepare(self, train_rows: Iterable[Mapping[str, Any]]) -> None:
        # standardising log voxels is standardising log mL: the spacing is one factor for every case
        volumes = rows_log_voxels(check_train_rows(train_rows, self.name))
        if len(volumes) < 2:
            raise ValueError(f"tumour_volume needs at least 2 training cases with a tumour box, got {len(volumes)}")
        self.mean, self.std = float(volumes.mean()), float(volumes.std()) or 1.0

    def build_head(self, dim: int, tokenizer: Any = None, map_channels: Sequence[int] = ()) -> nn.Module:
        return nn.Linear(dim, 1)

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        return {"z": head(encoder(inputs).pooled).squeeze(-1)}

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        z = outputs["z"].float()
        volumes, present = log_voxels(batch["boxes"], batch["box_present"])
        if not present.any():
            return z.sum() * 0.0  # keeps backward (and DDP's hooks) working on a batch without boxes
        target = torch.as_tensor((volumes - self.mean) / self.std, dtype=z.dtype, device=z.device)
        known = torch.as_tensor(present, device=z.device)
        return F.mse_loss(z[known], target[known])

    def millilitres(self, outputs: Outputs, batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Predicted and true volumes in mL, and which cases have a true one."""
        z = outputs["z"].detach().float().cpu().numpy()
        volumes, present = log_voxels(batch["boxes"], batch["box_present"])
        return np.exp(z * self.std + self.mean) * self.ml_per_voxel, np.exp(volumes) * self.ml_per_voxel, present

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        predicted, true, present = self.millilitres(outputs, batch)
        return [
            {"case_id": case_id, "prediction": round(float(p), 3), "target": round(float(t), 3) if known else None}
            for case_id, p, t, known in zip(batch["case_id"], predicted, true, present, strict=True)
        ]

    def metric(self) -> TaskMetric:
        return VolumeMetric(self)

    def chance_level(self, train_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> float:
        """Every test case given the training split's mean log volume (what the head says for a standardised 0)."""
        train, test = rows_log_voxels(train_rows), rows_log_voxels(test_rows)
        if not len(train) or not len(test):
            return float("nan")
        guess = math.exp(float(train.mean())) * self.ml_per_voxel
        return volume_metrics(np.full(len(test), guess), np.exp(test) * self.ml_per_voxel)[self.primary_metric]

    @classmethod
    def record_metrics(cls, records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """The metrics from prediction records (mL): what the report's patient bootstrap resamples."""
        predicted = np.array([r["prediction"] for r in records], dtype=float)
        return volume_metrics(predicted, np.array([r["target"] for r in records], dtype=float))

    def combine(self, members: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """The members' mean volume, their standard deviation as ``spread`` (mL)."""
        combined = []
        for records in member_records(members):
            volumes = np.array([r["prediction"] for r in records], dtype=float)
            combined.append(
                {
                    **records[0],
                    "prediction": float(volumes.mean()),
                    "spread": float(volumes.std()),
                    "members": len(records),
                }
            )
        return combined


def volume_metrics(predicted: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Mean absolute error (mL) and R² of the volumes in mL; NaN where undefined (no cases; R² of one)."""
    if not len(true):
        return {"mae_ml": float("nan"), "r2": float("nan")}
    spread = float(((true - true.mean()) ** 2).sum())
    r2 = 1.0 - float(((true - predicted) ** 2).sum()) / spread if len(true) > 1 and spread > 0 else float("nan")
    return {"mae_ml": float(np.abs(predicted - true).mean()), "r2": r2}


class VolumeMetric(TaskMetric):
    def __init__(self, task: TumourVolume):
        super().__init__()
        self.task = task

    def update(self, outputs: Outputs, batch: Batch) -> None:
        predicted, true, present = self.task.millilitres(outputs, batch)
        self.add(predicted=predicted[present], true=true[present])

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        return volume_metrics(concat(state.get("predicted", [])), concat(state.get("true", [])))
