"""On-disk layouts of Gastric-X cases: one reader and one writer per layout, turning folders into `Case` records.

Two layouts exist (their trees are below). Either may hold a phase as a volume file (``.nii.gz``, ``.nii``,
``.mha``) or as a folder of DICOM slices, since hospitals export DICOM.

**release** — the public Hugging Face release (``HaoChen2/Gastric-X``), plus the paper's extras
(``endoscopy/``, ``clinical/``, ``endoscopy_report``, boxes on every phase) that the demo cohort writes::

    ROOT/imaging/<ID>/<phase>.nii.gz | <phase>/*.dcm     non_contrast, venous, delayed; arterial optional
    ROOT/imaging/<ID>/<phase>_organ_mask.nii.gz          6 stomach, 7 aorta, 8 IVC, 9 portal/splenic vein, 10 pancreas
    ROOT/imaging/<ID>/<phase>_tumor_mask.nii.gz          binary
    ROOT/imaging/<ID>/bbox.json                          {"boxes": [{"class", "phase", "zyx_min", "zyx_max"}]}
    ROOT/metadata/EN/<ID>.json, metadata/CN/<ID>.json    {"ct_report", "diagnosis", "meta": {...}, "vqa": [...]}
    ROOT/endoscopy/<ID>.png, ROOT/clinical/<ID>.json     paper extras: RGB image, {"variables": {...}}

**paper** — the full layout the paper describes (three box levels on every phase, 134 variables, three reports)::

    ROOT/<ID>/ct/<phase>.nii.gz | ct/<phase>/*.dcm
    ROOT/<ID>/boxes.json      {"<phase>": {"tumour" | "lymph_nodes" | "stomach": {"zyx_min", "zyx_max"}}}
    ROOT/<ID>/clinical.json   {"patient_id", "variables": {...}}   (T/N/M are among the variables)
    ROOT/<ID>/reports.json    {"en": {"ct_report", "endoscopy_report", "diagnosis_report"}, "zh": {...}}
    ROOT/<ID>/vqa.json        {"en": [{"question", "answer", "category"}], "zh": [...]}
    ROOT/<ID>/endoscopy.png

Box corners on disk are ``zyx_min`` / ``zyx_max`` voxel indices of the box's own phase; whether ``zyx_max`` is
inclusive, which the release does not say, is stated once (:data:`BOX_MAX_INCLUSIVE`) for reader and writer. Unknown
JSON keys are kept in ``Case.extra``; a missing part or malformed annotation is a :class:`CaseError` naming the case,
the file and the field. A **manifest** ``.csv`` (:mod:`gx_ray.data.manifest`) is a third layout, ``manifest``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import SimpleITK as sitk
from PIL import Image

from gx_ray.data.catalogue import load_catalogue
from gx_ray.data.volumes import VOLUME_SUFFIXES, write_dicom_series, write_volume
from gx_ray.schema import (
    BOX_LEVEL_ALIASES,
    BOX_LEVELS,
    LANGUAGES,
    PHASE_ALIASES,
    PHASES,
    REQUIRED_PHASES,
    Box,
    Case,
    CaseError,
    Staging,
    VQAItem,
)

LAYOUTS: tuple[str, ...] = ("release", "paper")
"""The folder layouts, which the demo cohort can be written in."""
MANIFEST_LAYOUT = "manifest"
"""A CSV naming each case's files (:mod:`gx_ray.data.manifest`): read, never written by the demo."""
BOX_MAX_INCLUSIVE = True
"""``zyx_max`` names the last voxel inside the box (so the end-exclusive ``z1`` is ``zyx_max + 1``).
Annotation tools that export voxel corners (ITK-SNAP, 3D Slicer ROI → index) give inclusive ends, and the
release's boxes touch the mask's last slice, which an exclusive reading would cut off."""

RELEASE_LANGUAGE_DIRS = {"en": "EN", "zh": "CN"}
RELEASE_BOX_CLASS = {"tumour": "lesion", "lymph_nodes": "nodule", "stomach": "stomach_body"}
RELEASE_DEFAULT_BOX_PHASE = "arterial"  # the release annotates the arterial phase only
RELEASE_REPORT_KEYS = {
    "ct_report": "ct_report",
    "diagnosis": "diagnosis_report",
    "endoscopy_report": "endoscopy_report",
}
_KNOWN_RELEASE_METADATA_KEYS = {*RELEASE_REPORT_KEYS, "meta", "vqa"}
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass
class CaseContent:
    """A case in memory, ready to be written in either layout (the demo generator builds these)."""

    case_id: str
    phases: dict[str, sitk.Image]
    organ_masks: dict[str, sitk.Image] = field(default_factory=dict)
    tumour_masks: dict[str, sitk.Image] = field(default_factory=dict)
    boxes: list[Box] = field(default_factory=list)
    staging: Staging | None = None
    labs: dict[str, Any] = field(default_factory=dict)
    reports: dict[str, dict[str, str]] = field(default_factory=dict)
    vqa: dict[str, list[VQAItem]] = field(default_factory=dict)
    endoscopy: np.ndarray | None = None
    endoscopy_annotation: dict[str, Any] | None = None
    """The frame's entry of the cohort's ``endoscopy_annotations.json`` (:mod:`gx_ray.data.endoscopy_annotations`)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Demographics, ground truth of a generated case and anything else worth keeping."""


# --- shared pieces -----------------------------------------------------------------------------------


def _load_json(path: Path, case_id: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CaseError(case_id, path, None, f"malformed JSON: {err}", "malformed_annotation") from err
    if not isinstance(data, dict):
        raise CaseError(case_id, path, None, "expected a JSON object at the top level", "malformed_annotation")
    return data


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False, sort_keys=True), encoding="utf-8")


def _canonical(name: str, valid: tuple[str, ...], aliases: dict[str, str]) -> str | None:
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    key = aliases.get(key, key)
    return key if key in valid else None


def _find_volume(folder: Path, stem: str) -> Path | None:
    for suffix in VOLUME_SUFFIXES:
        if (folder / f"{stem}{suffix}").is_file():
            return folder / f"{stem}{suffix}"
    return folder / stem if (folder / stem).is_dir() else None


def _find_phases(folder: Path, case_id: str) -> dict[str, Path]:
    """Phase volumes of a case folder; a missing required phase is a CaseError."""
    phases = {}
    for phase in PHASES:
        for stem in (phase, *(alias for alias, canonical in PHASE_ALIASES.items() if canonical == phase)):
            if found := _find_volume(folder, stem):
                phases[phase] = found
                break
    for phase in REQUIRED_PHASES:
        if phase not in phases:
            expected = folder / f"{phase}.nii.gz"
            raise CaseError(case_id, expected, phase, f"required CT phase {phase!r} is missing", "missing_part")
    return phases


def _box_coordinate(value: Any, case_id: str, path: Path, where: str) -> int:
    """One voxel index: an integer, or a float/string that is one (``10.0``, ``"10"``); anything else is refused.

    ``int()`` alone would truncate 10.5 to 10 and read ``true`` as 1, and raise OverflowError on ``Infinity``.
    """
    number: Any = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        reason = "a boolean" if isinstance(value, bool) else f"a {type(value).__name__}"
        message = f"box coordinate must be an integer voxel index, got {reason} ({value!r})"
        raise CaseError(case_id, path, where, message, "malformed_annotation")
    if isinstance(number, int):  # exact, however large (math.isfinite would overflow on 10**400)
        return number
    if not math.isfinite(number):
        raise CaseError(case_id, path, where, f"box coordinate is not finite ({value!r})", "malformed_annotation")
    if number != int(number):
        message = f"box coordinate is not a whole voxel index ({value!r})"
        raise CaseError(case_id, path, where, message, "malformed_annotation")
    return int(number)


def _parse_box(entry: Any, case_id: str, path: Path, where: str, level: str, phase: str) -> Box:
    if not isinstance(entry, dict) or "zyx_min" not in entry or "zyx_max" not in entry:
        raise CaseError(case_id, path, where, "a box needs 'zyx_min' and 'zyx_max'", "malformed_annotation")
    corners = {}
    for key in ("zyx_min", "zyx_max"):
        values = entry[key]
        if not isinstance(values, list) or len(values) != 3:
            message = f"{key} needs three coordinates (z, y, x) ({values!r})"
            raise CaseError(case_id, path, f"{where}.{key}", message, "malformed_annotation")
        corners[key] = [_box_coordinate(v, case_id, path, f"{where}.{key}[{i}]") for i, v in enumerate(values)]
    lo = corners["zyx_min"]
    hi = [v + (1 if BOX_MAX_INCLUSIVE else 0) for v in corners["zyx_max"]]
    try:
        return Box(level, phase, (*lo, *hi))
    except (TypeError, ValueError) as err:
        raise CaseError(case_id, path, where, f"invalid box: {err}", "malformed_annotation") from err


def _check_lab_values(labs: dict[str, Any], case_id: str, path: Path) -> None:
    """Refuse lab values that would reach a model as ±inf in the float32 shards: infinite (``Infinity``, ``"inf"``)
    or beyond float32's range (``-1e300``), and booleans of numeric variables (``true`` would become 1.0). Missing
    and NaN (a table export's empty cell) stay missing; only catalogue-numeric variables are parsed from text, so a
    category ``"INF"`` is never infinity."""
    catalogue = load_catalogue()
    for name, value in labs.items():
        numeric = name in catalogue and catalogue[name].kind == "numeric"
        if isinstance(value, bool):
            if numeric:
                message = f"lab value must be a number, got a boolean ({value!r})"
                raise CaseError(case_id, path, name, message, "malformed_annotation")
            continue
        if not isinstance(value, (int, float)) and not (numeric and isinstance(value, str)):
            continue
        try:
            number = float(value)
        except ValueError:
            continue  # not a number: prepare names it when it builds the lab vector
        except OverflowError:  # an integer with hundreds of digits
            number = math.inf
        if math.isnan(number):
            continue
        if math.isinf(number) or abs(number) > FLOAT32_MAX:
            what = "infinite" if math.isinf(number) else "beyond float32's range"
            raise CaseError(case_id, path, name, f"lab value is {what} ({value!r})", "malformed_annotation")


def _box_corners(box: Box) -> dict[str, list[int]]:
    z0, y0, x0, z1, y1, x1 = box.zyx
    end = 1 if BOX_MAX_INCLUSIVE else 0
    return {"zyx_min": [z0, y0, x0], "zyx_max": [z1 - end, y1 - end, x1 - end]}


def _staging_from(values: dict[str, Any], case_id: str, path: Path) -> Staging | None:
    """T, N and M from a mapping whose keys may be spelled "T", "t_stage", "pT", "T Stage" ..."""
    found: dict[str, Any] = {}
    for key, value in values.items():
        compact = re.sub(r"[\s_\-]", "", str(key)).lower()
        for letter in "tnm":
            if compact in (letter, f"{letter}stage", f"p{letter}", f"p{letter}stage") and value not in (None, ""):
                found[letter] = value
    if not found:
        return None
    if len(found) < 3:
        missing = ", ".join(f"{letter.upper()} stage" for letter in "tnm" if letter not in found)
        raise CaseError(case_id, path, missing, "staging is incomplete", "malformed_annotation")
    try:
        return Staging.parse(str(found["t"]), str(found["n"]), str(found["m"]))
    except ValueError as err:
        raise CaseError(case_id, path, "staging", str(err), "malformed_annotation") from err


def _parse_vqa(items: Any, case_id: str, path: Path, where: str) -> list[VQAItem]:
    if not isinstance(items, list):
        raise CaseError(case_id, path, where, "expected a list of VQA items", "malformed_annotation")
    parsed = []
    for i, item in enumerate(items):
        try:
            parsed.append(VQAItem(str(item["question"]), str(item["answer"]), str(item["category"])))
        except (KeyError, TypeError, ValueError) as err:
            raise CaseError(case_id, path, f"{where}[{i}]", f"invalid VQA item: {err}", "malformed_annotation") from err
    return parsed


def _vqa_json(items: list[VQAItem]) -> list[dict[str, str]]:
    return [{"question": v.question, "answer": v.answer, "category": v.category} for v in items]


def _write_phases(folder: Path, content: CaseContent, dicom: bool) -> None:
    for phase, image in content.phases.items():
        if dicom:
            # a stable series UID per case and phase: "2.25.<UUID as integer>" is DICOM's UUID-derived form
            uid = f"2.25.{uuid.uuid5(uuid.NAMESPACE_OID, f'gx-ray/{content.case_id}/{phase}').int}"
            write_dicom_series(image, folder / phase, uid, phase)
        else:
            write_volume(image, folder / f"{phase}.nii.gz")


def _write_png(path: Path, rgb: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path, optimize=False)


# --- release layout ----------------------------------------------------------------------------------


def write_release_case(root: Path, content: CaseContent, dicom: bool = False) -> Path:
    """Write one case in the release layout (plus the paper's extras); returns its imaging folder."""
    cid = content.case_id
    folder = root / "imaging" / cid
    _write_phases(folder, content, dicom)
    for phase, mask in content.organ_masks.items():
        write_volume(mask, folder / f"{phase}_organ_mask.nii.gz")
    for phase, mask in content.tumour_masks.items():
        write_volume(mask, folder / f"{phase}_tumor_mask.nii.gz")
    boxes = [{"class": RELEASE_BOX_CLASS[b.level], "phase": b.phase, **_box_corners(b)} for b in content.boxes]
    _write_json(folder / "bbox.json", {"boxes": boxes})
    meta = dict(content.meta)
    if content.staging:
        meta.update(T=content.staging.t, N=content.staging.n, M=content.staging.m, stage=content.staging.stage)
    for lang, lang_dir in RELEASE_LANGUAGE_DIRS.items():
        reports = content.reports.get(lang, {})
        document = {key: reports[kind] for key, kind in RELEASE_REPORT_KEYS.items() if kind in reports}
        document.update(meta=meta, vqa=_vqa_json(content.vqa.get(lang, [])))
        _write_json(root / "metadata" / lang_dir / f"{cid}.json", document)
    if content.endoscopy is not None:
        _write_png(root / "endoscopy" / f"{cid}.png", content.endoscopy)
    if content.labs:
        _write_json(root / "clinical" / f"{cid}.json", {"variables": content.labs})
    return folder


def _read_release_boxes(path: Path, case_id: str) -> list[Box]:
    data = _load_json(path, case_id)
    entries = data.get("boxes")
    if entries is None:  # also accept {"lesion": {...}, "nodule": [...], ...}
        entries = [
            {"class": name, **item}
            for name, value in data.items()
            for item in (value if isinstance(value, list) else [value])
            if isinstance(item, dict)
        ]
    if not isinstance(entries, list):
        raise CaseError(case_id, path, "boxes", "expected a list of boxes", "malformed_annotation")
    boxes = []
    for i, entry in enumerate(entries):
        where = f"boxes[{i}]"
        if not isinstance(entry, dict):
            raise CaseError(case_id, path, where, "a box must be a JSON object", "malformed_annotation")
        level = _canonical(str(entry.get("class", "")), BOX_LEVELS, BOX_LEVEL_ALIASES)
        phase = _canonical(str(entry.get("phase", RELEASE_DEFAULT_BOX_PHASE)), PHASES, PHASE_ALIASES)
        if level is None:
            raise CaseError(
                case_id, path, f"{where}.class", f"unknown box class {entry.get('class')!r}", "malformed_annotation"
            )
        if phase is None:
            raise CaseError(
                case_id, path, f"{where}.phase", f"unknown phase {entry.get('phase')!r}", "malformed_annotation"
            )
        boxes.append(_parse_box(entry, case_id, path, where, level, phase))
    return boxes


def read_release_case(root: Path, case_id: str) -> Case:
    """Read one case of the release layout; raises CaseError naming the file and field on bad input."""
    folder = root / "imaging" / case_id
    phases = _find_phases(folder, case_id)
    case = Case(case_id=case_id, source=folder, phases=phases)
    for phase in phases:
        if (mask := folder / f"{phase}_organ_mask.nii.gz").is_file():
            case.organ_masks[phase] = mask
        if (mask := folder / f"{phase}_tumor_mask.nii.gz").is_file():
            case.tumour_masks[phase] = mask
    if (bbox := folder / "bbox.json").is_file():
        case.boxes = _read_release_boxes(bbox, case_id)
    for lang, lang_dir in RELEASE_LANGUAGE_DIRS.items():
        path = root / "metadata" / lang_dir / f"{case_id}.json"
        if not path.is_file():
            continue
        data = _load_json(path, case_id)
        reports = {kind: str(data[key]) for key, kind in RELEASE_REPORT_KEYS.items() if data.get(key)}
        if reports:
            case.reports[lang] = reports
        if "vqa" in data:
            case.vqa[lang] = _parse_vqa(data["vqa"], case_id, path, "vqa")
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise CaseError(case_id, path, "meta", "expected a JSON object", "malformed_annotation")
        if case.staging is None:
            case.staging = _staging_from(meta, case_id, path)
        if meta.get("patient_id"):
            case.patient_id = str(meta["patient_id"])
        unknown = {k: v for k, v in data.items() if k not in _KNOWN_RELEASE_METADATA_KEYS}
        case.extra[f"metadata/{lang_dir}"] = {"meta": meta, **unknown}
    if (png := root / "endoscopy" / f"{case_id}.png").is_file():
        case.endoscopy = png
    if (clinical := root / "clinical" / f"{case_id}.json").is_file():
        data = _load_json(clinical, case_id)
        case.labs = dict(data.get("variables") or {})
        _check_lab_values(case.labs, case_id, clinical)
        case.extra.update({f"clinical/{k}": v for k, v in data.items() if k != "variables"})
        if case.staging is None:
            case.staging = _staging_from(case.labs, case_id, clinical)
    return case


def release_case_ids(root: Path) -> list[str]:
    """Case ids of the release layout: the folders under ``imaging/`` (see :func:`case_folder_errors`)."""
    return _case_folders(root / "imaging", Path.is_dir)[0]


# --- paper layout ------------------------------------------------------------------------------------


def write_paper_case(root: Path, content: CaseContent, dicom: bool = False) -> Path:
    """Write one case in the paper layout; returns its folder."""
    folder = root / content.case_id
    _write_phases(folder / "ct", content, dicom)
    boxes: dict[str, dict[str, Any]] = defaultdict(dict)
    for box in content.boxes:
        boxes[box.phase][box.level] = _box_corners(box)
    _write_json(folder / "boxes.json", boxes)
    variables = dict(content.labs)
    if content.staging and not _has_staging(variables):
        variables.update(t_stage=content.staging.t, n_stage=content.staging.n, m_stage=content.staging.m)
    _write_json(folder / "clinical.json", {"patient_id": content.case_id, "variables": variables, "meta": content.meta})
    _write_json(folder / "reports.json", content.reports)
    _write_json(folder / "vqa.json", {lang: _vqa_json(items) for lang, items in content.vqa.items()})
    if content.endoscopy is not None:
        _write_png(folder / "endoscopy.png", content.endoscopy)
    return folder


def _has_staging(values: dict[str, Any]) -> bool:
    try:
        return _staging_from(values, "", Path()) is not None
    except CaseError:
        return False


def read_paper_case(root: Path, case_id: str) -> Case:
    """Read one case of the paper layout; raises CaseError naming the file and field on bad input."""
    folder = root / case_id
    case = Case(case_id=case_id, source=folder, phases=_find_phases(folder / "ct", case_id))
    if (path := folder / "boxes.json").is_file():
        for phase_name, levels in _load_json(path, case_id).items():
            phase = _canonical(phase_name, PHASES, PHASE_ALIASES)
            if phase is None or not isinstance(levels, dict):
                raise CaseError(
                    case_id, path, phase_name, "expected a phase name → {level: box}", "malformed_annotation"
                )
            for level_name, entry in levels.items():
                level = _canonical(level_name, BOX_LEVELS, BOX_LEVEL_ALIASES)
                where = f"{phase_name}.{level_name}"
                if level is None:
                    raise CaseError(case_id, path, where, f"unknown box level {level_name!r}", "malformed_annotation")
                case.boxes.append(_parse_box(entry, case_id, path, where, level, phase))
    if (path := folder / "clinical.json").is_file():
        data = _load_json(path, case_id)
        case.labs = dict(data.get("variables") or {})
        _check_lab_values(case.labs, case_id, path)
        case.staging = _staging_from(case.labs, case_id, path)
        case.patient_id = str(data.get("patient_id") or case_id)
        case.extra.update({f"clinical/{k}": v for k, v in data.items() if k not in ("variables", "patient_id")})
    if (path := folder / "reports.json").is_file():
        for lang, reports in _load_json(path, case_id).items():
            if lang in LANGUAGES and isinstance(reports, dict):
                case.reports[lang] = {str(k): str(v) for k, v in reports.items()}
            else:
                case.extra.setdefault("reports", {})[lang] = reports
    if (path := folder / "vqa.json").is_file():
        for lang, items in _load_json(path, case_id).items():
            case.vqa[lang] = _parse_vqa(items, case_id, path, lang)
    if (png := folder / "endoscopy.png").is_file():
        case.endoscopy = png
    return case


def _is_paper_case(folder: Path) -> bool:
    return folder.is_dir() and (folder / "ct").is_dir()


def paper_case_ids(root: Path) -> list[str]:
    """Case ids of the paper layout: the folders under ``root`` that hold ``ct/`` (see :func:`case_folder_errors`)."""
    return _case_folders(root, _is_paper_case)[0]


def printable(name: str | Path) -> str:
    """A file name as valid UTF-8 text, other bytes as ``\\xNN`` escapes: Python hands them on as lone surrogates,
    which SimpleITK aborts the process on and no UTF-8 report can hold."""
    return os.fsencode(str(name)).decode("utf-8", "backslashreplace")


def _case_folders(parent: Path, is_case: Callable[[Path], bool]) -> tuple[list[str], list[CaseError]]:
    """The case folders under ``parent``, and a QC error for each entry that looks like one but cannot be read:
    a name that is not valid UTF-8, a symlink that points nowhere or loops (``is_dir`` would be False for both,
    and the case would silently vanish)."""
    if not parent.is_dir():
        return [], []
    ids, errors = [], []
    for entry in sorted(parent.iterdir()):
        name = entry.name
        if entry.is_symlink() and not entry.exists():
            try:
                os.stat(entry)
                problem = "cannot be followed"
            except OSError as err:
                problem = "loops" if err.errno == errno.ELOOP else "points to nothing"
            message = f"case folder is a symlink that {problem} ({printable(os.readlink(entry))})"
            errors.append(CaseError(printable(name), printable(entry), "case folder", message, "unreadable"))
            continue
        if not is_case(entry):
            continue
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            message = f"case folder name is not valid UTF-8 ({os.fsencode(name)!r})"
            errors.append(CaseError(printable(name), printable(entry), "case_id", message, "unreadable"))
            continue
        ids.append(name)
    return ids, errors


def case_folder_errors(root: Path, layout: str) -> list[CaseError]:
    """QC errors of case folders the layout's id listing leaves out: non-UTF-8 names, broken or looping symlinks."""
    parent = Path(root) / "imaging" if layout == "release" else Path(root)
    return _case_folders(parent, Path.is_dir if layout == "release" else _is_paper_case)[1]


# --- the whole cohort --------------------------------------------------------------------------------

WRITERS = {"release": write_release_case, "paper": write_paper_case}
READERS = {"release": (release_case_ids, read_release_case), "paper": (paper_case_ids, read_paper_case)}


def detect_layout(root: Path) -> str:
    root = Path(root)
    if root.suffix.lower() == ".csv":
        return MANIFEST_LAYOUT
    if (root / "imaging").is_dir():
        return "release"
    if paper_case_ids(root):
        return "paper"
    raise FileNotFoundError(
        f"{root} holds no Gastric-X cases: expected imaging/<ID>/ (release layout), <ID>/ct/ (paper layout) or a "
        "manifest .csv"
    )


def _read_folders(root: Path, layout: str, strict: bool) -> tuple[list[Case], list[CaseError]]:
    """The cases of a folder layout, each bad one an error (or raised when ``strict``)."""
    if layout not in READERS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join((*LAYOUTS, MANIFEST_LAYOUT))}")
    list_ids, read_case = READERS[layout]
    cases: list[Case] = []
    errors = case_folder_errors(root, layout)
    if strict and errors:
        raise errors[0]
    for case_id in list_ids(root):
        try:
            cases.append(read_case(root, case_id))
        except CaseError as err:
            if strict:
                raise
            errors.append(err)
        except Exception as err:  # an unforeseen failure is still one case's failure, not the cohort's
            folder = root / "imaging" / case_id if layout == "release" else root / case_id
            wrapped = CaseError(case_id, folder, None, f"{type(err).__name__}: {err}", "malformed_annotation")
            if strict:
                raise wrapped from err
            errors.append(wrapped)
    return cases, errors


def read_cohort(root: Path, layout: str | None = None, strict: bool = False) -> tuple[list[Case], list[CaseError]]:
    """Every case under ``root`` (a folder, or a manifest ``.csv``), bad ones as errors (raised when ``strict``). A
    patient id in two case folders cannot be split at patient level, so both are excluded."""
    root = Path(root)
    layout = layout or detect_layout(root)
    if layout == MANIFEST_LAYOUT:
        # imported here: the manifest reader builds on this module's helpers
        from gx_ray.data.manifest import read_manifest_cohort

        cases, errors = read_manifest_cohort(root, strict)
    else:
        cases, errors = _read_folders(root, layout, strict)
    by_patient: dict[str, list[Case]] = defaultdict(list)
    for case in cases:
        by_patient[case.patient_id].append(case)
    duplicates = {pid: group for pid, group in by_patient.items() if len(group) > 1}
    for pid, group in duplicates.items():
        folders = ", ".join(c.case_id for c in group)
        for case in group:
            err = CaseError(
                case.case_id,
                case.source,
                "patient_id",
                f"patient {pid} appears in case folders {folders}; remove all but one",
                "duplicate_patient",
            )
            if strict:
                raise err
            errors.append(err)
    duplicated = {c.case_id for group in duplicates.values() for c in group}
    return [c for c in cases if c.case_id not in duplicated], errors
