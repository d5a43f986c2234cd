"""3D → 2D views: the HU window, slice stacks at the volume's edges, the drawn box, on random cases and on a real CT."""

from __future__ import annotations

import numpy as np
import pytest
import SimpleITK as sitk

from gx_ray.modalities.views import (
    OVERLAY_COLOUR,
    SOFT_TISSUE,
    axial_stack,
    box_centre_slice,
    draw_box,
    lesion_view,
    stack_indices,
    window,
)

from .conftest import find_real_ct_dir


def test_the_window_maps_its_edges_to_0_and_1_linearly_and_clips_outside():
    rng = np.random.default_rng(0)
    for _ in range(200):
        centre, width = rng.uniform(-500, 500), rng.uniform(1, 2000)
        hu = rng.uniform(-1500, 1500, 64)
        expected = np.minimum(1, np.maximum(0, (hu - (centre - width / 2)) / width))
        np.testing.assert_allclose(window(hu, centre, width), expected, rtol=1e-5, atol=1e-6)
    assert window(np.array([-150.0, 50.0, 250.0]), *SOFT_TISSUE).tolist() == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="width must be positive"):
        window(np.zeros(2), 0, 0)


def test_a_stack_is_centred_on_its_slice_and_repeats_the_edge_slices():
    volume = np.arange(10)[:, None, None] * np.ones((10, 3, 4))
    assert axial_stack(volume, 5, 9)[:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert axial_stack(volume, 0, 9)[:, 0, 0].tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4]
    assert axial_stack(volume, 9, 9)[:, 0, 0].tolist() == [5, 6, 7, 8, 9, 9, 9, 9, 9]
    assert axial_stack(volume, 4, 1).shape == (1, 3, 4) and axial_stack(volume, 4, 2)[:, 0, 0].tolist() == [3, 4]
    for z in range(10):  # the middle slice is always the asked one
        assert stack_indices(10, z, 9)[4] == z
    with pytest.raises(ValueError, match="0 <= z < 10"):
        stack_indices(10, 10, 9)


def test_the_key_slice_lies_in_the_middle_of_the_box():
    rng = np.random.default_rng(1)
    for _ in range(200):
        z0 = int(rng.integers(0, 50))
        z1 = z0 + int(rng.integers(1, 20))
        z = box_centre_slice([z0, 0, 0, z1, 1, 1])
        assert z0 <= z < z1 and abs((z - z0) - (z1 - 1 - z)) <= 1


def test_the_drawn_box_is_exactly_its_rectangle_on_the_slices_it_spans():
    rng = np.random.default_rng(2)
    for _ in range(100):
        k, h, w = 5, int(rng.integers(8, 30)), int(rng.integers(8, 30))
        grey = rng.uniform(0, 1, (k, h, w)).astype(np.float32)
        y0, x0 = int(rng.integers(0, h - 2)), int(rng.integers(0, w - 2))
        y1, x1 = int(rng.integers(y0 + 2, h + 1)), int(rng.integers(x0 + 2, w + 1))
        z_indices = np.array([3, 4, 5, 6, 6])  # a stack whose last slice repeats
        box = [4, y0, x0, 7, y1, x1]
        rgb = draw_box(grey, box, z_indices)
        expected = np.zeros((h, w), bool)
        expected[[y0, y1 - 1], x0:x1] = True
        expected[y0:y1, [x0, x1 - 1]] = True
        for i, z in enumerate(z_indices):
            # a grey pixel has three equal channels, so it never reads as the (red) outline
            drawn = np.all(rgb[i] == np.asarray(OVERLAY_COLOUR, np.float32)[:, None, None], axis=0)
            spans = 4 <= z < 7
            assert (drawn == (expected & spans)).all(), (i, z)
            untouched = ~expected if spans else np.ones_like(expected)
            for channel in range(3):  # every other pixel keeps its grey value in all three channels
                np.testing.assert_array_equal(rgb[i, channel][untouched], grey[i][untouched])


def test_a_lesion_view_of_a_real_ct_windows_its_key_slices():
    ct = sitk.GetArrayFromImage(sitk.ReadImage(str(find_real_ct_dir() / "example_ct_sm.nii.gz"))).astype(np.float32)
    box = [ct.shape[0] // 2 - 2, 20, 30, ct.shape[0] // 2 + 3, 40, 60]
    plain = lesion_view(ct, box, slices=9)
    z = box_centre_slice(box)
    assert plain.shape == (9, 3, *ct.shape[1:]) and plain.dtype == np.float32
    np.testing.assert_allclose(plain[4, 0], window(ct[z]), atol=1e-6)
    assert plain.min() >= 0.0 and plain.max() <= 1.0
    assert (plain == 0).any() and (plain == 1).any()  # air below the window, bone above it
    drawn = lesion_view(ct, box, slices=9, overlay=True)
    changed = (drawn != plain).any(axis=1)  # (9, H, W)
    spans = [z - 4 + i for i in range(9)]
    for i, zi in enumerate(spans):
        assert changed[i].any() == (box[0] <= zi < box[3]), (i, zi)


def _case(rng: np.random.Generator, depth: int = 24, size: int = 32) -> tuple[dict, list[int], list[int]]:
    hu = {p: rng.uniform(-300, 400, (depth, size, size)).astype(np.float32) for p in ("arterial", "venous", "delayed")}
    z0, y0, x0 = int(rng.integers(0, depth - 6)), int(rng.integers(0, size - 8)), int(rng.integers(0, size - 8))
    tumour = [z0, y0, x0, z0 + int(rng.integers(1, 6)), y0 + int(rng.integers(2, 8)), x0 + int(rng.integers(2, 8))]
    stomach = [1, 2, 2, depth - 2, size - 2, size - 2]
    return hu, tumour, stomach


@pytest.mark.parametrize("seed", range(10))
def test_ct_images_follow_their_recipe_on_random_cases(seed):
    from gx_ray.modalities.views import ViewRecipe, ct_images

    rng = np.random.default_rng(seed)
    hu, tumour, stomach = _case(rng)
    z = box_centre_slice(tumour)
    k = int(rng.choice([1, 3, 9]))
    indices = stack_indices(24, z, k)
    # k slices of each phase, phase-major, each the windowed slice as grey RGB
    images, prompt = ct_images(hu, ViewRecipe(slices=k, phases=("arterial", "venous")), tumour, stomach)
    assert images.shape == (2 * k, 3, 32, 32) and prompt == ""
    np.testing.assert_allclose(images[k + 1 % k, 0], window(hu["venous"][indices[1 % k]]), atol=1e-6)
    assert (images[:, 0] == images[:, 2]).all()  # grey
    # the slab's maximum-intensity projection
    mip, _ = ct_images(hu, ViewRecipe(slices=k, mode="mip"), tumour, stomach)
    np.testing.assert_allclose(mip[0, 1], window(hu["venous"][indices].max(axis=0)), atol=1e-6)
    # three phases as the RGB channels of one image per slice
    rgb, _ = ct_images(
        hu, ViewRecipe(slices=k, phases=("arterial", "venous", "delayed"), phase_layout="channels"), tumour, stomach
    )
    for c, phase in enumerate(("arterial", "venous", "delayed")):
        np.testing.assert_allclose(rgb[:, c], window(hu[phase][indices]), atol=1e-6)
    # centred on the stomach's middle slice instead of the lesion's key slice
    centred, _ = ct_images(hu, ViewRecipe(centre="stomach"), None, stomach)
    np.testing.assert_allclose(centred[0, 0], window(hu["venous"][box_centre_slice(stomach)]), atol=1e-6)
    # the box drawn in on the slices it spans, in every layout; or given as coordinates in the prompt instead
    for layout, phases in (("images", ("venous",)), ("channels", ("arterial", "venous"))):
        recipe = ViewRecipe(slices=k, phases=phases, phase_layout=layout)
        plain, _ = ct_images(hu, recipe, tumour, stomach)
        drawn, _ = ct_images(hu, ViewRecipe(**{**recipe.__dict__, "boxes": "drawn"}), tumour, stomach)
        red = (drawn == np.array(OVERLAY_COLOUR, np.float32)[:, None, None]).all(axis=1)  # (N, H, W)
        outline = np.zeros((32, 32), bool)
        outline[tumour[1] : tumour[4], tumour[2] : tumour[5]] = True
        outline[tumour[1] + 1 : tumour[4] - 1, tumour[2] + 1 : tumour[5] - 1] = False
        spans = np.tile((indices >= tumour[0]) & (indices < tumour[3]), len(phases) if layout == "images" else 1)
        for n, drawn_here in enumerate(spans):
            # the outline, all of it red, on the slices the box spans; every other pixel as it was
            assert red[n][outline].all() == drawn_here
            untouched = ~outline if drawn_here else np.ones_like(outline)
            assert (drawn[n][:, untouched] == plain[n][:, untouched]).all()
    told, prompt = ct_images(hu, ViewRecipe(boxes="prompt"), tumour, stomach)
    assert f"rows {tumour[1]}-{tumour[4] - 1}" in prompt and "24 x 32 x 32" in prompt
    assert not (told == np.array(OVERLAY_COLOUR, np.float32)[:, None, None]).all(axis=1).any()


def test_a_view_recipe_refuses_what_it_cannot_draw():
    from gx_ray.modalities.views import ViewRecipe, ct_images

    with pytest.raises(ValueError, match="mode='slab'; valid: stack, mip"):
        ViewRecipe(mode="slab")
    with pytest.raises(ValueError, match="1 to 3 phases as RGB"):
        ViewRecipe(phases=("non_contrast", "arterial", "venous", "delayed"), phase_layout="channels")
    hu, tumour, stomach = _case(np.random.default_rng(0))
    with pytest.raises(ValueError, match="phases \\['non_contrast'\\]"):
        ct_images(hu, ViewRecipe(phases=("non_contrast",)), tumour, stomach)
    with pytest.raises(ValueError, match="centre='stomach' needs the stomach's box"):
        ct_images(hu, ViewRecipe(centre="stomach"), tumour, None)
