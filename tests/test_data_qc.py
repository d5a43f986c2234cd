"""Data that cannot slip through: every kind of bad input is one case's QC exclusion, never a crash of the run.

Each kind corrupts one clone of a demo case; one preparation run over all the clones checks that each is
excluded with a QC line naming the case, the file and the field (``qc_report.json`` and ``qc_report.md``), and
a strict run over each clone alone checks the clean error. The anatomy check is also run on the real CT
(never copied here) and on the demo cohort, where it must exclude nothing; the shard checks corrupt a copy of
small shards byte by byte.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import SimpleITK as sitk

from gx_ray.data import volumes
from gx_ray.data.demo.cohort import generate_case
from gx_ray.data.layouts import read_cohort, write_release_case
from gx_ray.data.prepare import QC_MARKDOWN, prepare_shards
from gx_ray.data.preprocess import (
    PreprocessConfig,
    preprocess_case,
    structure_score,
)
from gx_ray.data.shards import (
    MANIFEST_FILE,
    ShardIntegrityError,
    ShardWriter,
    TensorLayout,
    check_shards,
    read_manifest,
    read_shard,
    read_split,
    shard_schema,
    write_manifest,
)
from gx_ray.data.volumes import load_volume, parse_nifti_header
from gx_ray.schema import PHASES, REFERENCE_PHASE, Case, CaseError
from tests.common import tiny_cohort, tiny_prepare

from .conftest import find_real_ct_dir

SOURCE = "GXD00000"
LAB = "wbc"  # a numeric model input the demo case has


# --- building and corrupting case clones ---------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """Case 0 of the tiny demo cohort, written in the release layout (no Ray needed)."""
    root = tmp_path_factory.mktemp("template")
    write_release_case(root, generate_case(tiny_cohort(), 0))
    return root


def _clone(template: Path, root: Path, cid: str) -> Path:
    """A copy of the template case under id ``cid`` (its own patient); returns its imaging folder."""
    folder = root / "imaging" / cid
    shutil.copytree(template / "imaging" / SOURCE, folder)
    for lang in ("EN", "CN"):
        document = json.loads((template / "metadata" / lang / f"{SOURCE}.json").read_text(encoding="utf-8"))
        document["meta"]["patient_id"] = cid
        (root / "metadata" / lang).mkdir(parents=True, exist_ok=True)
        (root / "metadata" / lang / f"{cid}.json").write_text(json.dumps(document), encoding="utf-8")
    for sub, suffix in (("clinical", ".json"), ("endoscopy", ".png")):
        (root / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy(template / sub / f"{SOURCE}{suffix}", root / sub / f"{cid}{suffix}")
    return folder


@dataclasses.dataclass(frozen=True)
class Expected:
    case_id: str
    reason: str
    file: str
    field: str
    says: str
    """A piece of the message: the value or the problem."""


def _nifti_bytes(path: Path) -> bytearray:
    return bytearray(gzip.decompress(path.read_bytes()))


def _write_nifti(path: Path, data: bytes) -> None:
    path.write_bytes(gzip.compress(bytes(data), compresslevel=1))


def _zero_z_spacing(root: Path, cid: str) -> Expected:
    path = root / "imaging" / cid / "delayed.nii.gz"
    data = _nifti_bytes(path)
    data[76 + 3 * 4 : 76 + 4 * 4] = struct.pack("<f", 0.0)  # pixdim[3]; ITK would read it as 1 mm
    _write_nifti(path, data)
    return Expected(cid, "bad_geometry", str(path), "delayed.pixdim[3]", "(0.0)")


def _sheared_direction(root: Path, cid: str) -> Expected:
    folder = root / "imaging" / cid
    image = sitk.ReadImage(str(folder / "non_contrast.nii.gz"))
    image.SetDirection((1.0, 0.3, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0))  # MetaIO keeps it as written
    (folder / "non_contrast.nii.gz").unlink()
    sitk.WriteImage(image, str(folder / "non_contrast.mha"))
    return Expected(cid, "bad_geometry", str(folder / "non_contrast.mha"), "non_contrast.direction", "orthonormal")


def _sheared_sform(root: Path, cid: str) -> Expected:
    path = root / "imaging" / cid / "delayed.nii.gz"
    data = _nifti_bytes(path)
    srow = list(struct.unpack("<12f", data[280:328]))
    srow[1] = 0.5 * abs(srow[0])  # x picks up y: ITK would silently fall back to the qform
    data[280:328] = struct.pack("<12f", *srow)
    _write_nifti(path, data)
    return Expected(cid, "bad_geometry", str(path), "delayed.srow", "orthonormal")


def _noise_phase(root: Path, cid: str) -> Expected:
    path = root / "imaging" / cid / "delayed.nii.gz"
    image = sitk.ReadImage(str(path))
    rng = np.random.default_rng(0)
    noise = sitk.GetImageFromArray(rng.uniform(-1000, 1000, image.GetSize()[::-1]).astype(np.int16))
    noise.CopyInformation(image)
    sitk.WriteImage(noise, str(path), useCompression=True)
    return Expected(cid, "no_anatomy", str(path), "delayed", "no anatomy")


def _lab(value_json: str, says: str) -> Callable[[Path, str], Expected]:
    def corrupt(root: Path, cid: str) -> Expected:
        path = root / "clinical" / f"{cid}.json"
        text = path.read_text(encoding="utf-8")
        document = json.loads(text)
        document["variables"][LAB] = "__VALUE__"
        path.write_text(json.dumps(document).replace('"__VALUE__"', value_json), encoding="utf-8")
        return Expected(cid, "malformed_annotation", str(path), LAB, says)

    return corrupt


def _box(value_json: str, says: str) -> Callable[[Path, str], Expected]:
    def corrupt(root: Path, cid: str) -> Expected:
        path = root / "imaging" / cid / "bbox.json"
        document = json.loads(path.read_text(encoding="utf-8"))
        document["boxes"][2]["zyx_min"][1] = "__VALUE__"
        path.write_text(json.dumps(document).replace('"__VALUE__"', value_json), encoding="utf-8")
        return Expected(cid, "malformed_annotation", str(path), "boxes[2].zyx_min[1]", says)

    return corrupt


def _non_utf8_folder(root: Path, cid: str) -> Expected:
    folder = root / "imaging" / cid
    raw = os.fsencode(folder.parent) + b"/" + cid.encode() + b"\xff\xfe"
    os.rename(os.fsencode(folder), raw)  # a Latin-1 export, say: not valid UTF-8
    printable = cid + "\\xff\\xfe"
    return Expected(printable, "unreadable", str(folder.parent / printable), "case_id", "not valid UTF-8")


def _dangling_symlink(root: Path, cid: str) -> Expected:
    shutil.rmtree(root / "imaging" / cid)
    link = root / "imaging" / cid
    link.symlink_to(root / "gone" / cid)  # the disk it pointed to is not mounted
    return Expected(cid, "unreadable", str(link), "case folder", "points to nothing")


def _looping_symlink(root: Path, cid: str) -> Expected:
    shutil.rmtree(root / "imaging" / cid)
    link = root / "imaging" / cid
    link.symlink_to(cid)  # itself
    return Expected(cid, "unreadable", str(link), "case folder", "loops")


GIB = 1 << 30


def _gzip_bomb(root: Path, cid: str) -> Expected:
    """The valid NIfTI followed by 1 GiB of zeros, about 1 MB on disk: gzip members of 64 MiB of zeros each
    (concatenated members are one valid gzip stream), so building it takes no 1 GiB compression."""
    path = root / "imaging" / cid / "venous.nii.gz"
    zeros = gzip.compress(bytes(64 << 20), compresslevel=9)
    path.write_bytes(gzip.compress(bytes(_nifti_bytes(path)), compresslevel=1) + zeros * (GIB // (64 << 20)))
    return Expected(cid, "unreadable", str(path), "venous", "gzip bomb")


BAD_INPUTS: dict[str, Callable[[Path, str], Expected]] = {
    "zero_z_spacing": _zero_z_spacing,
    "sheared_direction": _sheared_direction,
    "sheared_sform": _sheared_sform,
    "noise_phase": _noise_phase,
    "lab_infinity_literal": _lab("Infinity", "infinite (inf)"),
    "lab_infinity_string": _lab('"Infinity"', "infinite ('Infinity')"),
    "lab_beyond_float32": _lab("-1e300", "beyond float32's range (-1e+300)"),
    "box_infinity": _box("Infinity", "not finite (inf)"),
    "box_infinity_string": _box('"Infinity"', "not finite ('Infinity')"),
    "box_fraction": _box("10.5", "not a whole voxel index (10.5)"),
    "box_boolean": _box("true", "a boolean (True)"),
    "non_utf8_folder": _non_utf8_folder,
    "dangling_symlink": _dangling_symlink,
    "looping_symlink": _looping_symlink,
    "gzip_bomb": _gzip_bomb,
}


def _corrupt_one(template: Path, root: Path, kind: str, cid: str) -> Expected:
    _clone(template, root, cid)
    return BAD_INPUTS[kind](root, cid)


@pytest.fixture(scope="module")
def corrupted_clones(ray_cluster, template, tmp_path_factory):
    """One clone per bad kind, one intact clone and one with a NaN lab; a single preparation run."""
    root = tmp_path_factory.mktemp("qc") / "raw"
    expected = {kind: _corrupt_one(template, root, kind, f"GXQ{i:03d}") for i, kind in enumerate(BAD_INPUTS)}
    _clone(template, root, "GXOK000")
    _clone(template, root, "GXOK001")
    _lab("NaN", "")(root, "GXOK001")
    result = prepare_shards(root, root.parent / "out", tiny_prepare())
    return result, expected


def _qc_line(result, expected: Expected) -> str:
    lines = (result.qc_report.parent / QC_MARKDOWN).read_text(encoding="utf-8").splitlines()
    found = [line for line in lines if line.startswith(f"| {expected.case_id} |")]
    assert len(found) == 1, (expected.case_id, lines)
    return found[0]


def _check_reported(result, expected: Expected) -> None:
    errors = [e for e in result.excluded if e["case_id"] == expected.case_id]
    assert len(errors) == 1, (expected, result.excluded)
    error = errors[0]
    assert (error["reason"], error["file"], error["field"]) == (expected.reason, expected.file, expected.field)
    assert expected.says in error["message"], error["message"]
    line = _qc_line(result, expected)
    assert f"| {expected.reason} | {expected.file} | {expected.field} |" in line and expected.says in line
    split = json.loads((result.shard_dir / "split.json").read_text(encoding="utf-8"))
    assert expected.case_id in split["excluded"]


def _check_strict(template: Path, tmp_path: Path, kind: str) -> None:
    root = tmp_path / "raw"
    expected = _corrupt_one(template, root, kind, "GXS000")
    with pytest.raises(CaseError) as caught:
        prepare_shards(root, tmp_path / "out", dataclasses.replace(tiny_prepare(), strict=True))
    err = caught.value
    assert (err.case_id, err.reason, str(err.file), err.field) == (
        expected.case_id,
        expected.reason,
        expected.file,
        expected.field,
    )
    assert str(err).startswith(f"case {expected.case_id}: {expected.file}: {expected.field!r}: ")
    assert expected.says in str(err)
    assert not (tmp_path / "out" / "shards" / MANIFEST_FILE).exists()


def test_the_run_survives_every_bad_input_and_keeps_the_good_cases(corrupted_clones):
    result, expected = corrupted_clones
    assert {e["case_id"] for e in result.excluded} == {e.case_id for e in expected.values()}
    kept = [row for f in sorted(result.shard_dir.glob("*.parquet")) for row in pq.read_table(f).to_pylist()]
    assert sorted(r["case_id"] for r in kept) == ["GXOK000", "GXOK001"]
    # NaN is how table exports write an empty cell: missing, with its mask, not an exclusion
    names = list(read_manifest(result.shard_dir)["lab_names"])
    nan_row = next(r for r in kept if r["case_id"] == "GXOK001")
    assert nan_row["labs_missing"][names.index(LAB)] and math.isnan(nan_row["labs"][names.index(LAB)])


# a. voxel spacing


def test_zero_z_spacing_is_excluded(corrupted_clones):
    _check_reported(corrupted_clones[0], corrupted_clones[1]["zero_z_spacing"])


def test_zero_z_spacing_strict(template, tmp_path):
    _check_strict(template, tmp_path, "zero_z_spacing")


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("spacing", [0.0, -2.0, math.nan, math.inf])
def test_bad_pixdim_in_either_byte_order_is_refused(tmp_path, order, spacing):
    path = tmp_path / "phase.nii.gz"
    _write_nifti(path, _tiny_nifti(order, (2.0, 2.0, spacing)))
    with pytest.raises(CaseError) as caught:
        load_volume(path, "GX1", "venous")
    assert (caught.value.reason, caught.value.field) == ("bad_geometry", "venous.pixdim[3]")
    assert f"({spacing})" in caught.value.message


@pytest.mark.parametrize("order", ["<", ">"])
def test_a_good_header_in_either_byte_order_reads(tmp_path, order):
    path = tmp_path / "phase.nii"
    path.write_bytes(_tiny_nifti(order, (2.0, 2.5, 3.0)))
    header = parse_nifti_header(path.read_bytes())
    assert header.byte_order == order and header.dims == (4, 3, 2) and header.pixdim == (2.0, 2.5, 3.0)
    image = load_volume(path, "GX1", "venous")
    assert image.GetSpacing() == (2.0, 2.5, 3.0) and image.GetSize() == (4, 3, 2)
    assert sitk.GetArrayViewFromImage(image)[1, 2, 3] == 23


def test_zero_spacing_in_a_metaimage_is_refused(tmp_path):
    # MetaIO keeps a zero spacing as written; a SimpleITK image cannot be given one, so write the header by hand
    path = tmp_path / "phase.mha"
    header = "ObjectType = Image\nNDims = 3\nBinaryData = True\nBinaryDataByteOrderMSB = False\n"
    header += "ElementSpacing = 1 1 0\nDimSize = 4 3 2\nElementType = MET_SHORT\nElementDataFile = LOCAL\n"
    path.write_bytes(header.encode() + bytes(2 * 24))
    with pytest.raises(CaseError) as caught:
        load_volume(path, "GX1", "venous")
    # ITK itself refuses this one ("Refusing to change spacing"); check_geometry is there for what it lets through
    assert caught.value.reason in ("bad_geometry", "unreadable") and caught.value.field.startswith("venous")
    assert "spacing" in caught.value.message


def _tiny_nifti(order: str, spacing: tuple[float, float, float]) -> bytes:
    """A 4x3x2 int16 NIfTI-1 file (voxel value 10*y + x) written by hand in byte order ``order``."""
    header = bytearray(348)
    struct.pack_into(order + "i", header, 0, 348)
    struct.pack_into(order + "8h", header, 40, 3, 4, 3, 2, 1, 1, 1, 1)
    struct.pack_into(order + "2h", header, 70, 4, 16)  # int16
    struct.pack_into(order + "8f", header, 76, 1.0, *spacing, 0, 0, 0, 0)
    struct.pack_into(order + "f", header, 108, 352.0)
    struct.pack_into(order + "f", header, 112, 1.0)  # scl_slope
    struct.pack_into(order + "h", header, 252, 1)  # qform_code, identity quaternion
    header[344:348] = b"n+1\0"
    voxels = np.fromfunction(lambda z, y, x: 10 * y + x, (2, 3, 4)).astype(order + "i2")
    return bytes(header) + bytes(4) + voxels.tobytes()


# b. direction


def test_sheared_direction_is_excluded(corrupted_clones):
    _check_reported(corrupted_clones[0], corrupted_clones[1]["sheared_direction"])


def test_sheared_direction_strict(template, tmp_path):
    _check_strict(template, tmp_path, "sheared_direction")


def test_sheared_nifti_sform_is_excluded(corrupted_clones):
    _check_reported(corrupted_clones[0], corrupted_clones[1]["sheared_sform"])


def test_direction_within_tolerance_is_kept(tmp_path):
    image = sitk.Image(4, 3, 2, sitk.sitkInt16)
    angle = 0.3
    c, s = math.cos(angle), math.sin(angle)
    image.SetDirection((c, -s, 0.0, s, c, 1e-4, 0.0, 0.0, 1.0))  # a rotation with float noise: fine
    sitk.WriteImage(image, str(tmp_path / "ok.mha"))
    assert load_volume(tmp_path / "ok.mha", "GX1", "venous").GetSize() == (4, 3, 2)


# c. no anatomy


def test_noise_phase_is_excluded(corrupted_clones):
    _check_reported(corrupted_clones[0], corrupted_clones[1]["noise_phase"])


def test_noise_phase_strict(template, tmp_path):
    _check_strict(template, tmp_path, "noise_phase")


REAL = PreprocessConfig.preset("demo")


REAL_CONFIGS = (REAL, PreprocessConfig(spacing_zyx_mm=(3.0, 2.0, 2.0), shape_zyx=(40, 80, 80)))


def _real_phases(folder: Path) -> dict[str, Path]:
    """Phases of the real CT that share one frame: venous is ``example_ct_sm``; non-contrast the same with the
    organs 40 HU darker and moved 3 mm; delayed the same 30 slices read from ``example_ct`` (int32, other file).

    ``example_ct_sm`` holds slices 82-111 of ``example_ct`` but keeps its origin, so as files the two lie 246 mm
    apart; delayed is given the origin of its slices in ``example_ct_sm``'s frame."""
    real = find_real_ct_dir()
    lower, full, seg = (sitk.ReadImage(str(real / f"example_{n}.nii.gz")) for n in ("ct_sm", "ct", "seg"))
    values = sitk.GetArrayFromImage(lower)
    values[np.isin(sitk.GetArrayViewFromImage(seg), (1, 2, 3, 5, 6, 7))] -= 40
    darker = sitk.GetImageFromArray(values)
    darker.CopyInformation(lower)
    shift = sitk.TranslationTransform(3, (2.0, -1.5, 1.5))
    sitk.WriteImage(sitk.Resample(darker, lower, shift, sitk.sitkLinear, -1024), str(folder / "non_contrast.nii.gz"))
    upper = full[:, :, full.GetSize()[2] - lower.GetSize()[2] :]
    upper.SetOrigin(lower.GetOrigin())
    sitk.WriteImage(upper, str(folder / "delayed.nii.gz"))
    return {
        "venous": real / "example_ct_sm.nii.gz",
        "non_contrast": folder / "non_contrast.nii.gz",
        "delayed": folder / "delayed.nii.gz",
    }


def test_anatomy_check_excludes_nothing_on_the_real_ct(tmp_path):
    real = find_real_ct_dir()
    for config in REAL_CONFIGS:
        for name in ("example_ct.nii.gz", "example_ct_sm.nii.gz"):
            assert structure_score(sitk.ReadImage(str(real / name)), config) >= config.min_structure + 0.4
    # the whole pipeline, registration included, on real-CT phases: nothing excluded, with a wide margin
    case = Case("real", tmp_path, _real_phases(tmp_path))
    for config in REAL_CONFIGS:
        out = preprocess_case(case, config)
        assert set(out.anatomy) == {"venous", "non_contrast", "delayed"}
        assert min(a["structure"] for a in out.anatomy.values()) >= config.min_structure + 0.4
        for phase in ("non_contrast", "delayed"):
            assert out.anatomy[phase]["reference_correlation"] >= config.min_reference_correlation + 0.4


def test_anatomy_check_excludes_nothing_on_the_demo_cohort(demo_prepared):
    qc = json.loads(demo_prepared.qc_report.read_text(encoding="utf-8"))
    assert not qc["excluded"]
    config = tiny_prepare().preprocess
    for case in qc["cases"].values():
        assert set(case["anatomy"]) >= {"non_contrast", "venous", "delayed"}
        for phase, scores in case["anatomy"].items():
            assert scores["structure"] >= config.min_structure + 0.4, phase
            if phase != REFERENCE_PHASE:
                assert scores["reference_correlation"] >= config.min_reference_correlation + 0.4, phase


def _real_with(phase_image: sitk.Image, tmp_path: Path, phase: str = "delayed") -> Case:
    real = find_real_ct_dir()
    path = tmp_path / f"{phase}.nii.gz"
    sitk.WriteImage(phase_image, str(path))
    phases = {p: real / "example_ct_sm.nii.gz" for p in ("non_contrast", "venous", "delayed")}
    return Case("real-noise", tmp_path, {**phases, phase: path})


@pytest.mark.parametrize("phase", ["delayed", "arterial", "venous"])
def test_a_uniform_noise_phase_of_the_real_ct_is_excluded(tmp_path, phase):
    ct = sitk.ReadImage(str(find_real_ct_dir() / "example_ct_sm.nii.gz"))
    rng = np.random.default_rng(1)
    noise = sitk.GetImageFromArray(rng.uniform(-1024, 3000, ct.GetSize()[::-1]).astype(np.int16))
    noise.CopyInformation(ct)
    # arterial is not registered here: the check does not depend on registration
    config = dataclasses.replace(REAL, register_phases=("non_contrast", "delayed"))
    with pytest.raises(CaseError) as caught:
        preprocess_case(_real_with(noise, tmp_path, phase), config)
    assert (caught.value.reason, caught.value.field) == ("no_anatomy", phase)
    assert caught.value.file == tmp_path / f"{phase}.nii.gz"


def test_a_structured_phase_of_other_anatomy_fails_the_reference_correlation(tmp_path):
    ct = sitk.ReadImage(str(find_real_ct_dir() / "example_ct_sm.nii.gz"))
    rng = np.random.default_rng(2)
    blobs = sitk.SmoothingRecursiveGaussian(
        sitk.GetImageFromArray(rng.normal(0, 1, ct.GetSize()[::-1]).astype(np.float32)), 2.0
    )
    values = sitk.GetArrayFromImage(blobs)
    smooth = sitk.GetImageFromArray((values / values.std() * 400).astype(np.int16))
    smooth.CopyInformation(ct)
    config = dataclasses.replace(REAL, register_phases=())
    assert structure_score(smooth, config) > config.min_structure  # passes the structure check ...
    with pytest.raises(CaseError) as caught:
        preprocess_case(_real_with(smooth, tmp_path), config)
    assert (caught.value.reason, caught.value.field) == ("no_anatomy", "delayed")  # ... not the venous one
    assert "does not show the venous anatomy" in caught.value.message


# d. labs


@pytest.mark.parametrize("kind", ["lab_infinity_literal", "lab_infinity_string", "lab_beyond_float32"])
def test_non_finite_lab_is_excluded(corrupted_clones, kind):
    _check_reported(corrupted_clones[0], corrupted_clones[1][kind])


def test_non_finite_lab_strict(template, tmp_path):
    _check_strict(template, tmp_path, "lab_infinity_string")


def test_lab_check_leaves_categories_and_text_alone(template, tmp_path):
    root = tmp_path / "raw"
    _clone(template, root, "GXL000")
    path = root / "clinical" / "GXL000.json"
    document = json.loads(path.read_text(encoding="utf-8"))
    document["variables"].update(sex="INF", ct_description="inf")  # not numeric variables: not parsed
    path.write_text(json.dumps(document), encoding="utf-8")
    cases, errors = read_cohort(root)
    assert not errors and cases[0].labs["sex"] == "INF"


# e. boxes


@pytest.mark.parametrize("kind", ["box_infinity", "box_infinity_string", "box_fraction", "box_boolean"])
def test_bad_box_coordinate_is_excluded(corrupted_clones, kind):
    _check_reported(corrupted_clones[0], corrupted_clones[1][kind])


@pytest.mark.parametrize("kind", ["box_infinity", "box_fraction"])
def test_bad_box_coordinate_strict(template, tmp_path, kind):
    _check_strict(template, tmp_path, kind)


def test_whole_number_box_coordinates_in_any_spelling_are_kept(template, tmp_path):
    root = tmp_path / "raw"
    _clone(template, root, "GXB000")
    path = root / "imaging" / "GXB000" / "bbox.json"
    document = json.loads(path.read_text(encoding="utf-8"))
    original = list(document["boxes"][0]["zyx_min"])
    document["boxes"][0]["zyx_min"] = [float(original[0]), str(original[1]), original[2]]
    path.write_text(json.dumps(document), encoding="utf-8")
    cases, errors = read_cohort(root)
    assert not errors and cases[0].boxes[0].zyx[:3] == tuple(original)


# f. folder names


def test_non_utf8_case_folder_is_excluded(corrupted_clones):
    _check_reported(corrupted_clones[0], corrupted_clones[1]["non_utf8_folder"])


def test_non_utf8_case_folder_strict(template, tmp_path):
    _check_strict(template, tmp_path, "non_utf8_folder")


# g. symlinks


@pytest.mark.parametrize("kind", ["dangling_symlink", "looping_symlink"])
def test_broken_symlinked_case_folder_is_excluded(corrupted_clones, kind):
    _check_reported(corrupted_clones[0], corrupted_clones[1][kind])


def test_broken_symlink_strict(template, tmp_path):
    _check_strict(template, tmp_path, "looping_symlink")


def test_a_working_symlinked_case_folder_is_read(template, tmp_path):
    root = tmp_path / "raw"
    folder = _clone(template, root, "GXY000")
    shutil.move(folder, tmp_path / "elsewhere")
    folder.symlink_to(tmp_path / "elsewhere")
    cases, errors = read_cohort(root)
    assert not errors and [c.case_id for c in cases] == ["GXY000"]


# h. gzip bombs


def test_gzip_bomb_is_excluded(corrupted_clones):
    _check_reported(corrupted_clones[0], corrupted_clones[1]["gzip_bomb"])


def test_gzip_bomb_strict(template, tmp_path):
    _check_strict(template, tmp_path, "gzip_bomb")


def test_gzip_bomb_is_refused_before_it_is_decompressed(template, tmp_path, monkeypatch):
    root = tmp_path / "raw"
    expected = _corrupt_one(template, root, "gzip_bomb", "GXG000")
    path = Path(expected.file)
    with gzip.open(path) as f:
        image_bytes = parse_nifti_header(f.read(540)).image_bytes
    served = []
    real_open = gzip.open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._file = real_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._file.close()

        def read(self, size=-1):
            data = self._file.read(size)
            served.append(len(data))
            return data

    monkeypatch.setattr(volumes.gzip, "open", Counting)
    with pytest.raises(CaseError, match="gzip bomb"):
        load_volume(path, "GXG000", "venous")
    assert image_bytes < sum(served) <= image_bytes + volumes.NIFTI_SLACK_BYTES + 1 < GIB // 100


def test_a_file_with_a_little_trailing_data_still_reads(tmp_path):
    path = tmp_path / "phase.nii.gz"
    _write_nifti(path, _tiny_nifti("<", (1.0, 1.0, 1.0)) + bytes(1000))
    assert load_volume(path, "GX1", "venous").GetSize() == (4, 3, 2)


# i. shard integrity


LAB_NAMES = ["a", "b"]
CT_SHAPE = (len(PHASES), 4, 16, 16)


@pytest.fixture
def shards(tmp_path) -> Path:
    """Two small train shards of random CT bytes (incompressible, so a page is mostly voxel data)."""
    rng = np.random.default_rng(0)
    schema = shard_schema(CT_SHAPE, 8, LAB_NAMES)
    writer = ShardWriter(tmp_path / "shards", schema, rows_per_shard=4, row_group_rows=2)
    for i in range(8):
        writer.write(
            {
                "case_id": f"C{i}",
                "patient_id": f"C{i}",
                "split": "train",
                "ct": rng.standard_normal(CT_SHAPE).astype(np.float16).tobytes(),
                "phase_present": [True] * len(PHASES),
                "labs": [1.0, 2.0],
                "labs_missing": [False, False],
                "stage_label": -1,
            }
        )
    files = writer.close()
    write_manifest(tmp_path / "shards", files, TensorLayout(CT_SHAPE, (3, 8, 8), tuple(LAB_NAMES)), {})
    return tmp_path / "shards"


def _first_shard(shard_dir: Path) -> Path:
    return shard_dir / read_manifest(shard_dir)["files"][0]["file"]


def _flip_inside_ct_page(path: Path) -> None:
    metadata = pq.ParquetFile(path).metadata
    ct = metadata.schema.names.index("ct")
    column = metadata.row_group(0).column(ct)
    offset = column.data_page_offset + column.total_compressed_size // 2  # well past the page header
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_intact_shards_pass_every_check(shards):
    manifest = check_shards(shards, verify=True)
    assert sum(f["rows"] for f in manifest["files"]) == 8
    assert read_shard(_first_shard(shards)).num_rows == 4


def test_truncated_shard_fails_the_size_check_naming_the_file(shards):
    path = _first_shard(shards)
    path.write_bytes(path.read_bytes()[:-100])
    for check in (lambda: read_manifest(shards), lambda: check_shards(shards, verify=False)):
        with pytest.raises(ShardIntegrityError, match=f"{path}: .* bytes, the manifest records .*truncated"):
            check()
    with pytest.raises(ShardIntegrityError, match=str(path)):  # and a read names it too, not a bare pyarrow error
        read_shard(path)


def test_flipped_byte_fails_the_sha256_check_naming_the_file(shards):
    path = _first_shard(shards)
    _flip_inside_ct_page(path)
    read_manifest(shards, verify=False)  # the size still matches: only the digest can tell
    with pytest.raises(ShardIntegrityError, match=f"{path}: SHA-256 .* does not match"):
        check_shards(shards, verify=True)


def test_flipped_byte_inside_a_page_fails_the_page_checksum_naming_the_file(shards):
    path = _first_shard(shards)
    _flip_inside_ct_page(path)
    with pytest.raises(OSError, match="CRC"):  # pyarrow itself sees it: the pages carry checksums
        pq.ParquetFile(path, page_checksum_verification=True).read_row_group(0)
    with pytest.raises(ShardIntegrityError, match=f"{path}: row group 0 is corrupt .*CRC"):
        read_shard(path, row_group=0)
    assert read_shard(path, row_group=1).num_rows == 2  # the other row group is intact


def test_a_corrupt_page_fails_the_streaming_read_naming_the_file(ray_cluster, shards):
    path = _first_shard(shards)
    _flip_inside_ct_page(path)
    with pytest.raises(Exception, match=str(path)) as caught:
        for _ in read_split(shards, "train").iter_batches(batch_size=2):
            pass
    assert "CRC" in str(caught.value)


def test_a_missing_shard_is_named(shards):
    path = _first_shard(shards)
    path.unlink()
    with pytest.raises(ShardIntegrityError, match=f"{path}: listed in"):
        check_shards(shards)
