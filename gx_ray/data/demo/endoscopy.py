"""The endoscopy side of a demo case: what the endoscopist sees, and an RGB gastroscopy frame showing it.

It renders ``findings.endoscopy_staging`` (a decoy stage under a weak endoscopy signal): the lesion's gross type and
size are re-derived from it (:func:`endoscopic_lesion`), a record the endoscopy report reads too, so image and report
agree; the location is shared by the case and carries no stage. The frame is procedural: mucosa, rugal folds
converging on a dark lumen, highlights, a vignetted field of view, and a lesion whose look follows its gross type
(early: subtle reddened or pale patches; advanced: lobulated or ulcerated masses with a fibrin base and red rim).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage

from gx_ray.data.demo.findings import (
    GROSS_TYPES_ADVANCED,
    GROSS_TYPES_EARLY,
    TUMOUR_SIZE_MM,
    Findings,
)

EARLY_T = ("Tis", "T1a", "T1b")
# How prominent the rugal folds are by region: the body and fundus are folded, the antrum nearly smooth.
FOLD_PROMINENCE = {"cardia": 0.7, "fundus": 0.9, "body": 1.0, "angle": 0.5, "antrum": 0.35}

MUCOSA_RGB = np.array([0.86, 0.48, 0.38])
FIBRIN_RGB = np.array([0.93, 0.9, 0.78])
RIM_RGB = np.array([0.84, 0.3, 0.27])
MASS_RGB = np.array([0.74, 0.28, 0.28])
PALE_RGB = np.array([0.88, 0.66, 0.6])
BLOOD_RGB = np.array([0.45, 0.12, 0.1])


@dataclass(frozen=True)
class EndoscopicLesion:
    """The lesion as endoscopy shows it: follows ``endoscopy_staging``, not the imaging stage."""

    t: str
    location: str
    curvature: str
    gross_type: str
    size_mm: int
    """Long axis."""
    short_mm: int

    @property
    def early(self) -> bool:
        return self.t in EARLY_T


def endoscopic_lesion(findings: Findings) -> EndoscopicLesion:
    """The lesion of ``findings`` as endoscopy renders it (deterministic): the imaging lesion, or under a decoy stage
    its gross type moved to the endoscopy T's family (same position) and its size rescaled to that T with the case's
    jitter, so a decoy endoscopy leaks nothing about the imaging stage."""
    t = findings.endoscopy_staging.t
    jitter = findings.tumour_size_mm / TUMOUR_SIZE_MM[findings.imaging_staging.t]
    family = GROSS_TYPES_EARLY if t in EARLY_T else GROSS_TYPES_ADVANCED
    gross = findings.gross_type
    if gross not in family:
        other = GROSS_TYPES_ADVANCED if family is GROSS_TYPES_EARLY else GROSS_TYPES_EARLY
        gross = family[other.index(gross)]
    size = TUMOUR_SIZE_MM[t] * jitter
    # the short axis is a fixed fraction per case: deterministic and stage-free
    short = size * (0.55 + 0.3 * (jitter - 0.8) / 0.45)
    return EndoscopicLesion(
        t=t,
        location=findings.tumour_location,
        curvature=findings.tumour_curvature,
        gross_type=gross,
        size_mm=max(1, round(size)),
        short_mm=max(1, round(short)),
    )


def render_endoscopy(rng: np.random.Generator, findings: Findings, size: int = 256) -> np.ndarray:
    """An RGB gastroscopy frame of the case's lesion, ``uint8`` of shape ``(size, size, 3)``."""
    return render_endoscopy_with_mask(rng, findings, size)[0]


def render_endoscopy_with_mask(
    rng: np.random.Generator, findings: Findings, size: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """The frame of :func:`render_endoscopy` and the boolean lesion mask ``(size, size)`` inside the view."""
    lesion = endoscopic_lesion(findings)
    yy, xx = (np.mgrid[0:size, 0:size] + 0.5) / size  # normalised coordinates, image centre at 0.5

    # camera geometry: the lumen on one side, the lesion on the opposite wall
    view_angle = rng.uniform(0, 2 * np.pi)
    direction = np.array([np.sin(view_angle), np.cos(view_angle)])
    lumen = 0.5 + rng.uniform(0.2, 0.27) * direction
    radius = 0.035 + 0.0029 * lesion.size_mm * rng.uniform(0.9, 1.1)  # grows with T through size_mm
    centre = 0.5 - min(0.15, 0.4 - 1.1 * radius) * direction + rng.normal(0, 0.02, 2)

    colour, fold_height = _mucosa(rng, yy, xx, lumen, FOLD_PROMINENCE[lesion.location])
    colour, lesion_height, inside = _paint_lesion(rng, colour, yy, xx, centre, radius, lesion)
    height = fold_height * 0.04 + lesion_height * radius
    # light comes from the scope tip, slightly up-left: slopes facing it are brighter
    gy, gx = np.gradient(height * size)
    slope_light = gy + gx
    colour = colour * np.clip(1 + 0.6 * slope_light, 0.55, 1.5)[..., None]
    lit = colour.mean(-1) > 0.35  # no reflections from the dark lumen
    colour = _add_highlights(rng, colour, (slope_light > 0.25) & (height > 0) & lit, size)

    r = np.hypot(yy - 0.5, xx - 0.5) / 0.5
    fov = np.clip((0.97 - r) / 0.03, 0, 1)  # soft-edged circular field of view
    light = (1.08 - 0.4 * r**2) * fov
    colour = (colour + rng.normal(0, 0.01, colour.shape)) * light[..., None]  # sensor noise; the mask stays black
    image = (np.clip(colour, 0, 1) * 255 + 0.5).astype(np.uint8)
    return image, inside & (fov > 0.99)


def _smooth_noise(rng: np.random.Generator, size: int, cells: int, channels: int = 0) -> np.ndarray:
    """Zero-mean, roughly unit-variance noise varying over ``size / cells`` pixels (bicubic upsampling)."""
    coarse = rng.standard_normal((max(channels, 1), cells, cells)).astype(np.float32)
    planes = [np.asarray(Image.fromarray(c).resize((size, size), Image.Resampling.BICUBIC)) for c in coarse]
    return np.stack(planes, -1).astype(np.float64) if channels else planes[0].astype(np.float64)


def _mucosa(
    rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray, lumen: np.ndarray, fold_prominence: float
) -> tuple[np.ndarray, np.ndarray]:
    """Background mucosa (float RGB in [0, 1]) and the height of its rugal folds (0 to 1)."""
    size = yy.shape[0]
    dy, dx = yy - lumen[0], xx - lumen[1]
    dist = np.hypot(dy, dx)
    # rugal folds run towards the lumen: a wavy pattern in the angle around it, fading into the distance
    warp = _smooth_noise(rng, size, 6)
    folds = np.sin(rng.integers(6, 11) * np.arctan2(dy, dx) + 1.2 * warp + 8 * dist)
    fold_height = ((0.5 + 0.5 * folds) ** 2) * fold_prominence * np.clip(dist / 0.15, 0, 1)

    tint = MUCOSA_RGB * rng.uniform(0.95, 1.05, 3) + 0.035 * _smooth_noise(rng, size, 5, 3)
    areae = 1 + 0.025 * _smooth_noise(rng, size, max(8, size // 5))  # fine mucosal surface pattern
    colour = tint * (areae * (0.82 + 0.22 * fold_height))[..., None] + 0.04 * fold_height[..., None]
    depth = 1 - 0.9 * np.exp(-((dist / rng.uniform(0.09, 0.13)) ** 2))  # the far lumen gets little light
    return colour * depth[..., None], fold_height


def _paint_lesion(
    rng: np.random.Generator,
    colour: np.ndarray,
    yy: np.ndarray,
    xx: np.ndarray,
    centre: np.ndarray,
    radius: float,
    lesion: EndoscopicLesion,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Paint the lesion; returns the colour, its height (in lesion radii) and the hard lesion mask."""
    size = yy.shape[0]
    dy, dx = (yy - centre[0]) / radius, (xx - centre[1]) / radius
    theta = np.arctan2(dy, dx)
    # irregular outline: a few random low harmonics of the boundary radius, wilder for advanced lesions
    roughness = 0.1 if lesion.early else 0.16 + 0.03 * lesion.t.startswith("T4")
    boundary = 1 + sum(
        roughness / k * rng.uniform(0.5, 1.5) * np.cos(k * theta + rng.uniform(0, 2 * np.pi)) for k in range(2, 6)
    )
    u = np.hypot(dy, dx) / boundary  # < 1 inside the lesion
    # early and diffuse lesions have ill-defined margins
    edge = np.clip((1 - u) / (0.3 if lesion.early or lesion.gross_type == "Borrmann IV" else 0.12), 0, 1)
    texture = _smooth_noise(rng, size, max(8, size // 10))

    def blend(target: np.ndarray, weight: np.ndarray) -> None:
        nonlocal colour
        colour = colour * (1 - weight[..., None]) + target * weight[..., None]

    kind = lesion.gross_type
    if kind in ("0-IIc", "0-III"):  # superficial depressed: reddened, slightly darker, fine granular surface
        blend(colour * np.array([1.0, 0.7, 0.74]) * (0.9 + 0.04 * texture[..., None]), 0.9 * edge)
        height = -0.06 * edge
        if kind == "0-III":
            floor = np.clip((0.35 - u) / 0.1, 0, 1)
            blend(FIBRIN_RGB * (0.95 + 0.05 * texture[..., None]), floor)
            height = height - 0.15 * floor
    elif kind == "0-IIa":  # superficial elevated: paler, faintly raised
        blend(PALE_RGB * (0.97 + 0.05 * texture[..., None]), 0.75 * edge)
        height = 0.08 * edge
    elif kind in ("0-I", "Borrmann I"):  # polypoid: a lobulated red dome
        lobes = _smooth_noise(rng, size, max(6, size // 24))
        height = np.sqrt(np.clip(1 - u**2, 0, 1)) * (0.6 if kind == "0-I" else 0.9) + 0.1 * lobes * edge
        blend((MASS_RGB if kind == "Borrmann I" else RIM_RGB) * (0.95 + 0.05 * lobes[..., None]), edge)
        if kind == "Borrmann I":  # surface erosions with whitish exudate
            blend(FIBRIN_RGB * 0.9, 0.7 * (texture > 1.4) * edge)
    elif kind == "Borrmann IV":  # diffuse infiltration: pale, rigid mucosa over swollen giant folds
        across = dy * np.cos(theta[0, 0]) + dx * np.sin(theta[0, 0])
        giant_folds = 0.5 + 0.5 * np.sin(1.6 * np.pi * across + 0.6 * texture)
        blend(PALE_RGB * (0.9 + 0.1 * giant_folds[..., None]), 0.7 * edge)
        erosions = (_smooth_noise(rng, size, max(12, size // 6)) > 1.6) * edge
        blend(RIM_RGB * 0.9, 0.6 * erosions)
        height = (0.1 + 0.25 * giant_folds) * edge
    else:  # Borrmann II/III: ulcer with a whitish fibrin base inside a raised red rim
        base = 0.62 if kind == "Borrmann II" else 0.74
        rim = np.exp(-(((u - (base + 1) / 2) / 0.18) ** 2))
        floor = np.clip((base - u) / 0.06, 0, 1)
        blend(RIM_RGB, np.maximum(rim, 0.8 * edge))
        fibrin = FIBRIN_RGB * (0.86 + 0.06 * texture[..., None]) + np.array([0, 0, -0.05]) * texture[..., None]
        blend(fibrin, floor)
        blend(BLOOD_RGB, 0.5 * (texture > 1.5) * floor)  # haemorrhagic spots on the ulcer floor
        height = 0.45 * rim - 0.1 * floor
        if kind == "Borrmann III":  # ill-defined infiltrative halo beyond the rim
            halo = np.clip((1.3 - u) / 0.3, 0, 1) * (u > 1)
            blend(colour * np.array([1.0, 0.8, 0.82]), 0.6 * halo)
    return colour, height, u < 1


def _add_highlights(rng: np.random.Generator, colour: np.ndarray, glossy: np.ndarray, size: int) -> np.ndarray:
    """Specular reflections of the scope light: a few small white spots on wet, light-facing slopes."""
    ys, xs = np.nonzero(glossy)
    spots = Image.new("L", (size, size))
    if len(ys):
        draw = ImageDraw.Draw(spots)
        for i in rng.choice(len(ys), size=min(len(ys), int(rng.integers(5, 14))), replace=False):
            ry, rx = rng.uniform(0.4, 1.6, 2) * size / 128
            draw.ellipse((xs[i] - rx, ys[i] - ry, xs[i] + rx, ys[i] + ry), fill=255)
    weight = ndimage.gaussian_filter(np.asarray(spots, dtype=np.float64) / 255, 0.7 * size / 256)[..., None]
    return colour * (1 - weight) + weight
