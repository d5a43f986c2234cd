"""3D CT → 2D views, for slice-based tasks and 2D models: an HU window, one axial slice or a stack of consecutive
slices, a box outline drawn in.

Imaging conventions, named once here:

- **Window.** HU map linearly onto [0, 1] between ``centre - width / 2`` and ``centre + width / 2`` and are clipped
  outside; CT-Bench's soft-tissue window is centre 50, width 400 (:data:`SOFT_TISSUE`). The shards keep z-scores,
  so HU come back through :func:`~gx_ray.data.shards.hounsfield` (shard format 2). They were clipped to the
  preparation's HU range ([-100, 300] for the paper's), so a window reaching below it shows that floor.
- **Slices** are axial: the volume's first axis (z). A stack of ``k`` slices centred on ``z`` (CT-Bench's CT2txt:
  nine) repeats the first or last slice where it leaves the volume, so every stack has ``k`` slices.
- **Overlay.** The box's rectangle, one pixel wide, in :data:`OVERLAY_COLOUR` on an RGB copy of the slice (CT-Bench's
  "with bbox" images), on every slice of the stack that the box spans.

A view centred on a lesion's own box (its key slice) is itself a box cue: the box chose what the model sees.
Tasks that build such views say so through their leakage rules.
"""

from __future__ import annotations

import numpy as np
import torch

from gx_ray.modalities.boxes import box_outlines

SOFT_TISSUE: tuple[float, float] = (50.0, 400.0)
"""(centre, width) in HU: CT-Bench's window for its slices."""
OVERLAY_COLOUR: tuple[float, float, float] = (1.0, 0.0, 0.0)
"""RGB of a drawn box outline (red, as the paper's and CT-Bench's overlays)."""


def window(hu: np.ndarray, centre: float = SOFT_TISSUE[0], width: float = SOFT_TISSUE[1]) -> np.ndarray:
    """HU → [0, 1] float32 under the window ``(centre, width)``."""
    if width <= 0:
        raise ValueError(f"a window's width must be positive, got {width}")
    low = centre - width / 2
    return np.clip((np.asarray(hu, np.float32) - low) / width, 0.0, 1.0)


def stack_indices(depth: int, z: int, count: int = 1) -> np.ndarray:
    """The slice indices of ``count`` consecutive slices centred on ``z`` (for an even count the extra slice is below
    ``z``), clipped to ``[0, depth)``: the edge slice repeats beyond the volume."""
    if count < 1 or not 0 <= z < depth:
        raise ValueError(f"need count >= 1 and 0 <= z < {depth}, got count {count}, z {z}")
    return np.clip(np.arange(count) - count // 2 + z, 0, depth - 1)


def axial_stack(volume: np.ndarray, z: int, count: int = 1) -> np.ndarray:
    """``(count, H, W)``: the slices :func:`stack_indices` names, of a ``(D, H, W)`` volume."""
    return volume[stack_indices(volume.shape[0], z, count)]


def box_centre_slice(box: np.ndarray | list[int]) -> int:
    """The axial slice through the middle of a ``(z0, y0, x0, z1, y1, x1)`` end-exclusive box: its key slice."""
    return int((int(box[0]) + int(box[3]) - 1) // 2)


def grey_rgb(slices: np.ndarray) -> np.ndarray:
    """Grey ``(k, H, W)`` slices as RGB ``(k, 3, H, W)`` float32."""
    return np.repeat(np.asarray(slices, np.float32)[:, None], 3, axis=1)


def draw_box(slices: np.ndarray, box: np.ndarray | list[int], z_indices: np.ndarray | None = None) -> np.ndarray:
    """RGB ``(k, 3, H, W)`` float32 copies of the grey ``(k, H, W)`` slices in [0, 1], the box's rectangle drawn in
    :data:`OVERLAY_COLOUR` on each slice whose volume index (``z_indices``, default ``0 .. k-1``) the box spans."""
    k, h, w = slices.shape
    z_indices = np.arange(k) if z_indices is None else np.asarray(z_indices)
    rgb = grey_rgb(slices)
    z0, y0, x0, z1, y1, x1 = (int(v) for v in box)
    rectangle = box_outlines(torch.tensor([0, y0, x0, 1, y1, x1]), (1, h, w))[0].numpy()  # (H, W)
    for i in np.flatnonzero((z_indices >= z0) & (z_indices < z1)):
        for channel, value in enumerate(OVERLAY_COLOUR):
            rgb[i, channel][rectangle] = value
    return rgb


def lesion_view(
    hu: np.ndarray,
    box: np.ndarray | list[int],
    slices: int = 1,
    overlay: bool = False,
    centre: float = SOFT_TISSUE[0],
    width: float = SOFT_TISSUE[1],
) -> np.ndarray:
    """CT-Bench's view of one lesion from one phase's ``(D, H, W)`` HU volume: the window, ``slices`` axial slices
    centred on the box's key slice, as RGB ``(slices, 3, H, W)`` float32, the box drawn in when ``overlay``."""
    indices = stack_indices(hu.shape[0], box_centre_slice(box), slices)
    stack = window(hu[indices], centre, width)
    return draw_box(stack, box, indices) if overlay else grey_rgb(stack)


def box_option_views(
    hu: np.ndarray,
    key_box: np.ndarray | list[int],
    option_boxes: np.ndarray | list[list[int]],
    centre: float = SOFT_TISSUE[0],
    width: float = SOFT_TISSUE[1],
) -> np.ndarray:
    """CT-Bench's Txt2bbox images: the key slice of ``key_box`` (the lesion's) under the window, once per option box,
    each with only that box drawn in: RGB ``(K, 3, H, W)`` float32 for ``K`` options. Every option is drawn on the same
    slice, so the slice itself says nothing about which box is the lesion's."""
    z = box_centre_slice(key_box)
    stack = window(hu[z : z + 1], centre, width)
    return np.concatenate([draw_box(stack, [z, *box[1:3], z + 1, *box[4:6]], [z]) for box in option_boxes])
