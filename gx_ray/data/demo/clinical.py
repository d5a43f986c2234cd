"""Lab and EHR values of one demo patient: a value for every variable of the clinical catalogue.

What a model may see (pre-diagnosis variables) is drawn from ``findings.table_staging`` and stage-free facts only,
before anything that reads the truth, so a cohort whose table signal is 0 has labs independent of the true stage; the
higher the table's stage, the more often markers are raised and haemoglobin, albumin, prealbumin and protein low.
Post-diagnosis variables record the truth, ``findings.staging``: labels, never inputs. Identifiers are pseudonyms
derived from the case id; dates are ISO strings.
"""

from __future__ import annotations

import datetime as dt
import hashlib

import numpy as np

from gx_ray.data.catalogue import load_catalogue
from gx_ray.data.demo.findings import (
    GROSS_TYPES_ADVANCED,
    GROSS_TYPES_EARLY,
    TUMOUR_SIZE_MM,
    WALL_THICKNESS_MM,
    Findings,
)
from gx_ray.schema import STAGE_GROUPS, Staging

LAB_GROUPS: tuple[str, ...] = ("cbc", "biochemistry", "tumour_markers")
"""Groups whose numeric values go missing at ``missing_rate``."""

EARLY_T = ("Tis", "T1a", "T1b")

# Probability that a marker is raised by the tumour at table stage I and at stage IV (linear in between).
# Marker positivity in gastric cancer is low in early disease and reaches about half in stage IV.
MARKER_RAISED = {"cea": (0.04, 0.55), "ca19_9": (0.04, 0.50), "ca72_4": (0.05, 0.45), "ca125": (0.02, 0.35)}
AFP_RAISED = (0.01, 0.06)  # AFP-producing gastric cancer is rare
# Probability of a low value (bleeding, malnutrition) at table stage I and IV.
LOW_AT_STAGE = {"haemoglobin": (0.12, 0.60), "albumin": (0.08, 0.50), "prealbumin": (0.10, 0.55)}
LOW_TOTAL_PROTEIN = (0.05, 0.35)

# Pathological N categories by count of positive nodes (AJCC 8th edition); N3b has no upper bound.
POSITIVE_NODES = {"N0": (0, 0), "N1": (1, 2), "N2": (3, 6), "N3a": (7, 15), "N3b": (16, 30)}

ENDOSCOPIC_APPEARANCE = {
    "0-I": "protruding lesion",
    "0-IIa": "slightly elevated lesion",
    "0-IIc": "slightly depressed lesion with irregular margin",
    "0-III": "excavated lesion",
    "Borrmann I": "polypoid mass",
    "Borrmann II": "ulcerated mass with sharply raised margins",
    "Borrmann III": "ulcerated mass with infiltrative margins",
    "Borrmann IV": "diffuse wall thickening with rigid, thickened folds",
}
BIOPSY_EARLY = (0.30, 0.30, 0.25, 0.10, 0.05)  # over the catalogue's biopsy categories, in their order
BIOPSY_ADVANCED = (0.03, 0.10, 0.30, 0.40, 0.17)
PAST_CONDITIONS = ("hypertension", "type 2 diabetes", "coronary heart disease", "hepatitis B carrier", "appendectomy")

RESECTION_BY_LOCATION = {  # (distal, proximal, total) gastrectomy
    "cardia": (0.0, 0.4, 0.6),
    "fundus": (0.0, 0.4, 0.6),
    "body": (0.3, 0.0, 0.7),
    "angle": (0.85, 0.0, 0.15),
    "antrum": (0.85, 0.0, 0.15),
}
RECONSTRUCTION = {  # (Billroth I, Billroth II, Roux-en-Y, double tract, esophagogastrostomy)
    "distal gastrectomy": (0.3, 0.4, 0.3, 0.0, 0.0),
    "proximal gastrectomy": (0.0, 0.0, 0.0, 0.6, 0.4),
    "total gastrectomy": (0.0, 0.0, 1.0, 0.0, 0.0),
}
CLAVIEN_DINDO = {"I": 0.25, "II": 0.45, "IIIa": 0.13, "IIIb": 0.08, "IVa": 0.05, "IVb": 0.02, "V": 0.02}
EXTRA_STAY_DAYS = {"none": 0, "I": 1, "II": 4, "IIIa": 8, "IIIb": 12, "IVa": 18, "IVb": 22, "V": 10}
INTERVENTION = {
    "none": "none",
    "I": "observation",
    "II": "medication",
    "IIIa": "percutaneous or endoscopic intervention",
    "IIIb": "reoperation",
    "IVa": "intensive care",
    "IVb": "intensive care",
    "V": "intensive care",
}
COMPLICATIONS = {
    "anastomotic leak": 0.15,
    "pneumonia": 0.25,
    "intra-abdominal infection": 0.20,
    "bleeding": 0.10,
    "ileus": 0.10,
    "wound infection": 0.12,
    "other": 0.08,
}


def _stage_level(staging: Staging) -> float:
    """0 for stage I (or 0), 1 for stage IV, evenly in between: how advanced a stage looks."""
    group = staging.group
    return 0.0 if group is None else STAGE_GROUPS.index(group) / (len(STAGE_GROUPS) - 1)


def _lerp(at_stage_i_and_iv: tuple[float, float], level: float) -> float:
    low, high = at_stage_i_and_iv
    return low + (high - low) * level


def _pick(rng: np.random.Generator, options, p=None) -> str:
    return str(rng.choice(list(options), p=p))


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _round(value: float, decimals: int) -> float | int:
    return int(round(value)) if decimals == 0 else round(float(value), decimals)


def _pseudonym(prefix: str, case_id: str, field: str) -> str:
    digest = hashlib.sha256(f"{field}:{case_id}".encode()).hexdigest()[:10].upper()
    return f"{prefix}-{digest}"


def _identifiers(case_id: str) -> dict[str, object]:
    prefixes = {
        "hospital_id": "HID",
        "patient_name": "PT",
        "bed_number": "BED",
        "id_number": "IDN",
        "contact_number": "TEL",
        "imaging_id": "CT",
        "pathology_id": "PATH",
    }
    return {name: _pseudonym(prefix, case_id, name) for name, prefix in prefixes.items()}


def _within(rng: np.random.Generator, low: float, high: float) -> float:
    """A healthy value: normal, centred in the range, about 95% inside it."""
    return max(float(rng.normal((low + high) / 2, (high - low) / 4)), 0.1 * low)


def _log_within(rng: np.random.Generator, low: float, high: float) -> float:
    """A healthy value of a right-skewed analyte (enzymes, bilirubin): log-normal, about 95% inside the range."""
    return float(rng.lognormal(np.log(np.sqrt(low * high)), np.log(high / low) / 4))


def _marker(rng: np.random.Generator, upper: float, p_raised: float, level: float) -> float:
    if rng.random() < p_raised:  # the tumour secretes it: above the limit, further in advanced disease
        return upper * (1 + float(rng.lognormal(np.log(0.6 + 2.4 * level), 0.7)))
    return upper * float(rng.lognormal(np.log(0.35), 0.4))


def _low_or_healthy(rng: np.random.Generator, low: float, high: float, p_low: float, depth: float) -> float:
    if rng.random() < p_low:
        return low * float(rng.uniform(depth, 0.97))
    return _within(rng, low, high)


def _labs(rng: np.random.Generator, sex: str, level: float) -> dict[str, object]:
    catalogue = load_catalogue()

    def ref(name: str) -> tuple[float, float]:
        return catalogue.reference_range(name, sex)

    def ulimit(name: str) -> float:
        return ref(name)[1]

    wbc = max(float(rng.normal(6.3, 1.5)), 1.0)
    neutrophil_pct = float(np.clip(rng.normal(60, 8), 30, 90))
    lymphocyte_pct = float(np.clip(rng.normal(30, 7), 5, 95 - neutrophil_pct))
    labs = {
        "wbc": _round(wbc, 2),
        "neutrophil_count": _round(wbc * neutrophil_pct / 100, 2),
        "neutrophil_ratio": _round(neutrophil_pct, 1),
        "lymphocyte_count": _round(wbc * lymphocyte_pct / 100, 2),
        "lymphocyte_ratio": _round(lymphocyte_pct, 1),
        "haemoglobin": _round(
            _low_or_healthy(rng, *ref("haemoglobin"), _lerp(LOW_AT_STAGE["haemoglobin"], level), 0.55), 0
        ),
        "platelet_count": _round(_within(rng, *ref("platelet_count")), 0),
        "fasting_glucose": _round(rng.lognormal(np.log(5.0), 0.12), 2),
        "prealbumin": _round(
            _low_or_healthy(rng, *ref("prealbumin"), _lerp(LOW_AT_STAGE["prealbumin"], level), 0.45), 0
        ),
        "alt": _round(_log_within(rng, *ref("alt")), 0),
        "ast": _round(_log_within(rng, *ref("ast")), 0),
        "total_protein": _round(_low_or_healthy(rng, *ref("total_protein"), _lerp(LOW_TOTAL_PROTEIN, level), 0.8), 1),
        "albumin": _round(_low_or_healthy(rng, *ref("albumin"), _lerp(LOW_AT_STAGE["albumin"], level), 0.7), 1),
        "total_bilirubin": _round(_log_within(rng, *ref("total_bilirubin")), 1),
        "direct_bilirubin": _round(rng.lognormal(np.log(2.5), 0.4), 1),
        "creatinine": _round(_within(rng, *ref("creatinine")), 0),
        "urea": _round(_within(rng, *ref("urea")), 2),
        "afp": _round(_marker(rng, ulimit("afp"), _lerp(AFP_RAISED, level), level), 2),
    }
    for name, raised in MARKER_RAISED.items():
        labs[name] = _round(_marker(rng, ulimit(name), _lerp(raised, level), level), 2)
    return labs


def _patient(rng: np.random.Generator, findings: Findings, level: float) -> dict[str, object]:
    """Demographics, history and admission findings."""
    male = findings.sex == "male"
    height = float(rng.normal(168, 6) if male else rng.normal(157, 5.5))
    bmi = float(np.clip(rng.normal(22.8 - 1.5 * level, 2.8), 15, 35))  # advanced disease wastes
    weight = round(bmi * (height / 100) ** 2, 1)
    p_poor, p_fair = _lerp((0.03, 0.25), level), _lerp((0.17, 0.40), level)
    n_conditions = int(rng.choice(3, p=(0.55, 0.3, 0.15)))
    history = rng.choice(PAST_CONDITIONS, size=n_conditions, replace=False)
    retired = 0.45 if findings.age >= 60 else 0.05
    working = (1 - retired) / 7
    occupation_p = (working, working, retired, working, working, working, working, working)
    occupations = load_catalogue()["occupation"].categories
    return {
        "sex": findings.sex,
        "age": findings.age,
        "occupation": _pick(rng, occupations, p=occupation_p),
        "education_level": _pick(rng, load_catalogue()["education_level"].categories, p=(0.35, 0.3, 0.2, 0.15)),
        "marital_status": _pick(rng, ("married", "single", "divorced", "widowed"), p=(0.85, 0.03, 0.04, 0.08)),
        "ethnicity": _pick(rng, ("Han", "other"), p=(0.95, 0.05)),
        "admission_method": _pick(rng, ("outpatient", "emergency", "transfer"), p=(0.88, 0.05, 0.07)),
        "insurance_status": _pick(
            rng, ("urban employee", "urban-rural resident", "self-pay", "commercial"), p=(0.4, 0.45, 0.1, 0.05)
        ),
        "past_medical_history": "; ".join(str(c) for c in history) if n_conditions else "none",
        "smoking_status": _pick(
            rng, ("never", "former", "current"), p=(0.45, 0.2, 0.35) if male else (0.92, 0.03, 0.05)
        ),
        "drinking_status": _pick(
            rng, ("never", "former", "current"), p=(0.5, 0.15, 0.35) if male else (0.9, 0.03, 0.07)
        ),
        "admission_temperature": _round(rng.normal(36.5, 0.2), 1),
        "admission_pulse": _round(rng.normal(78, 9), 0),
        "admission_respiration": _round(rng.normal(18, 1.5), 0),
        "admission_systolic_bp": _round(rng.normal(127, 15), 0),
        "admission_diastolic_bp": _round(rng.normal(78, 9), 0),
        "height": round(height, 1),
        "weight": weight,
        "bmi": round(weight / (height / 100) ** 2, 1),
        "general_condition": _pick(rng, ("good", "fair", "poor"), p=(1 - p_poor - p_fair, p_fair, p_poor)),
        "weight_loss": _yes(rng.random() < _lerp((0.15, 0.60), level)),
        "reduced_food_intake": _yes(rng.random() < _lerp((0.10, 0.50), level)),
    }


def _endoscopy(rng: np.random.Generator, findings: Findings) -> dict[str, object]:
    """What the endoscopist records before surgery: the table's stage and the (stage-free) tumour site only."""
    t = findings.table_staging.t
    gross = _pick(rng, GROSS_TYPES_EARLY if t in EARLY_T else GROSS_TYPES_ADVANCED)
    side = findings.tumour_curvature + (" curvature" if findings.tumour_curvature in ("lesser", "greater") else "")
    biopsy = load_catalogue()["endoscopy_biopsy_pathology"].categories
    location = findings.tumour_location
    return {
        "endoscopy_tumour_location": findings.tumour_location,
        "endoscopy_tumour_size": round(TUMOUR_SIZE_MM[t] * float(rng.uniform(0.75, 1.3)), 1),
        "endoscopy_gross_type": gross,
        "endoscopy_biopsy_pathology": _pick(rng, biopsy, p=BIOPSY_EARLY if t in EARLY_T else BIOPSY_ADVANCED),
        "endoscopy_appearance": f"{ENDOSCOPIC_APPEARANCE[gross]} in the gastric {findings.tumour_location}, {side}",
        # the CT report proper is rendered by the report modality; this line says nothing about the stage
        "ct_description": f"Multiphase contrast-enhanced CT of the upper abdomen; lesion in the gastric {location}.",
    }


def _pathology(rng: np.random.Generator, findings: Findings) -> dict[str, object]:
    """The resected specimen: records the true stage."""
    truth, imaging = findings.staging, findings.imaging_staging
    level = _stage_level(truth)
    # reuse the case's size jitter so pathology matches the phantom wherever imaging shows the true T
    jitter = findings.tumour_size_mm / TUMOUR_SIZE_MM[imaging.t]
    long_axis = round(TUMOUR_SIZE_MM[truth.t] * jitter, 1)
    early = truth.t in EARLY_T
    if early == (imaging.t in EARLY_T):
        gross = findings.gross_type
    else:
        gross = _pick(rng, GROSS_TYPES_EARLY if early else GROSS_TYPES_ADVANCED)
    if truth.m == "M1":
        liver = findings.n_liver_mets > 0 if imaging.m == "M1" else bool(rng.random() < 0.5)
        peritoneal = not liver or bool(rng.random() < 0.3)  # M1 needs at least one distant site
    else:
        liver = peritoneal = False
    ascites = findings.ascites if imaging.m == truth.m else bool(truth.m == "M1" and rng.random() < 0.5)
    p_poor = _lerp((0.30, 0.62), level)
    grade_p = (0.3 * (0.97 - p_poor), 0.7 * (0.97 - p_poor), p_poor, 0.03)
    proximal_positive = bool(rng.random() < _lerp((0.01, 0.08), level))
    distal_positive = bool(rng.random() < _lerp((0.01, 0.05), level))
    lo, hi = POSITIVE_NODES[truth.n]
    positive_nodes = int(rng.integers(lo, hi + 1))
    return {
        "tumour_location": findings.tumour_location,
        "max_tumour_diameter": long_axis,
        "serosal_invasion": _yes(truth.t in ("T4a", "T4b")),
        "gross_tumour_type": gross,
        "linitis_plastica": _yes(gross == "Borrmann IV"),
        "perigastric_lymph_nodes": "negative" if truth.n == "N0" else "positive",
        "liver_metastasis": _yes(liver),
        "adjacent_organ_invasion": _yes(truth.t == "T4b"),
        "peritoneal_seeding": _yes(peritoneal),
        "ascites": _yes(ascites),
        "tumour_long_axis": long_axis,
        "tumour_short_axis": round(long_axis * float(rng.uniform(0.5, 0.9)), 1),
        "tumour_height": round(WALL_THICKNESS_MM[truth.t] * jitter * float(rng.uniform(0.8, 1.1)), 1),
        "histologic_grade": _pick(rng, ("well", "moderate", "poor", "undifferentiated"), p=grade_p),
        "additional_histologic_type": _pick(
            rng, ("none", "signet-ring cell", "mucinous", "papillary"), p=(0.75, 0.15, 0.07, 0.03)
        ),
        "proximal_margin_distance": 0.0 if proximal_positive else round(float(rng.lognormal(np.log(35), 0.5)), 1),
        "distal_margin_distance": 0.0 if distal_positive else round(float(rng.lognormal(np.log(50), 0.5)), 1),
        "proximal_margin_status": "positive" if proximal_positive else "negative",
        "distal_margin_status": "positive" if distal_positive else "negative",
        "perineural_invasion": _yes(rng.random() < _lerp((0.10, 0.70), level)),
        "vascular_tumour_thrombus": _yes(rng.random() < _lerp((0.10, 0.70), level)),
        "t_stage": truth.t,
        "n_stage": truth.n,
        "m_stage": truth.m,
        "overall_stage": truth.stage,
        "positive_lymph_nodes": positive_nodes,
        "dissected_lymph_nodes": positive_nodes + int(rng.integers(12, 35)),
    }


def _molecular(rng: np.random.Generator, findings: Findings) -> dict[str, object]:
    level = _stage_level(findings.staging)
    deficient = bool(rng.random() < 0.08)
    lost = ("mlh1", "pms2") if rng.random() < 0.8 else ("msh2", "msh6")  # MMR proteins are lost in pairs
    return {
        "ki67": _round(np.clip(rng.normal(45 + 15 * level, 20), 1, 95), 0),
        "her2_status": _pick(rng, ("0", "1+", "2+", "3+"), p=(0.45, 0.3, 0.15, 0.1)),
        "cldn_status": "positive" if rng.random() < 0.4 else "negative",
        **{p: "lost" if deficient and p in lost else "retained" for p in ("mlh1", "pms2", "msh2", "msh6")},
        "eber": "positive" if rng.random() < 0.07 else "negative",
        "pdl1_score": 0 if rng.random() < 0.35 else _round(min(rng.lognormal(np.log(5), 1.0), 100), 0),
        "mmr_status": "dMMR" if deficient else "pMMR",
    }


def _surgery_and_outcomes(
    rng: np.random.Generator, findings: Findings, admission: dt.date, surgery: dt.date
) -> dict[str, object]:
    level = _stage_level(findings.staging)
    resection = _pick(
        rng, load_catalogue()["resection_range"].categories, p=RESECTION_BY_LOCATION[findings.tumour_location]
    )
    reconstruction = _pick(rng, load_catalogue()["gi_reconstruction"].categories, p=RECONSTRUCTION[resection])
    complicated = bool(rng.random() < _lerp((0.15, 0.30), level))
    severity = _pick(rng, CLAVIEN_DINDO, p=list(CLAVIEN_DINDO.values())) if complicated else "none"
    category = _pick(rng, COMPLICATIONS, p=list(COMPLICATIONS.values())) if complicated else "none"
    intervention = INTERVENTION[severity]
    postoperative_stay = int(round(rng.lognormal(np.log(8), 0.2))) + EXTRA_STAY_DAYS[severity]
    fever = bool(rng.random() < (0.6 if complicated else 0.2))
    discharge = surgery + dt.timedelta(days=postoperative_stay)
    cost = rng.lognormal(np.log(60000), 0.15) + 2500 * postoperative_stay + 15000 * (resection == "total gastrectomy")
    return {
        "surgery_date": surgery.isoformat(),
        "surgery_date_deid": surgery.isoformat(),
        "resection_range": resection,
        "gi_reconstruction": reconstruction,
        "chief_surgeon": f"SURG-{int(rng.integers(1, 13)):02d}",  # a small team operates on every patient
        "discharge_date": discharge.isoformat(),
        "hospitalisation_cost": round(float(cost), 2),
        "complication_severity": severity,
        "secondary_surgery": _yes(severity == "IIIb" or (severity in ("IVa", "IVb") and rng.random() < 0.5)),
        "complication_occurrence": _yes(complicated),
        "severe_complication": _yes(severity in ("IIIa", "IIIb", "IVa", "IVb", "V")),
        "total_hospital_stay": (discharge - admission).days,
        "postoperative_stay": postoperative_stay,
        "postoperative_fever": _yes(fever),
        "fever_days": int(rng.integers(1, 6)) if fever else 0,
        "complication_category": category,
        "intervention": intervention,
        "complication_notes": (
            f"Clavien-Dindo grade {severity} {category}; {intervention}."
            if complicated
            else "No postoperative complication."
        ),
    }


def sample_clinical(rng: np.random.Generator, findings: Findings, missing_rate: float = 0.05) -> dict[str, object]:
    """A value (or ``None`` when missing) for every catalogue variable of one demo patient, in catalogue order.

    Numeric lab values (CBC, biochemistry, tumour markers) go missing independently at ``missing_rate``.
    """
    if not 0.0 <= missing_rate <= 1.0:
        raise ValueError(f"missing_rate={missing_rate} must lie in [0, 1]")
    catalogue = load_catalogue()
    level = _stage_level(findings.table_staging)
    values: dict[str, object] = _identifiers(findings.case_id)

    # Everything up to the missing mask reads only the table's stage and stage-free facts; drawing it before
    # anything that reads the truth keeps the truth out of the random stream these values consume too.
    admission = dt.date(2016, 1, 1) + dt.timedelta(days=int(rng.integers(0, 8 * 365)))
    surgery = admission + dt.timedelta(days=int(rng.integers(3, 11)))
    values["admission_date"] = admission.isoformat()
    values["endoscopy_date"] = (admission - dt.timedelta(days=int(rng.integers(3, 31)))).isoformat()
    for name in ("cbc_test_date", "biochemistry_test_date", "tumour_marker_test_date"):
        values[name] = (admission + dt.timedelta(days=int(rng.integers(0, 3)))).isoformat()
    values.update(_patient(rng, findings, level))
    values.update(_labs(rng, findings.sex, level))
    values.update(_endoscopy(rng, findings))
    labs = [v.name for v in catalogue if v.group in LAB_GROUPS and v.kind == "numeric"]
    for name, missing in zip(labs, rng.random(len(labs)) < missing_rate, strict=True):
        if missing:
            values[name] = None

    values.update(_pathology(rng, findings))
    values.update(_molecular(rng, findings))
    values.update(_surgery_and_outcomes(rng, findings, admission, surgery))

    if set(values) != set(catalogue.names):
        raise RuntimeError(
            f"demo clinical values do not match the catalogue: missing {sorted(set(catalogue.names) - set(values))}, "
            f"unknown {sorted(set(values) - set(catalogue.names))}"
        )
    return {name: values[name] for name in catalogue.names}
