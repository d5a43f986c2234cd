"""The paper's five tasks, CT-Bench's lesion QA and the endoscopy tasks, one module each: head, loss, predictions
and a DDP-correct metric (docs/design.md); and tasks from outside gx-ray (docs/how-to/add-a-task.md).

``build_task(name, **options)`` gives a :class:`Task`, its module imported when first built (detection pulls in
MONAI, report generation transformers); :class:`TaskModel` joins it to an encoder. :func:`task_class` resolves a
built-in name (:data:`gx_ray.schema.TASKS`), a plug-in's ``module:Class`` reference, or an entry point of the group
:data:`ENTRY_POINT_GROUP`. A plug-in is checked against the :class:`Task` protocol when first resolved and remembered
by its ``name``: configs and the runs' ``task`` tag keep the reference (any process can import it again), while
labels, cells and tables name the task by its ``name`` (:func:`task_label`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from gx_ray.modalities import input_name_problems
from gx_ray.plugins import entry_points_named, load_class
from gx_ray.schema import TASKS
from gx_ray.tasks.base import Task, TaskMetric, TaskModel, gather_state, member_records

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
ENTRY_POINT_GROUP = "gx_ray.tasks"
"""The entry-point group a distribution registers its tasks in: entry point name = the task's ``name``."""
TASK_NAME = re.compile(r"[a-z][a-z0-9_]*")
"""A task's ``name``: labels join it to its options with dots, references hold a colon; neither may be in it."""
REQUIRED_METHODS = ("build_head", "forward", "loss", "predict", "metric")
"""What every task implements; the rest of :class:`Task` has defaults."""

_PLUGINS: dict[str, type[Task]] = {}
"""Plug-in tasks this process has resolved, by ``name``: what a label (which holds the name) resolves to."""


class TaskPluginError(ValueError):
    """A task reference that does not give a task: it names the reference and everything that is missing."""


def task_class(name: str) -> type[Task]:
    """The task class of ``name``: a built-in task, a ``module:Class`` reference, an entry point of the group
    :data:`ENTRY_POINT_GROUP`, or the ``name`` of a plug-in this process resolved before (a label's task)."""
    if name in TASK_CLASSES:
        module, cls = TASK_CLASSES[name].split(":")
        return getattr(importlib.import_module(module), cls)
    if name in _PLUGINS:
        return _PLUGINS[name]
    if ":" in str(name):
        return _register(_load(str(name), f"task reference {name!r}"))
    found = _entry_points(name) if isinstance(name, str) and name else []
    if not found and "." in str(name):  # a module's path without its class (entry point names have no dots)
        raise TaskPluginError(f"task reference {name!r} is not 'module:Class': the class after a colon is missing")
    if not found:
        installed = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} - set(TASKS))
        raise ValueError(
            f"unknown task {name!r}; valid: {', '.join(TASKS)}; an entry point of group {ENTRY_POINT_GROUP!r} "
            f"({', '.join(installed) or 'none installed'}); or a plug-in's 'module:Class' reference"
        )
    if len({ep.value for ep in found}) > 1:
        raise TaskPluginError(
            f"entry point {name!r} of group {ENTRY_POINT_GROUP!r} is registered more than once, as "
            f"{', '.join(sorted({ep.value for ep in found}))}: uninstall all but one"
        )
    where = f"entry point {name!r} ({found[0].value})"
    cls = _load(found[0].value, where)
    if cls.name != name:
        raise TaskPluginError(f"{where}: its task is named {cls.name!r}; an entry point's name must be its task's")
    return _register(cls)


def _entry_points(name: str) -> list[EntryPoint]:
    return entry_points_named(ENTRY_POINT_GROUP, name)


def _load(reference: str, where: str) -> type[Task]:
    """The class ``module:Qual.Name`` points to, checked against the protocol; one error naming what is missing."""
    return load_class(reference, where, protocol_problems, "gx_ray Task", TaskPluginError)


def protocol_problems(cls: Any) -> list[str]:
    """What ``cls`` lacks to be a task (empty: nothing): a :class:`Task` subclass, a dataclass, with a ``name``
    (lower-case, not a built-in task's), ``primary_metric``, ``mode`` (max or min), the methods of
    :data:`REQUIRED_METHODS`, and valid ``label_options``, ``leaking_inputs`` and ``lower_is_better``."""
    if not isinstance(cls, type):
        return [f"it is {type(cls).__name__} {cls!r}, not a class"]
    if not issubclass(cls, Task):
        return [f"{cls.__qualname__} is not a subclass of gx_ray.tasks.Task"]
    problems = []
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        problems.append("missing class attribute name (the task's name in labels, tables and tags)")
    elif not TASK_NAME.fullmatch(name):
        problems.append(f"name {name!r} is not lower-case letters, digits and underscores")
    elif name in TASKS:
        problems.append(f"name {name!r} is a built-in task's")
    if not isinstance(getattr(cls, "primary_metric", None), str) or not cls.primary_metric:
        problems.append("missing class attribute primary_metric (what sweeps optimise)")
    if not hasattr(cls, "mode"):
        problems.append("missing class attribute mode ('max' or 'min': the primary metric's direction)")
    elif cls.mode not in ("max", "min"):
        problems.append(f"mode is {cls.mode!r}, not 'max' or 'min' (the primary metric's direction)")
    missing = [m for m in REQUIRED_METHODS if getattr(cls, m) is getattr(Task, m)]
    if missing:
        problems.append(f"missing methods {', '.join(missing)}")
    if not is_dataclass(cls):
        problems.append("not a dataclass (its fields are the task's options: task_options.* in a space)")
    else:
        options = {f.name for f in fields(cls) if f.init}
        if unknown := [o for o in cls.label_options if o not in options]:
            problems.append(f"label_options {unknown} are not options (init fields) of the class")
    if not isinstance(cls.leaking_inputs, Mapping):
        problems.append("leaking_inputs is not a mapping of input name to why it gives the answer away")
    else:
        problems += [f"leaking_inputs {p}" for p in input_name_problems(cls.leaking_inputs)]
    if isinstance(cls.lower_is_better, str) or not all(isinstance(m, str) for m in cls.lower_is_better):
        problems.append("lower_is_better is not a tuple of metric names")
    return problems


def _register(cls: type[Task]) -> type[Task]:
    """Remember a plug-in by its name; two different classes of one name would pool their results in one cell."""
    known = _PLUGINS.get(cls.name)
    if known is not None and _qualified(known) != _qualified(cls):
        raise TaskPluginError(
            f"two tasks are named {cls.name!r}: {_qualified(known)} and {_qualified(cls)}; results go under the "
            "name, so it must be unique"
        )
    _PLUGINS[cls.name] = cls
    return cls


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def plugin_tasks() -> dict[str, type[Task]]:
    """The plug-in tasks this process has resolved, by name."""
    return dict(_PLUGINS)


def lower_is_better_metrics() -> frozenset[str]:
    """The metrics the resolved plug-in tasks score lower-is-better: a ``min`` primary metric and their
    ``lower_is_better`` (the built-in tasks' are their ranks, which :func:`gx_ray.analysis.runs.higher_is_better`
    knows by name)."""
    found = set()
    for cls in _PLUGINS.values():
        found.update(cls.lower_is_better)
        if cls.mode == "min":
            found.add(cls.primary_metric)
    return frozenset(found)


def build_task(name: str, **options: Any) -> Task:
    """The task ``name`` (a built-in, a ``module:Class`` reference or an entry point: :func:`task_class`) with its
    options (the task class's fields)."""
    cls = task_class(name)
    valid = [f.name for f in fields(cls) if f.init]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown options {unknown} for task {name!r}; valid: {', '.join(valid) or 'none'}")
    return cls(**options)


def task_label(name: str | None, options: Mapping[str, Any]) -> str | None:
    """The name a trial's results go under: the task, followed by the options that make it a different question
    (the task class's ``label_options``; lesion QA: ``lesion_qa.img2txt.matched``), so that no summary or report
    pools them into one cell. Options not given take the class's defaults. A plug-in's label starts with its
    ``name``, not the reference it was given by (``tests.plugins.tumour_volume:TumourVolume`` → ``tumour_volume``)."""
    if name is None:
        return None
    cls = task_class(name)
    defaults = {f.name: f.default for f in fields(cls)}
    return ".".join([cls.name, *(str(options.get(key, defaults[key])) for key in cls.label_options)])


def task_of(label: str) -> str:
    """The task of a :func:`task_label`; a ``module:Class`` reference (a config's task, not a label) as it is."""
    return label if ":" in label else label.split(".")[0]


def _split_label(label: str) -> tuple[type[Task], list[str]]:
    if ":" in label:  # a reference: no options in it
        return task_class(label), []
    name, *values = label.split(".")
    return task_class(name), values


def primary_metric(label: str) -> str:
    """The primary metric of a :func:`task_label`'s question (a family may have its own: endoscopy's captions)."""
    cls, values = _split_label(label)
    return cls.primary_metric_for(dict(zip(cls.label_options, values, strict=False)))


def label_options(label: str) -> dict[str, str]:
    """The options a :func:`task_label` holds, by name (``{"family": "img2txt", "distractors": "matched"}``)."""
    cls, values = _split_label(label)
    return dict(zip(cls.label_options, values, strict=True))


__all__ = [
    "ENTRY_POINT_GROUP",
    "TASK_CLASSES",
    "Task",
    "TaskMetric",
    "TaskModel",
    "TaskPluginError",
    "build_task",
    "gather_state",
    "label_options",
    "lower_is_better_metrics",
    "member_records",
    "plugin_tasks",
    "primary_metric",
    "protocol_problems",
    "task_class",
    "task_label",
    "task_of",
]
