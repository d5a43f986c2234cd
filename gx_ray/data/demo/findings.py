"""The ground truth of one procedural demo case, sampled once and then rendered by every modality.

The imaging phantom, the lab table, the endoscopy image, the reports and the VQA items all read the same
:class:`Findings`, so the modalities agree with each other the way a real patient's records do. How
strongly each modality tells the true stage is a parameter (:class:`SignalStrength`): a modality with
strength 0 renders a *decoy* stage drawn independently of the truth, so a sweep run on such a cohort has
a known answer (e.g. only the lab table carries the stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gx_ray.schema import N_CATEGORIES, STAGE_GROUPS, T_CATEGORIES, Staging

# Overall stage mix of a surgical gastric-cancer cohort (roughly the paper's Figure 2A).
STAGE_GROUP_PRIOR = {"I": 0.22, "II": 0.26, "III": 0.40, "IV": 0.12}
MALE_FRACTION = 0.675  # Figure 2A

TUMOUR_LOCATIONS: tuple[str, ...] = ("cardia", "fundus", "body", "angle", "antrum")
TUMOUR_LOCATION_PRIOR = (0.15, 0.05, 0.30, 0.15, 0.35)
CURVATURES: tuple[str, ...] = ("lesser", "greater", "anterior wall", "posterior wall")

# How deep a tumour of each T category reaches into the gastric wall, and its typical long axis (mm).
INVASION_DEPTH = {
    "Tis": "intraepithelial",
    "T1a": "mucosa",
    "T1b": "submucosa",
    "T2": "muscularis propria",
    "T3": "subserosa",
    "T4a": "serosa",
    "T4b": "adjacent organs",
}
TUMOUR_SIZE_MM = {"Tis": 8, "T1a": 12, "T1b": 18, "T2": 28, "T3": 40, "T4a": 52, "T4b": 62}
WALL_THICKNESS_MM = {"Tis": 5, "T1a": 6, "T1b": 8, "T2": 11, "T3": 15, "T4a": 19, "T4b": 22}
NODE_COUNT = {"N0": (0, 0), "N1": (1, 2), "N2": (3, 6), "N3a": (7, 10), "N3b": (11, 15)}
GROSS_TYPES_EARLY = ("0-I", "0-IIa", "0-IIc", "0-III")
GROSS_TYPES_ADVANCED = ("Borrmann I", "Borrmann II", "Borrmann III", "Borrmann IV")


@dataclass(frozen=True)
class SignalStrength:
    """Probability, per case, that a modality shows the true stage rather than a decoy: 1.0 everywhere is a faithful
    cohort; ``SignalStrength(image=0, endoscopy=0, table=1, text=0)`` plants the stage in the lab table alone."""

    image: float = 1.0
    table: float = 1.0
    endoscopy: float = 1.0
    text: float = 1.0

    def __post_init__(self) -> None:
        for name in ("image", "table", "endoscopy", "text"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"signal strength {name}={value} must lie in [0, 1]")


@dataclass(frozen=True)
class Findings:
    """Everything the modalities of one demo case render. ``*_staging`` is the stage each modality shows."""

    case_id: str
    staging: Staging
    """The truth: the label of the stage-classification task."""
    imaging_staging: Staging
    table_staging: Staging
    endoscopy_staging: Staging
    text_staging: Staging
    sex: str
    age: int
    tumour_location: str
    tumour_curvature: str
    tumour_size_mm: float
    """Long axis, from ``imaging_staging``."""
    wall_thickness_mm: float
    invasion_depth: str
    gross_type: str
    arterial_hyperenhancement: bool
    node_short_axes_mm: tuple[float, ...] = field(default_factory=tuple)
    liver_met_sizes_mm: tuple[float, ...] = field(default_factory=tuple)
    ascites: bool = False

    @property
    def n_nodes(self) -> int:
        return len(self.node_short_axes_mm)

    @property
    def n_liver_mets(self) -> int:
        return len(self.liver_met_sizes_mm)


def sample_staging(rng: np.random.Generator) -> Staging:
    """A T, N, M triple whose overall group follows :data:`STAGE_GROUP_PRIOR` (never stage 0)."""
    group = rng.choice(STAGE_GROUPS, p=[STAGE_GROUP_PRIOR[g] for g in STAGE_GROUPS])
    while True:  # rejection sampling over the pTNM grid: simple and exact
        t = rng.choice(T_CATEGORIES[1:])
        n = rng.choice(N_CATEGORIES)
        m = "M1" if group == "IV" else "M0"
        staging = Staging(str(t), str(n), m)
        if staging.group == group:
            return staging


def sample_findings(
    rng: np.random.Generator, case_id: str, staging: Staging, signal: SignalStrength = SignalStrength()
) -> Findings:
    """Sample one case's findings; each modality shows ``staging`` with its signal probability."""

    def shown(strength: float) -> Staging:
        return staging if rng.random() < strength else sample_staging(rng)

    imaging, table, endoscopy, text = (shown(s) for s in (signal.image, signal.table, signal.endoscopy, signal.text))
    t = imaging.t
    jitter = float(rng.uniform(0.8, 1.25))
    lo, hi = NODE_COUNT[imaging.n]
    n_nodes = int(rng.integers(lo, hi + 1))
    nodes = tuple(float(rng.uniform(8, 16 if imaging.n != "N0" else 8)) for _ in range(n_nodes))
    mets = tuple(float(rng.uniform(8, 25)) for _ in range(int(rng.integers(1, 4)))) if imaging.m == "M1" else ()
    early = t in ("Tis", "T1a", "T1b")
    return Findings(
        case_id=case_id,
        staging=staging,
        imaging_staging=imaging,
        table_staging=table,
        endoscopy_staging=endoscopy,
        text_staging=text,
        sex="male" if rng.random() < MALE_FRACTION else "female",
        age=int(np.clip(rng.normal(62, 10), 28, 89)),
        tumour_location=str(rng.choice(TUMOUR_LOCATIONS, p=TUMOUR_LOCATION_PRIOR)),
        tumour_curvature=str(rng.choice(CURVATURES)),
        tumour_size_mm=round(TUMOUR_SIZE_MM[t] * jitter, 1),
        wall_thickness_mm=round(WALL_THICKNESS_MM[t] * jitter, 1),
        invasion_depth=INVASION_DEPTH[t],
        gross_type=str(rng.choice(GROSS_TYPES_EARLY if early else GROSS_TYPES_ADVANCED)),
        arterial_hyperenhancement=bool(rng.random() < (0.4 if early else 0.75)),
        node_short_axes_mm=nodes,
        liver_met_sizes_mm=mets,
        ascites=bool(imaging.m == "M1" and rng.random() < 0.5),
    )
