"""Demo lab/EHR values: complete, deterministic, consistent with the case; inputs see the stage only via the table."""

import dataclasses
import datetime as dt
import json

import numpy as np
import pytest

from gx_ray.data.catalogue import load_catalogue
from gx_ray.data.demo.clinical import LAB_GROUPS, POSITIVE_NODES, sample_clinical
from gx_ray.data.demo.findings import SignalStrength, sample_findings, sample_staging
from gx_ray.schema import Staging

MARKERS = ("cea", "ca19_9", "ca72_4", "ca125")
CATALOGUE = load_catalogue()
INPUTS = [v.name for v in CATALOGUE.model_inputs()]


FAITHFUL = SignalStrength()


def clinical_cases(seed: int, n: int, signal: SignalStrength = FAITHFUL, staging: Staging | None = None):
    """``n`` demo cases drawn with ``seed`` (at ``staging``, or each at a stage of the prior), each as its findings and
    its clinical values."""
    rng = np.random.default_rng(seed)
    cohort = []
    for i in range(n):
        findings = sample_findings(rng, f"case-{i:04d}", staging or sample_staging(rng), signal)
        cohort.append((findings, sample_clinical(rng, findings)))
    return cohort


def _abnormal_markers(findings, values) -> int:
    return sum(f.variable.name in MARKERS for f in CATALOGUE.abnormal_findings(values, findings.sex))


def test_every_variable_gets_a_valid_value():
    for findings, values in clinical_cases(0, 60, SignalStrength(table=0.5, image=0.5)):
        assert list(values) == list(CATALOGUE.names)
        for v in CATALOGUE:
            value = values[v.name]
            if value is None:
                assert v.group in LAB_GROUPS and v.kind == "numeric", v.name  # only labs go missing
            elif v.kind == "numeric":
                assert isinstance(value, int | float) and np.isfinite(value) and value >= 0, (v.name, value)
            elif v.kind == "categorical":
                assert value in v.categories, (v.name, value)
            elif v.kind == "date":
                dt.date.fromisoformat(value)
            else:
                assert isinstance(value, str) and value, v.name
        assert (values["sex"], values["age"]) == (findings.sex, findings.age)


def test_identifiers_are_pseudonyms_of_the_case_id():
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(2)
    findings = sample_findings(rng_a, "case-7", sample_staging(rng_a))
    a, b = sample_clinical(rng_a, findings), sample_clinical(rng_b, findings)
    other = sample_clinical(rng_b, dataclasses.replace(findings, case_id="case-8"))
    assert a["hospital_id"].startswith("HID-") and "case-7" not in a["hospital_id"]
    for name in ("hospital_id", "patient_name", "id_number", "pathology_id"):
        assert a[name] == b[name] != other[name]


def test_same_seed_gives_identical_values():
    first = json.dumps([values for _, values in clinical_cases(3, 10)])
    assert first == json.dumps([values for _, values in clinical_cases(3, 10)])
    assert first != json.dumps([values for _, values in clinical_cases(4, 10)])


def test_missing_rate_applies_to_labs_only():
    labs = [v.name for v in CATALOGUE if v.group in LAB_GROUPS and v.kind == "numeric"]
    rng = np.random.default_rng(5)
    missing = []
    for i in range(40):
        findings = sample_findings(rng, f"c{i}", sample_staging(rng))
        values = sample_clinical(rng, findings, missing_rate=0.5)
        missing += [values[name] is None for name in labs]
        assert all(values[name] is not None for name in CATALOGUE.names if name not in labs)
        assert None not in sample_clinical(rng, findings, missing_rate=0.0).values()
    assert 0.4 < np.mean(missing) < 0.6
    with pytest.raises(ValueError, match="missing_rate"):
        sample_clinical(rng, findings, missing_rate=1.5)


def test_post_diagnosis_variables_record_the_truth():
    decoys_everywhere = SignalStrength(image=0.0, table=0.0, endoscopy=0.0, text=0.0)
    for findings, values in clinical_cases(6, 80, decoys_everywhere):
        truth = findings.staging
        assert (values["t_stage"], values["n_stage"], values["m_stage"]) == (truth.t, truth.n, truth.m)
        assert values["overall_stage"] == truth.stage
        low, high = POSITIVE_NODES[truth.n]
        assert low <= values["positive_lymph_nodes"] <= high
        assert values["positive_lymph_nodes"] <= values["dissected_lymph_nodes"]
        distant = "yes" in (values["liver_metastasis"], values["peritoneal_seeding"])
        assert distant == (truth.m == "M1")
        assert (values["serosal_invasion"] == "yes") == (truth.t in ("T4a", "T4b"))
        assert (values["perigastric_lymph_nodes"] == "positive") == (truth.n != "N0")


def test_dates_and_body_measures_are_consistent():
    for _, values in clinical_cases(7, 30):
        day = {name: dt.date.fromisoformat(values[name]) for name in CATALOGUE.names if CATALOGUE[name].kind == "date"}
        assert day["endoscopy_date"] < day["admission_date"] <= day["cbc_test_date"] < day["surgery_date"]
        assert day["surgery_date"] < day["discharge_date"]
        assert (day["discharge_date"] - day["admission_date"]).days == values["total_hospital_stay"]
        assert (day["discharge_date"] - day["surgery_date"]).days == values["postoperative_stay"]
        assert values["bmi"] == pytest.approx(values["weight"] / (values["height"] / 100) ** 2, abs=0.06)


def test_tumour_markers_rise_with_the_table_stage():
    stages = [
        Staging("T1b", "N0", "M0"),
        Staging("T2", "N1", "M0"),
        Staging("T3", "N2", "M0"),
        Staging("T3", "N1", "M1"),
    ]
    assert [s.group for s in stages] == ["I", "II", "III", "IV"]
    counts, any_raised, low_hb = [], [], []
    for staging in stages:
        cohort = clinical_cases(8, 200, staging=staging)
        per_case = [_abnormal_markers(f, v) for f, v in cohort]
        counts.append(np.mean(per_case))
        any_raised.append(np.mean([c > 0 for c in per_case]))
        low_hb.append(np.mean([v["haemoglobin"] is not None and v["haemoglobin"] < 110 for _, v in cohort]))
    assert counts == sorted(counts) and len(set(counts)) == 4  # strictly monotone in stage
    assert any_raised[0] < 0.3 and any_raised[3] > 0.75
    assert low_hb[3] > low_hb[0] + 0.2


def _marker_rate_by_true_stage(signal: SignalStrength) -> float:
    """Abnormal-marker rate of truly advanced (III-IV) minus truly early (I-II) cases."""
    cohort = clinical_cases(9, 500, signal)
    raised = np.array([_abnormal_markers(f, v) > 0 for f, v in cohort])
    advanced = np.array([f.staging.group in ("III", "IV") for f, _ in cohort])
    return raised[advanced].mean() - raised[~advanced].mean()


def test_without_table_signal_markers_do_not_depend_on_the_true_stage():
    assert abs(_marker_rate_by_true_stage(SignalStrength(table=0.0))) < 0.1
    assert _marker_rate_by_true_stage(SignalStrength(table=1.0)) > 0.25  # the check has power


def test_inputs_see_only_the_table_stage():
    """Changing everything about the case except the table's stage (and stage-free facts) leaves every input alone."""
    rng = np.random.default_rng(10)
    for i in range(20):
        findings = sample_findings(rng, f"c{i}", sample_staging(rng), SignalStrength(table=0.0))
        other = Staging("T4b", "N3b", "M1") if findings.staging.group != "IV" else Staging("T1a", "N0", "M0")
        altered = dataclasses.replace(
            findings,
            staging=other,
            imaging_staging=other,
            endoscopy_staging=other,
            text_staging=other,
            tumour_size_mm=findings.tumour_size_mm * 2,
            wall_thickness_mm=findings.wall_thickness_mm * 2,
            gross_type="Borrmann IV",
            node_short_axes_mm=(12.0,) * 9,
            liver_met_sizes_mm=(20.0,),
            ascites=not findings.ascites,
        )
        seed = int(rng.integers(2**32))
        original = sample_clinical(np.random.default_rng(seed), findings)
        changed = sample_clinical(np.random.default_rng(seed), altered)
        assert {n: original[n] for n in INPUTS} == {n: changed[n] for n in INPUTS}
        assert changed["overall_stage"] == other.stage != original["overall_stage"]
