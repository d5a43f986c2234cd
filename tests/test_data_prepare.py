"""Raw demo cohort → shards: contents, patient-level splits, streaming, determinism, and every kind of bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import SimpleITK as sitk

from gx_ray.data.catalogue import load_catalogue
from gx_ray.data.demo.cohort import DemoConfig, generate_cohort
from gx_ray.data.layouts import read_cohort
from gx_ray.data.prepare import prepare_shards
from gx_ray.data.shards import (
    FORMAT_VERSION,
    BatchCollate,
    ShardFormatError,
    TensorLayout,
    hounsfield,
    read_manifest,
    read_split,
    require_format,
    split_files,
)
from gx_ray.data.splits import SPLITS, read_split_file
from gx_ray.data.volumes import write_dicom_series
from gx_ray.schema import PHASES, STAGE_GROUPS, CaseError
from tests.common import tiny_prepare


def _rows(shard_dir: Path) -> list[dict]:
    return [row for f in sorted(shard_dir.glob("*.parquet")) for row in pq.read_table(f).to_pylist()]


def test_prepare_writes_shards_split_manifest_and_qc(demo_prepared, demo_raw):
    manifest = read_manifest(demo_prepared.shard_dir, verify=True)  # checksums hold
    assert sum(manifest["rows"].values()) == 10 == sum(demo_prepared.rows.values())
    assert manifest["ct_shape"] == [len(PHASES), *tiny_prepare().preprocess.shape_zyx]
    qc = json.loads(demo_prepared.qc_report.read_text(encoding="utf-8"))
    assert qc["cases_found"] == 10 and qc["included"] == 10 and not qc["excluded"]
    assert (demo_prepared.qc_report.parent / "qc_report.md").is_file()
    assert all(set(c["registration"]) >= {"non_contrast", "delayed"} for c in qc["cases"].values())


def test_splits_are_patient_level_and_the_split_file_is_the_truth(demo_prepared):
    assignment = read_split_file(demo_prepared.shard_dir / "split.json")
    seen: dict[str, str] = {}
    for split in SPLITS:
        for f in split_files(demo_prepared.shard_dir, split):
            for row in pq.read_table(f, columns=["patient_id", "split"]).to_pylist():
                assert row["split"] == split and assignment[row["patient_id"]] == split
                assert row["patient_id"] not in seen, "a patient in two rows or splits"
                seen[row["patient_id"]] = split
    assert set(seen) == set(assignment)
    assert Counter(seen.values())["train"] >= 6


def test_rows_carry_every_modality_of_their_case(demo_prepared, demo_raw):
    cases = {c.case_id: c for c in read_cohort(demo_raw)[0]}
    lab_names = [v.name for v in load_catalogue().numeric_inputs()]
    for row in _rows(demo_prepared.shard_dir):
        case = cases[row["case_id"]]
        assert row["stage"] == case.staging.stage and STAGE_GROUPS[row["stage_label"]] == case.staging.group
        assert row["ct_report"] == case.reports["en"]["ct_report"]
        assert row["diagnosis_report_zh"] == case.reports["zh"]["diagnosis_report"]
        assert [v["answer"] for v in row["vqa"]] == [v.answer for v in case.vqa["en"]]
        for name, value, missing in zip(lab_names, row["labs"], row["labs_missing"], strict=True):
            raw = case.labs.get(name)
            assert missing == (raw is None) and (missing or value == pytest.approx(float(raw), rel=1e-6))
        assert row["phase_present"] == [p in case.phases for p in PHASES]
        volume = np.frombuffer(row["ct"], np.float16).reshape(len(PHASES), *tiny_prepare().preprocess.shape_zyx)
        for p, present in enumerate(row["phase_present"]):
            channel = volume[p].astype(np.float32)
            assert (abs(channel.mean()) < 0.05 and abs(channel.std() - 1) < 0.05) if present else not channel.any()
            # the HU statistics travel with the row: windows in HU can be taken from the shards alone
            assert present == np.isfinite(row["ct_hu_mean"][p]) == (row["ct_hu_std"][p] > 0)
        hu = hounsfield(volume, row["ct_hu_mean"], row["ct_hu_std"])[np.asarray(row["phase_present"])]
        low, high = tiny_prepare().preprocess.hu_window
        assert hu.min() >= low - 1 and hu.max() <= high + 1
        boxes = np.asarray(row["boxes"]).reshape(len(PHASES), 3, 6)
        tumour = boxes[PHASES.index("venous"), 0]
        assert row["box_present"][PHASES.index("venous") * 3] and (tumour[3:] > tumour[:3]).all()
        assert row["endoscopy_present"] and len(row["endoscopy"]) == 3 * 32 * 32


def test_shards_older_than_a_task_needs_are_refused_with_the_fix(demo_prepared, tmp_path):
    assert read_manifest(demo_prepared.shard_dir)["format_version"] == FORMAT_VERSION == 2
    require_format(demo_prepared.shard_dir, 2, "lesion QA")  # current shards pass
    old = tmp_path / "old"
    shutil.copytree(demo_prepared.shard_dir, old)
    manifest = json.loads((old / "manifest.json").read_text(encoding="utf-8"))
    manifest["format_version"] = 1
    (old / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ShardFormatError, match=r"old holds shard format 1; lesion QA needs format 2.*HU.*prepare_data"):
        require_format(old, 2, "lesion QA")


def test_a_split_streams_through_ray_data_into_tensors(demo_prepared):
    files = split_files(demo_prepared.shard_dir, "train")
    layout = TensorLayout.from_schema(pq.read_schema(files[0]))
    expected = {r["case_id"]: r for r in _rows(demo_prepared.shard_dir) if r["split"] == "train"}
    seen = []
    for batch in read_split(demo_prepared.shard_dir, "train").iter_torch_batches(
        batch_size=3, collate_fn=BatchCollate(layout)
    ):
        assert batch["ct"].shape[1:] == (len(PHASES), *tiny_prepare().preprocess.shape_zyx)
        assert batch["boxes"].shape[1:] == (len(PHASES), 3, 6) and batch["labs"].shape[1] == len(layout.lab_names)
        for i, case_id in enumerate(batch["case_id"]):
            row = expected[case_id]
            assert batch["ct"][i].numpy().tobytes() == row["ct"]
            assert int(batch["stage_label"][i]) == row["stage_label"]
            assert batch["endoscopy"][i].shape == (3, 32, 32)
        seen += batch["case_id"]
    assert sorted(seen) == sorted(expected)


def test_same_input_gives_byte_identical_shards(demo_prepared, demo_raw, tmp_path):
    again = prepare_shards(demo_raw, tmp_path, tiny_prepare())
    first = {f["file"]: f["sha256"] for f in read_manifest(demo_prepared.shard_dir)["files"]}
    second = {f["file"]: f["sha256"] for f in read_manifest(again.shard_dir)["files"]}
    assert first == second
    assert (demo_prepared.shard_dir / "split.json").read_bytes() == (again.shard_dir / "split.json").read_bytes()


def test_replicated_benchmark_cohort_is_the_same_written_by_one_thread_or_many(demo_prepared, tmp_path):
    """The benchmarks' cohort of a chosen size: each split holds its rows, every file passes the shard checks, and
    writing a file per thread gives byte for byte what one thread writes."""
    from benchmarks.ingest import SHARD_ROWS, replicate_splits
    from gx_ray.data.shards import check_shards

    rows = {"train": SHARD_ROWS + 5, "val": 3, "test": 2 * SHARD_ROWS}
    one = replicate_splits(demo_prepared.shard_dir, tmp_path / "one", rows, threads=1)
    many = replicate_splits(demo_prepared.shard_dir, tmp_path / "many", rows, threads=4)
    files = read_manifest(many)["files"]
    assert files == read_manifest(one)["files"]
    assert {split: sum(f["rows"] for f in files if f["split"] == split) for split in rows} == rows
    assert [f["file"] for f in files if f["split"] == "train"] == ["train-00000.parquet", "train-00001.parquet"]
    check_shards(many, verify=True)
    ids = [i for f in files for i in pq.read_table(many / f["file"], columns=["case_id"])["case_id"].to_pylist()]
    assert len(ids) == len(set(ids)) == sum(rows.values())


# --- bad input: each corrupts one case of a copy of the cohort; one preparation run checks them all ---


def _truncate(root: Path, cid: str) -> tuple[str, str]:
    path = root / "imaging" / cid / "delayed.nii.gz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    return str(path), "delayed"


def _missing_phase(root: Path, cid: str) -> tuple[str, str]:
    path = root / "imaging" / cid / "non_contrast.nii.gz"
    path.unlink()
    return str(path), "non_contrast"


def _nan_phase(root: Path, cid: str) -> tuple[str, str]:
    path = root / "imaging" / cid / "venous.nii.gz"
    image = sitk.ReadImage(str(path))
    values = sitk.GetArrayFromImage(image).astype(np.float32)
    values[values.shape[0] // 2, 10, 10] = np.nan
    nan_image = sitk.GetImageFromArray(values)
    nan_image.CopyInformation(image)
    sitk.WriteImage(nan_image, str(path), useCompression=True)
    return str(path), "venous"


def _box_outside(root: Path, cid: str) -> tuple[str, str]:
    path = root / "imaging" / cid / "bbox.json"
    document = json.loads(path.read_text(encoding="utf-8"))
    document["boxes"][0]["zyx_max"][2] += 10_000
    path.write_text(json.dumps(document), encoding="utf-8")
    box = document["boxes"][0]
    return str(root / "imaging" / cid / f"{box['phase']}.nii.gz"), "boxes[0]"


def _malformed_bbox(root: Path, cid: str) -> tuple[str, str | None]:
    path = root / "imaging" / cid / "bbox.json"
    path.write_text('{"boxes": [{"class": "lesion", "zyx_min": [1, 2', encoding="utf-8")
    return str(path), None


def _duplicate_patient(root: Path, cid: str) -> tuple[str, str]:
    shutil.copytree(root / "imaging" / cid, root / "imaging" / f"{cid}B")
    for lang in ("EN", "CN"):
        shutil.copy(root / "metadata" / lang / f"{cid}.json", root / "metadata" / lang / f"{cid}B.json")
    return str(root / "imaging" / cid), "patient_id"


def _unreadable_dicom_slice(root: Path, cid: str) -> tuple[str, str]:
    folder = root / "imaging" / cid
    image = sitk.ReadImage(str(folder / "venous.nii.gz"))
    (folder / "venous.nii.gz").unlink()
    write_dicom_series(image, folder / "venous", "1.2.826.0.1.3680043.10.1", "venous")
    victim = sorted((folder / "venous").iterdir())[5]
    victim.write_bytes(victim.read_bytes()[:300])
    return str(folder / "venous"), "venous"


BAD_INPUTS = {
    "truncated_nifti": (_truncate, "unreadable"),
    "missing_phase": (_missing_phase, "missing_part"),
    "nan_voxels": (_nan_phase, "nan_values"),
    "box_outside_volume": (_box_outside, "box_outside_volume"),
    "malformed_bbox_json": (_malformed_bbox, "malformed_annotation"),
    "patient_in_two_folders": (_duplicate_patient, "duplicate_patient"),
    "unreadable_dicom_slice": (_unreadable_dicom_slice, "unreadable"),
}


@pytest.fixture(scope="module")
def corrupted_cohort(demo_raw, tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupted")
    shutil.copytree(demo_raw, root / "raw")
    raw = root / "raw"
    case_ids = sorted(p.name for p in (raw / "imaging").iterdir())
    expected = {}
    for (kind, (corrupt, reason)), cid in zip(BAD_INPUTS.items(), case_ids, strict=False):
        file, field = corrupt(raw, cid)
        expected[kind] = (cid, reason, file, field)
    result = prepare_shards(raw, root / "out", tiny_prepare())
    return result, expected, case_ids


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_bad_input_is_reported_with_case_file_and_field(corrupted_cohort, kind):
    result, expected, _ = corrupted_cohort
    cid, reason, file, field = expected[kind]
    errors = [e for e in result.excluded if e["case_id"] == cid]
    assert len(errors) == 1, errors
    assert errors[0]["reason"] == reason
    assert errors[0]["file"] == file and (field is None or errors[0]["field"].startswith(field))
    split = json.loads((result.shard_dir / "split.json").read_text(encoding="utf-8"))
    assert cid in split["excluded"] and all(cid not in split[s] for s in SPLITS)


def test_bad_inputs_lose_nothing_else(corrupted_cohort):
    result, expected, case_ids = corrupted_cohort
    bad = {cid for cid, *_ in expected.values()} | {f"{expected['patient_in_two_folders'][0]}B"}
    assert {e["case_id"] for e in result.excluded} == bad
    kept = {r["case_id"] for r in _rows(result.shard_dir)}
    assert kept == set(case_ids) - bad and len(kept) == 3
    qc_markdown = (result.qc_report.parent / "qc_report.md").read_text(encoding="utf-8")
    assert all(cid in qc_markdown for cid in bad)


def test_strict_mode_stops_at_the_first_bad_case(corrupted_cohort, tmp_path):
    raw = corrupted_cohort[0].qc_report.parent.parent / "raw"
    with pytest.raises(CaseError):
        prepare_shards(raw, tmp_path, dataclasses.replace(tiny_prepare(), strict=True))
    assert not (tmp_path / "shards" / "manifest.json").exists()


# --- the other layouts and sources, end to end ---


def test_paper_layout_with_dicom_phases_end_to_end(ray_cluster, tmp_path):
    generate_cohort(tmp_path / "raw", DemoConfig(cases=3, seed=11, layout="paper", dicom=True, endoscopy_size=32))
    assert (tmp_path / "raw" / "GXD00000" / "ct" / "venous").is_dir()
    result = prepare_shards(tmp_path / "raw", tmp_path / "out", tiny_prepare())
    assert sum(result.rows.values()) == 3 and not result.excluded


def test_demo_cases_built_on_the_real_ct(ray_cluster, tmp_path, real_ct_dir):
    config = DemoConfig(
        cases=2,
        seed=5,
        endoscopy_size=32,
        template_ct=real_ct_dir / "example_ct_sm.nii.gz",
        template_labels=real_ct_dir / "example_seg.nii.gz",
    )
    generate_cohort(tmp_path / "raw", config)
    result = prepare_shards(tmp_path / "raw", tmp_path / "out", tiny_prepare())
    assert sum(result.rows.values()) == 2 and not result.excluded
    for row in _rows(result.shard_dir):
        venous = PHASES.index("venous")
        assert row["box_present"][venous * 3 + 2], "the real stomach gives a stomach box"
