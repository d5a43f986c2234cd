"""Modality schemas: which inputs a model may see, as data, and the leakage rules every schema must pass.

The paper's four input settings are presets; a search space may define more as plain mappings
(``{"phases": ["venous"], "table": "numeric", "boxes": "channels"}``). A schema that breaks a leakage rule for
a task is refused before any trial starts, naming the rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from gx_ray.data.catalogue import load_catalogue
from gx_ray.schema import BOX_LEVELS, PHASES, REPORT_KINDS, TASKS

TABLE_MODES: tuple[str, ...] = ("off", "text", "numeric")
"""``text``: only abnormal values, as descriptors (the paper, Sec. 4); ``numeric``: every value, normalised."""
BOX_MODES: tuple[str, ...] = ("off", "overlay", "channels")
"""``overlay``: box outlines drawn into the CT (the paper's coloured overlays); ``channels``: one mask per level."""


@dataclass(frozen=True)
class ModalitySchema:
    """The inputs of one model. The paper's "Image" is the multi-phase CT; the endoscopy image is opt-in."""

    name: str
    phases: tuple[str, ...] = PHASES
    endoscopy: bool = False
    table: str = "off"
    boxes: str = "off"
    box_levels: tuple[str, ...] = BOX_LEVELS
    reports: tuple[str, ...] = ()
    """Report kinds given to the model as input text."""
    table_variables: tuple[str, ...] | None = None
    """Catalogue variables of the table; None means every pre-diagnosis model input."""

    def __post_init__(self) -> None:
        _check_choices("phases", self.phases, PHASES)
        if not self.phases:
            raise ValueError(f"schema {self.name!r}: at least one CT phase is needed")
        _check_choice("table", self.table, TABLE_MODES)
        _check_choice("boxes", self.boxes, BOX_MODES)
        _check_choices("box_levels", self.box_levels, BOX_LEVELS)
        _check_choices("reports", self.reports, REPORT_KINDS)
        if self.table_variables is not None:
            _check_choices("table_variables", self.table_variables, load_catalogue().names)

    @property
    def has_text(self) -> bool:
        return self.table == "text" or bool(self.reports)

    def variables(self) -> tuple[str, ...]:
        """The table's variables, in catalogue order."""
        inputs = [v.name for v in load_catalogue().numeric_inputs()]
        return tuple(inputs if self.table_variables is None else [v for v in inputs if v in self.table_variables])

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {key} {value!r}; valid: {', '.join(valid)}")


def _check_choices(key: str, values: tuple[str, ...], valid: tuple[str, ...]) -> None:
    unknown = [v for v in values if v not in valid]
    if unknown:
        raise ValueError(f"unknown {key} {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{key} lists {', '.join(map(repr, repeated))} more than once")


PRESETS: dict[str, ModalitySchema] = {
    "image_only": ModalitySchema("image_only"),
    "image_table": ModalitySchema("image_table", table="text"),
    "image_bbox": ModalitySchema("image_bbox", boxes="overlay"),
    "image_table_bbox": ModalitySchema("image_table_bbox", table="text", boxes="overlay"),
}
"""The paper's four input settings (Sec. 5), in its column order."""


_TUPLE_FIELDS = ("phases", "box_levels", "reports", "table_variables")


def resolve_schema(spec: str | dict[str, Any] | ModalitySchema) -> ModalitySchema:
    """A preset by name, a mapping (``name`` optional) or a schema as is."""
    if isinstance(spec, ModalitySchema):
        return spec
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown modality schema {spec!r}; valid presets: {', '.join(PRESETS)}")
        return PRESETS[spec]
    known = {f.name for f in fields(ModalitySchema)}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"unknown modality schema keys {unknown}; valid: {', '.join(sorted(known))}")
    # YAML gives lists; a lone string for a tuple field (`phases: venous`) means a one-item tuple
    values = {
        k: (v,) if isinstance(v, str) and k in _TUPLE_FIELDS else tuple(v) if isinstance(v, list) else v
        for k, v in spec.items()
    }
    return ModalitySchema(**{"name": "custom", **values})


# --- leakage rules -----------------------------------------------------------------------------------


class LeakageError(ValueError):
    """A schema would show a model what it must predict; ``rule`` names the rule broken."""

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(f"leakage rule {rule!r}: {message}")


@dataclass(frozen=True)
class LeakageRule:
    name: str
    description: str
    tasks: tuple[str, ...] = field(default=TASKS)


LEAKAGE_RULES: tuple[LeakageRule, ...] = (
    LeakageRule(
        "post_diagnosis_variables",
        "variables known only after diagnosis (pathology, pathological staging, surgery, outcomes) or identifiers "
        "are never model inputs",
    ),
    LeakageRule(
        "box_cues_in_detection",
        "the tumour box, which lesion detection predicts, is never its input (stomach and lymph-node boxes may be "
        "cues: soft spatial priors, as the paper uses them)",
        ("lesion_detection",),
    ),
    LeakageRule(
        "stage_in_reports",
        "reports that state the stage (the diagnosis report) are never inputs to stage classification",
        ("stage_classification",),
    ),
    LeakageRule(
        "target_report",
        "the report a task generates or retrieves is never its input",
        ("report_generation", "retrieval"),
    ),
    LeakageRule("report_answers", "VQA answers are taken from the reports, so no report is a VQA input", ("vqa",)),
    LeakageRule(
        "box_gives_the_answer",
        "a lesion QA family whose answer the tumour box shows (Img2size: the outline's extent is the size; "
        "Txt2bbox: the lesion's outline marks the right box) never sees the tumour box",
        ("lesion_qa",),
    ),
    LeakageRule(
        "reports_in_lesion_qa",
        "lesion QA's descriptions and attributes are taken from the reports, so no report is a lesion QA input",
        ("lesion_qa",),
    ),
    LeakageRule(
        "reports_in_endoscopy",
        "the endoscopy report names the site and the lesion the endoscopy tasks ask about, and the captions are "
        "written like it, so no report is an endoscopy task's input",
        ("endoscopy",),
    ),
)
BOX_ANSWERS: dict[str, str] = {
    "img2size": "the drawn outline's extent is the lesion's size",
    "txt2bbox": "the lesion's own outline drawn in marks the right option",
}
"""Lesion QA families (``task_options.family``) that a tumour box would answer, and why."""

REPORT_TARGETS = {"report_generation": "ct_report", "retrieval": "ct_report"}
"""The report each text task produces or matches (the CT report describes what the image shows)."""

DECLARED_RULE = LeakageRule(
    "declared_leaking_inputs",
    "the inputs a task declares give its answer away (``Task.leaking_inputs``: how a task from outside gx-ray states "
    "its leakage rule) are never its inputs",
    (),
)
"""The rule of every task's own ``leaking_inputs`` (for the built-in tasks, :data:`LEAKAGE_RULES` state theirs)."""

INPUT_NAMES: dict[str, tuple[str, ...] | None] = {
    "phases": PHASES,
    "boxes": BOX_LEVELS,
    "reports": REPORT_KINDS,
    "table": None,
    "endoscopy": (),
}
"""What a task's ``leaking_inputs`` may name: a kind of input (``boxes``, ``reports``, ``table`` in any form,
``endoscopy``) or one item of it (``boxes:tumour``, ``table:cea``, ``phases:arterial``: a phase is always named, as
every schema has one): kind → its items (None: the catalogue's variables; empty: no items)."""


class LeaksAnswers(Protocol):
    """What :func:`check_leakage` reads of a task object or class (:class:`gx_ray.tasks.Task`)."""

    name: str
    leaking_inputs: Mapping[str, str]


def input_name_problems(names: Iterable[str]) -> list[str]:
    """Why each of ``names`` is not a valid input name (:data:`INPUT_NAMES`); empty when all are."""
    problems = []
    for name in names:
        kind, _, item = str(name).partition(":")
        items = INPUT_NAMES.get(kind, ())
        if kind not in INPUT_NAMES:
            problems.append(f"{name!r}: unknown input kind {kind!r} (valid: {', '.join(INPUT_NAMES)})")
        elif not item and kind == "phases":
            problems.append(f"{name!r}: every schema has a CT phase; name one (phases:arterial)")
        elif item and items == ():
            problems.append(f"{name!r}: {kind} has no items; name it alone")
        elif item and item not in (load_catalogue().names if items is None else items):
            valid = "the catalogue's variables" if items is None else ", ".join(items)
            problems.append(f"{name!r}: unknown {kind} {item!r} (valid: {valid})")
    return problems


def given_inputs(schema: ModalitySchema, names: Iterable[str]) -> list[str]:
    """Which of the input ``names`` (:data:`INPUT_NAMES`) ``schema`` gives its model."""
    given = {
        "phases": set(schema.phases),
        "boxes": set(schema.box_levels) if schema.boxes != "off" else set(),
        "reports": set(schema.reports),
        "table": set(schema.variables()) if schema.table != "off" else set(),
    }
    found = []
    for name in names:
        kind, _, item = name.partition(":")
        if kind == "endoscopy":
            shown = schema.endoscopy
        elif kind == "table" and not item:
            shown = schema.table != "off"  # the table in any form, even with no variable chosen
        else:
            shown = item in given[kind] if item else bool(given[kind])
        if shown:
            found.append(name)
    return found


def check_leakage(schema: ModalitySchema, task: str | LeaksAnswers, options: dict[str, Any] | None = None) -> None:
    """Raise :class:`LeakageError` when ``schema`` breaks a rule of :data:`LEAKAGE_RULES` for ``task`` with its
    ``options``. A task object or class (not a name) has its declared ``leaking_inputs`` checked too
    (:data:`DECLARED_RULE`): how a plug-in task, whose name this layer cannot resolve, gets its rule."""
    if isinstance(task, str):
        _check_choice("task", task, TASKS)  # a plug-in's name alone is no task here: this layer cannot import it
        declared: Mapping[str, str] = {}
    else:
        task, declared = task.name, dict(getattr(task, "leaking_inputs", None) or {})
    _check_builtin_rules(schema, task, options or {})
    if problems := input_name_problems(declared):
        raise ValueError(f"task {task!r} declares leaking_inputs that name no input: {'; '.join(problems)}")
    if given := given_inputs(schema, declared):
        why = "; ".join(f"{name}: {declared[name]}" for name in given)
        raise LeakageError(
            DECLARED_RULE.name, f"schema {schema.name!r} gives {', '.join(given)}, which {task} declares leaks ({why})"
        )


def _check_builtin_rules(schema: ModalitySchema, task: str, options: dict[str, Any]) -> None:
    """:data:`LEAKAGE_RULES`: the variables rule for every task, then the built-in tasks' own."""
    catalogue = load_catalogue()
    leaking = [v for v in schema.table_variables or () if not catalogue[v].is_model_input]
    if schema.table != "off" and leaking:
        raise LeakageError("post_diagnosis_variables", f"schema {schema.name!r} puts {', '.join(leaking)} in the table")
    if task == "lesion_detection" and schema.boxes != "off" and "tumour" in schema.box_levels:
        raise LeakageError(
            "box_cues_in_detection",
            f"schema {schema.name!r} gives the tumour box as a cue; use box_levels without 'tumour' for detection",
        )
    if task == "stage_classification" and "diagnosis_report" in schema.reports:
        raise LeakageError(
            "stage_in_reports", f"schema {schema.name!r} gives the diagnosis report, which states the stage"
        )
    if task in REPORT_TARGETS and REPORT_TARGETS[task] in schema.reports:
        raise LeakageError(
            "target_report", f"schema {schema.name!r} gives the {REPORT_TARGETS[task]} that {task} targets"
        )
    no_reports = {"vqa": "report_answers", "lesion_qa": "reports_in_lesion_qa", "endoscopy": "reports_in_endoscopy"}
    if task in no_reports and schema.reports:
        raise LeakageError(no_reports[task], f"schema {schema.name!r} gives reports ({', '.join(schema.reports)})")
    family = options.get("family")
    if task == "lesion_qa" and family in BOX_ANSWERS and schema.boxes != "off" and "tumour" in schema.box_levels:
        raise LeakageError(
            "box_gives_the_answer",
            f"schema {schema.name!r} shows the tumour box to {family}, whose answer it gives ({BOX_ANSWERS[family]})",
        )
