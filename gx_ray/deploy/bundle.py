"""A finalized model as files: one or more trained members (a refitted model, or a cross-validation's fold models),
what each needs to be rebuilt (its trial config and what its task learnt from training rows), the preprocessing it
was trained behind, and the training cohort's fingerprint ranges that tell whether a new case looks like the
training patients. :class:`Predictor` loads a bundle and predicts on shard rows or on raw cases.

Everything in a bundle is plain data: weights and learnt task state are ``torch.save`` files read back with
``weights_only=True`` (a bundle is not a program anyone may plant), the rest JSON. Loading needs neither the
sweep's output folder nor the training shards.

Layout::

    bundle.json                 format, task, preprocessing, members (config, provenance), fingerprint ranges, ...
    members/<i>/weights.pt      the member's state dict
    members/<i>/task_state.pt   what its task learnt in ``prepare`` (the VQA answers, detector anchors, ...)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from gx_ray.data.preprocess import PreprocessConfig
from gx_ray.data.shards import BatchCollate, TensorLayout, shard_schema
from gx_ray.data.stream import on_device
from gx_ray.models.registry import build_encoder
from gx_ray.schema import PHASES
from gx_ray.tasks import Task, TaskModel, build_task, task_class
from gx_ray.train.build import autocast
from gx_ray.train.config import TrialConfig

BUNDLE_FORMAT = 1
BUNDLE_FILE = "bundle.json"
MEMBERS = "members"


@dataclass
class Member:
    """One trained model of a bundle: its trial config, weights, learnt task state and where it came from."""

    config: TrialConfig
    weights: dict[str, torch.Tensor]
    task_state: dict[str, Any]
    source: dict[str, Any] = field(default_factory=dict)
    """``run_id``, ``trial``, ``seed``, ``fold`` (None for a refitted model)."""


def config_from_flat(flat: Mapping[str, Any]) -> TrialConfig:
    """A :class:`TrialConfig` from its :meth:`~TrialConfig.to_flat` form (lists and mappings there are JSON text)."""
    return TrialConfig.from_flat({k: _unjson(v) for k, v in flat.items()})


def _unjson(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:  # a name that merely starts with a bracket
            return value
    return value


def learnt_state(task: Task) -> dict[str, Any]:
    """What ``task`` learnt in ``prepare`` (its attributes beyond the options it was built with), as plain data.

    Objects that are not plain data (a tokenizer the head keeps) are left out: building the head makes them again."""
    options = {f.name for f in dataclasses.fields(task) if f.init} if dataclasses.is_dataclass(task) else set()
    return {k: v for k, v in vars(task).items() if k not in options and _plain(v)}


def _plain(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back as it was."""
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str | int) and _plain(v) for k, v in value.items())
    return False


def check_predictable(config: TrialConfig, ensemble: bool = False) -> None:
    """Refuse, naming why, a trial whose model cannot predict on new patients (or, with ``ensemble``, cannot be one
    of an ensemble's members)."""
    if config.model.family == "vlm":
        raise ValueError("vision-language models are not finalized yet: finalize an encoder trial")
    cls = task_class(config.task)
    if cls.attach_splits is not Task.attach_splits:
        raise ValueError(
            f"{cls.name} builds its questions from each split's material (attach_splits): it cannot predict on new "
            "patients yet"
        )
    if ensemble and cls.combine is Task.combine:
        raise ValueError(f"{cls.name} does not say how an ensemble's predictions combine (Task.combine): use --refit")


def build_member_model(config: TrialConfig, task_state: Mapping[str, Any]) -> TaskModel:
    """The member's task model, its task given what it learnt (no training rows needed), weights not yet loaded."""
    check_predictable(config)
    task = build_task(config.task, **config.task_options)
    for key, value in task_state.items():
        setattr(task, key, value)
    return TaskModel(task, build_encoder(config.model, config.schema), config.schema)


def save_bundle(folder: Path, members: Sequence[Member], info: Mapping[str, Any]) -> Path:
    """Write ``members`` and ``info`` (task, preprocessing, fingerprint ranges, selection ...) under ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    described = []
    for i, member in enumerate(members):
        where = folder / MEMBERS / str(i)
        where.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in member.weights.items()}, where / "weights.pt")
        torch.save(member.task_state, where / "task_state.pt")
        described.append({"config": member.config.to_flat(), "source": member.source})
    document = {"format": BUNDLE_FORMAT, **info, "members": described}
    (folder / BUNDLE_FILE).write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")
    return folder


def read_bundle(folder: Path) -> dict[str, Any]:
    path = Path(folder) / BUNDLE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{folder} is not a gx-ray model: it has no {BUNDLE_FILE}")
    document = json.loads(path.read_text(encoding="utf-8"))
    if document.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"{path}: model format {document.get('format')!r}; this gx-ray reads {BUNDLE_FORMAT}")
    return document


def layout_of(document: Mapping[str, Any]) -> TensorLayout:
    shapes = document["inputs"]
    return TensorLayout(tuple(shapes["ct_shape"]), tuple(shapes["endoscopy_shape"]), tuple(shapes["lab_names"]))


def preprocess_of(document: Mapping[str, Any]) -> PreprocessConfig:
    """The Appendix-B settings the model was trained behind (tuples again after JSON's lists)."""
    values = document["inputs"]["preprocess"]
    return PreprocessConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


class Predictor:
    """A bundle's members on a device: :meth:`predict_table` gives one record per case (the members' records
    combined by the task, with their spread, where there are several)."""

    def __init__(self, folder: Path, device: str | torch.device | None = None):
        self.folder = Path(folder)
        self.document = read_bundle(self.folder)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.layout = layout_of(self.document)
        self.members: list[tuple[TrialConfig, TaskModel]] = []
        for i, described in enumerate(self.document["members"]):
            where = self.folder / MEMBERS / str(i)
            config = config_from_flat(described["config"])
            state = torch.load(where / "task_state.pt", map_location="cpu", weights_only=True)
            model = build_member_model(config, state)
            model.load_state_dict(torch.load(where / "weights.pt", map_location="cpu", weights_only=True))
            self.members.append((config, model.to(self.device).eval()))

    @property
    def task(self) -> Task:
        return self.members[0][1].task

    def batches(self, table: pa.Table, batch_size: int) -> Iterator[dict[str, Any]]:
        collate = BatchCollate(self.layout, pin_memory=self.device.type == "cuda")
        for start in range(0, len(table), batch_size):
            yield collate(table.slice(start, batch_size))

    def predict_table(self, table: pa.Table, batch_size: int = 8) -> list[dict[str, Any]]:
        """Records for the rows of ``table`` (shard rows), in its order."""
        if not len(table):
            return []
        outputs: list[list[dict[str, Any]]] = []
        for config, model in self.members:
            records: list[dict[str, Any]] = []
            with torch.no_grad(), autocast(config, self.device):
                for batch in self.batches(table, batch_size):
                    records += model.task.predict(model(on_device(batch, self.device)), batch)
            outputs.append(records)
        return outputs[0] if len(outputs) == 1 else self.task.combine(outputs)

    def shard_table(self, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
        """Shard rows (:func:`gx_ray.data.prepare.case_row`) as the table the model reads."""
        ct_shape, endoscopy_shape, labs = self.layout.ct_shape, self.layout.endoscopy_shape, self.layout.lab_names
        return pa.Table.from_pylist(list(rows), schema=shard_schema(ct_shape, endoscopy_shape[-1], list(labs)))


# --- does a new case look like the training patients? ------------------------------------------------------------


def fingerprint_ranges(case_fingerprints: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The training cases' range of each fingerprint number a new case is checked against: the acquired spacing per
    axis and each phase's mean intensity inside the stomach (HU)."""
    spacing = np.array([fp["source_spacing_zyx"] for fp in case_fingerprints.values()], dtype=float).reshape(-1, 3)
    ranges: dict[str, Any] = {"cases": len(case_fingerprints), "spacing_zyx_mm": None, "intensity_mean_hu": {}}
    if len(spacing):
        # rounded outwards (as the intensities below): a training case is never outside its own cohort's range
        ranges["spacing_zyx_mm"] = {"min": (np.floor(spacing.min(0) * 1e4) / 1e4).tolist(),
                                    "max": (np.ceil(spacing.max(0) * 1e4) / 1e4).tolist()}  # fmt: skip
    for phase in PHASES:
        means = [fp["intensity_hu"][phase]["mean"] for fp in case_fingerprints.values() if phase in fp["intensity_hu"]]
        means = [m for m in means if math.isfinite(m)]
        if means:
            ranges["intensity_mean_hu"][phase] = {"min": math.floor(min(means) * 10) / 10,
                                                  "max": math.ceil(max(means) * 10) / 10}  # fmt: skip
    return ranges


def outside_training(fingerprint: Mapping[str, Any], ranges: Mapping[str, Any] | None) -> list[str]:
    """Each way the case's fingerprint lies outside the training cases' ``ranges``, in words (empty: inside)."""
    if not ranges:
        return []
    flags = []
    if spacing := ranges.get("spacing_zyx_mm"):
        for axis, value, low, high in zip(
            "zyx", fingerprint["source_spacing_zyx"], spacing["min"], spacing["max"], strict=True
        ):
            if not low <= value <= high:
                flags.append(f"spacing {axis} {value:g} mm outside the training cases' {low:g}-{high:g} mm")
    for phase, limits in ranges.get("intensity_mean_hu", {}).items():
        value = fingerprint["intensity_hu"].get(phase, {}).get("mean")
        if value is not None and math.isfinite(value) and not limits["min"] <= value <= limits["max"]:
            flags.append(
                f"{phase} mean {value:.0f} HU outside the training cases' {limits['min']:.0f} to {limits['max']:.0f} HU"
            )
    return flags
