"""Readers and writers of the release and paper layouts, NIfTI and DICOM: what is written is read back."""

import json
import shutil

import numpy as np
import pytest
import SimpleITK as sitk

from gx_ray.data.layouts import (
    BOX_MAX_INCLUSIVE,
    CaseContent,
    detect_layout,
    read_cohort,
    read_paper_case,
    read_release_case,
    write_paper_case,
    write_release_case,
)
from gx_ray.data.volumes import load_volume
from gx_ray.schema import Box, CaseError, Staging, VQAItem


def _image(value: int, size=(12, 10, 8), spacing=(2.5, 2.5, 4.0)) -> sitk.Image:
    array = np.full(size[::-1], value, dtype=np.int16)
    array[2:5, 3:6, 4:9] += 50
    image = sitk.GetImageFromArray(array)
    image.SetSpacing(spacing)
    image.SetOrigin((-15.0, -12.5, 100.0))
    return image


def _content(case_id: str = "GX0001", arterial: bool = True) -> CaseContent:
    phases = {p: _image(v) for p, v in (("non_contrast", 40), ("venous", 120), ("delayed", 90))}
    if arterial:
        phases["arterial"] = _image(200)
    return CaseContent(
        case_id=case_id,
        phases=phases,
        organ_masks={"venous": sitk.Cast(_image(0) > 30, sitk.sitkUInt8)},
        boxes=[Box("tumour", "venous", (2, 3, 4, 5, 6, 9)), Box("stomach", "arterial", (1, 1, 1, 7, 9, 11))],
        staging=Staging("T3", "N1", "M0"),
        labs={"cea": 12.5, "sex": "male", "t_stage": "T3", "n_stage": "N1", "m_stage": "M0"},
        reports={
            "en": {"ct_report": "Wall thickening.", "diagnosis_report": "cT3N1M0"},
            "zh": {"ct_report": "胃壁增厚。"},
        },
        vqa={"en": [VQAItem("Where is the lesion?", "antrum", "localization")]},
        endoscopy=np.full((16, 16, 3), 180, dtype=np.uint8),
        meta={"sex": "male", "ground_truth": {"x": 1}},
    )


@pytest.mark.parametrize("dicom", [False, True], ids=["nifti", "dicom"])
@pytest.mark.parametrize("layout", ["release", "paper"])
def test_written_case_reads_back(tmp_path, layout, dicom):
    content = _content()
    writer, reader = (
        (write_release_case, read_release_case) if layout == "release" else (write_paper_case, read_paper_case)
    )
    writer(tmp_path, content, dicom=dicom)
    assert detect_layout(tmp_path) == layout
    case = reader(tmp_path, "GX0001")
    assert set(case.phases) == {"non_contrast", "arterial", "venous", "delayed"}
    venous = load_volume(case.phases["venous"], case.case_id, "venous")
    assert np.array_equal(sitk.GetArrayFromImage(venous), sitk.GetArrayFromImage(content.phases["venous"]))
    assert venous.GetSpacing() == pytest.approx(content.phases["venous"].GetSpacing())
    assert venous.GetOrigin() == pytest.approx(content.phases["venous"].GetOrigin(), abs=1e-4)
    assert sorted(case.boxes, key=str) == sorted(content.boxes, key=str)
    assert case.staging == Staging("T3", "N1", "M0")
    assert case.labs["cea"] == 12.5
    assert case.reports["en"]["ct_report"] == "Wall thickening." and case.reports["zh"]["ct_report"] == "胃壁增厚。"
    assert case.vqa["en"] == content.vqa["en"]
    assert case.endoscopy is not None and case.endoscopy.is_file()
    assert (
        case.presence()["phase_arterial"] and case.presence()["box_tumour"] and not case.presence()["box_lymph_nodes"]
    )


def test_release_box_corners_are_read_inclusive_once(tmp_path):
    write_release_case(tmp_path, _content())
    stored = json.loads((tmp_path / "imaging/GX0001/bbox.json").read_text(encoding="utf-8"))["boxes"]
    tumour = next(b for b in stored if b["class"] == "lesion")
    assert BOX_MAX_INCLUSIVE and tumour["zyx_max"] == [4, 5, 8]  # end-exclusive (5, 6, 9) minus one
    # a release box without a phase is on the arterial phase, and its class names map to our levels
    (tmp_path / "imaging/GX0001/bbox.json").write_text(
        json.dumps({"lesion": {"zyx_min": [0, 0, 0], "zyx_max": [0, 0, 0]}})
    )
    assert read_release_case(tmp_path, "GX0001").boxes == [Box("tumour", "arterial", (0, 0, 0, 1, 1, 1))]


def test_unknown_keys_are_kept(tmp_path):
    write_release_case(tmp_path, _content())
    path = tmp_path / "metadata/EN/GX0001.json"
    document = json.loads(path.read_text(encoding="utf-8"))
    document["scanner"] = {"vendor": "X"}
    path.write_text(json.dumps(document), encoding="utf-8")
    case = read_release_case(tmp_path, "GX0001")
    assert case.extra["metadata/EN"]["scanner"] == {"vendor": "X"}
    assert case.extra["metadata/EN"]["meta"]["ground_truth"] == {"x": 1}


def test_optional_arterial_phase_may_be_absent(tmp_path):
    write_release_case(tmp_path, _content(arterial=False))
    assert "arterial" not in read_release_case(tmp_path, "GX0001").phases


def test_missing_required_phase_names_case_file_and_field(tmp_path):
    write_release_case(tmp_path, _content())
    (tmp_path / "imaging/GX0001/delayed.nii.gz").unlink()
    with pytest.raises(CaseError) as info:
        read_release_case(tmp_path, "GX0001")
    assert info.value.reason == "missing_part" and info.value.field == "delayed"
    assert str(info.value.file).endswith("GX0001/delayed.nii.gz")


@pytest.mark.parametrize(
    "text, field",
    [
        ("{not json", None),
        ('{"boxes": [{"class": "lesion", "zyx_min": [1, 2, 3]}]}', "boxes[0]"),
        ('{"boxes": [{"class": "spleen", "zyx_min": [1, 2, 3], "zyx_max": [4, 5, 6]}]}', "boxes[0].class"),
        ('{"boxes": [{"class": "lesion", "zyx_min": [5, 2, 3], "zyx_max": [1, 5, 6]}]}', "boxes[0]"),
    ],
    ids=["not-json", "no-max", "unknown-class", "inverted"],
)
def test_malformed_bbox_json_names_file_and_field(tmp_path, text, field):
    write_release_case(tmp_path, _content())
    (tmp_path / "imaging/GX0001/bbox.json").write_text(text)
    with pytest.raises(CaseError) as info:
        read_release_case(tmp_path, "GX0001")
    assert info.value.reason == "malformed_annotation" and info.value.field == field
    assert str(info.value.file).endswith("bbox.json") and "GX0001" in str(info.value)


def test_cohort_reader_skips_bad_cases_and_both_folders_of_a_duplicated_patient(tmp_path):
    for cid in ("GX0001", "GX0002", "GX0003"):
        write_release_case(tmp_path, _content(cid))
    (tmp_path / "imaging/GX0002/venous.nii.gz").unlink()
    # GX0004 is GX0003's patient again under another folder name
    shutil.copytree(tmp_path / "imaging/GX0003", tmp_path / "imaging/GX0004")
    for lang in ("EN", "CN"):
        meta = json.loads((tmp_path / f"metadata/{lang}/GX0003.json").read_text(encoding="utf-8"))
        meta["meta"]["patient_id"] = "P-3"
        for cid in ("GX0003", "GX0004"):
            (tmp_path / f"metadata/{lang}/{cid}.json").write_text(json.dumps(meta), encoding="utf-8")
    cases, errors = read_cohort(tmp_path)
    assert [c.case_id for c in cases] == ["GX0001"]
    reasons = {e.case_id: e.reason for e in errors}
    assert reasons == {"GX0002": "missing_part", "GX0003": "duplicate_patient", "GX0004": "duplicate_patient"}
    assert "GX0003, GX0004" in next(e.message for e in errors if e.case_id == "GX0004")
    with pytest.raises(CaseError, match="GX0002"):
        read_cohort(tmp_path, strict=True)


def test_truncated_volume_and_unreadable_dicom_slice_fail_on_load(tmp_path):
    write_release_case(tmp_path, _content(), dicom=True)
    case = read_release_case(tmp_path, "GX0001")
    slices = sorted(case.phases["venous"].glob("*.dcm"))
    slices[3].write_bytes(slices[3].read_bytes()[:200])
    with pytest.raises(CaseError) as info:
        load_volume(case.phases["venous"], case.case_id, "venous")
    assert info.value.reason == "unreadable" and info.value.field == "venous"
    path = tmp_path / "nifti.nii.gz"
    sitk.WriteImage(_image(5, size=(64, 64, 32)), str(path), useCompression=True)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CaseError, match="unreadable volume"):
        load_volume(path, "GX0001", "delayed")
