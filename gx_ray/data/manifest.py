"""A cohort described by a manifest: one CSV row per patient, naming its files and holding its labels, reports and labs.

Hospitals rarely export the release or paper layout (:mod:`gx_ray.data.layouts`); a spreadsheet pointing at the
files they have is easier to make. :func:`read_manifest_cohort` reads the CSV (``read_cohort`` and ``prepare_data``
take it as the ``manifest`` layout), :func:`manifest_cases` the same rows from a DataFrame (a serving process's).

Columns (names are case-insensitive; spaces and hyphens read as ``_``; empty cells are absent)::

    case_id                       required, unique
    patient_id                    default: the case id (splits are per patient)
    non_contrast, arterial,       a volume file (.nii.gz, .nii, .mha, ...) or a DICOM series folder;
    venous, delayed               non_contrast, venous and delayed are required (aliases: plain, portal_venous,
                                  equilibrium)
    <phase>_organ_mask            organ label volume of that phase (6 = stomach; the venous one guides the crop)
    <phase>_tumour_mask           binary tumour volume of that phase (also <phase>_tumor_mask)
    <phase>_<level>_box           "z0,y0,x0,z1,y1,x1": voxel corners on that phase's grid, the second corner the
                                  last voxel inside (as the release's zyx_max); several boxes joined by ";".
                                  level: tumour, lymph_nodes, stomach (or the release's lesion, nodule, stomach_body)
    endoscopy                     an RGB image file
    t, n, m                       pathological staging ("T3", "pT4a", "N3b", "M0"); without them, staging comes
                                  from the lab columns t_stage, n_stage, m_stage as in the paper layout
    ct_report, endoscopy_report,  report text (English; also <kind>_en); <kind>_zh: Chinese
    diagnosis_report
    vqa, vqa_zh                   a JSON list of {"question", "answer", "category"}
    anything else                 a clinical variable: a catalogue variable (``gx_ray/data/catalogue.csv``) is
                                  parsed as its kind says (numeric: a number, or a missing value); any other
                                  column is kept verbatim in ``Case.labs``, as an unknown variable of a
                                  ``clinical.json`` is, and reaches no model

Relative paths resolve against the CSV's folder (a DataFrame's ``base``). A bad row is a :class:`CaseError` naming
the case, the file and the column, and loses no other row; a manifest that cannot be read at all (no ``case_id``,
two columns of one name, a column naming no phase or level) is a :class:`ManifestError`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gx_ray.data.catalogue import load_catalogue
from gx_ray.data.layouts import (
    _box_coordinate,
    _box_corners,
    _canonical,
    _check_lab_values,
    _parse_box,
    _parse_vqa,
    _staging_from,
    read_cohort,
)
from gx_ray.data.volumes import VOLUME_SUFFIXES, is_volume_path
from gx_ray.schema import (
    BOX_LEVEL_ALIASES,
    BOX_LEVELS,
    LANGUAGES,
    PHASE_ALIASES,
    PHASES,
    REPORT_KINDS,
    REQUIRED_PHASES,
    Case,
    CaseError,
    Staging,
    normalise_tnm,
)

MANIFEST_FILE = "manifest.csv"
"""Where :func:`write_manifest_for` writes by default, beside the cohort it describes."""
MISSING_NUMBER_TEXT = frozenset({"na", "n/a", "nan", "null", "none"})
"""Texts a numeric variable's cell may hold for a missing value (what spreadsheets and pandas write), besides an empty
cell; case-insensitive. Other columns keep them: ``none`` is a category of several variables."""
_MASK_KINDS = {"organ_mask": "organ", "tumour_mask": "tumour", "tumor_mask": "tumour"}
_PHASE_SPELLINGS = sorted([*PHASES, *PHASE_ALIASES], key=len, reverse=True)  # longest first: portal_venous, venous
_INTEGER = re.compile(r"[+-]?\d+")


class ManifestError(ValueError):
    """A manifest that cannot be read at all (rather than one bad row): names the file and the column."""


@dataclass(frozen=True)
class _Column:
    """What one column of the manifest holds: ``kind`` and, for per-phase columns, the phase and level."""

    name: str
    """The header as written (errors name it so)."""
    kind: str
    """case_id, patient_id, phase, mask, box, endoscopy, staging, report, vqa, lab, or blank (no header)."""
    key: str = ""
    """The canonical name: the phase, the staging letter, the report kind, the language, the lab variable."""
    phase: str = ""
    level: str = ""
    """The box level, or the mask's kind (organ, tumour)."""


def _normalise_name(name: Any) -> str:
    return re.sub(r"[\s\-]+", "_", str(name).strip()).lower()


def _phase_prefix(name: str) -> tuple[str, str] | None:
    """``(phase, rest)`` of a column named ``<phase>_<rest>``, the phase in any spelling the schema knows."""
    for spelling in _PHASE_SPELLINGS:
        if name.startswith(f"{spelling}_"):
            return PHASE_ALIASES.get(spelling, spelling), name[len(spelling) + 1 :]
    return None


def _classify(header: Any, source: str) -> _Column:
    name = _normalise_name(header)
    if not name:
        return _Column(str(header), "blank")
    if name in ("case_id", "patient_id", "endoscopy"):
        return _Column(str(header), name, name)
    if (phase := _canonical(name, PHASES, PHASE_ALIASES)) is not None:
        return _Column(str(header), "phase", phase, phase)
    if name in ("t", "n", "m"):
        return _Column(str(header), "staging", name)
    for lang in LANGUAGES:
        for kind in REPORT_KINDS:
            if name == f"{kind}_{lang}" or (lang == "en" and name == kind):
                return _Column(str(header), "report", kind, level=lang)
        if name == f"vqa_{lang}" or (lang == "en" and name == "vqa"):
            return _Column(str(header), "vqa", lang)
    catalogue = load_catalogue()
    if name not in catalogue and name.endswith(("_box", "_mask")):
        # a column meant as a box or mask that names no phase or level is refused, not kept as an unknown lab
        split = _phase_prefix(name)
        if split and split[1] in _MASK_KINDS:
            return _Column(str(header), "mask", "", split[0], _MASK_KINDS[split[1]])
        level = _canonical(split[1][: -len("_box")], BOX_LEVELS, BOX_LEVEL_ALIASES) if split else None
        if split and name.endswith("_box") and level:
            return _Column(str(header), "box", "", split[0], level)
        raise ManifestError(
            f"{source}: column {header!r} is neither <phase>_organ_mask, <phase>_tumour_mask nor <phase>_<level>_box "
            f"(phases: {', '.join(PHASES)}; levels: {', '.join(BOX_LEVELS)})"
        )
    return _Column(str(header), "lab", name)


def _columns(frame: pd.DataFrame, source: str) -> list[_Column]:
    columns = [_classify(header, source) for header in frame.columns]
    if not any(c.kind == "case_id" for c in columns):
        raise ManifestError(f"{source}: no case_id column (columns: {', '.join(map(str, frame.columns))})")
    # two columns that mean one thing ("CEA" and "cea", "delayed" and "equilibrium"): which one holds the value?
    by_meaning: dict[tuple[str, ...], list[str]] = {}
    for at, c in enumerate(columns):
        if c.kind == "blank":  # a spreadsheet's trailing empty columns are nothing; a nameless column of values is
            if any(_value(cell) is not None for cell in frame.iloc[:, at]):
                raise ManifestError(f"{source}: column {at + 1} has no name but holds values")
            continue
        by_meaning.setdefault((c.kind, c.key, c.phase, c.level), []).append(c.name)
    for names in by_meaning.values():
        if len(names) > 1:
            raise ManifestError(f"{source}: columns {', '.join(map(repr, names))} name the same field; keep one")
    return columns


def _value(cell: Any) -> Any:
    """A cell as a plain Python value; ``None`` where it is empty (blank text, NaN, ``pd.NA``)."""
    if cell is None or cell is pd.NA or cell is pd.NaT:
        return None
    if isinstance(cell, np.generic):
        cell = cell.item()  # a DataFrame's numpy scalar → int, float, bool
    if isinstance(cell, float) and math.isnan(cell):
        return None
    if isinstance(cell, str):
        cell = cell.strip()
        return cell or None
    return cell


class _Row:
    """One manifest row being read: its cells by column, and what every error about it names."""

    def __init__(self, case_id: str, number: int, source: str, base: Path):
        self.case_id, self.number, self.source, self.base = case_id, number, source, base

    def error(
        self, column: str | None, message: str, reason: str = "malformed_annotation", file: Any = None
    ) -> CaseError:
        return CaseError(self.case_id, file or self.source, column, message, reason)

    def path(self, column: _Column, value: Any, volume: bool) -> Path:
        """The file a cell names, resolved against the manifest's folder; it must exist (and be a volume)."""
        path = Path(os.path.expanduser(str(value)))
        path = path if path.is_absolute() else self.base / path
        if not path.exists():
            message = f"{column.name} file does not exist (named in {self.source})"
            raise self.error(column.name, message, "missing_part", path)
        if volume and not is_volume_path(path):
            message = (
                f"{column.name} is neither a volume file ({', '.join(VOLUME_SUFFIXES)}) nor a folder of DICOM slices "
                f"(named in {self.source})"
            )
            raise self.error(column.name, message, "unreadable", path)
        return path

    def boxes(self, column: _Column, value: Any) -> list:
        """``"z0,y0,x0,z1,y1,x1[;...]"`` (or one sequence of six numbers) → boxes, the second corner inclusive as
        the release's ``zyx_max`` (:data:`gx_ray.data.layouts.BOX_MAX_INCLUSIVE`)."""
        groups = [value] if isinstance(value, (list, tuple)) else [g for g in str(value).split(";") if g.strip()]
        boxes = []
        for group in groups:
            parts = list(group) if isinstance(group, (list, tuple)) else group.split(",")
            if len(parts) != 6:
                message = f"a box is six voxel indices z0,y0,x0,z1,y1,x1, got {len(parts)} ({group!r})"
                raise self.error(column.name, message)
            coords = [_box_coordinate(p, self.case_id, self.source, column.name) for p in parts]
            entry = {"zyx_min": coords[:3], "zyx_max": coords[3:]}
            boxes.append(_parse_box(entry, self.case_id, self.source, column.name, column.level, column.phase))
        return boxes

    def lab(self, column: _Column, value: Any) -> Any:
        """A catalogue variable parsed as its kind says; an unknown column's value as it is."""
        catalogue = load_catalogue()
        if column.key not in catalogue or value is None:
            return value
        if catalogue[column.key].kind != "numeric":
            return str(value)
        if isinstance(value, bool):  # True would silently become 1.0
            raise self.error(column.name, f"{column.key} is numeric, got a boolean ({value!r})")
        if isinstance(value, (int, float)):
            return value
        text = str(value)
        if text.lower() in MISSING_NUMBER_TEXT:
            return None
        try:
            # "69" stays an integer and "60.0" a float, as they would in a clinical.json
            return int(text) if _INTEGER.fullmatch(text) else float(text)
        except ValueError:
            raise self.error(column.name, f"{column.key} is numeric, got {text!r}") from None


def _staging(row: _Row, letters: dict[str, Any], labs: dict[str, Any]) -> Staging | None:
    """T, N and M from the t/n/m columns, naming the column at fault; else from the labs, as the paper layout does."""
    given = {letter: value for letter, value in letters.items() if value is not None}
    if not given:
        return _staging_from(labs, row.case_id, row.source)
    if missing := [letter for letter in "tnm" if letter not in given]:
        raise row.error(", ".join(missing), f"staging is incomplete: {', '.join(missing)} is empty")
    for letter in "tnm":
        # one letter at a time, the others a valid placeholder, so that the error names the column at fault
        probe = {"t": "T1a", "n": "N0", "m": "M0", letter: str(given[letter])}
        try:
            normalise_tnm(probe["t"], probe["n"], probe["m"])
        except ValueError as err:
            raise row.error(letter, str(err)) from None
    staging = Staging.parse(str(given["t"]), str(given["n"]), str(given["m"]))
    try:
        staging.stage  # noqa: B018 -- Tis with nodes has no stage group; say so here rather than at preprocessing
    except ValueError as err:
        raise row.error("t", str(err)) from None
    return staging


def _read_row(row: _Row, columns: list[_Column], cells: list[Any]) -> Case:
    case = Case(case_id=row.case_id, source=Path(row.source), phases={})
    case.extra["manifest_row"] = row.number
    letters: dict[str, Any] = {}
    for column, cell in zip(columns, cells, strict=True):
        value = _value(cell)
        if column.kind == "blank":
            continue
        if column.kind == "lab":
            # an empty cell is a variable not recorded, as one absent from a clinical.json: a row of empty lab cells
            # has no labs (Case.presence), rather than a lab table of missing values
            if (lab := row.lab(column, value)) is not None:
                case.labs[column.key] = lab
            continue
        if value is None:
            continue
        if column.kind == "patient_id":
            case.patient_id = str(value)
        elif column.kind == "phase":
            case.phases[column.phase] = row.path(column, value, volume=True)
        elif column.kind == "mask":
            masks = case.organ_masks if column.level == "organ" else case.tumour_masks
            masks[column.phase] = row.path(column, value, volume=True)
        elif column.kind == "box":
            case.boxes += row.boxes(column, value)
        elif column.kind == "endoscopy":
            case.endoscopy = row.path(column, value, volume=False)
        elif column.kind == "staging":
            letters[column.key] = value
        elif column.kind == "report":
            case.reports.setdefault(column.level, {})[column.key] = str(value)
        elif column.kind == "vqa":
            try:
                items = json.loads(value) if isinstance(value, str) else value
            except json.JSONDecodeError as err:
                raise row.error(column.name, f"malformed JSON: {err}") from None
            case.vqa[column.key] = _parse_vqa(items, row.case_id, row.source, column.name)
    for phase in REQUIRED_PHASES:
        if phase not in case.phases:
            raise row.error(phase, f"required CT phase {phase!r} is missing", "missing_part")
    for kind, masks in (("organ", case.organ_masks), ("tumour", case.tumour_masks)):
        if stray := sorted(set(masks) - set(case.phases)):
            raise row.error(f"{stray[0]}_{kind}_mask", f"a {kind} mask of phase {stray[0]!r}, which the row lacks")
    _check_lab_values(case.labs, row.case_id, row.source)
    case.staging = _staging(row, letters, case.labs)
    return case


def manifest_cases(frame: pd.DataFrame, base: Path, source: str = "manifest") -> tuple[list[Case], list[CaseError]]:
    """The cases of a manifest's rows, each bad row a :class:`CaseError` instead (a case id on two rows: both);
    :class:`ManifestError` when the columns are wrong. ``base``: where relative paths resolve; ``source``: what
    errors and each case's ``source`` name as the file (``Case.extra["manifest_row"]``: the 1-based row)."""
    cases: list[Case] = []
    errors: list[CaseError] = []
    for _, result in _read_rows(frame, Path(base), source, frozenset()):
        (errors if isinstance(result, CaseError) else cases).append(result)
    return cases, errors


def _read_rows(
    frame: pd.DataFrame, base: Path, source: str, skip: frozenset[int]
) -> list[tuple[int, Case | CaseError]]:
    """Each row's case or error, by 1-based row number, in row order; rows in ``skip`` are left out."""
    columns = _columns(frame, source)
    id_at = next(i for i, c in enumerate(columns) if c.kind == "case_id")
    rows = list(frame.itertuples(index=False, name=None))
    ids = [None if (v := _value(cells[id_at])) is None else str(v) for cells in rows]
    ids = [None if n in skip else i for n, i in enumerate(ids, 1)]
    seen = Counter(i for i in ids if i is not None)
    results: list[tuple[int, Case | CaseError]] = []
    for number, (case_id, cells) in enumerate(zip(ids, rows, strict=True), 1):
        if number in skip:
            continue
        row = _Row(case_id or f"row {number}", number, source, base)
        result: Case | CaseError
        if case_id is None:
            result = row.error(columns[id_at].name, "the case id is empty", "missing_part")
        elif seen[case_id] > 1:
            others = ", ".join(str(n) for n, other in enumerate(ids, 1) if other == case_id)
            result = row.error(
                columns[id_at].name, f"case id {case_id} is on rows {others}; keep one", "duplicate_patient"
            )
        else:
            try:
                result = _read_row(row, columns, list(cells))
            except CaseError as err:
                result = err
            except Exception as err:  # an unforeseen failure is still one row's failure, not the cohort's
                result = row.error(None, f"{type(err).__name__}: {err}")
        if isinstance(result, CaseError):  # the row's number too, whichever reader found it: a case id may be empty
            result = CaseError(
                result.case_id, result.file, result.field, f"row {number}: {result.message}", result.reason
            )
        results.append((number, result))
    return results


def read_manifest_frame(csv_path: Path | str) -> tuple[pd.DataFrame, dict[int, CaseError]]:
    """A manifest CSV as a frame of text cells (nothing guessed: "007" stays "007"), and an error for each row with
    more cells than the header (an unquoted comma in a report, say), by row number; such a row is empty in the frame."""
    csv_path = Path(csv_path)
    try:
        text = csv_path.read_text(encoding="utf-8-sig")  # a spreadsheet's byte-order mark is not part of "case_id"
    except UnicodeDecodeError as err:
        raise ManifestError(f"{csv_path}: not UTF-8 text ({err})") from err
    try:
        lines = [line for line in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in line)]
    except csv.Error as err:
        raise ManifestError(f"{csv_path}: not a CSV file ({err})") from err
    if not lines:
        raise ManifestError(f"{csv_path}: empty (expected a header row with case_id)")
    header, body = lines[0], lines[1:]
    if repeated := sorted({h for h in header if h.strip() and header.count(h) > 1}):
        raise ManifestError(f"{csv_path}: columns {', '.join(map(repr, repeated))} appear twice; keep one")
    ragged, kept = {}, []
    for number, cells in enumerate(body, 1):
        if len(cells) > len(header):
            names = [_normalise_name(h) for h in header]
            case_id = cells[names.index("case_id")].strip() if "case_id" in names else ""
            message = f"row {number} has {len(cells)} cells, the header {len(header)} (a comma in an unquoted cell?)"
            ragged[number] = CaseError(case_id or f"row {number}", str(csv_path), None, message, "malformed_annotation")
            cells = []
        kept.append(cells + [""] * (len(header) - len(cells)))  # a short row's missing cells are empty
    return pd.DataFrame(kept, columns=header, dtype=object), ragged


def read_manifest_cohort(csv_path: Path | str, strict: bool = False) -> tuple[list[Case], list[CaseError]]:
    """The cases a manifest CSV lists (relative paths resolve against its folder) and an error per bad row, in row
    order; with ``strict``, the first bad row raises."""
    csv_path = Path(csv_path)
    frame, ragged = read_manifest_frame(csv_path)
    results = dict(_read_rows(frame, csv_path.parent, str(csv_path), frozenset(ragged)))
    results.update(ragged)
    cases: list[Case] = []
    errors: list[CaseError] = []
    for number in sorted(results):
        result = results[number]
        if isinstance(result, CaseError) and strict:
            raise result
        (errors if isinstance(result, CaseError) else cases).append(result)
    return cases, errors


# --- a manifest for a cohort in the release layout ---------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (bool, dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)  # str(float) is its shortest exact form: read back, it is the same number


def write_manifest_for(root: Path | str, out: Path | str | None = None) -> Path:
    """A manifest CSV describing the cohort at ``root`` (release or paper layout), paths relative to the CSV's
    folder; ``out`` defaults to ``root/manifest.csv``. Prepared, it gives the shards the folder gives."""
    root = Path(root)
    out = Path(out) if out is not None else root / MANIFEST_FILE
    cases, _ = read_cohort(root, strict=True)
    out.parent.mkdir(parents=True, exist_ok=True)

    def rel(path: Path) -> str:
        return Path(os.path.relpath(path.resolve(), out.parent.resolve())).as_posix()

    columns = ["case_id", "patient_id", *PHASES]
    columns += [f"{p}_{kind}_mask" for p in PHASES for kind in ("organ", "tumour")]
    columns += [f"{p}_{level}_box" for p in PHASES for level in BOX_LEVELS]  # the release's order of boxes
    columns += ["endoscopy", "t", "n", "m"]
    columns += [kind if lang == "en" else f"{kind}_{lang}" for lang in LANGUAGES for kind in REPORT_KINDS]
    columns += ["vqa" if lang == "en" else f"vqa_{lang}" for lang in LANGUAGES]
    labs = sorted({name for case in cases for name in case.labs})
    rows = []
    for case in cases:
        row: dict[str, Any] = {"case_id": case.case_id, "patient_id": case.patient_id}
        row.update({p: rel(path) for p, path in case.phases.items()})
        row.update({f"{p}_organ_mask": rel(path) for p, path in case.organ_masks.items()})
        row.update({f"{p}_tumour_mask": rel(path) for p, path in case.tumour_masks.items()})
        for box in case.boxes:
            key, corners = f"{box.phase}_{box.level}_box", _box_corners(box)
            text = ",".join(str(v) for v in corners["zyx_min"] + corners["zyx_max"])
            row[key] = f"{row[key]};{text}" if key in row else text
        if case.endoscopy is not None:
            row["endoscopy"] = rel(case.endoscopy)
        if case.staging is not None:
            row.update(t=case.staging.t, n=case.staging.n, m=case.staging.m)
        for lang, reports in case.reports.items():
            row.update({kind if lang == "en" else f"{kind}_{lang}": text for kind, text in reports.items()})
        for lang, items in case.vqa.items():
            document = [{"question": v.question, "answer": v.answer, "category": v.category} for v in items]
            row["vqa" if lang == "en" else f"vqa_{lang}"] = json.dumps(document, ensure_ascii=False)
        row.update({name: _cell(value) for name, value in case.labs.items()})
        rows.append([row.get(c, "") for c in [*columns, *labs]])
    with out.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*columns, *labs])
        writer.writerows(rows)
    return out
