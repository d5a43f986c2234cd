"""The vocabulary every gx-ray module shares: CT phases, box levels, tasks, TNM staging and the case record.

Conventions stated once here and used everywhere:

* Arrays are indexed ``(z, y, x)`` (SimpleITK's ``GetArrayFromImage`` order); ``z`` is the axial slice.
* A 3D box is ``(z0, y0, x0, z1, y1, x1)`` in voxel indices of the grid it lives on, **end-exclusive**
  (a box covering only voxel ``(2, 3, 4)`` is ``(2, 3, 4, 3, 4, 5)``). Raw layouts that store inclusive
  corners are converted once, in their reader (:mod:`gx_ray.data.layouts`).
* HU windows, spacing and crop shapes are preprocessing settings (:mod:`gx_ray.data.preprocess`).
* Staging follows the AJCC 8th edition pathological (pTNM) stage groups for gastric cancer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AUTO = "auto"
"""A setting measured or chosen at run time rather than given (``data.micro_batch``, ``resources.gpus_per_worker``)."""

# --- CT phases --------------------------------------------------------------------------------------

PHASES: tuple[str, ...] = ("non_contrast", "arterial", "venous", "delayed")
"""All CT phases, in acquisition order. ``delayed`` is the paper's "equilibrium" phase."""
REQUIRED_PHASES: tuple[str, ...] = ("non_contrast", "venous", "delayed")
REFERENCE_PHASE = "venous"
"""The phase every other phase is registered to and resampled onto (Appendix B)."""
PHASE_ALIASES = {"equilibrium": "delayed", "plain": "non_contrast", "portal_venous": "venous"}

# --- boxes ------------------------------------------------------------------------------------------

BOX_LEVELS: tuple[str, ...] = ("tumour", "lymph_nodes", "stomach")
"""The paper's three box levels: tumour core, regional lymph nodes, whole stomach."""
BOX_LEVEL_ALIASES = {
    # the public release's class names
    "lesion": "tumour",
    "nodule": "lymph_nodes",
    "stomach_body": "stomach",
    # spellings seen in the paper and in user data
    "tumor": "tumour",
    "lymph_node": "lymph_nodes",
    "nodes": "lymph_nodes",
}

# --- tasks, reports, VQA ----------------------------------------------------------------------------

PAPER_TASKS: tuple[str, ...] = ("vqa", "report_generation", "retrieval", "stage_classification", "lesion_detection")
"""The Gastric-X paper's five tasks: its ablation (``modality_ablation``) and Tables 2a-6."""
TASKS: tuple[str, ...] = (*PAPER_TASKS, "lesion_qa", "endoscopy")
"""Every task: the paper's, then the related papers' (``lesion_qa``: CT-Bench's lesion-level multiple choice;
``endoscopy``: the upper-GI endoscopy paper's GastroINST tasks on the endoscopy frame)."""
REPORT_KINDS: tuple[str, ...] = ("ct_report", "endoscopy_report", "diagnosis_report")
LANGUAGES: tuple[str, ...] = ("en", "zh")
VQA_CATEGORIES: tuple[str, ...] = ("lesion", "enhancement", "staging", "localization", "yes_no")

# --- staging (AJCC 8th edition, gastric cancer, pathological) ---------------------------------------

T_CATEGORIES: tuple[str, ...] = ("Tis", "T1a", "T1b", "T2", "T3", "T4a", "T4b")
N_CATEGORIES: tuple[str, ...] = ("N0", "N1", "N2", "N3a", "N3b")
M_CATEGORIES: tuple[str, ...] = ("M0", "M1")
STAGES: tuple[str, ...] = ("0", "IA", "IB", "IIA", "IIB", "IIIA", "IIIB", "IIIC", "IV")
STAGE_GROUPS: tuple[str, ...] = ("I", "II", "III", "IV")
"""The classes of the stage-classification task (Table 5): overall stage I-IV."""

# pTNM stage for M0, rows T1..T4b, columns N0, N1, N2, N3a, N3b (AJCC 8th ed., Table 17.4).
_PTNM_M0 = {
    "T1": ("IA", "IB", "IIA", "IIB", "IIIB"),
    "T2": ("IB", "IIA", "IIB", "IIIA", "IIIB"),
    "T3": ("IIA", "IIB", "IIIA", "IIIB", "IIIC"),
    "T4a": ("IIB", "IIIA", "IIIA", "IIIB", "IIIC"),
    "T4b": ("IIIA", "IIIB", "IIIB", "IIIC", "IIIC"),
}


def _normalise_category(value: str, prefix: str, valid: tuple[str, ...]) -> str:
    # accept "pT3", "ypT3", "cT3", "3", "t4A", "3a" ...
    text = re.sub(r"^(yp|p|c)(?=[TNM])", "", str(value).strip(), flags=re.IGNORECASE)
    if not text.upper().startswith(prefix):
        text = prefix + text
    for v in valid:
        if text.lower() == v.lower():
            return v
    raise ValueError(f"unknown {prefix} category {value!r}; valid: {', '.join(valid)}")


def normalise_tnm(t: str, n: str, m: str) -> tuple[str, str, str]:
    """Canonical spellings of T, N and M (``"pT4A"`` → ``"T4a"``, ``"3a"`` as N → ``"N3a"``)."""
    return (
        _normalise_category(t, "T", T_CATEGORIES),
        _normalise_category(n, "N", N_CATEGORIES),
        _normalise_category(m, "M", M_CATEGORIES),
    )


def ajcc_stage(t: str, n: str, m: str) -> str:
    """AJCC 8th edition pathological stage of gastric cancer from T, N and M (e.g. ``"IIIA"``): M1 is stage IV
    whatever T and N; Tis N0 M0 is stage 0; T1a and T1b stage as T1."""
    t, n, m = normalise_tnm(t, n, m)
    if m == "M1":
        return "IV"
    if t == "Tis":
        if n != "N0":
            raise ValueError(f"Tis with {n} has no AJCC stage group (carcinoma in situ has no nodal spread)")
        return "0"
    row = _PTNM_M0["T1" if t in ("T1a", "T1b") else t]
    return row[N_CATEGORIES.index(n)]


def stage_group(stage: str) -> str | None:
    """Overall group I-IV of a detailed stage (``"IIIB"`` → ``"III"``); stage 0 has none."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; valid: {', '.join(STAGES)}")
    if stage == "0":
        return None
    return stage if stage == "IV" else stage.rstrip("ABC")


# --- the case record --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    """A 3D box on one phase's voxel grid: ``zyx`` = ``(z0, y0, x0, z1, y1, x1)``, end-exclusive."""

    level: str
    phase: str
    zyx: tuple[int, int, int, int, int, int]

    def __post_init__(self) -> None:
        if self.level not in BOX_LEVELS:
            raise ValueError(f"unknown box level {self.level!r}; valid: {', '.join(BOX_LEVELS)}")
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; valid: {', '.join(PHASES)}")
        if len(self.zyx) != 6:
            raise ValueError(f"a box needs 6 coordinates (z0, y0, x0, z1, y1, x1), got {len(self.zyx)}")
        z0, y0, x0, z1, y1, x1 = self.zyx
        if not (z1 > z0 and y1 > y0 and x1 > x0):
            raise ValueError(f"empty or inverted box {self.zyx} (end-exclusive: z1 > z0, y1 > y0, x1 > x0)")

    @property
    def size(self) -> tuple[int, int, int]:
        z0, y0, x0, z1, y1, x1 = self.zyx
        return (z1 - z0, y1 - y0, x1 - x0)

    def inside(self, shape: tuple[int, int, int]) -> bool:
        """Whether the box lies within a volume of ``shape`` = ``(D, H, W)``."""
        z0, y0, x0, z1, y1, x1 = self.zyx
        return min(z0, y0, x0) >= 0 and z1 <= shape[0] and y1 <= shape[1] and x1 <= shape[2]


@dataclass(frozen=True)
class Staging:
    """Pathological T, N, M and the AJCC stage derived from them."""

    t: str
    n: str
    m: str

    @property
    def stage(self) -> str:
        return ajcc_stage(self.t, self.n, self.m)

    @property
    def group(self) -> str | None:
        return stage_group(self.stage)

    @classmethod
    def parse(cls, t: str, n: str, m: str) -> Staging:
        return cls(*normalise_tnm(t, n, m))


@dataclass(frozen=True)
class VQAItem:
    question: str
    answer: str
    category: str

    def __post_init__(self) -> None:
        if self.category not in VQA_CATEGORIES:
            raise ValueError(f"unknown VQA category {self.category!r}; valid: {', '.join(VQA_CATEGORIES)}")


@dataclass
class Case:
    """One patient as a reader finds it on disk: images by reference, everything else in memory. Only the required
    CT phases must be present; :meth:`presence` flags the optional parts, which travel into the shards."""

    case_id: str
    """The case folder's name."""
    source: Path
    phases: dict[str, Path]
    """phase → NIfTI/MHA file or DICOM series folder."""
    organ_masks: dict[str, Path] = field(default_factory=dict)
    tumour_masks: dict[str, Path] = field(default_factory=dict)
    boxes: list[Box] = field(default_factory=list)
    """On the raw voxel grid of the box's own phase."""
    staging: Staging | None = None
    labs: dict[str, Any] = field(default_factory=dict)
    """Catalogue variable name → value as recorded (number, string or None)."""
    reports: dict[str, dict[str, str]] = field(default_factory=dict)
    """language → report kind → text."""
    vqa: dict[str, list[VQAItem]] = field(default_factory=dict)
    """language → items."""
    endoscopy: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys a reader did not recognise, kept verbatim."""
    patient_id: str = ""
    """The patient the case belongs to (splits are per patient); the case id when the data does not say."""

    def __post_init__(self) -> None:
        self.patient_id = self.patient_id or self.case_id

    def presence(self) -> dict[str, bool]:
        """Presence flag of every optional part."""
        return {
            **{f"phase_{p}": p in self.phases for p in PHASES},
            **{f"box_{level}": any(b.level == level for b in self.boxes) for level in BOX_LEVELS},
            "staging": self.staging is not None,
            "labs": bool(self.labs),
            **{f"report_{k}": any(k in r for r in self.reports.values()) for k in REPORT_KINDS},
            "vqa": any(self.vqa.values()),
            "endoscopy": self.endoscopy is not None,
        }


QC_REASONS: tuple[str, ...] = (
    "unreadable",  # a file that cannot be opened or decoded (truncated, corrupt, unreadable DICOM slice)
    "missing_part",  # a required phase or file is absent
    "malformed_annotation",  # JSON that does not parse or lacks a required field
    "nan_values",  # NaN or infinite voxels
    "box_outside_volume",  # a box that does not lie within its phase's volume or the crop
    "misaligned",  # phases too far apart after registration
    "bad_geometry",  # voxel spacing <= 0 or not finite, a direction matrix that is not orthonormal
    "no_anatomy",  # a CT phase without image structure (noise, blank) or unlike the reference phase
    "duplicate_patient",  # one patient id in two case folders
    "preprocessing_failed",  # anything else that went wrong with this case; the message has the details
)
"""Why a case is excluded; every :class:`CaseError` carries one."""


class CaseError(Exception):
    """A problem with one case's input, naming the case, the file, the field and a :data:`QC_REASONS` code."""

    def __init__(
        self,
        case_id: str,
        file: Path | str | None,
        field_name: str | None,
        message: str,
        reason: str = "unreadable",
    ):
        if reason not in QC_REASONS:
            raise ValueError(f"unknown QC reason {reason!r}; valid: {', '.join(QC_REASONS)}")
        self.case_id, self.file, self.field, self.message, self.reason = case_id, file, field_name, message, reason
        # "case <id>: <file>: <field>: <what is wrong>": the same order in the QC report, logs and strict errors
        parts = (f"case {case_id}", str(file) if file else "", repr(field_name) if field_name else "", message)
        super().__init__(": ".join(part for part in parts if part))

    def to_dict(self) -> dict[str, str | None]:
        return {
            "case_id": self.case_id,
            "reason": self.reason,
            "file": str(self.file) if self.file else None,
            "field": self.field,
            "message": self.message,
        }

    def __reduce__(self):  # picklable across Ray workers
        return (type(self), (self.case_id, self.file, self.field, self.message, self.reason))
