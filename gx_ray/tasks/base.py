"""What every task shares: the task interface, a metric object that is correct under DDP, and the task model.

A task turns the encoder's view of a batch into outputs with a head of its own, scores them with its loss and metric,
and names its primary metric and its direction (``mode``). Tasks are plain picklable objects; what one learns from
data it learns in :meth:`Task.prepare` from training rows only. :meth:`TaskMetric.compute` gathers every rank's
per-example state first, so every rank returns the metric of the whole evaluation set, not a mean of per-rank
metrics (wrong for AUC, ranks, AP and corpus BLEU alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gx_ray.modalities import ModalitySchema, ModelInputs, build_inputs, check_leakage
from gx_ray.schema import LANGUAGES, REPORT_KINDS

Batch = dict[str, Any]
"""A collated shard batch (:class:`gx_ray.data.shards.BatchCollate`)."""
Outputs = dict[str, Any]
"""What :meth:`Task.forward` returns: tensors for the loss, and whatever the metric and predictions need."""


class TaskMetric:
    """Per-example state accumulated batch by batch (:meth:`add` in :meth:`update`); :meth:`summarise` turns every
    rank's merged state (rank order, then batch order) into metrics. :meth:`compute` is collective under DDP."""

    def __init__(self) -> None:
        self.state: dict[str, list[Any]] = {}

    def add(self, **items: Any) -> None:
        for key, value in items.items():
            self.state.setdefault(key, []).append(value)

    def update(self, outputs: Outputs, batch: Batch) -> None:
        raise NotImplementedError

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        raise NotImplementedError

    def compute(self) -> dict[str, float]:
        return self.summarise(gather_state(self.state))


def gather_state(state: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Every rank's state merged (rank 0's items first); the state itself outside a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return state
    states: list[dict[str, list[Any]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    merged: dict[str, list[Any]] = {}
    for rank_state in states:
        for key, items in (rank_state or {}).items():
            merged.setdefault(key, []).extend(items)
    return merged


def concat(items: list[np.ndarray], width: int | None = None) -> np.ndarray:
    """Per-batch arrays joined along the first axis; an empty ``(0, width)`` (or ``(0,)``) array for none."""
    if items:
        return np.concatenate(items)
    return np.zeros((0,) if width is None else (0, width))


class Task:
    """The interface every task module implements (see the module docstring of :mod:`gx_ray.tasks.base`)."""

    name: ClassVar[str]
    primary_metric: ClassVar[str]
    mode: ClassVar[str]
    """``"max"`` or ``"min"``: the direction in which :attr:`primary_metric` improves."""
    primary_unit: ClassVar[str] = ""
    """The primary metric's unit where it is not the paper's 0-100 scale or a rank (a plug-in's ``mL``)."""
    shares_a_gpu: ClassVar[bool] = True
    """Whether ``gpus_per_worker: auto`` may pack this task's trials on one GPU: a step that waits on the GPU many
    times (per-image matching) loses far more than its share when CUDA time-slices the card."""
    label_options: ClassVar[tuple[str, ...]] = ()
    """Options that make another question of the same task: results are never pooled across them
    (:func:`gx_ray.tasks.task_label`)."""
    short_name: ClassVar[str] = ""
    """What run names call the task (MLflow's table cuts names at ~20 characters); its name where empty."""
    report_imports: ClassVar[tuple[str, ...]] = ()
    """Modules the report imports to score this task's trials again, imported ahead while the trials run."""
    leaking_inputs: ClassVar[Mapping[str, str]] = {}
    """Inputs (:data:`gx_ray.modalities.INPUT_NAMES`) that would give this task's answer away, each with why
    (``{"boxes:tumour": "the box's extent is the volume"}``): a schema giving any is refused for the task
    (:func:`gx_ray.modalities.check_leakage`). How a plug-in task states what the built-ins' ``LEAKAGE_RULES`` do."""
    lower_is_better: ClassVar[tuple[str, ...]] = ()
    """Metrics for which smaller is better besides ranks (an error in mL; :attr:`mode` says it for the primary):
    the report's arrows, best cells and one-sided tests read it (:func:`gx_ray.analysis.runs.higher_is_better`)."""

    @classmethod
    def sweep_inputs(cls, options: Mapping[str, Any], shards: str, root: str) -> dict[str, Any]:
        """Task options built once for a cohort before any trial of a sweep starts, for the trials asked with
        ``options``: written under ``root`` (the sweep's output or storage), read by every trial. None by default;
        lesion QA builds its question files here."""
        return {}

    @classmethod
    def primary_metric_for(cls, options: Mapping[str, Any]) -> str:
        """The primary metric of the task asked with ``options`` (its label options): :attr:`primary_metric`, unless
        a family of the task is scored another way (endoscopy's captions)."""
        return cls.primary_metric

    def prepare(self, train_rows: Iterable[Mapping[str, Any]]) -> None:
        """Fit what the task learns from data (the VQA vocabulary, the detector's anchors), from training shard rows
        only, before :meth:`build_head`; nothing by default. A row of another split is refused."""

    def attach_splits(
        self, rows: Mapping[str, Sequence[Mapping[str, Any]]], manifest: Mapping[str, Any], shards: str | None = None
    ) -> None:
        """Build what the task asks its questions with (lesion QA's questions, the endoscopy annotations), per split
        from its own rows (no image columns), the manifest and files beside the ``shards``; nothing by default.
        Nothing learnt may come from here: that is :meth:`prepare`'s."""

    def bind(self, schema: ModalitySchema) -> None:
        """See the trial's modality schema before the head is built (a task whose inputs depend on it); nothing
        by default."""

    def build_head(self, dim: int, tokenizer: Any, map_channels: Sequence[int] = ()) -> nn.Module:
        """The task's head over features of width ``dim``; ``map_channels``: the vision feature maps' channels."""
        raise NotImplementedError

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        raise NotImplementedError

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        """One record per example (``case_id``, ``prediction``, ``target``, ...), for logging sample predictions."""
        raise NotImplementedError

    def metric(self) -> TaskMetric:
        raise NotImplementedError

    def chance_level(self, train_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> float:
        """The primary metric on ``test_rows`` of a predictor that never looks at the patient: it knows only what
        the training rows say of everyone (answer frequencies, a typical box, typical reports), scored by the
        task's own metric. A model must beat it to have learnt anything from the inputs. NaN where undefined."""
        return float("nan")

    @classmethod
    def record_metrics(cls, records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """The task's metrics from its :meth:`predict` records (one per labelled case), which the report's patient
        bootstrap resamples (built-ins: :mod:`gx_ray.analysis.cases`); a task without any is compared over seeds."""
        raise NotImplementedError

    def combine(self, members: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """An ensemble's predictions from ``members[k][i]``, member ``k``'s :meth:`predict` record of case ``i``
        (:func:`member_records`): one record per case with the combined ``prediction``, the ``target`` and ``spread``
        (how far the members disagree)."""
        raise NotImplementedError(
            f"task {self.name!r} does not say how an ensemble's predictions combine: implement "
            f"{type(self).__name__}.combine(members) (one record per case with 'prediction' and 'spread')"
        )


def member_records(members: Sequence[Sequence[Mapping[str, Any]]]) -> list[tuple[Mapping[str, Any], ...]]:
    """An ensemble's records case by case (one tuple of every member's record per case), refusing members that do
    not hold the same cases in the same order: combining two patients' predictions would pass unnoticed."""
    if not members:
        raise ValueError("an ensemble needs at least one member's predictions")
    cases = [[r["case_id"] for r in member] for member in members]
    for k, ids in enumerate(cases[1:], 1):
        if ids != cases[0]:
            raise ValueError(f"ensemble member {k} holds other cases (or another order) than member 0: {ids[:3]} ...")
    return list(zip(*members, strict=True))


def task_options(task: Task) -> dict[str, Any]:
    """The options a task was built with (its dataclass's init fields)."""
    return (
        {f.name: getattr(task, f.name) for f in dataclasses.fields(task) if f.init}
        if dataclasses.is_dataclass(task)
        else {}
    )


def check_train_rows(rows: Iterable[Mapping[str, Any]], task: str) -> list[Mapping[str, Any]]:
    """The rows as a list, refusing any row that says it is not from the training split (no leakage)."""
    rows = list(rows)
    leaking = sorted({str(r["split"]) for r in rows if "split" in r and r["split"] != "train"})
    if leaking:
        raise ValueError(f"{task}.prepare takes training rows only; got rows of split {', '.join(leaking)}")
    return rows


def report_column(report: str, language: str) -> str:
    """The batch column of a report kind in a language (``ct_report``, ``ct_report_zh``)."""
    if report not in REPORT_KINDS:
        raise ValueError(f"unknown report {report!r}; valid: {', '.join(REPORT_KINDS)}")
    if language not in LANGUAGES:
        raise ValueError(f"unknown language {language!r}; valid: {', '.join(LANGUAGES)}")
    return report if language == "en" else f"{report}_{language}"


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over targets >= 0; a zero that still reaches the graph when there are none."""
    targets = targets.to(logits.device)
    if not (targets >= 0).any():
        return logits.sum() * 0.0  # keeps backward (and DDP's gradient hooks) working on unlabelled batches
    return F.cross_entropy(logits, targets, ignore_index=-1)


class TaskModel(nn.Module):
    """Encoder and task head as one module (what the loop optimises and wraps in DDP): ``forward(batch)`` builds the
    schema's inputs and runs the task. A leaking schema cannot even be built."""

    def __init__(self, task: Task, encoder: nn.Module, schema: ModalitySchema):
        super().__init__()
        check_leakage(schema, task, task_options(task))  # the task itself: a plug-in's declared rule too
        self.task = task
        self.schema = schema
        self.encoder = encoder
        task.bind(schema)
        self.head = task.build_head(encoder.dim, encoder.tokenizer, map_channels=list(encoder.vision.channels))

    def forward(self, batch: Batch) -> Outputs:
        device = next(self.parameters()).device
        inputs = build_inputs(batch, self.schema, device)
        return self.task.forward(self.encoder, self.head, inputs, batch)
