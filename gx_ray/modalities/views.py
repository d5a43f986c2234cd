"""3D CT → 2D views, for slice-based tasks and 2D models: an HU window, one axial slice or a stack of consecutive
slices, a box outline drawn in.

Imaging conventions, named once here:

- **Window.** HU map linearly onto [0, 1] between ``centre ± width / 2``, clipped outside (CT-Bench's soft tissue:
  :data:`SOFT_TISSUE`). HU come back from the shards' z-scores through :func:`~gx_ray.data.shards.hounsfield`,
  clipped to the preparation's range ([-100, 300] for the paper's), so a window reaching below shows that floor.
- **Slices** are axial (z, the first axis). A stack of ``k`` slices centred on ``z`` (CT-Bench's CT2txt: nine)
  repeats the first or last slice where it leaves the volume.
- **Overlay.** The box's one-pixel rectangle in :data:`OVERLAY_COLOUR` on an RGB copy of every slice it spans.

A view centred on a lesion's own box is itself a box cue (the box chose what the model sees): such tasks say so in
their leakage rules. :class:`ViewRecipe` names every choice of the conversion as a search dimension; :func:`ct_images`
applies one, and lesion QA's views are its one-phase case (:func:`lesion_view`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gx_ray.modalities.boxes import box_outlines
from gx_ray.modalities.schemas import ModalitySchema

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
    z_indices = np.arange(len(slices)) if z_indices is None else np.asarray(z_indices)
    return _draw_rgb(grey_rgb(slices), box, z_indices)


def lesion_view(
    hu: np.ndarray,
    box: np.ndarray | list[int],
    slices: int = 1,
    overlay: bool = False,
    centre: float = SOFT_TISSUE[0],
    width: float = SOFT_TISSUE[1],
) -> np.ndarray:
    """CT-Bench's view of one lesion from one phase's ``(D, H, W)`` HU volume: the window, ``slices`` axial slices
    centred on the box's key slice, as RGB ``(slices, 3, H, W)`` float32, the box drawn in when ``overlay``
    (:func:`ct_images` with one phase)."""
    recipe = ViewRecipe(slices=slices, window=(centre, width), phases=("one",), boxes="drawn" if overlay else "off")
    return ct_images({"one": hu}, recipe, box)[0]


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


VIEW_CENTRES = ("lesion", "stomach")
VIEW_MODES = ("stack", "mip")
PHASE_LAYOUTS = ("images", "channels")
BOX_FORMS = ("off", "drawn", "prompt")


@dataclass(frozen=True)
class ViewRecipe:
    """How a multi-phase 3D CT becomes the 2D images a 2D or vision-language model reads: each field is a search
    dimension (the related papers' 3D-to-2D choices; none of them handles multi-phase CT, so the phases' layout is one
    too)."""

    centre: str = "lesion"
    """``lesion``: the tumour box's key slice; ``stomach``: the stomach box's middle slice (no lesion box needed)."""
    slices: int = 1
    """``k`` consecutive axial slices around the centre (1, 3, 9)."""
    mode: str = "stack"
    """``stack``: one image per slice; ``mip``: the slab's maximum-intensity projection, one image."""
    window: tuple[float, float] = SOFT_TISSUE
    phases: tuple[str, ...] = ("venous",)
    phase_layout: str = "images"
    """``images``: each phase its own grey images; ``channels``: up to three phases as one image's RGB channels."""
    boxes: str = "off"
    """The tumour box: ``drawn`` in (red outline), given as coordinates in the ``prompt``, or ``off``."""

    def __post_init__(self) -> None:
        for name, value, valid in (
            ("centre", self.centre, VIEW_CENTRES),
            ("mode", self.mode, VIEW_MODES),
            ("phase_layout", self.phase_layout, PHASE_LAYOUTS),
            ("boxes", self.boxes, BOX_FORMS),
        ):
            if value not in valid:
                raise ValueError(f"view recipe {name}={value!r}; valid: {', '.join(valid)}")
        if self.slices < 1:
            raise ValueError(f"view recipe slices={self.slices}: at least one slice")
        if self.phase_layout == "channels" and not 1 <= len(self.phases) <= 3:
            raise ValueError(f"view recipe phase_layout='channels' holds 1 to 3 phases as RGB, not {list(self.phases)}")

    @property
    def images_per_case(self) -> int:
        """How many images :func:`ct_images` makes of a case: a slab's ``slices`` (one for a MIP), times the phases
        under the ``images`` layout."""
        per_phase = 1 if self.mode == "mip" else self.slices
        return per_phase * (len(self.phases) if self.phase_layout == "images" else 1)


def ct_images(
    hu: dict[str, np.ndarray],
    recipe: ViewRecipe,
    tumour_box: np.ndarray | list[int] | None = None,
    stomach_box: np.ndarray | list[int] | None = None,
) -> tuple[np.ndarray, str]:
    """A case's images under ``recipe`` from its phases' ``(D, H, W)`` HU volumes (``hu``: phase → volume), and the
    prompt text the recipe adds (the box's coordinates, or nothing): RGB ``(N, 3, H, W)`` float32 in [0, 1], ordered
    phase-major then slice (``images`` layout) or by slice (``channels``)."""
    missing = [p for p in recipe.phases if p not in hu]
    if missing:
        raise ValueError(f"the view recipe asks for phases {missing}, not among the case's {sorted(hu)}")
    if recipe.boxes != "off" and tumour_box is None:
        raise ValueError(f"view recipe boxes={recipe.boxes!r} needs the tumour box")
    centre_box = tumour_box if recipe.centre == "lesion" else stomach_box
    if centre_box is None:
        raise ValueError(f"view recipe centre={recipe.centre!r} needs the {recipe.centre}'s box")
    depth = hu[recipe.phases[0]].shape[0]
    indices = stack_indices(depth, box_centre_slice(centre_box), recipe.slices)
    windowed = {p: window(hu[p][indices], *recipe.window) for p in recipe.phases}  # (k, H, W) each
    if recipe.mode == "mip":  # the window is monotonic: projecting the windowed slab is windowing the projection
        windowed = {p: w.max(axis=0, keepdims=True) for p, w in windowed.items()}
        indices = indices[len(indices) // 2 : len(indices) // 2 + 1]  # drawn as on the slab's middle slice
    if recipe.phase_layout == "channels":
        planes = [windowed[p] for p in recipe.phases]
        planes += [planes[-1]] * (3 - len(planes))  # fewer than three phases: the last fills the rest
        images = np.stack(planes, axis=1)  # (k, 3, H, W)
        if recipe.boxes == "drawn":
            images = _draw_rgb(images, tumour_box, indices)
    else:
        images = np.concatenate(
            [draw_box(w, tumour_box, indices) if recipe.boxes == "drawn" else grey_rgb(w) for w in windowed.values()]
        )
    prompt = ""
    if recipe.boxes == "prompt":
        prompt = f"The lesion's box on the {grid_text(hu[recipe.phases[0]].shape)} grid: {box_text(tumour_box)}."
    return images.astype(np.float32), prompt


def grid_text(shape: Sequence[int]) -> str:
    """A CT grid's size as the prompts give it: ``12 x 32 x 32 (slices x rows x columns)``."""
    d, h, w = (int(v) for v in shape[-3:])
    return f"{d} x {h} x {w} (slices x rows x columns)"


def box_text(box: np.ndarray | Sequence[int]) -> str:
    """An end-exclusive ``(z0, y0, x0, z1, y1, x1)`` box in words, its ends inclusive: ``slices 2-4, rows 8-15,
    columns 8-15`` (the prompt's form under ``boxes: prompt``, and the answer a VLM writes for lesion detection)."""
    z0, y0, x0, z1, y1, x1 = (int(v) for v in box)
    return f"slices {z0}-{z1 - 1}, rows {y0}-{y1 - 1}, columns {x0}-{x1 - 1}"


BOX_TEXT = re.compile(r"slices\s*(\d+)\s*-\s*(\d+)\W*rows\s*(\d+)\s*-\s*(\d+)\W*columns\s*(\d+)\s*-\s*(\d+)")


def parse_box_text(text: str) -> np.ndarray | None:
    """The end-exclusive box that :func:`box_text` wrote in ``text`` (the first one, anywhere in it), or None where
    there is none or its ranges are inverted."""
    found = BOX_TEXT.search(text.lower())
    if not found:
        return None
    z0, z1, y0, y1, x0, x1 = (int(v) for v in found.groups())
    if z1 < z0 or y1 < y0 or x1 < x0:
        return None
    return np.array([z0, y0, x0, z1 + 1, y1 + 1, x1 + 1], dtype=np.float64)


def _draw_rgb(images: np.ndarray, box: np.ndarray | list[int], z_indices: np.ndarray) -> np.ndarray:
    """The box's outline in :data:`OVERLAY_COLOUR` on RGB ``(k, 3, H, W)`` images, on each slice the box spans."""
    images = images.copy()
    k, _, h, w = images.shape
    z0, y0, x0, z1, y1, x1 = (int(v) for v in box)
    rectangle = box_outlines(torch.tensor([0, y0, x0, 1, y1, x1]), (1, h, w))[0].numpy()
    for i in np.flatnonzero((np.asarray(z_indices) >= z0) & (np.asarray(z_indices) < z1)):
        for channel, value in enumerate(OVERLAY_COLOUR):
            images[i, channel][rectangle] = value
    return images


AUTO = "auto"


@dataclass(frozen=True)
class ViewsConfig:
    """A VLM trial's 3D-to-2D conversion (``views.*``): the :class:`ViewRecipe`'s fields, the phases the schema's.
    What the model may see stays the schema's to say: the tumour box only under a tumour box cue, the lab table
    (``schema.table: text``) in the prompt as its abnormal-value descriptors."""

    centre: str = AUTO
    """``lesion`` (the tumour box's key slice: itself a box cue), ``stomach``; ``auto``: the lesion under a schema with
    a tumour box cue, else the stomach."""
    slices: int = 1
    mode: str = "stack"
    window: tuple[float, float] = SOFT_TISSUE
    phase_layout: str = "images"
    boxes: str = AUTO
    """``drawn``, ``prompt`` or ``off``; ``auto``: drawn under a schema with a tumour box cue, else off."""

    def recipe(self, schema: ModalitySchema) -> ViewRecipe:
        """The recipe this config gives under ``schema``; refuses a choice that would show the model the tumour box
        the schema withholds, naming the key."""
        tumour_cue = schema.boxes != "off" and "tumour" in schema.box_levels
        centre = self.centre if self.centre != AUTO else ("lesion" if tumour_cue else "stomach")
        boxes = self.boxes if self.boxes != AUTO else ("drawn" if tumour_cue else "off")
        if not tumour_cue and (centre == "lesion" or boxes != "off"):
            key, value = ("views.centre", centre) if centre == "lesion" else ("views.boxes", boxes)
            raise ValueError(
                f"{key} = {value!r} shows the model the tumour box, which schema {schema.name!r} does not give "
                "(set schema.boxes and a tumour box level, or views.centre: stomach and views.boxes: off)"
            )
        if len(self.window) != 2:
            raise ValueError(f"views.window = {list(self.window)} is not valid: [centre, width] in HU")
        return ViewRecipe(
            centre=centre, slices=self.slices, mode=self.mode, window=(float(self.window[0]), float(self.window[1])),
            phases=tuple(schema.phases), phase_layout=self.phase_layout, boxes=boxes,
        )  # fmt: skip
