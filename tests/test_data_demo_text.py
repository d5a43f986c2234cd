"""Demo reports and VQA: both languages state the same facts, each report follows its modality's stage,
phrasing varies between cases, and VQA answers come from a small closed vocabulary that matches the findings."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from gx_ray.data.demo.findings import SignalStrength, sample_findings, sample_staging
from gx_ray.data.demo.text import ANSWERS_ZH, LOCATION_EN, make_reports, make_vqa
from gx_ray.schema import LANGUAGES, N_CATEGORIES, REPORT_KINDS, T_CATEGORIES, VQA_CATEGORIES, Staging
from tests.common import findings_for

FAITHFUL = SignalStrength()
NUMBER = re.compile(r"\d+(?:\.\d+)?")
CJK = re.compile(r"[\u4e00-\u9fff]")
STAGINGS = [
    ("Tis", "N0", "M0"),
    ("T1a", "N0", "M0"),
    ("T1b", "N1", "M0"),
    ("T2", "N2", "M0"),
    ("T3", "N1", "M0"),
    ("T4a", "N3a", "M0"),
    ("T4b", "N3b", "M1"),
]


def cohort(n: int, signal: SignalStrength = FAITHFUL):
    """Cases with stages from the cohort prior, every modality possibly showing a decoy stage."""
    return [
        sample_findings(
            np.random.default_rng([i, 1]), f"C{i:04d}", sample_staging(np.random.default_rng([i, 0])), signal
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("tnm", STAGINGS)
def test_both_languages_hold_all_three_reports(tnm):
    reports = make_reports(np.random.default_rng(0), findings_for(1, tnm))
    assert set(reports) == set(LANGUAGES)
    for language in LANGUAGES:
        assert set(reports[language]) == set(REPORT_KINDS)
    for kind in REPORT_KINDS:
        assert len(reports["en"][kind]) > 80 and not CJK.search(reports["en"][kind])
        assert len(CJK.findall(reports["zh"][kind])) > 30


def test_numbers_agree_between_languages():
    for i, findings in enumerate(cohort(40, SignalStrength(0.5, 0.5, 0.5, 0.5))):
        reports = make_reports(np.random.default_rng(i), findings)
        for kind in REPORT_KINDS:
            en, zh = reports["en"][kind], reports["zh"][kind]
            assert sorted(NUMBER.findall(en)) == sorted(NUMBER.findall(zh)), (kind, en, zh)
        ct_numbers = NUMBER.findall(reports["zh"]["ct_report"])
        assert f"{findings.tumour_size_mm:.1f}" in ct_numbers
        assert f"{findings.wall_thickness_mm:.1f}" in ct_numbers
        if findings.n_nodes > 1:
            assert str(findings.n_nodes) in ct_numbers
        if findings.n_liver_mets:
            assert f"{max(findings.liver_met_sizes_mm):.1f}" in ct_numbers


def test_diagnosis_states_text_staging_and_only_it_follows_text_staging():
    base = findings_for(3, ("T3", "N1", "M0"))
    seen = set()
    for tnm, stage in [(("T2", "N0", "M0"), "IB"), (("T4a", "N2", "M0"), "IIIA"), (("T1b", "N3b", "M1"), "IV")]:
        text_staging = Staging.parse(*tnm)
        assert text_staging.stage == stage
        reports = make_reports(np.random.default_rng(7), dataclasses.replace(base, text_staging=text_staging))
        tnm_string = "c" + "".join(tnm)
        assert tnm_string in reports["en"]["diagnosis_report"] and f"stage {stage}" in reports["en"]["diagnosis_report"]
        assert tnm_string in reports["zh"]["diagnosis_report"] and f"{stage}期" in reports["zh"]["diagnosis_report"]
        seen.add((reports["en"]["ct_report"], reports["en"]["endoscopy_report"], reports["en"]["diagnosis_report"]))
    # the CT and endoscopy reports describe their own modalities: the text stage does not reach them
    assert len({ct for ct, _, _ in seen}) == 1 and len({endo for _, endo, _ in seen}) == 1
    assert len({dx for _, _, dx in seen}) == 3


def test_ct_report_follows_imaging_stage_and_endoscopy_report_follows_endoscopy_stage():
    early, advanced = findings_for(5, ("T1a", "N0", "M0")), findings_for(5, ("T4a", "N2", "M0"))
    decoy = dataclasses.replace(early, endoscopy_staging=advanced.imaging_staging)
    reports = make_reports(np.random.default_rng(0), decoy)
    assert (
        "early gastric cancer" in reports["en"]["ct_report"] or "early gastric carcinoma" in reports["en"]["ct_report"]
    )
    assert "advanced gastric" in reports["en"]["endoscopy_report"]
    assert "进展期" in reports["zh"]["endoscopy_report"] and "进展期" not in reports["zh"]["ct_report"]


def test_phrasing_varies_across_seeds_for_identical_findings():
    findings = findings_for(11, ("T3", "N2", "M0"))
    reports = [make_reports(np.random.default_rng(seed), findings) for seed in range(12)]
    for language in LANGUAGES:
        for kind in REPORT_KINDS:
            assert len({r[language][kind] for r in reports}) >= 4, (language, kind)


def test_reports_and_vqa_are_deterministic_per_seed():
    findings = findings_for(2)
    assert make_reports(np.random.default_rng(9), findings) == make_reports(np.random.default_rng(9), findings)
    assert make_vqa(np.random.default_rng(9), findings) == make_vqa(np.random.default_rng(9), findings)


def test_vqa_items_are_valid_and_aligned_across_languages():
    for i, findings in enumerate(cohort(30)):
        vqa = make_vqa(np.random.default_rng(i), findings, n_items=8)
        assert set(vqa) == set(LANGUAGES)
        en, zh = vqa["en"], vqa["zh"]
        assert len(en) == len(zh) == 8
        assert len({item.question for item in en}) == 8  # no question asked twice
        assert {item.category for item in en} == set(VQA_CATEGORIES)  # 8 >= 5 items cover every category
        for e, z in zip(en, zh, strict=True):
            assert e.category == z.category and e.category in VQA_CATEGORIES
            assert z.answer == ANSWERS_ZH[e.answer]
            assert CJK.search(z.question) and not CJK.search(e.question)


def test_yes_no_answers_are_yes_or_no_and_balanced():
    answers = [
        item.answer
        for i, findings in enumerate(cohort(60))
        for item in make_vqa(np.random.default_rng(i), findings)["en"]
        if item.category == "yes_no"
    ]
    assert set(answers) == {"yes", "no"}
    assert 0.3 < answers.count("yes") / len(answers) < 0.7


def test_vqa_answers_agree_with_findings():
    # every modality shows its own (often decoy) stage: answers must come from the right one
    locations = set(LOCATION_EN)
    for i, findings in enumerate(cohort(60, SignalStrength(0.3, 0.3, 0.3, 0.3))):
        for item in make_vqa(np.random.default_rng(i), findings, n_items=12)["en"]:
            if item.category == "localization" and item.answer in locations:
                assert item.answer == findings.tumour_location
            if item.category == "staging" and item.answer in T_CATEGORIES:
                assert item.answer == findings.text_staging.t
            if item.category == "staging" and item.answer in N_CATEGORIES:
                assert item.answer == findings.text_staging.n
            if item.category == "lesion" and item.answer in ANSWERS_ZH and "layer" in item.question:
                assert item.answer == findings.invasion_depth
            if item.question.startswith("Is the tumour located in the"):
                assert (item.answer == "yes") == item.question.endswith(f"the {LOCATION_EN[findings.tumour_location]}?")
            if item.question == "Are there liver metastases?":
                assert (item.answer == "yes") == (findings.n_liver_mets > 0)
            if item.question == "Does the diagnosis suggest distant metastasis?":
                assert (item.answer == "yes") == (findings.text_staging.m == "M1")


def test_every_category_appears_across_a_small_cohort_even_with_few_items():
    categories = {
        item.category for i, f in enumerate(cohort(8)) for item in make_vqa(np.random.default_rng(i), f, 2)["en"]
    }
    assert categories == set(VQA_CATEGORIES)


def test_answer_vocabulary_stays_small_and_closed():
    vocabulary = {
        item.answer
        for i, findings in enumerate(cohort(100))
        for item in make_vqa(np.random.default_rng(i), findings)["en"]
    }
    assert vocabulary <= set(ANSWERS_ZH)
    assert len(ANSWERS_ZH) <= 80
    assert len(vocabulary) >= 30  # the vocabulary is actually used, not collapsed to a handful of answers
