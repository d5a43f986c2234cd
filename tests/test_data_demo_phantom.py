"""The demo CT: per-case geometry, phase enhancement, tumour/node/box truth, known phase offsets, real-CT template."""

from __future__ import annotations

import json

import numpy as np
import pytest
import SimpleITK as sitk
from scipy import ndimage

from gx_ray.data.demo.phantom import (
    RELEASE_LABELS,
    TISSUE_CODE,
    PhantomConfig,
    make_from_template,
    make_phantom,
    offset_transform,
)
from gx_ray.schema import PHASES, REFERENCE_PHASE, REQUIRED_PHASES
from tests.common import findings_for

COARSE = PhantomConfig(in_plane_spacing_mm=(4.0, 5.0), slice_spacing_mm=(5.0, 6.0), z_extent_mm=(180.0, 200.0))
"""Coarse voxels for the tests that need many cases; the default geometry is tested on its own."""
T3N2 = ("T3", "N2", "M0")
"""The stage of the cases drawn here unless a test needs another."""


def voxels(image: sitk.Image) -> np.ndarray:
    return sitk.GetArrayFromImage(image)


def bounds(mask: np.ndarray) -> tuple[int, ...]:
    hits = np.argwhere(mask)
    return (*hits.min(0), *(hits.max(0) + 1))


def centroid_mm(mask: sitk.Image) -> np.ndarray:
    index = np.argwhere(voxels(mask) > 0).mean(0)[::-1]  # (x, y, z) continuous index
    return np.array(mask.TransformContinuousIndexToPhysicalPoint(index.tolist()))


def box_of(case, level: str, phase: str):
    return next((b for b in case.boxes if b.level == level and b.phase == phase), None)


@pytest.fixture(scope="module")
def cases():
    """Three T3 N2 cases with all four phases, at the cohort's default geometry."""
    config = PhantomConfig(arterial_probability=1.0)
    return [make_phantom(np.random.default_rng(seed), findings_for(seed, T3N2), config) for seed in range(3)]


def test_geometry_varies_per_case_and_fits_the_voxel_budget(cases):
    in_plane, slice_counts = set(), set()
    for case in cases:
        assert set(case.phases) == set(PHASES)
        for phase, image in case.phases.items():
            assert image.GetPixelID() == sitk.sitkInt16
            assert np.prod(image.GetSize()) < 1_500_000
            for mask in (case.organ_masks[phase], case.tumour_masks[phase]):
                assert mask.GetPixelID() == sitk.sitkUInt8
                assert mask.GetSize() == image.GetSize() and mask.GetSpacing() == image.GetSpacing()
                assert mask.GetOrigin() == image.GetOrigin()
            sx, sy, sz = image.GetSpacing()
            assert sx == sy and 2.4 <= sx <= 3.2 and 3.0 <= sz <= 5.0
            assert sx * image.GetSize()[0] == pytest.approx(300, abs=sx)
            in_plane.add(round(sx, 3))
            slice_counts.add(image.GetSize()[2])
    assert len(in_plane) > 1 and len(slice_counts) > 2


def test_arterial_phase_is_optional():
    case = make_phantom(np.random.default_rng(0), findings_for(0, T3N2), PhantomConfig(arterial_probability=0.0))
    assert set(case.phases) == set(REQUIRED_PHASES)
    assert {b.phase for b in case.boxes} == set(REQUIRED_PHASES)
    assert set(case.phase_offsets) == set(REQUIRED_PHASES) - {REFERENCE_PHASE}


def test_enhancement_follows_the_phase(cases):
    for case in cases:
        aorta = {
            p: np.median(voxels(case.phases[p])[voxels(case.organ_masks[p]) == RELEASE_LABELS["aorta"]]) for p in PHASES
        }
        liver = {
            p: np.median(voxels(case.phases[p])[voxels(case.tissue_maps[p]) == TISSUE_CODE["liver"]]) for p in PHASES
        }
        assert aorta["non_contrast"] < 70 and 230 < aorta["arterial"] < 400
        assert aorta["arterial"] > aorta["venous"] > aorta["delayed"] > aorta["non_contrast"] + 40
        assert liver["venous"] > liver["non_contrast"] + 30 and liver["venous"] > liver["arterial"]
        gas = voxels(case.phases["venous"])[voxels(case.tissue_maps["venous"]) == TISSUE_CODE["gastric_gas"]]
        assert gas.size and gas.min() < -950  # air (partial volume lifts thin gas layers)


def test_boxes_are_the_bounds_of_their_masks_on_every_phase(cases):
    for case in cases:
        for phase, image in case.phases.items():
            shape = image.GetSize()[::-1]
            tumour = voxels(case.tumour_masks[phase]) > 0
            stomach = voxels(case.organ_masks[phase]) == RELEASE_LABELS["stomach"]
            nodes = voxels(case.tissue_maps[phase]) == TISSUE_CODE["lymph_node"]
            for level, mask in (("tumour", tumour), ("stomach", stomach), ("lymph_nodes", nodes)):
                box = box_of(case, level, phase)
                assert box is not None and box.inside(shape)
                assert box.zyx == bounds(mask)
            t, s = box_of(case, "tumour", phase).zyx, box_of(case, "stomach", phase).zyx
            assert all(s[a] <= t[a] and t[a + 3] <= s[a + 3] for a in range(3))  # a T3 tumour stays in the stomach


def test_tumour_sits_in_the_stomach_wall(cases):
    for case in cases:
        tumour = voxels(case.tumour_masks["venous"]) > 0
        tissue, organs = voxels(case.tissue_maps["venous"]), voxels(case.organ_masks["venous"])
        assert tumour.sum() > 20
        assert np.all(organs[tumour] == RELEASE_LABELS["stomach"])  # T3: within the wall, not beyond it
        assert np.any(tissue[ndimage.binary_dilation(tumour)] == TISSUE_CODE["gastric_wall"])


def test_t4b_tumour_breaches_into_a_neighbour_organ():
    case = make_phantom(np.random.default_rng(1), findings_for(1, ("T4b", "N2", "M0")), COARSE)
    tumour = voxels(case.tumour_masks["venous"]) > 0
    labels_under = voxels(case.organ_masks["venous"])[tumour]
    assert np.mean(labels_under == RELEASE_LABELS["stomach"]) > 0.5  # it starts in the stomach wall ...
    assert np.any(labels_under != RELEASE_LABELS["stomach"])  # ... and reaches into another organ


@pytest.mark.parametrize("seed", [0, 1])
def test_t4_tumours_are_larger_than_t1(seed):
    extent = {}
    for t in ("T1a", "T4a"):
        case = make_phantom(np.random.default_rng(seed), findings_for(seed, (t, "N2", "M0")), COARSE)
        mask = case.tumour_masks["venous"]
        z, y, x = np.array(case.tumour_masks["venous"].GetSpacing())[::-1] * box_of(case, "tumour", "venous").size
        extent[t] = (voxels(mask).sum() * np.prod(mask.GetSpacing()), max(x, y, z))
    assert extent["T4a"][0] > 10 * extent["T1a"][0]
    assert extent["T4a"][1] > 2 * extent["T1a"][1]


@pytest.mark.parametrize("n", ["N0", "N1", "N3b"])
def test_node_count_follows_findings(n):
    findings = findings_for(3, ("T3", n, "M0"))
    case = make_phantom(np.random.default_rng(3), findings, COARSE)
    for phase in case.phases:
        # nodes are placed at least 8 mm apart, so face-connected components count them
        count = ndimage.label(voxels(case.tissue_maps[phase]) == TISSUE_CODE["lymph_node"])[1]
        assert count == findings.n_nodes
        assert (box_of(case, "lymph_nodes", phase) is not None) == (findings.n_nodes > 0)


def test_phase_offsets_map_venous_landmarks_onto_each_phase(cases):
    for case in cases:
        json.dumps(case.phase_offsets)
        assert set(case.phase_offsets) == set(case.phases) - {REFERENCE_PHASE}
        landmark = centroid_mm(case.tumour_masks[REFERENCE_PHASE])
        for phase, offset in case.phase_offsets.items():
            transform = offset_transform(offset)
            assert np.allclose(np.reshape(transform.GetMatrix(), (3, 3)), offset["matrix"])
            mapped = np.array(transform.TransformPoint(landmark.tolist()))
            voxel = max(case.phases[phase].GetSpacing())
            assert np.linalg.norm(mapped - centroid_mm(case.tumour_masks[phase])) < voxel
            # the whole stomach follows the same transform
            venous_mask, phase_mask = case.organ_masks[REFERENCE_PHASE], case.organ_masks[phase]
            resampled = sitk.Resample(venous_mask, phase_mask, transform.GetInverse(), sitk.sitkNearestNeighbor, 0)
            a = voxels(resampled) == RELEASE_LABELS["stomach"]
            b = voxels(case.organ_masks[phase]) == RELEASE_LABELS["stomach"]
            assert 2 * (a & b).sum() / (a.sum() + b.sum()) > 0.9


def test_recorded_offset_is_needed_to_find_the_landmark():
    """With large offsets, only the recorded transform (not its inverse, not none) finds the tumour again."""
    config = PhantomConfig(
        in_plane_spacing_mm=(4.0, 4.0), slice_spacing_mm=(5.0, 5.0), max_rotation_deg=8.0, max_translation_mm=25.0
    )
    case = make_phantom(np.random.default_rng(5), findings_for(5, ("T4a", "N2", "M0")), config)
    landmark = centroid_mm(case.tumour_masks[REFERENCE_PHASE])
    for phase, offset in case.phase_offsets.items():
        target, transform = centroid_mm(case.tumour_masks[phase]), offset_transform(offset)
        error = {
            "recorded": np.linalg.norm(np.array(transform.TransformPoint(landmark.tolist())) - target),
            "inverse": np.linalg.norm(np.array(transform.GetInverse().TransformPoint(landmark.tolist())) - target),
            "none": np.linalg.norm(landmark - target),
        }
        assert error["recorded"] < 5.0 < min(error["inverse"], error["none"])


def test_same_seed_gives_identical_case():
    a, b, c = (make_phantom(np.random.default_rng(s), findings_for(9, T3N2), COARSE) for s in (7, 7, 8))
    assert a.boxes == b.boxes and a.phase_offsets == b.phase_offsets
    for phase in a.phases:
        for field in ("phases", "organ_masks", "tumour_masks"):
            image_a, image_b = getattr(a, field)[phase], getattr(b, field)[phase]
            assert np.array_equal(voxels(image_a), voxels(image_b))
            assert image_a.GetOrigin() == image_b.GetOrigin() and image_a.GetSpacing() == image_b.GetSpacing()
    assert a.boxes != c.boxes or not np.array_equal(voxels(a.phases["venous"]), voxels(c.phases["venous"]))


@pytest.fixture(scope="module")
def real_ct(real_ct_dir):
    return sitk.ReadImage(str(real_ct_dir / "example_ct_sm.nii.gz")), sitk.ReadImage(
        str(real_ct_dir / "example_seg.nii.gz")
    )


def test_template_case_on_real_ct(real_ct):
    ct, labels = real_ct
    findings = findings_for(2, ("T3", "N2", "M1"))
    case = make_from_template(np.random.default_rng(2), findings, ct, labels, PhantomConfig(arterial_probability=1.0))
    real_stomach = voxels(labels) == 6
    venous = case.phases["venous"]
    assert venous.GetSize() == ct.GetSize() and venous.GetOrigin() == ct.GetOrigin()

    # the stomach box is the real stomach's, and the tumour lies in it
    box, real = box_of(case, "stomach", "venous").zyx, bounds(real_stomach)
    overlap = np.prod([max(0, min(box[a + 3], real[a + 3]) - max(box[a], real[a])) for a in range(3)])
    union = np.prod(np.subtract(box[3:], box[:3])) + np.prod(np.subtract(real[3:], real[:3])) - overlap
    assert overlap / union > 0.7
    tumour = voxels(case.tumour_masks["venous"]) > 0
    assert tumour.any() and real_stomach[tumour].mean() > 0.9
    assert box_of(case, "tumour", "venous").zyx == bounds(tumour)

    assert set(np.unique(voxels(case.organ_masks["venous"]))) <= {0, *RELEASE_LABELS.values()}
    aorta = {
        p: np.median(voxels(case.phases[p])[voxels(case.organ_masks[p]) == RELEASE_LABELS["aorta"]]) for p in PHASES
    }
    liver = {p: np.median(voxels(case.phases[p])[voxels(case.tissue_maps[p]) == TISSUE_CODE["liver"]]) for p in PHASES}
    assert aorta["arterial"] > aorta["non_contrast"] + 150 and liver["venous"] > liver["non_contrast"] + 30

    assert ndimage.label(voxels(case.tissue_maps["venous"]) == TISSUE_CODE["lymph_node"])[1] == findings.n_nodes
    assert (voxels(case.tissue_maps["venous"]) == TISSUE_CODE["liver_metastasis"]).any()

    landmark = centroid_mm(case.tumour_masks["venous"])
    for phase, offset in case.phase_offsets.items():
        mapped = np.array(offset_transform(offset).TransformPoint(landmark.tolist()))
        assert np.linalg.norm(mapped - centroid_mm(case.tumour_masks[phase])) < max(case.phases[phase].GetSpacing())
        assert box_of(case, "stomach", phase).inside(case.phases[phase].GetSize()[::-1])


def test_template_t4b_tumour_reaches_a_neighbour_organ(real_ct):
    ct, labels = real_ct
    case = make_from_template(np.random.default_rng(4), findings_for(4, ("T4b", "N2", "M0")), ct, labels)
    tumour = voxels(case.tumour_masks["venous"]) > 0
    under = voxels(labels)[tumour]
    assert np.any(under == 6) and np.any(np.isin(under, (1, 5, 7, 18, 19, 20)))


def test_template_mode_is_deterministic(real_ct):
    ct, labels = real_ct
    a, b = (make_from_template(np.random.default_rng(6), findings_for(6, T3N2), ct, labels) for _ in range(2))
    assert a.boxes == b.boxes and a.phase_offsets == b.phase_offsets
    for phase in a.phases:
        assert np.array_equal(voxels(a.phases[phase]), voxels(b.phases[phase]))
        assert np.array_equal(voxels(a.tumour_masks[phase]), voxels(b.tumour_masks[phase]))
