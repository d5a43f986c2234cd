"""The paper's five tasks, CT-Bench's lesion QA and the endoscopy tasks, one module each: head, loss, predictions
and a DDP-correct metric (docs/design.md).

``build_task(name, **options)`` gives a :class:`Task`; :class:`TaskModel` joins it to an encoder. A task's module
is imported when the task is first built: detection pulls in MONAI and report generation transformers, which a
process that only computes another task's metric need not pay for.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from gx_ray.schema import TASKS
from gx_ray.tasks.base import Task, TaskMetric, TaskModel, gather_state

TASK_CLASSES: dict[str, str] = {
    "vqa": "gx_ray.tasks.vqa:VisualQuestionAnswering",
    "report_generation": "gx_ray.tasks.report_generation:ReportGeneration",
    "retrieval": "gx_ray.tasks.retrieval:Retrieval",
    "stage_classification": "gx_ray.tasks.stage_classification:StageClassification",
    "lesion_detection": "gx_ray.tasks.lesion_detection:LesionDetection",
    "lesion_qa": "gx_ray.tasks.lesion_qa:LesionQA",
    "endoscopy": "gx_ray.tasks.endoscopy:Endoscopy",
}
"""Task name → ``module:class``, for every task of :data:`gx_ray.schema.TASKS`."""


def task_class(name: str) -> type[Task]:
    if name not in TASK_CLASSES:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    module, cls = TASK_CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_task(name: str, **options: Any) -> Task:
    """The task ``name`` (one of :data:`gx_ray.schema.TASKS`) with its options (the task class's fields)."""
    cls = task_class(name)
    valid = [f.name for f in fields(cls) if f.init]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown options {unknown} for task {name!r}; valid: {', '.join(valid) or 'none'}")
    return cls(**options)


def task_label(name: str | None, options: Mapping[str, Any]) -> str | None:
    """The name a trial's results go under: the task, followed by the options that make it a different question
    (the task class's ``label_options``; lesion QA: ``lesion_qa.img2txt.matched``), so that no summary or report
    pools them into one cell. Options not given take the class's defaults."""
    if name is None:
        return None
    cls = task_class(name)
    defaults = {f.name: f.default for f in fields(cls)}
    return ".".join([name, *(str(options.get(key, defaults[key])) for key in cls.label_options)])


def task_of(label: str) -> str:
    """The task of a :func:`task_label`."""
    return label.split(".")[0]


def primary_metric(label: str) -> str:
    """The primary metric of a :func:`task_label`'s question (a family may have its own: endoscopy's captions)."""
    name, *values = label.split(".")
    cls = task_class(name)
    return cls.primary_metric_for(dict(zip(cls.label_options, values, strict=False)))


def label_options(label: str) -> dict[str, str]:
    """The options a :func:`task_label` holds, by name (``{"family": "img2txt", "distractors": "matched"}``)."""
    name, *values = label.split(".")
    return dict(zip(task_class(name).label_options, values, strict=True))


__all__ = [
    "TASK_CLASSES",
    "Task",
    "TaskMetric",
    "TaskModel",
    "build_task",
    "gather_state",
    "label_options",
    "primary_metric",
    "task_class",
    "task_label",
    "task_of",
]
