"""Appendix-B preprocessing on the real abdominal CT, with the other phases made from it by known rigid moves.

The venous phase is the real CT; non-contrast, arterial and delayed are the same CT with organ enhancement
changed, moved by a known transform and written at another spacing, so registration has a known answer.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk

from gx_ray.data.preprocess import Grid, PreprocessConfig, preprocess_case, register_rigid, resample_onto
from gx_ray.data.shards import hounsfield
from gx_ray.schema import PHASES, Box, Case, CaseError

from .conftest import find_real_ct_dir

REAL_CT = find_real_ct_dir()
STOMACH = 6

CONFIG = PreprocessConfig(spacing_zyx_mm=(3.0, 2.0, 2.0), shape_zyx=(40, 80, 80))
UNREGISTERED = dataclasses.replace(CONFIG, register_phases=())
# (rotation about x, y, z in degrees, translation in mm): non-contrast only translates, so its box must come back
# onto the venous box exactly; the others rotate as well.
MOVES = {
    "non_contrast": ((0.0, 0.0, 0.0), (-3.0, 2.0, -2.5)),
    "arterial": ((2.0, -1.5, 3.0), (4.0, -3.0, 2.5)),
    "delayed": ((-1.5, 1.0, -2.0), (2.0, 4.0, -3.0)),
}
SPACINGS = {"non_contrast": (2.8, 2.8, 3.0), "arterial": (2.5, 2.5, 3.5), "delayed": (3.2, 3.2, 2.8)}
ENHANCEMENT_HU = {"non_contrast": -40, "arterial": 60, "delayed": 15}  # added to spleen, kidneys, liver, stomach...
ENHANCED_LABELS = (1, 2, 3, 5, 6, 7)


def _ct() -> sitk.Image:
    return sitk.ReadImage(str(REAL_CT / "example_ct_sm.nii.gz"))


def _seg() -> sitk.Image:
    return sitk.ReadImage(str(REAL_CT / "example_seg.nii.gz"))


def _truth(phase: str) -> sitk.Euler3DTransform:
    """Venous point → the same anatomy in ``phase`` (the registration's convention)."""
    ct = _ct()
    degrees, shift = MOVES[phase]
    transform = sitk.Euler3DTransform()
    transform.SetCenter(ct.TransformContinuousIndexToPhysicalPoint([(s - 1) / 2 for s in ct.GetSize()]))
    transform.SetRotation(*np.deg2rad(degrees))
    transform.SetTranslation(shift)
    return transform


def _moved(image: sitk.Image, truth: sitk.Transform, spacing: tuple[float, ...], nearest: bool = False):
    """``image``'s anatomy moved by ``truth``, on a grid of the same field of view at ``spacing``."""
    size = [int(np.ceil(n * s / t)) for n, s, t in zip(image.GetSize(), image.GetSpacing(), spacing, strict=True)]
    edge = image.TransformContinuousIndexToPhysicalPoint([-0.5] * 3)
    origin = np.asarray(edge) + np.reshape(image.GetDirection(), (3, 3)) @ (np.asarray(spacing) / 2)
    return sitk.Resample(
        image,
        size,
        truth.GetInverse(),  # the moved image at q shows the venous anatomy at truth⁻¹(q)
        sitk.sitkNearestNeighbor if nearest else sitk.sitkLinear,
        tuple(origin),
        spacing,
        image.GetDirection(),
        0 if nearest else -1024,
        image.GetPixelID(),
    )


def _stomach_box(seg: sitk.Image, phase: str) -> Box:
    voxels = np.argwhere(sitk.GetArrayViewFromImage(seg) == STOMACH)
    return Box("stomach", phase, tuple(int(v) for v in (*voxels.min(axis=0), *(voxels.max(axis=0) + 1))))


def _write_phase(folder: Path, phase: str, truth: sitk.Transform | None = None) -> Path:
    ct, seg = _ct(), _seg()
    values = sitk.GetArrayFromImage(ct)
    values[np.isin(sitk.GetArrayViewFromImage(seg), ENHANCED_LABELS)] += ENHANCEMENT_HU[phase]
    enhanced = sitk.GetImageFromArray(values)
    enhanced.CopyInformation(ct)
    path = folder / f"{phase}.nii.gz"
    sitk.WriteImage(_moved(enhanced, truth or _truth(phase), SPACINGS[phase]), str(path))
    return path


@pytest.fixture(scope="module")
def real_case(tmp_path_factory) -> Case:
    folder = tmp_path_factory.mktemp("real_case")
    phases = {"venous": REAL_CT / "example_ct_sm.nii.gz"}
    boxes = [_stomach_box(_seg(), "venous")]
    for phase in MOVES:
        phases[phase] = _write_phase(folder, phase)
        boxes.append(_stomach_box(_moved(_seg(), _truth(phase), SPACINGS[phase], nearest=True), phase))
    return Case("real-001", folder, phases, boxes=boxes)


@pytest.fixture(scope="module")
def result(real_case):
    return preprocess_case(real_case, CONFIG)


def _stomach_corners() -> np.ndarray:
    # a view of a temporary image reads freed memory once the image is collected: keep the image alive while read
    ct, seg = _ct(), _seg()
    voxels = np.argwhere(sitk.GetArrayViewFromImage(seg) == STOMACH)
    corners = itertools.product(*zip(voxels.min(axis=0), voxels.max(axis=0), strict=True))
    return np.array([ct.TransformContinuousIndexToPhysicalPoint([float(v) for v in c[::-1]]) for c in corners])


def _expected_box(venous_points: np.ndarray, crop_origin: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """Where venous-space points must land on the crop: the resampled grid spans the venous field of view."""
    ct = _ct()
    index = np.array([ct.TransformPhysicalPointToContinuousIndex(tuple(p)) for p in venous_points])[:, ::-1]
    mm_from_edge = (index + 0.5) * np.asarray(ct.GetSpacing()[::-1])
    cells = mm_from_edge / np.asarray(CONFIG.spacing_zyx_mm) - np.asarray(crop_origin)
    start, stop = np.floor(cells.min(axis=0) + 1e-6), np.ceil(cells.max(axis=0) - 1e-6)
    return np.clip(np.concatenate([start, stop]), 0, np.tile(shape, 2)).astype(int)


def test_registration_recovers_the_known_transform_within_one_voxel(result):
    corners, voxel_mm = _stomach_corners(), min(CONFIG.spacing_zyx_mm)
    assert set(result.registration) == set(MOVES)
    for phase, info in result.registration.items():
        found = sitk.Euler3DTransform()
        found.SetFixedParameters(info["fixed_parameters"])
        found.SetParameters(info["parameters"])
        truth = _truth(phase)
        errors = [np.linalg.norm(np.subtract(found.TransformPoint(p), truth.TransformPoint(p))) for p in corners]
        assert max(errors) < voxel_mm, (phase, errors)
        true_shift = np.mean([np.linalg.norm(np.subtract(truth.TransformPoint(p), p)) for p in corners])
        assert info["misalignment_mm"] == pytest.approx(true_shift, abs=voxel_mm)
        assert info["iterations"] > 0 and info["stop_reason"]


def test_boxes_come_back_onto_the_venous_stomach_box(result, real_case):
    shape = CONFIG.shape_zyx
    boxes = {box.phase: np.array(box.zyx) for box in result.boxes}
    ct = _ct()
    # the venous box only changes grid: its edges in mm from the field of view's edge fix it exactly
    venous = real_case.boxes[0].zyx
    edges = [[c - 0.5 for c in corner[::-1]] for corner in itertools.product(*zip(venous[:3], venous[3:], strict=True))]
    venous_points = np.array([ct.TransformContinuousIndexToPhysicalPoint(e) for e in edges])
    np.testing.assert_array_equal(boxes["venous"], _expected_box(venous_points, result.crop_origin_zyx, shape))
    # a translated phase's box lands on the venous one
    assert np.abs(boxes["non_contrast"] - boxes["venous"]).max() <= 1
    # a rotated phase's box is its raw box carried back by the true transform (the hull grows with the rotation)
    for phase in ("arterial", "delayed"):
        raw_box = next(b for b in real_case.boxes if b.phase == phase).zyx
        moved = sitk.ReadImage(str(real_case.phases[phase]))
        corners = itertools.product(*zip(raw_box[:3], raw_box[3:], strict=True))
        points = [moved.TransformContinuousIndexToPhysicalPoint([c - 0.5 for c in corner[::-1]]) for corner in corners]
        inverse = _truth(phase).GetInverse()
        truth_points = np.array([inverse.TransformPoint(p) for p in points])
        assert np.abs(boxes[phase] - _expected_box(truth_points, result.crop_origin_zyx, shape)).max() <= 1, phase
        assert np.all(boxes[phase][:3] <= boxes["venous"][:3] + 1) and np.all(
            boxes[phase][3:] >= boxes["venous"][3:] - 1
        )


def test_output_is_float16_z_scored_and_the_phases_are_aligned(result, real_case):
    assert result.case_id == "real-001"
    assert result.volume.shape == (len(PHASES), *CONFIG.shape_zyx) and result.volume.dtype == np.float16
    assert result.phase_present == (True,) * len(PHASES)
    for channel in result.volume.astype(np.float64):
        assert abs(channel.mean()) < 1e-2 and abs(channel.std() - 1) < 1e-2
    # the crop is centred on the (venous) stomach box
    box = np.array(result.boxes[0].zyx)
    assert np.all(np.abs((box[:3] + box[3:]) / 2 - np.array(CONFIG.shape_zyx) / 2) <= 1)
    # registration is what makes the phases agree voxel by voxel
    unregistered = preprocess_case(real_case, UNREGISTERED)
    venous = PHASES.index("venous")
    for phase in MOVES:
        channel = PHASES.index(phase)
        aligned = np.corrcoef(result.volume[venous].ravel(), result.volume[channel].ravel())[0, 1]
        apart = np.corrcoef(unregistered.volume[venous].ravel(), unregistered.volume[channel].ravel())[0, 1]
        assert aligned > 0.9 and aligned > apart + 0.05, (phase, aligned, apart)


def test_the_stored_hu_statistics_undo_the_z_score_to_float16_precision(result, real_case):
    """What windowed views rely on: ``hounsfield`` gives back the clipped HU of the crop (venous, unmatched, is
    resampled here independently), every phase stays inside the clip window, an absent phase has no statistics."""
    venous = _ct()
    reference = Grid.of(venous).resampled(tuple(reversed(CONFIG.spacing_zyx_mm)))
    crop = reference.window(np.asarray(result.crop_origin_zyx)[::-1], tuple(reversed(CONFIG.shape_zyx)))
    low, high = CONFIG.hu_window
    resampled = sitk.Clamp(resample_onto(venous, crop, default=low), sitk.sitkFloat32, low, high)
    hu = hounsfield(result.volume, result.hu_mean, result.hu_std)
    v = PHASES.index("venous")
    # float16 keeps 11 significant bits of the z-score: |z| <= ~5 here, so a few thousandths of an sd
    np.testing.assert_allclose(hu[v], sitk.GetArrayFromImage(resampled), atol=5e-3 * result.hu_std[v])
    assert hu.min() >= low - 1 and hu.max() <= high + 1
    assert all(20 < s < 400 for s in result.hu_std)  # soft tissue, air and fat floor: tens to hundreds of HU
    phases = {p: f for p, f in real_case.phases.items() if p != "arterial"}
    boxes = [b for b in real_case.boxes if b.phase != "arterial"]
    missing = preprocess_case(Case("real-003", real_case.source, phases, boxes=boxes), UNREGISTERED)
    a = PHASES.index("arterial")
    assert np.isnan(missing.hu_mean[a]) and np.isnan(missing.hu_std[a])
    assert np.isnan(hounsfield(missing.volume, missing.hu_mean, missing.hu_std)[a]).all()


def test_histogram_matching_brings_each_phase_to_the_venous_distribution(real_case):
    matched = preprocess_case(real_case, UNREGISTERED)
    unmatched = preprocess_case(real_case, dataclasses.replace(UNREGISTERED, histogram_match=False))
    quantiles = np.linspace(0.6, 0.95, 8)  # the soft-tissue part, above the padding/air floor

    def gap(volume: np.ndarray, phase: str) -> float:
        venous = np.quantile(volume[PHASES.index("venous")].astype(np.float64), quantiles)
        return float(np.abs(np.quantile(volume[PHASES.index(phase)].astype(np.float64), quantiles) - venous).max())

    for phase in ("non_contrast", "arterial"):  # the largest enhancement changes
        assert gap(matched.volume, phase) < gap(unmatched.volume, phase) / 2, phase


def test_deterministic(result, real_case):
    again = preprocess_case(real_case, CONFIG)
    assert again.volume.tobytes() == result.volume.tobytes()
    assert again.registration == result.registration and again.boxes == result.boxes


def test_missing_arterial_gives_an_absent_zero_channel(real_case):
    phases = {p: f for p, f in real_case.phases.items() if p != "arterial"}
    boxes = [b for b in real_case.boxes if b.phase != "arterial"]
    out = preprocess_case(Case("real-002", real_case.source, phases, boxes=boxes), CONFIG)
    arterial = PHASES.index("arterial")
    assert out.phase_present == tuple(p != "arterial" for p in PHASES)
    assert not out.volume[arterial].any() and "arterial" not in out.registration
    assert all(abs(out.volume[i].astype(np.float64).std() - 1) < 1e-2 for i in range(len(PHASES)) if i != arterial)


def test_crop_falls_back_to_the_stomach_mask_then_the_body(real_case):
    required = {p: real_case.phases[p] for p in ("non_contrast", "venous", "delayed")}
    with_box = preprocess_case(Case("b", real_case.source, required, boxes=[real_case.boxes[0]]), UNREGISTERED)
    with_mask = preprocess_case(
        Case("m", real_case.source, required, organ_masks={"venous": REAL_CT / "example_seg.nii.gz"}), UNREGISTERED
    )
    assert with_mask.crop_origin_zyx == with_box.crop_origin_zyx and not with_mask.warnings
    with_nothing = preprocess_case(Case("n", real_case.source, required), UNREGISTERED)
    assert any("centred on the body" in w for w in with_nothing.warnings)


def test_box_clipped_to_a_small_crop_warns(real_case):
    small = dataclasses.replace(UNREGISTERED, shape_zyx=(16, 32, 32))
    required = {p: real_case.phases[p] for p in ("non_contrast", "venous", "delayed")}
    out = preprocess_case(Case("c", real_case.source, required, boxes=[real_case.boxes[0]]), small)
    assert out.boxes[0].inside(small.shape_zyx) and out.boxes[0].size == (16, 32, 32)
    assert any("clipped" in w and "boxes[0]" in w for w in out.warnings)


# --- quality control ----------------------------------------------------------------------------------


def _qc_error(case: Case, config: PreprocessConfig = CONFIG) -> CaseError:
    with pytest.raises(CaseError) as caught:
        preprocess_case(case, config)
    assert caught.value.case_id == case.case_id and case.case_id in str(caught.value)
    return caught.value


def test_missing_venous_file_is_missing_part(real_case, tmp_path):
    missing = tmp_path / "venous.nii.gz"
    err = _qc_error(Case("qc-1", tmp_path, {**real_case.phases, "venous": missing}))
    assert (err.reason, err.field, Path(err.file)) == ("missing_part", "venous", missing)
    phases = {p: f for p, f in real_case.phases.items() if p != "delayed"}
    err = _qc_error(Case("qc-2", tmp_path, phases))
    assert (err.reason, err.field) == ("missing_part", "delayed")


@pytest.mark.parametrize("suffix", [".mha", ".nii.gz"])
def test_nan_phase_is_nan_values(real_case, tmp_path, suffix):
    values = sitk.GetArrayFromImage(_ct()).astype(np.float32)
    values[10, 50, 60] = np.nan
    image = sitk.GetImageFromArray(values)
    image.CopyInformation(_ct())
    path = tmp_path / f"delayed{suffix}"
    sitk.WriteImage(image, str(path))
    err = _qc_error(Case("qc-3", tmp_path, {**real_case.phases, "delayed": path}), UNREGISTERED)
    assert (err.reason, err.field, Path(err.file)) == ("nan_values", "delayed", path)


def test_truncated_file_is_unreadable(real_case, tmp_path):
    path = tmp_path / "non_contrast.nii.gz"
    data = Path(real_case.phases["non_contrast"]).read_bytes()
    assert gzip.decompress(data)  # the original is whole
    path.write_bytes(data[: len(data) // 2])
    err = _qc_error(Case("qc-4", tmp_path, {**real_case.phases, "non_contrast": path}))
    assert (err.reason, err.field, Path(err.file)) == ("unreadable", "non_contrast", path)


def test_box_outside_its_volume_or_the_crop_is_rejected(real_case, tmp_path):
    depth, height, width = _ct().GetSize()[::-1]
    outside = Box("tumour", "venous", (5, 10, width - 3, 9, 20, width + 4))
    err = _qc_error(Case("qc-5", tmp_path, real_case.phases, boxes=[real_case.boxes[0], outside]))
    assert (err.reason, err.field) == ("box_outside_volume", "boxes[1] (tumour on venous)")
    assert Path(err.file) == real_case.phases["venous"]
    corner = Box("lymph_nodes", "venous", (0, 0, 0, 2, 2, 2))  # inside the scan, far from the stomach crop
    small = dataclasses.replace(UNREGISTERED, shape_zyx=(8, 16, 16))
    err = _qc_error(Case("qc-6", tmp_path, real_case.phases, boxes=[real_case.boxes[0], corner]), small)
    assert (err.reason, err.field) == ("box_outside_volume", "boxes[1] (lymph_nodes on venous)")
    assert "crop misses" in err.message


def test_phase_far_off_is_misaligned(real_case, tmp_path):
    far = sitk.Euler3DTransform()
    far.SetTranslation((14.0, -10.0, 0.0))  # 17 mm, far beyond the 5 mm allowed below
    path = _write_phase(tmp_path, "arterial", far)
    strict = dataclasses.replace(CONFIG, register_phases=("arterial",), max_misalignment_mm=5.0)
    err = _qc_error(Case("qc-7", tmp_path, {**real_case.phases, "arterial": path}), strict)
    assert (err.reason, err.field, Path(err.file)) == ("misaligned", "arterial", path)
    assert "17." in err.message  # the recovered distance, not a failed registration


def test_centre_alignment_recovers_a_lost_origin(real_case):
    moving = sitk.ReadImage(str(real_case.phases["arterial"]))
    lost = np.array([60.0, -40.0, 0.0])
    moving.SetOrigin(tuple(np.asarray(moving.GetOrigin()) + lost))  # as if the file's origin had been reset
    config = dataclasses.replace(CONFIG, align_centres=True, registration_samples=3000)
    found, _ = register_rigid(sitk.ReadImage(str(real_case.phases["venous"])), moving, config)
    truth = _truth("arterial")
    errors = [
        np.linalg.norm(np.subtract(found.TransformPoint(p), truth.TransformPoint(p)) - lost) for p in _stomach_corners()
    ]
    assert max(errors) < min(CONFIG.spacing_zyx_mm)


def test_mask_resampling_keeps_labels():
    seg = _seg()
    finer = Grid.of(seg).resampled((1.5, 1.5, 1.5))
    resampled = resample_onto(seg, finer, mask=True)
    labels = sitk.GetArrayViewFromImage(resampled)
    assert resampled.GetPixelID() == seg.GetPixelID()
    assert set(np.unique(labels)) <= set(np.unique(sitk.GetArrayViewFromImage(seg)))  # no blended labels
    assert np.count_nonzero(labels == STOMACH) == pytest.approx(
        8 * np.count_nonzero(sitk.GetArrayViewFromImage(seg) == STOMACH), rel=0.05
    )


def test_presets():
    assert PreprocessConfig.preset("paper") == PreprocessConfig()
    assert PreprocessConfig().shape_zyx == (192, 288, 288) and PreprocessConfig().hu_window == (-100.0, 300.0)
    demo, bench = PreprocessConfig.preset("demo"), PreprocessConfig.preset("bench")
    # the demo preset sees the paper crop's whole field of view (the stomach region), only coarser
    assert tuple(s * n for s, n in zip(demo.spacing_zyx_mm, demo.shape_zyx, strict=True)) == (192.0, 288.0, 288.0)
    assert demo.shape_zyx == (32, 64, 64)
    assert (bench.spacing_zyx_mm, bench.shape_zyx) == ((2.0, 2.0, 2.0), (64, 128, 128))
    with pytest.raises(ValueError, match="paper, demo, bench"):
        PreprocessConfig.preset("huge")
    with pytest.raises(ValueError, match="venous"):
        PreprocessConfig(register_phases=("venous",))
