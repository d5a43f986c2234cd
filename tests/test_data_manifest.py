"""A cohort described by a manifest CSV: what it reads, every kind of bad row, and the release layout's shards."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import SimpleITK as sitk

from gx_ray.data.layouts import detect_layout, read_cohort
from gx_ray.data.manifest import ManifestError, manifest_cases, read_manifest_cohort, write_manifest_for
from gx_ray.data.volumes import load_volume, write_dicom_series, write_volume
from gx_ray.schema import Box, CaseError, Staging
from tests.common import ROOT

PREPARE_DOC = ROOT / "docs" / "how-to" / "prepare-data.md"


def _volume(path: Path, value: int = 100) -> Path:
    array = np.full((6, 8, 8), value, dtype=np.int16)
    array[2:4, 3:6, 3:6] += 50
    image = sitk.GetImageFromArray(array)
    image.SetSpacing((1.0, 1.0, 2.0))
    write_volume(image, path)
    return path


def _write_csv(path: Path, rows: list[dict[str, str]]) -> Path:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture
def scans(tmp_path: Path) -> Path:
    """Three phases as small NIfTI files under ``tmp_path/ct``, shared by every row of the hand-made manifests."""
    for phase, value in (("non_contrast", 40), ("venous", 120), ("delayed", 90)):
        _volume(tmp_path / "ct" / f"{phase}.nii.gz", value)
    return tmp_path


def _row(case_id: str, **cells: str) -> dict[str, str]:
    row = {
        "case_id": case_id,
        "non_contrast": "ct/non_contrast.nii.gz",
        "venous": "ct/venous.nii.gz",
        "delayed": "ct/delayed.nii.gz",
        "venous_tumour_box": "1,2,3,3,5,6",
        "t": "T3",
        "n": "N1",
        "m": "M0",
        "cea": "4.2",
    }
    return {**row, **cells}


# --- what a row holds ----------------------------------------------------------------------------------------------


def test_a_row_reads_into_a_case(scans: Path):
    # paths relative to the CSV's folder, which is not the working directory; aliases, masks, reports, VQA, labs
    (scans / "sub").mkdir()
    _volume(scans / "ct" / "organs.nii.gz", 6)
    shutil.copy(scans / "ct" / "delayed.nii.gz", scans / "ct" / "late.nii.gz")
    row = _row(
        "P1",
        patient_id="H-9",
        Equilibrium="../ct/late.nii.gz",
        venous="../ct/venous.nii.gz",
        non_contrast=str(scans / "ct" / "non_contrast.nii.gz"),  # an absolute path stays as it is
        **{
            "venous_organ_mask": "../ct/organs.nii.gz",
            "venous_lesion_box": "1,2,3,3,5,6;0,0,0,1,1,1",
            "Delayed Stomach Box": "0,1,1,5,7,7",
            "t": "pT4a",
            "n": "3b",
            "ct_report": "Wall thickening.",
            "ct_report_zh": "胃壁增厚。",
            "vqa": json.dumps([{"question": "Where?", "answer": "antrum", "category": "localization"}]),
            "CA19-9": "37",
            "age": "61",
            "sex": "male",
            "alt": "NA",
            "intervention": "none",
            "ward": "007",
        },
    )
    del row["venous_tumour_box"], row["delayed"]  # the delayed phase is in the equilibrium column
    csv_path = _write_csv(scans / "sub" / "cohort.csv", [row])
    assert detect_layout(csv_path) == "manifest"
    cases, errors = read_cohort(csv_path)
    assert errors == [] and len(cases) == 1
    case = cases[0]
    assert case.case_id == "P1" and case.patient_id == "H-9" and case.extra["manifest_row"] == 1
    assert {p: path.resolve() for p, path in case.phases.items()} == {
        "non_contrast": scans / "ct" / "non_contrast.nii.gz",
        "venous": scans / "ct" / "venous.nii.gz",
        "delayed": scans / "ct" / "late.nii.gz",
    }
    assert case.organ_masks["venous"].resolve() == scans / "ct" / "organs.nii.gz"
    # the second corner is the last voxel inside, as the release's zyx_max: end-exclusive in the Case
    assert case.boxes == [
        Box("tumour", "venous", (1, 2, 3, 4, 6, 7)),
        Box("tumour", "venous", (0, 0, 0, 2, 2, 2)),
        Box("stomach", "delayed", (0, 1, 1, 6, 8, 8)),
    ]
    assert case.staging == Staging("T4a", "N3b", "M0")
    assert case.reports == {"en": {"ct_report": "Wall thickening."}, "zh": {"ct_report": "胃壁增厚。"}}
    assert case.vqa["en"][0].answer == "antrum"
    # numeric catalogue variables become numbers, "NA" missing; categories and unknown columns stay text
    assert case.labs == {"cea": 4.2, "ca19_9": 37, "age": 61, "sex": "male", "intervention": "none", "ward": "007"}
    assert case.presence()["labs"] and case.presence()["box_stomach"] and not case.presence()["endoscopy"]


def test_staging_comes_from_the_lab_columns_without_t_n_m(scans: Path):
    row = _row("P1", t="", n="", m="", t_stage="T2", n_stage="N0", m_stage="M0")
    case = read_manifest_cohort(_write_csv(scans / "cohort.csv", [row]))[0][0]
    assert case.staging == Staging("T2", "N0", "M0") and case.labs["t_stage"] == "T2"


def test_a_dataframe_reads_without_ray_or_a_csv(scans: Path):
    frame = pd.DataFrame(
        {
            "case_id": ["P1", "P2"],
            "non_contrast": ["ct/non_contrast.nii.gz"] * 2,
            "venous": ["ct/venous.nii.gz"] * 2,
            "delayed": ["ct/delayed.nii.gz"] * 2,
            "cea": [4.5, np.nan],  # a numpy float column; NaN is missing
            "age": np.array([61, 70], dtype=np.int64),
            "weight": [True, False],  # a boolean is no measurement
        }
    )
    cases, errors = manifest_cases(frame, scans, "request 17")
    assert [c.case_id for c in cases] == []
    assert [(e.case_id, e.file, e.field) for e in errors] == [
        ("P1", "request 17", "weight"),
        ("P2", "request 17", "weight"),
    ]
    cases, errors = manifest_cases(frame.drop(columns="weight"), scans, "request 17")
    assert errors == [] and [c.labs for c in cases] == [{"cea": 4.5, "age": 61}, {"age": 70}]
    assert type(cases[1].labs["age"]) is int and cases[0].phases["venous"] == scans / "ct" / "venous.nii.gz"
    # the serving process imports no Ray with it
    code = "import sys, gx_ray.data.manifest; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


# --- bad rows ------------------------------------------------------------------------------------------------------

BAD_ROWS = {
    # name: (cells of the bad row, the field the error names, its reason, the file it names: "csv" or a path)
    "missing_required_phase": ({"venous": ""}, "venous", "missing_part", "csv"),
    "path_does_not_exist": ({"delayed": "ct/nowhere.nii.gz"}, "delayed", "missing_part", "ct/nowhere.nii.gz"),
    "phase_is_not_a_volume": ({"delayed": "ct/notes.txt"}, "delayed", "unreadable", "ct/notes.txt"),
    "unparsable_number": ({"cea": "4,2"}, "cea", "malformed_annotation", "csv"),
    "infinite_lab": ({"cea": "inf"}, "cea", "malformed_annotation", "csv"),
    "box_of_five_numbers": ({"venous_tumour_box": "1,2,3,3,5"}, "venous_tumour_box", "malformed_annotation", "csv"),
    "box_not_whole": ({"venous_tumour_box": "1,2,3.5,3,5,6"}, "venous_tumour_box", "malformed_annotation", "csv"),
    "box_inverted": ({"venous_tumour_box": "3,2,3,1,5,6"}, "venous_tumour_box", "malformed_annotation", "csv"),
    "unknown_t": ({"t": "T9"}, "t", "malformed_annotation", "csv"),
    "incomplete_staging": ({"n": ""}, "n", "malformed_annotation", "csv"),
    "malformed_vqa": ({"vqa": "[{"}, "vqa", "malformed_annotation", "csv"),
    "mask_without_its_phase": ({"arterial_organ_mask": "ct/venous.nii.gz"}, "arterial_organ_mask", None, "csv"),
}


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_a_bad_row_names_case_file_and_column_and_loses_nothing_else(scans: Path, kind: str):
    cells, field, reason, file = BAD_ROWS[kind]
    (scans / "ct" / "notes.txt").write_text("not a volume", encoding="utf-8")
    csv_path = _write_csv(scans / "cohort.csv", [_row("P1"), _row("BAD", **cells), _row("P3")])
    cases, errors = read_cohort(csv_path)
    assert [c.case_id for c in cases] == ["P1", "P3"]
    assert len(errors) == 1, errors
    error = errors[0]
    assert isinstance(error, CaseError) and error.case_id == "BAD" and error.field == field
    assert reason is None or error.reason == reason
    assert Path(error.file) == (csv_path if file == "csv" else scans / file)
    assert "row 2" in str(error) and str(csv_path) in str(error)
    with pytest.raises(CaseError) as raised:
        read_cohort(csv_path, strict=True)
    assert str(raised.value) == str(error)


def test_a_case_id_on_two_rows_excludes_both(scans: Path):
    csv_path = _write_csv(scans / "cohort.csv", [_row("P1"), _row("P2"), _row("P1"), _row("")])
    cases, errors = read_manifest_cohort(csv_path)
    assert [c.case_id for c in cases] == ["P2"]
    assert [(e.case_id, e.field, e.reason) for e in errors] == [
        ("P1", "case_id", "duplicate_patient"),
        ("P1", "case_id", "duplicate_patient"),
        ("row 4", "case_id", "missing_part"),
    ]
    assert "rows 1, 3" in errors[0].message


def test_a_patient_on_two_rows_is_excluded_as_in_the_folder_layouts(scans: Path):
    csv_path = _write_csv(scans / "cohort.csv", [_row("P1", patient_id="H1"), _row("P2", patient_id="H1"), _row("P3")])
    cases, errors = read_cohort(csv_path)
    assert [c.case_id for c in cases] == ["P3"] and [e.reason for e in errors] == ["duplicate_patient"] * 2


def test_a_spreadsheets_empty_trailing_columns_are_nothing(scans: Path):
    header = ",".join(_row("P1")) + ",,"
    body = ",".join(f'"{v}"' for v in _row("P1").values()) + ",,"
    (scans / "cohort.csv").write_text(f"{header}\n{body}\n", encoding="utf-8-sig")  # with Excel's byte-order mark
    cases, errors = read_manifest_cohort(scans / "cohort.csv")
    assert errors == [] and [c.case_id for c in cases] == ["P1"] and cases[0].labs == {"cea": 4.2}


def test_a_row_with_more_cells_than_the_header_is_one_error(scans: Path):
    good = ",".join(_row("X").values()).replace("1,2,3,3,5,6", '"1,2,3,3,5,6"')
    header = ",".join(_row("X"))
    lines = [header, good.replace("X", "P1", 1), good.replace("X", "P2", 1) + ",extra", good.replace("X", "P3", 1)]
    csv_path = scans / "cohort.csv"
    csv_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cases, errors = read_manifest_cohort(csv_path)
    assert [c.case_id for c in cases] == ["P1", "P3"] and [c.extra["manifest_row"] for c in cases] == [1, 3]
    assert [(e.case_id, e.file) for e in errors] == [("P2", str(csv_path))] and "row 2 has" in errors[0].message


@pytest.mark.parametrize(
    "header, message",
    [
        (["patient", "venous"], "no case_id column"),
        (["case_id", "CEA", "cea"], "'CEA', 'cea' name the same field"),
        (["case_id", "delayed", "equilibrium"], "'delayed', 'equilibrium' name the same field"),
        (["case_id", "tumour_box"], "neither <phase>_organ_mask"),
        (["case_id", "venous_lesions_box"], "neither <phase>_organ_mask"),
        (["case_id", "venous", "venous"], "appear twice"),
        (["case_id", "venous_tumor_mask", "Venous Tumour Mask"], "name the same field"),
        (["case_id", "venous_lesion_box", "venous_tumour_box"], "name the same field"),
        (["case_id", "venous", ""], "column 3 has no name but holds values"),
    ],
)
def test_a_manifest_whose_columns_are_wrong_is_refused_as_a_whole(tmp_path: Path, header, message):
    csv_path = tmp_path / "cohort.csv"
    csv_path.write_text(",".join(header) + "\n" + ",".join("x" for _ in header) + "\n", encoding="utf-8")
    with pytest.raises(ManifestError, match=re.escape(message)) as raised:
        read_cohort(csv_path)
    assert str(csv_path) in str(raised.value)


# --- the documented example and the demo cohort ---------------------------------------------------------------------


def _doc_section(title: str) -> str:
    text = PREPARE_DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_the_documented_manifest_reads_as_the_docs_say(demo_raw: Path, tmp_path: Path):
    section = _doc_section("Your own cohort (a manifest)")
    example = re.search(r"```csv\n(.*?)```", section, re.S).group(1)
    rows = list(csv.DictReader(io.StringIO(example)))
    # the files it names, made from the demo cohort's: NIfTI, MHA and a DICOM folder, a mask and an endoscopy image
    demo = sorted((demo_raw / "imaging").iterdir())[0]
    for row in rows:
        for column, value in row.items():
            target = tmp_path / value
            if column == "endoscopy" and value:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(next((demo_raw / "endoscopy").iterdir()), target)
            elif column.endswith("_mask") and value:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(demo / f"{column.removesuffix('_organ_mask')}_organ_mask.nii.gz", target)
            elif column in ("non_contrast", "venous", "delayed"):
                image = load_volume(demo / f"{column}.nii.gz")
                if value.endswith((".nii.gz", ".mha")):
                    write_volume(image, target)
                else:
                    write_dicom_series(image, target, "2.25.1234", column)
    (tmp_path / "cohort.csv").write_text(example, encoding="utf-8")
    cases, errors = read_cohort(tmp_path / "cohort.csv")
    assert errors == []
    p1, p2 = cases
    assert (p1.patient_id, p2.patient_id) == ("H-1001", "P002")
    assert p2.phases["venous"].is_dir() and p2.phases["delayed"].suffix == ".mha"
    assert p1.boxes == [Box("tumour", "venous", (22, 50, 78, 33, 72, 98))] and not p2.boxes
    assert p1.organ_masks and p1.endoscopy and not p2.endoscopy
    assert (p1.staging, p2.staging) == (Staging("T3", "N1", "M0"), Staging("T1b", "N0", "M0"))
    assert p1.labs == {"cea": 4.2, "age": 61, "sex": "male", "ward": "B2"} and p2.labs == {"age": 70, "sex": "female"}
    assert p1.reports == {"en": {"ct_report": "Wall thickening in the antrum."}} and not p2.reports
    for volume in (*p1.phases.values(), *p2.phases.values()):
        load_volume(volume)  # every file the example names is a volume the preprocessing reads


def test_a_manifest_of_the_demo_cohort_reads_the_same_cases(demo_raw: Path, tmp_path: Path):
    csv_path = write_manifest_for(demo_raw, tmp_path / "elsewhere" / "cohort.csv")
    assert "../" in csv_path.read_text(encoding="utf-8")  # relative to the CSV's folder, not the working directory
    folders = {c.case_id: c for c in read_cohort(demo_raw)[0]}
    cases, errors = read_cohort(csv_path)
    assert errors == [] and [c.case_id for c in cases] == sorted(folders)
    for case in cases:
        folder = folders[case.case_id]
        for part in ("phases", "organ_masks", "tumour_masks"):
            resolved = {p: path.resolve() for p, path in getattr(case, part).items()}
            assert resolved == {p: path.resolve() for p, path in getattr(folder, part).items()}, part
        assert case.endoscopy.resolve() == folder.endoscopy.resolve()
        assert (case.boxes, case.staging, case.patient_id) == (folder.boxes, folder.staging, folder.patient_id)
        assert (case.reports, case.vqa) == (folder.reports, folder.vqa)
        recorded = {k: v for k, v in folder.labs.items() if v is not None}
        assert case.labs == recorded and all(type(case.labs[k]) is type(v) for k, v in recorded.items())


def _rows(shard_dir: Path) -> dict[str, dict]:
    rows = [row for f in sorted(shard_dir.glob("*.parquet")) for row in pq.read_table(f).to_pylist()]
    return {row["case_id"]: row for row in rows}


def test_the_manifest_prepares_the_shards_the_release_layout_does(demo_raw: Path, demo_prepared, tmp_path: Path):
    """``python jobs/prepare_data.py --source cohort.csv``: every row equal to the folder's, byte for byte; the same
    split, fingerprint and QC report."""
    csv_path = write_manifest_for(demo_raw, tmp_path / "cohort.csv")
    out = tmp_path / "prepared"
    argv = ["--source", str(csv_path), "--out", str(out), "--endoscopy-size", "32"]
    argv += ["--endoscopy-annotations", str(demo_raw / "endoscopy_annotations.json")]
    spec = importlib.util.spec_from_file_location("gx_prepare_data_job", ROOT / "jobs" / "prepare_data.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.main(argv) == 0
    shards = Path(demo_prepared.shard_dir)
    expected, found = _rows(shards), _rows(out / "shards")
    assert list(found) == list(expected)  # the same order: split, then case id
    for case_id, row in expected.items():
        for column, value in row.items():  # repr: a missing phase's HU mean is NaN, which equals nothing
            assert repr(found[case_id][column]) == repr(value), (case_id, column)
    for name in ("split.json", "fingerprint.json", "endoscopy_annotations.json"):
        assert (out / "shards" / name).read_bytes() == (shards / name).read_bytes(), name
    qc, qc_folder = (
        json.loads(p.read_text(encoding="utf-8")) for p in (out / "qc_report.json", demo_prepared.qc_report)
    )
    assert qc.pop("source") == str(csv_path) and qc_folder.pop("source") == str(demo_raw)
    assert qc == qc_folder
