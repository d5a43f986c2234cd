"""The clinical-variable catalogue (Table 8): completeness, sound reference ranges, leakage rule, abnormal values."""

import dataclasses
import math
import re
from collections import Counter

import pytest

from gx_ray.data.catalogue import Catalogue, describe_abnormal, load_catalogue
from gx_ray.schema import M_CATEGORIES, N_CATEGORIES, STAGES, T_CATEGORIES

# Items Table 8 prints under each heading (two per line); 117 in all, though its caption says 134.
TABLE8_ITEMS_PER_SECTION = {
    "Demographics": 8,
    "CBC": 8,
    "Biochemistry": 10,
    "Tumor Markers": 8,
    "Surgery Details": 10,
    "Surgical and Admission Info": 24,
    "Tumor Anatomy and Pathology": 22,
    "Staging and Lymph Nodes": 6,
    "Molecular and IHC": 10,
    "Complications and Outcomes": 11,
}


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return load_catalogue()


def test_catalogue_lists_every_table8_item_once(catalogue):
    assert len(catalogue) == 117 == sum(TABLE8_ITEMS_PER_SECTION.values())
    assert Counter(v.section for v in catalogue) == TABLE8_ITEMS_PER_SECTION
    assert len(set(catalogue.names)) == len(catalogue)
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in catalogue.names)
    assert load_catalogue() is catalogue  # cached


def test_de_identified_items_are_the_ones_table8_marks(catalogue):
    deidentified = {v.name for v in catalogue if v.deidentified}
    assert len(deidentified) == 12
    assert {"hospital_id", "patient_name", "age", "id_number", "contact_number", "pathology_id"} <= deidentified


def test_every_lab_has_a_sound_reference_range(catalogue):
    labs = [v for v in catalogue if v.group in ("cbc", "biochemistry", "tumour_markers") and v.kind == "numeric"]
    assert len(labs) == 7 + 10 + 5
    for v in catalogue.numeric_inputs():
        for sex in ("male", "female", None):
            low, high = catalogue.reference_range(v.name, sex)
            if v in labs:
                assert high is not None, v.name
            if low is not None and high is not None:
                assert low < high, (v.name, sex)


def test_tumour_markers_have_only_an_upper_limit(catalogue):
    for name in ("afp", "cea", "ca125", "ca72_4", "ca19_9"):
        assert catalogue[name].ref_low is None and catalogue[name].ref_high > 0


def test_sex_specific_ranges_differ_between_sexes(catalogue):
    sex_specific = {v.name for v in catalogue if v.has_sex_specific_range}
    assert {"haemoglobin", "creatinine"} <= sex_specific
    for name in sex_specific:
        assert catalogue.reference_range(name, "male") != catalogue.reference_range(name, "female"), name
    assert catalogue.reference_range("haemoglobin", "female") == (115, 150)
    assert catalogue.reference_range("haemoglobin", "M") == (130, 175)
    assert catalogue.reference_range("haemoglobin", None) == (115, 175)  # unknown sex: normal for either
    with pytest.raises(ValueError, match="unknown sex"):
        catalogue.reference_range("haemoglobin", "x")


def test_post_diagnosis_variables_are_never_model_inputs(catalogue):
    inputs = {v.name for v in catalogue.model_inputs()}
    leaking = {v.name for v in catalogue.leaking_variables()}
    for name in ("t_stage", "n_stage", "m_stage", "overall_stage", "positive_lymph_nodes", "histologic_grade"):
        assert name in leaking and catalogue.is_post_diagnosis(name)
    for group in ("tumour_pathology", "staging", "molecular", "outcomes", "surgery"):
        members = {v.name for v in catalogue if v.group == group}
        assert members and not members & inputs, group
    assert not leaking & inputs
    assert all(v.kind not in ("identifier", "date") for v in catalogue.model_inputs())
    assert "ct_description" not in inputs  # reports reach models through the report modality only
    assert {"cea", "haemoglobin", "sex", "age", "endoscopy_gross_type"} <= inputs


def test_variables_kept_but_not_used_are_not_inputs(catalogue):
    assert not catalogue["past_medical_history"].used_in_study
    assert catalogue["past_medical_history"].availability == "pre_diagnosis"
    assert catalogue["past_medical_history"] not in catalogue.model_inputs()


def test_numeric_inputs_are_the_numeric_model_inputs_in_catalogue_order(catalogue):
    numeric = catalogue.numeric_inputs()
    assert [v.name for v in numeric] == [v.name for v in catalogue if v.is_model_input and v.kind == "numeric"]
    assert numeric[0].name == "age" and "cea" in {v.name for v in numeric}


def test_staging_categories_match_the_shared_schema(catalogue):
    assert catalogue["t_stage"].categories == T_CATEGORIES
    assert catalogue["n_stage"].categories == N_CATEGORIES
    assert catalogue["m_stage"].categories == M_CATEGORIES
    assert catalogue["overall_stage"].categories == STAGES


def test_abnormal_findings_ratios_by_hand(catalogue):
    values = {
        "cea": 12.5,  # > 5: 2.5x above
        "albumin": 32.0,  # < 40: 40 / 32 = 1.25x below
        "haemoglobin": 120,  # low for a man (< 130), normal for a woman (115-150)
        "creatinine": 90,  # normal for a man (57-111), high for a woman (> 81)
        "platelet_count": 200,  # normal
        "ca19_9": None,
        "ca125": float("nan"),
        "afp": "",
        "sex": "female",  # categorical: not evaluated
        "not_a_variable": 1e9,  # unknown keys are kept by readers, ignored here
    }
    male = {f.variable.name: f for f in catalogue.abnormal_findings(values, "male")}
    female = {f.variable.name: f for f in catalogue.abnormal_findings(values, "female")}
    assert set(male) == {"haemoglobin", "albumin", "cea"}
    assert set(female) == {"albumin", "creatinine", "cea"}
    assert male["cea"].direction == "high" and male["cea"].ratio == pytest.approx(2.5) and male["cea"].unit == "ng/mL"
    assert male["albumin"].direction == "low" and male["albumin"].ratio == pytest.approx(1.25)
    assert male["haemoglobin"].ratio == pytest.approx(130 / 120) and male["haemoglobin"].limit == 130
    assert female["creatinine"].direction == "high" and female["creatinine"].ratio == pytest.approx(90 / 81)
    # findings come in catalogue order, whatever the order of the input dict
    order = [f.variable.name for f in catalogue.abnormal_findings(values, "male")]
    assert order == sorted(order, key=catalogue.names.index)


def test_abnormal_findings_rejects_non_numbers_and_reads_numeric_strings(catalogue):
    with pytest.raises(ValueError, match="'cea'"):
        catalogue.abnormal_findings({"cea": "positive"}, "male")
    (finding,) = catalogue.abnormal_findings({"cea": "10"}, "male")
    assert finding.ratio == pytest.approx(2.0)
    (zero,) = catalogue.abnormal_findings({"platelet_count": 0}, "male")
    assert zero.direction == "low" and math.isinf(zero.ratio)


def test_describe_abnormal_gives_short_descriptors(catalogue):
    findings = catalogue.abnormal_findings({"cea": 12.4, "albumin": 30.0, "ca19_9": 15000.0}, "male")
    assert describe_abnormal(findings) == [
        "Albumin 30 g/L, 1.3x below lower limit",
        "CEA 12.4 ng/mL, 2.5x above upper limit",
        "CA19-9 15000 U/mL, 405.4x above upper limit",
    ]


def test_catalogue_refuses_inconsistent_rows(catalogue):
    cea = catalogue["cea"]
    with pytest.raises(ValueError, match="duplicate"):
        Catalogue((cea, cea))
    with pytest.raises(ValueError, match="empty"):
        Catalogue((dataclasses.replace(cea, ref_low=10.0, ref_high=5.0),))
