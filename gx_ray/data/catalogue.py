"""The catalogue of Gastric-X's structured clinical variables (the paper's Table 8) and the abnormal-value rule.

``catalogue.csv`` beside this module holds one row per variable Table 8 lists: **117 rows**. The paper speaks of 134
variables, but its table lists 117 items (``Surgery Date`` twice); nothing is invented to reach 134. Of Sec. 3.2's 11
serum biochemistry indicators Table 8 lists 10; its 5 tumour markers are all listed.

Every variable has an ``availability``, which decides whether a model may ever see it (the leakage rules):

* ``pre_diagnosis``: known before the pathological diagnosis (demographics, CBC, biochemistry, tumour markers,
  admission vitals and body measures, endoscopy findings); the only variables a model may take as input.
* ``post_diagnosis``: known only from the resected specimen or after surgery (pathology, pathological T/N/M and
  stage, surgery, margins, IHC and molecular status, complications, stay and cost); never an input.
* ``identifier``: identifiers, pseudonyms and dates; never an input.
* ``report``: free-text reports (``ct_description``); they reach a model only through the report modality,
  under its own leakage rule.

``used_in_study`` is false where Table 8 says so (``Past Medical History``) and for pure identifiers. Reference ranges
are standard adult intervals in Chinese hospital laboratories' units: ``ref_low``/``ref_high`` the male (or neutral)
range, ``*_female`` the female one where it differs (creatinine and urea at 60-79, the cohort's typical age).
Abnormal values are described as Sec. 4 encodes the lab table: only abnormal entries, each with its name, value and
the ratio by which it exceeds (``value / high``) or falls below (``low / value``) the limit.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

KINDS: tuple[str, ...] = ("numeric", "categorical", "date", "text", "identifier")
AVAILABILITIES: tuple[str, ...] = ("pre_diagnosis", "post_diagnosis", "identifier", "report")
SEXES: tuple[str, ...] = ("male", "female")
_SEX_ALIASES = {"male": "male", "m": "male", "female": "female", "f": "female"}


@dataclass(frozen=True)
class Variable:
    """One catalogue row. ``ref_*`` are ``None`` where the variable has no such limit."""

    name: str
    label: str
    """The item text of Table 8."""
    short_label: str
    """How abnormal-value descriptors name it (``"CEA"``, ``"Hemoglobin"``)."""
    description: str
    section: str
    """The Table 8 heading it is printed under."""
    group: str
    kind: str
    unit: str
    ref_low: float | None
    ref_high: float | None
    ref_low_female: float | None
    ref_high_female: float | None
    categories: tuple[str, ...]
    deidentified: bool
    availability: str
    used_in_study: bool

    @property
    def is_post_diagnosis(self) -> bool:
        return self.availability == "post_diagnosis"

    @property
    def is_model_input(self) -> bool:
        return self.availability == "pre_diagnosis" and self.used_in_study

    @property
    def has_sex_specific_range(self) -> bool:
        return self.ref_low_female is not None or self.ref_high_female is not None


@dataclass(frozen=True)
class AbnormalFinding:
    """One value outside its reference range; ``ratio`` >= 1 says by how much (``limit`` is the one crossed)."""

    variable: Variable
    value: float
    unit: str
    direction: str
    """``"high"`` or ``"low"``."""
    limit: float
    ratio: float


def _parse_float(text: str) -> float | None:
    return float(text) if text.strip() else None


def _parse_bool(text: str, field: str, name: str) -> bool:
    if text.strip().lower() not in ("true", "false"):
        raise ValueError(f"catalogue variable {name!r}: {field} must be true or false, got {text!r}")
    return text.strip().lower() == "true"


def _variable_from_row(row: dict[str, str]) -> Variable:
    name = row["name"]
    texts = ("name", "label", "short_label", "description", "section", "group", "kind", "unit", "availability")
    variable = Variable(
        **{key: row[key] for key in texts},
        **{key: _parse_float(row[key]) for key in ("ref_low", "ref_high", "ref_low_female", "ref_high_female")},
        categories=tuple(row["categories"].split("|")) if row["categories"] else (),
        **{key: _parse_bool(row[key], key, name) for key in ("deidentified", "used_in_study")},
    )
    if variable.kind not in KINDS:
        raise ValueError(f"catalogue variable {name!r}: unknown kind {variable.kind!r}; valid: {', '.join(KINDS)}")
    if variable.availability not in AVAILABILITIES:
        raise ValueError(
            f"catalogue variable {name!r}: unknown availability {variable.availability!r}; "
            f"valid: {', '.join(AVAILABILITIES)}"
        )
    if variable.kind == "categorical" and not variable.categories:
        raise ValueError(f"catalogue variable {name!r}: a categorical variable needs its categories")
    if variable.kind in ("identifier", "date") and variable.availability != "identifier":
        raise ValueError(f"catalogue variable {name!r}: identifiers and dates must have availability 'identifier'")
    has_range = any(v is not None for v in (variable.ref_low, variable.ref_high))
    if (has_range or variable.has_sex_specific_range) and variable.kind != "numeric":
        raise ValueError(f"catalogue variable {name!r}: only numeric variables have reference ranges")
    return variable


class Catalogue:
    """The clinical variables in Table 8's order, looked up by name."""

    def __init__(self, variables: tuple[Variable, ...]):
        self.variables = variables
        self._by_name = {v.name: v for v in variables}
        if len(self._by_name) != len(variables):
            duplicates = sorted({v.name for v in variables if sum(w.name == v.name for w in variables) > 1})
            raise ValueError(f"duplicate catalogue variable names: {', '.join(duplicates)}")
        for v in variables:
            for sex in SEXES:
                low, high = self.reference_range(v.name, sex)
                if low is not None and high is not None and not low < high:
                    raise ValueError(f"catalogue variable {v.name!r}: {sex} reference range {low}-{high} is empty")

    def __len__(self) -> int:
        return len(self.variables)

    def __iter__(self):
        return iter(self.variables)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Variable:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"unknown clinical variable {name!r}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variables)

    def model_inputs(self) -> tuple[Variable, ...]:
        """The variables a model may see: pre-diagnosis, not identifiers or dates, used in the study."""
        return tuple(v for v in self.variables if v.is_model_input)

    def numeric_inputs(self) -> tuple[Variable, ...]:
        """The numeric model inputs, in catalogue order: the order of the lab vector."""
        return tuple(v for v in self.model_inputs() if v.kind == "numeric")

    def leaking_variables(self) -> tuple[Variable, ...]:
        """Variables known only after diagnosis: giving one to a model leaks the label."""
        return tuple(v for v in self.variables if v.is_post_diagnosis)

    def is_post_diagnosis(self, name: str) -> bool:
        return self[name].is_post_diagnosis

    def reference_range(self, name: str, sex: str | None = None) -> tuple[float | None, float | None]:
        """``(low, high)`` of ``name`` for ``sex``; either may be ``None`` (no such limit). With ``sex=None`` a
        sex-specific range widens to cover both sexes, so a value normal for either sex is never flagged."""
        v = self[name]
        male = (v.ref_low, v.ref_high)
        female = (
            v.ref_low_female if v.ref_low_female is not None else v.ref_low,
            v.ref_high_female if v.ref_high_female is not None else v.ref_high,
        )
        if sex is None:
            low = None if None in (male[0], female[0]) else min(male[0], female[0])
            high = None if None in (male[1], female[1]) else max(male[1], female[1])
            return low, high
        return female if _normalise_sex(sex) == "female" else male

    def abnormal_findings(self, values: dict[str, Any], sex: str | None = None) -> list[AbnormalFinding]:
        """The numeric values outside their reference range, in catalogue order. Missing values are never abnormal;
        unknown and non-numeric variables are ignored; a numeric variable whose value is not a number raises."""
        findings = []
        for v in self.variables:
            if v.kind != "numeric" or v.name not in values:
                continue
            value = _as_number(v.name, values[v.name])
            if value is None:
                continue
            low, high = self.reference_range(v.name, sex)
            if high is not None and value > high:
                findings.append(AbnormalFinding(v, value, v.unit, "high", high, value / high))
            elif low is not None and value < low:
                ratio = low / value if value > 0 else math.inf
                findings.append(AbnormalFinding(v, value, v.unit, "low", low, ratio))
        return findings


def _normalise_sex(sex: str) -> str:
    try:
        return _SEX_ALIASES[str(sex).strip().lower()]
    except KeyError:
        raise ValueError(f"unknown sex {sex!r}; valid: male, female (or None when unknown)") from None


def _as_number(name: str, value: Any) -> float | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ValueError(f"clinical variable {name!r} is numeric but got the boolean {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"clinical variable {name!r} is numeric but got {value!r}") from None
    return None if math.isnan(number) else number


def describe_abnormal(findings: list[AbnormalFinding]) -> list[str]:
    """Short English descriptors, e.g. ``"CEA 12.4 ng/mL, 2.5x above upper limit"``."""
    lines = []
    for f in findings:
        side = "above upper" if f.direction == "high" else "below lower"
        amount = f"{f.ratio:.1f}x {side} limit" if math.isfinite(f.ratio) else f"{side} limit"
        unit = f" {f.unit}" if f.unit else ""
        value = np.format_float_positional(f.value, precision=4, fractional=False, trim="-")  # no exponents
        lines.append(f"{f.variable.short_label} {value}{unit}, {amount}")
    return lines


@cache
def load_catalogue() -> Catalogue:
    """The catalogue shipped with the package (parsed once per process)."""
    text = resources.files("gx_ray.data").joinpath("catalogue.csv").read_text(encoding="utf-8")
    return Catalogue(tuple(_variable_from_row(row) for row in csv.DictReader(io.StringIO(text))))
