"""Box cues as model input: outlines drawn into the CT (the paper's coloured overlays) or one mask channel per level.

The shard holds a box per (phase, level) on the common crop grid. A channel gets its own phase's box when present,
else the venous one, else the first present phase's in :data:`~gx_ray.schema.PHASES` order; mask channels, of no
phase, take the venous box under the same rule.

Overlays: a grey volume has no colour for the paper's coloured boxes, so each level is drawn at its own value above
the channel's maximum (:data:`OVERLAY_OFFSETS`): the box's one-voxel rectangle on every axial slice it spans (four
side faces, no caps), as a radiologist draws it; where outlines cross the brighter level wins. Absent phases stay 0.
"""

from __future__ import annotations

import numpy as np
import torch

from gx_ray.schema import BOX_LEVELS, PHASES, REFERENCE_PHASE

TARGET_PHASE, TARGET_LEVEL = "venous", "tumour"
"""The lesion's own box, as the tasks about it read it: the venous phase's tumour box."""


def tumour_boxes(
    boxes: torch.Tensor | np.ndarray, present: torch.Tensor | np.ndarray, level: str = TARGET_LEVEL
) -> tuple[np.ndarray, np.ndarray]:
    """(B, 6) venous boxes of ``level`` (the tumour's) and (B,) whether each case has one, from a batch's or a row's
    ``boxes``/``box_present``."""
    boxes = np.asarray(boxes).reshape(-1, len(PHASES), len(BOX_LEVELS), 6)
    present = np.asarray(present).reshape(-1, len(PHASES), len(BOX_LEVELS))
    phase, level = PHASES.index(TARGET_PHASE), BOX_LEVELS.index(level)
    return boxes[:, phase, level].astype(np.float32), present[:, phase, level].astype(bool)


OVERLAY_OFFSETS: dict[str, float] = {"tumour": 4.0, "lymph_nodes": 3.0, "stomach": 2.0}
"""Overlay value of each level above the channel's maximum, in the z-score units of the shards' CT."""


def _preference() -> torch.Tensor:
    """``(P, P)`` rank of source phase (column) for target phase (row): own phase, then reference, then order."""
    ref = PHASES.index(REFERENCE_PHASE)
    rank = torch.arange(len(PHASES)).repeat(len(PHASES), 1) + 2
    rank[:, ref] = 1
    rank.fill_diagonal_(0)
    return rank


def select_boxes(
    boxes: torch.Tensor, present: torch.Tensor, phases: tuple[str, ...], levels: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The box each of ``phases`` gets for each of ``levels`` (the module docstring's rule) from the shard's
    ``(B, P, L, 6)`` ``boxes`` and ``(B, P * L)`` flags: ``(B, len(phases), len(levels), 6)`` boxes and
    ``(B, len(levels))`` flags (a box on any phase)."""
    b, p, n_levels = boxes.shape[:3]
    present = present.reshape(b, p, n_levels)
    level_idx = torch.tensor([BOX_LEVELS.index(v) for v in levels], dtype=torch.long, device=boxes.device)
    phase_idx = torch.tensor([PHASES.index(v) for v in phases], dtype=torch.long, device=boxes.device)
    boxes, present = boxes.index_select(2, level_idx), present.index_select(2, level_idx)
    rank = _preference().to(boxes.device).index_select(0, phase_idx)  # (T, P)
    # absent sources rank last; argmin then picks the most preferred present source per (sample, target, level)
    score = torch.where(present[:, None], rank[None, :, :, None], len(PHASES) + 2)  # (B, T, P, L)
    source = score.argmin(dim=2)  # (B, T, L)
    chosen = torch.gather(boxes, 1, source[..., None].expand(-1, -1, -1, 6))  # (B, T, L, 6)
    return chosen, present.any(dim=1)


def _spans(boxes: torch.Tensor, shape: tuple[int, int, int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per axis, whether each index lies in the box and whether it is the box's first or last index.

    ``boxes`` is ``(..., 6)``; each result is ``(..., size of the axis)``.
    """
    inside, edge = [], []
    for axis, size in enumerate(shape):
        lo = boxes[..., axis].clamp(0, size)[..., None]
        hi = boxes[..., axis + 3].clamp(0, size)[..., None]
        i = torch.arange(size, device=boxes.device)
        inside.append((i >= lo) & (i < hi))
        edge.append(((i == lo) | (i == hi - 1)) & (hi > lo))
    return inside, edge


def box_masks(boxes: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """Filled boxes ``(..., 6)`` as ``(..., D, H, W)`` bool masks."""
    (z, y, x), _ = _spans(boxes, shape)
    return z[..., :, None, None] & y[..., None, :, None] & x[..., None, None, :]


def box_outlines(boxes: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """The rectangle of each box ``(..., 6)`` on every axial slice it spans, as ``(..., D, H, W)`` bool masks."""
    (z, y, x), (_, y_edge, x_edge) = _spans(boxes, shape)
    rectangle = (y_edge[..., :, None] & x[..., None, :]) | (y[..., :, None] & x_edge[..., None, :])
    return z[..., :, None, None] & rectangle[..., None, :, :]


def draw_overlay(
    ct: torch.Tensor,
    phase_mask: torch.Tensor,
    boxes: torch.Tensor,
    present: torch.Tensor,
    levels: tuple[str, ...],
) -> torch.Tensor:
    """``ct`` ``(B, C, D, H, W)`` with box outlines drawn into its present phase channels.

    ``boxes`` is ``(B, C, len(levels), 6)`` and ``present`` ``(B, len(levels))``, as :func:`select_boxes` gives.
    """
    shape = tuple(ct.shape[2:])
    top = ct.amax(dim=(2, 3, 4), keepdim=True)  # (B, C, 1, 1, 1)
    draw_on = phase_mask[:, :, None, None, None]
    # dimmest first, so the brightest level wins where outlines cross
    for j in sorted(range(len(levels)), key=lambda j: OVERLAY_OFFSETS[levels[j]]):
        outline = box_outlines(boxes[:, :, j], shape) & present[:, j, None, None, None, None] & draw_on
        ct = torch.where(outline, top + OVERLAY_OFFSETS[levels[j]], ct)
    return ct


def box_channels(boxes: torch.Tensor, present: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """``(B, L, D, H, W)`` float32 masks (1 inside the box) from ``(B, L, 6)`` boxes and ``(B, L)`` flags."""
    return (box_masks(boxes, shape) & present[..., None, None, None]).float()
