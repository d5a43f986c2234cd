"""Demo endoscopy image: a deterministic RGB frame whose lesion stands out from the mucosa around it, grows
with the endoscopy T category and follows the endoscopy stage, not the imaging one."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from scipy import ndimage

from gx_ray.data.demo.endoscopy import (
    EARLY_T,
    endoscopic_lesion,
    render_endoscopy,
    render_endoscopy_with_mask,
)
from gx_ray.data.demo.findings import GROSS_TYPES_ADVANCED, GROSS_TYPES_EARLY
from tests.common import findings_for


def test_shape_dtype_and_determinism():
    findings = findings_for(0, ("T3", "N1", "M0"))
    image = render_endoscopy(np.random.default_rng(4), findings, size=96)
    assert image.shape == (96, 96, 3) and image.dtype == np.uint8
    assert np.array_equal(image, render_endoscopy(np.random.default_rng(4), findings, size=96))
    assert not np.array_equal(image, render_endoscopy(np.random.default_rng(5), findings, size=96))


def test_frame_looks_like_gastric_mucosa_in_a_circular_view():
    image = render_endoscopy(np.random.default_rng(1), findings_for(1, ("T2", "N0", "M0")), size=128).astype(float)
    yy, xx = np.mgrid[0:128, 0:128]
    r = np.hypot(yy - 63.5, xx - 63.5)
    corners, view = image[r > 66], image[r < 50]
    assert corners.max() < 10  # vignetting: black outside the circular field of view
    red, green, blue = view.reshape(-1, 3).mean(0)
    assert red > green > blue and red > 120  # pinkish-orange mucosa
    assert view.std() > 10  # folds, highlights and the lesion: not a flat colour


@pytest.mark.parametrize("gross_type", GROSS_TYPES_EARLY + GROSS_TYPES_ADVANCED)
def test_lesion_differs_from_the_mucosa_around_it(gross_type):
    t = "T1a" if gross_type in GROSS_TYPES_EARLY else "T3"
    for seed in range(3):
        findings = dataclasses.replace(findings_for(seed, (t, "N0", "M0")), gross_type=gross_type)
        image, mask = render_endoscopy_with_mask(np.random.default_rng(seed), findings, size=128)
        assert mask.any()
        around = ndimage.binary_dilation(mask, iterations=6) & ~mask
        difference = np.linalg.norm(image[mask].mean(0) - image[around].mean(0).astype(float))
        assert difference > 8, (gross_type, seed, difference)


def test_advanced_lesions_cover_more_area_than_early_ones():
    def mean_area(tnm):
        areas = []
        for seed in range(6):
            _, mask = render_endoscopy_with_mask(np.random.default_rng(seed), findings_for(seed, tnm), size=96)
            areas.append(mask.mean())
        return np.mean(areas)

    early, t2, t4 = mean_area(("T1a", "N0", "M0")), mean_area(("T2", "N0", "M0")), mean_area(("T4a", "N0", "M0"))
    assert early < t2 < t4
    assert t4 > 3 * early


def test_endoscopic_lesion_follows_endoscopy_staging():
    early, advanced = findings_for(2, ("T1a", "N0", "M0")), findings_for(2, ("T4a", "N2", "M0"))
    # faithful endoscopy: the imaging lesion itself
    same = endoscopic_lesion(early)
    assert same.gross_type == early.gross_type and same.size_mm == round(early.tumour_size_mm)
    # a decoy advanced endoscopy stage on an early tumour: advanced gross type, larger lesion, same location
    decoy = endoscopic_lesion(dataclasses.replace(early, endoscopy_staging=advanced.imaging_staging))
    assert decoy.t not in EARLY_T and decoy.gross_type in GROSS_TYPES_ADVANCED
    assert decoy.size_mm > same.size_mm and decoy.location == early.tumour_location
    # and the image shows it: the decoy lesion is larger
    _, mask_same = render_endoscopy_with_mask(np.random.default_rng(0), early, size=96)
    _, mask_decoy = render_endoscopy_with_mask(
        np.random.default_rng(0), dataclasses.replace(early, endoscopy_staging=advanced.imaging_staging), size=96
    )
    assert mask_decoy.sum() > 2 * mask_same.sum()


def test_rendering_is_fast():
    findings = findings_for(3, ("T4b", "N1", "M1"))
    render_endoscopy(np.random.default_rng(0), findings)  # warm-up
    times = []
    for seed in range(5):
        start = time.perf_counter()
        render_endoscopy(np.random.default_rng(seed), findings)
        times.append(time.perf_counter() - start)
    assert np.median(times) < 0.2  # about 30 ms on a 2-core CPU; loose so a busy CI box does not flake
