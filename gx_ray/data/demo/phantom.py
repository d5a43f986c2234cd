"""Multi-phase abdominal CT of one demo case: a procedural phantom, or a real CT template, with a gastric tumour.

Both modes render the same :class:`~gx_ray.data.demo.findings.Findings`: a stomach-wall tumour at the findings'
location, as large and deep as its imaging T stage says; perigastric lymph nodes with the findings' short axes;
hypodense liver metastases; ascites. Each present phase gets its own voxel grid and a small known rigid offset from the
venous phase, so registration has an answer to check. :func:`make_phantom` needs no file: analytic shapes (wobbly
ellipsoids, tubes along splines) in the venous frame, evaluated at each phase's voxel centres mapped back through its
offset, so images, masks and boxes are exact on every grid. :func:`make_from_template` builds on a real CT and its
TotalSegmentator labels, resampling the other phases with SimpleITK. Attenuation comes from :data:`HU_TABLE`;
everything random from the caller's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import SimpleITK as sitk
from scipy import ndimage
from scipy.interpolate import CubicSpline

from gx_ray.data.demo.findings import Findings
from gx_ray.schema import PHASES, REFERENCE_PHASE, Box

# Mean attenuation (HU) of each tissue per phase, columns in PHASES order: non-contrast, arterial (late arterial,
# ~35 s), venous (portal venous, ~70 s), delayed (equilibrium, ~3-5 min). Textbook magnitudes of multiphasic
# abdominal CT (e.g. Bae, Radiology 2010;256:32-61): aorta ~40 HU unenhanced, 250-350 arterial, ~150 venous;
# liver ~55-60 unenhanced, ~50 HU more in the portal venous phase; corticomedullary renal enhancement in the
# arterial phase, nephrographic in the venous phase; pancreas peaks in the (late) arterial phase; everything
# converges towards ~80-120 HU at equilibrium. Fat, air, bone and gastric contents do not enhance.
HU_TABLE: dict[str, tuple[float, float, float, float]] = {
    "air": (-1000, -1000, -1000, -1000),
    "lung": (-860, -855, -850, -850),
    "skin": (30, 35, 40, 40),
    "subcutaneous_fat": (-105, -105, -100, -100),
    "visceral_fat": (-95, -95, -90, -90),
    "muscle": (50, 58, 65, 62),
    "cortical_bone": (900, 900, 900, 900),
    "cancellous_bone": (230, 240, 250, 245),
    "intervertebral_disc": (85, 90, 95, 95),
    "rib": (450, 450, 450, 450),
    "spinal_canal": (15, 15, 20, 20),
    "blood_pool": (40, 280, 160, 120),  # cardiac chambers
    "liver": (58, 75, 115, 95),
    "spleen": (48, 125, 120, 100),
    "kidney_cortex": (32, 185, 170, 130),
    "kidney_medulla": (32, 75, 165, 135),
    "aorta": (42, 310, 160, 120),
    "ivc": (40, 75, 140, 115),
    "portal_vein": (42, 120, 175, 125),
    "pancreas": (45, 125, 100, 85),
    "gastric_wall": (40, 105, 90, 80),  # mucosal enhancement is strongest in the arterial phase
    "gastric_gas": (-1000, -1000, -1000, -1000),
    "gastric_fluid": (8, 8, 10, 10),
    "colon_wall": (38, 80, 85, 75),
    "colon_gas": (-1000, -1000, -1000, -1000),
    "colon_content": (-30, -30, -25, -25),
    "lymph_node": (38, 65, 85, 80),
    "liver_metastasis": (35, 45, 60, 65),  # hypovascular: hypodense against the enhanced liver
    "ascites": (10, 10, 12, 14),
    "tumour": (40, 85, 100, 90),  # moderate, overridden by the findings below
}
TUMOUR_ARTERIAL_HYPERENHANCING_HU = 130.0  # intestinal-type tumours enhance early
TUMOUR_DELAYED_RETAINED_HU = 110.0  # diffuse/scirrhous (Borrmann IV) tumours enhance progressively
TUMOUR_DELAYED_WASHOUT_HU = 75.0

TISSUES: tuple[str, ...] = tuple(HU_TABLE)
TISSUE_CODE = {name: code for code, name in enumerate(TISSUES)}  # tissue name → code in the label maps
RELEASE_LABELS = {"stomach": 6, "aorta": 7, "ivc": 8, "portal_splenic_vein": 9, "pancreas": 10}
_TISSUE_TO_RELEASE = {
    "gastric_wall": 6,
    "gastric_gas": 6,
    "gastric_fluid": 6,
    "aorta": 7,
    "ivc": 8,
    "portal_vein": 9,
    "pancreas": 10,
}
# TotalSegmentator v2 classes a template may carry → the tissue whose enhancement they follow.
TOTALSEG_TISSUES = {
    1: "spleen",
    2: "kidney_cortex",
    3: "kidney_cortex",
    5: "liver",
    7: "pancreas",
    51: "blood_pool",
    52: "aorta",
    63: "ivc",
    64: "portal_vein",
}
TOTALSEG_TO_RELEASE = {6: 6, 52: 7, 63: 8, 64: 9, 7: 10}
TOTALSEG_STOMACH, TOTALSEG_LIVER = 6, 5
# Organs a T4b tumour may invade (TotalSegmentator: spleen, liver, pancreas, small bowel, duodenum, colon).
TOTALSEG_NEIGHBOURS = (1, 5, 7, 18, 19, 20)
TEMPLATE_WALL_MM = 4.0  # a normal gastric wall, thinner than the template's voxels
TEMPLATE_EXTRA_NOISE_HU = 3.0  # the template has its own noise; a little more so phases don't share it exactly

# Where each location sits along the stomach's centreline (0 = fundus dome, 1 = pylorus).
LOCATION_ALONG_STOMACH = {"fundus": 0.05, "cardia": 0.15, "body": 0.40, "angle": 0.60, "antrum": 0.80}
# How far the tumour reaches outwards, as a fraction of the normal wall counted from the lumen (mucosa is
# roughly the inner third, submucosa the next fifth, muscularis propria most of the rest); serosa and beyond
# breach the outer surface.
INVASION_REACH = {
    "intraepithelial": 0.15,
    "mucosa": 0.30,
    "submucosa": 0.50,
    "muscularis propria": 0.85,
    "subserosa": 0.95,
    "serosa": 1.15,
    "adjacent organs": 1.3,
}


@dataclass(frozen=True)
class PhantomConfig:
    """Geometry of the rendered cases; each range is sampled per case (slice spacing and extent per phase)."""

    in_plane_spacing_mm: tuple[float, float] = (2.4, 3.2)
    slice_spacing_mm: tuple[float, float] = (3.0, 5.0)
    fov_mm: float = 300.0
    z_extent_mm: tuple[float, float] = (180.0, 240.0)
    max_rotation_deg: float = 3.0
    max_translation_mm: float = 6.0
    arterial_probability: float = 0.5
    own_slice_spacing_probability: float = 0.3
    """Chance that a non-venous phase is reconstructed with its own slice spacing."""
    noise_hu: tuple[float, float] = (6.0, 12.0)
    enhancement_jitter: float = 0.15
    """Per-case, per-phase relative variation of contrast enhancement (dose, timing, cardiac output)."""
    tumour_enhancement_hu: float = 300.0
    """HU added to the tumour in every contrast phase. 0 is realistic (the tumour enhances about as the gastric wall it
    thickens, no brighter than its surroundings); the demo plants it brighter so that a detector trained from scratch
    for minutes can find it (docs/lab/demo_log.md: +150 HU is not enough)."""


@dataclass
class PhantomCase:
    phases: dict[str, sitk.Image]
    """int16 HU image per present phase."""
    organ_masks: dict[str, sitk.Image]
    """uint8 release labels per phase: 6 stomach, 7 aorta, 8 IVC, 9 portal/splenic vein, 10 pancreas."""
    tumour_masks: dict[str, sitk.Image]
    boxes: list[Box]
    """Tumour, lymph-node (when there are nodes) and stomach boxes on every present phase's own grid."""
    phase_offsets: dict[str, dict]
    """Non-venous phase → rigid transform mapping venous physical points to that phase's physical points."""
    tissue_maps: dict[str, sitk.Image] = field(default_factory=dict)
    """uint8 codes of :data:`TISSUES` per phase (for tests and debugging; not part of the release)."""


# --- rigid offsets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rigid:
    """p_phase = R (p_venous - c) + c + t."""

    matrix: np.ndarray
    translation: np.ndarray
    centre: np.ndarray

    def forward(self, points: np.ndarray) -> np.ndarray:  # (..., 3)
        return (points - self.centre) @ self.matrix.T + self.centre + self.translation

    @classmethod
    def identity(cls, centre: np.ndarray) -> _Rigid:
        return cls(np.eye(3), np.zeros(3), np.asarray(centre, float))


def offset_transform(offset: dict) -> sitk.Euler3DTransform:
    """The SimpleITK transform of one entry of :attr:`PhantomCase.phase_offsets` (venous → phase points): what a
    registration with the venous phase as fixed and this phase as moving image should recover."""
    transform = sitk.Euler3DTransform()
    transform.SetComputeZYX(True)
    transform.SetFixedParameters(offset["fixed_parameters"])
    transform.SetParameters(offset["parameters"])
    return transform


def _sample_offset(rng: np.random.Generator, config: PhantomConfig, centre: np.ndarray) -> tuple[_Rigid, dict]:
    angles_deg = rng.uniform(-config.max_rotation_deg, config.max_rotation_deg, 3)
    translation = rng.uniform(-config.max_translation_mm, config.max_translation_mm, 3)
    transform = sitk.Euler3DTransform()
    transform.SetComputeZYX(True)  # R = Rz · Ry · Rx
    transform.SetCenter([float(v) for v in centre])
    transform.SetRotation(*[float(np.deg2rad(a)) for a in angles_deg])
    transform.SetTranslation([float(v) for v in translation])
    matrix = np.array(transform.GetMatrix()).reshape(3, 3)
    offset = {
        "rotation_deg": [float(a) for a in angles_deg],  # about x, y, z
        "euler_zyx_deg": [float(angles_deg[2]), float(angles_deg[1]), float(angles_deg[0])],
        "rotation_order": "R = Rz @ Ry @ Rx",
        "translation_mm": [float(v) for v in translation],
        "center_mm": [float(v) for v in centre],
        "matrix": matrix.tolist(),
        "parameters": list(transform.GetParameters()),
        "fixed_parameters": list(transform.GetFixedParameters()),
        "maps": "venous physical point -> this phase's physical point",
    }
    return _Rigid(matrix, translation, np.asarray(centre, float)), offset


# --- voxel grids ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Grid:
    """An axis-aligned (identity direction) voxel grid; ``size`` is (nx, ny, nz)."""

    origin: np.ndarray
    spacing: np.ndarray
    size: tuple[int, int, int]

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.size[2], self.size[1], self.size[0]

    @property
    def centre(self) -> np.ndarray:
        return self.origin + self.spacing * (np.array(self.size) - 1) / 2

    def venous_coords(self, rigid: _Rigid) -> np.ndarray:
        """(3, z, y, x) venous-frame position (x, y, z in mm) of every voxel centre of this phase's grid."""
        # p = R^T (q - c - t) + c is affine in the voxel index: p = b + M · index
        m = rigid.matrix.T * self.spacing
        b = rigid.matrix.T @ (self.origin - rigid.centre - rigid.translation) + rigid.centre
        i, j, k = (np.arange(n, dtype=np.float32) for n in self.size)
        coords = np.empty((3, *self.shape), np.float32)
        for axis in range(3):
            coords[axis] = (
                np.float32(b[axis])
                + np.float32(m[axis, 0]) * i[None, None, :]
                + np.float32(m[axis, 1]) * j[None, :, None]
                + np.float32(m[axis, 2]) * k[:, None, None]
            )
        return coords

    def block(self, rigid: _Rigid, lo: np.ndarray, hi: np.ndarray) -> tuple[slice, slice, slice] | None:
        """The (z, y, x) slices of this grid that can hold a venous-frame box [lo, hi]."""
        corners = np.array([[(lo, hi)[c >> a & 1][a] for a in range(3)] for c in range(8)])
        index = (rigid.forward(corners) - self.origin) / self.spacing
        first = np.maximum(np.floor(index.min(0)).astype(int) - 1, 0)
        last = np.minimum(np.ceil(index.max(0)).astype(int) + 2, self.size)
        if np.any(last <= first):
            return None
        return tuple(slice(first[a], last[a]) for a in (2, 1, 0))

    def index_of(self, rigid: _Rigid, point: np.ndarray) -> tuple[int, int, int] | None:
        """(z, y, x) index of the voxel holding a venous-frame point, if it is on the grid."""
        index = np.rint((rigid.forward(point) - self.origin) / self.spacing).astype(int)
        if np.any(index < 0) or np.any(index >= self.size):
            return None
        return int(index[2]), int(index[1]), int(index[0])

    def image(self, array: np.ndarray) -> sitk.Image:
        image = sitk.GetImageFromArray(array)
        image.SetOrigin([float(v) for v in self.origin])
        image.SetSpacing([float(v) for v in self.spacing])
        return image


# --- analytic shapes (venous patient frame, LPS mm: +x left, +y posterior, +z superior) ----------------


def _codes_lut(*names: str) -> np.ndarray:
    lut = np.zeros(256, bool)
    lut[[TISSUE_CODE[n] for n in names]] = True
    return lut


_BODY_WALL = ("air", "skin", "subcutaneous_fat", "muscle", "cortical_bone", "cancellous_bone", "rib")
CAVITY = ~_codes_lut(*_BODY_WALL, "intervertebral_disc", "spinal_canal")
"""Organs are painted only inside the body cavity, so they meet the abdominal wall instead of piercing it."""
FAT = _codes_lut("visceral_fat", "ascites")
TUMOUR_MAY_REPLACE = ~_codes_lut(*_BODY_WALL, "intervertebral_disc", "spinal_canal", "aorta", "ivc", "portal_vein")
"""A tumour grows through fat and into solid organs and bowel; it encases vessels rather than filling them."""


@dataclass
class _Structure:
    paint: Callable[[np.ndarray], np.ndarray]
    """(3, ...) venous-frame coordinates → uint8 tissue codes; 0 leaves the voxel as it is."""
    lo: np.ndarray
    hi: np.ndarray
    over: np.ndarray | None = None
    """Which codes it may replace (a 256-entry bool table); None: all."""
    anchor: np.ndarray | None = None
    """A structure smaller than a voxel still marks the voxel holding this point (partial volume)."""
    anchor_code: int = 0


def _dot(vector, p: np.ndarray) -> np.ndarray:
    """vector · p for (3, ...) coordinates (numpy's tensordot copies and is several times slower here)."""
    v = np.asarray(vector, np.float32)
    return v[0] * p[0] + v[1] * p[1] + v[2] * p[2]


def _smooth_wobble(rng: np.random.Generator, amplitude: float, scale_mm: float, terms: int = 3):
    """A smooth random field (sum of plane waves) with wavelengths around ``scale_mm``."""
    waves = rng.normal(size=(terms, 3)) / scale_mm
    phases = rng.uniform(0, 2 * np.pi, terms)
    amplitudes = amplitude * rng.uniform(0.5, 1.0, terms) / np.sqrt(terms)

    def field_at(q: np.ndarray) -> np.ndarray:
        total = np.zeros(q.shape[1:], np.float32)
        for wave, phase, amp in zip(waves, phases, amplitudes, strict=True):
            total += np.float32(amp) * np.sin(_dot(wave, q) + np.float32(phase))
        return total

    return field_at


def _rotation(rng: np.random.Generator, max_deg: float) -> np.ndarray:
    transform = sitk.Euler3DTransform()
    transform.SetRotation(*np.deg2rad(rng.uniform(-max_deg, max_deg, 3)).tolist())
    return np.array(transform.GetMatrix()).reshape(3, 3)


def _ellipsoid_level(centre, radii, rotation, wobble) -> Callable[[np.ndarray], np.ndarray]:
    """Normalised radius (< 1 inside) of a wobbly rotated ellipsoid, as a function of (3, ...) points."""
    centre = np.asarray(centre, np.float32)
    to_local = (rotation.T / np.asarray(radii)[:, None]).astype(np.float32)

    def level(p: np.ndarray) -> np.ndarray:
        rel = [p[a] - centre[a] for a in range(3)]
        q = np.stack([_dot(row, rel) for row in to_local])
        rho = np.sqrt(q[0] * q[0] + q[1] * q[1] + q[2] * q[2])
        return rho - wobble(q * np.float32(max(radii))) if wobble is not None else rho

    return level


def _ellipsoid(rng, code, centre, radii, max_tilt_deg=10.0, wobble=0.05, over=CAVITY, shell=None) -> _Structure:
    """A solid ellipsoid; with ``shell=(inner_code, thickness_mm)`` its core is another tissue."""
    rotation = _rotation(rng, max_tilt_deg)
    field_ = _smooth_wobble(rng, wobble, max(radii)) if wobble else None
    level = _ellipsoid_level(centre, radii, rotation, field_)
    inner = None
    if shell is not None:
        inner_code, thickness = shell
        inner = _ellipsoid_level(centre, np.asarray(radii) - thickness, rotation, field_)

    def paint(p: np.ndarray) -> np.ndarray:
        codes = np.where(level(p) <= 1, np.uint8(code), np.uint8(0))
        if inner is not None:
            codes[inner(p) <= 1] = inner_code
        return codes

    reach = max(radii) * (1 + wobble) + 1
    return _Structure(paint, np.asarray(centre) - reach, np.asarray(centre) + reach, over)


def _polyline_distance(p: np.ndarray, points: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """Signed distance (mm, negative inside) to a tube whose radius varies linearly along a polyline."""
    mid = points.mean(0)
    points = (points - mid).astype(np.float32)
    q = [p[a] - np.float32(mid[a]) for a in range(3)]
    qq = q[0] * q[0] + q[1] * q[1] + q[2] * q[2]
    q_dot = [_dot(point, q) for point in points]  # q · d of a segment is a difference of these
    best = None
    for k in range(len(points) - 1):
        a, d = points[k], points[k + 1] - points[k]
        dd, ad, aa = float(d @ d), float(a @ d), float(a @ a)
        projection = (q_dot[k + 1] - q_dot[k] - np.float32(ad)) / np.float32(dd)
        t = np.clip(projection, 0, 1)
        squared = qq - 2 * q_dot[k] + np.float32(aa) + np.float32(dd) * t * (t - 2 * projection)
        value = np.sqrt(np.maximum(squared, 0)) - (np.float32(radii[k]) + t * np.float32(radii[k + 1] - radii[k]))
        best = value if best is None else np.minimum(best, value)
    return best


@dataclass(frozen=True)
class _Tube:
    """A hollow organ along a smooth centreline: wall, then gas above and fluid below a horizontal level."""

    points: np.ndarray  # (n, 3) samples of the centreline
    radii: np.ndarray
    wall_mm: float

    @classmethod
    def through(cls, controls, radii, wall_mm: float, samples: int = 14) -> _Tube:
        controls = np.asarray(controls, float)
        arc = np.concatenate([[0], np.cumsum(np.linalg.norm(np.diff(controls, axis=0), axis=1))])
        s = np.linspace(0, arc[-1], samples)
        return cls(CubicSpline(arc, controls)(s), np.interp(s, arc, radii), wall_mm)

    def distance(self, p: np.ndarray) -> np.ndarray:
        return _polyline_distance(p, self.points, self.radii)

    def at(self, s: float) -> tuple[np.ndarray, np.ndarray, float]:
        """Centre, unit tangent and radius at fraction ``s`` of the centreline's length."""
        arc = np.concatenate([[0], np.cumsum(np.linalg.norm(np.diff(self.points, axis=0), axis=1))])
        u = s * arc[-1]
        centre = np.array([np.interp(u, arc, self.points[:, a]) for a in range(3)])
        k = min(int(np.searchsorted(arc, u, side="right")) - 1, len(arc) - 2)
        tangent = self.points[k + 1] - self.points[k]
        return centre, tangent / np.linalg.norm(tangent), float(np.interp(u, arc, self.radii))

    def bounds(self, margin: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        reach = self.radii.max() + margin + 1
        return self.points.min(0) - reach, self.points.max(0) + reach

    def structure(self, wall: str, gas: str, fluid: str, gas_level_y: float) -> _Structure:
        codes = np.array([TISSUE_CODE[wall], TISSUE_CODE[gas], TISSUE_CODE[fluid]], np.uint8)

        def paint(p: np.ndarray) -> np.ndarray:
            f = self.distance(p)
            lumen = f < -self.wall_mm
            which = np.where(lumen, np.where(p[1] < gas_level_y, 1, 2), 0)  # supine: gas rises anteriorly (-y)
            return np.where(f < 0, codes[which], np.uint8(0))

        return _Structure(paint, *self.bounds(), CAVITY)


@dataclass(frozen=True)
class _TumourShape:
    """A lens-shaped wall thickening around wall point ``w``, optionally breaching along a bar into an organ.
    ``surface_distance`` maps (3, n) points to their signed distance (mm, negative inside) from the stomach's outer
    surface; the tumour spans ``thickness`` mm inwards from ``reach``, so a thick tumour bulges into the lumen."""

    w: np.ndarray
    normal: np.ndarray  # outward
    tangent: np.ndarray  # along the stomach
    size_mm: float
    thickness_mm: float
    reach_mm: float
    wall_mm: float
    invades: tuple[np.ndarray, np.ndarray, float] | None = None  # bar start, end, radius

    def inside(self, p: np.ndarray, surface_distance: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        rel = [p[a] - np.float32(self.w[a]) for a in range(3)]
        along = _dot(self.tangent, rel) / np.float32(self.size_mm / 2)
        across = _dot(np.cross(self.normal, self.tangent), rel) / np.float32(0.75 * self.size_mm / 2)
        footprint = along * along + across * across
        # the lens under the footprint, not the opposite wall
        near = (footprint <= 1) & (_dot(self.normal, rel) >= -(self.thickness_mm + self.wall_mm))
        depth = np.float32(self.thickness_mm) * np.sqrt(1 - footprint[near])
        f = surface_distance(p[:, near])  # only where it matters: the distance is the costly part
        inside = np.zeros(p.shape[1:], bool)
        inside[near] = (f <= self.reach_mm) & (f >= self.reach_mm - depth)
        if self.invades is not None:
            start, end, radius = self.invades
            inside |= _polyline_distance(p, np.stack([start, end]), np.array([radius, radius])) <= 0
        return inside

    @property
    def centre(self) -> np.ndarray:
        """Middle of the lens, halfway through its thickness."""
        return self.w + self.normal * (self.reach_mm - self.thickness_mm / 2)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        reach = self.size_mm / 2 + self.thickness_mm + self.wall_mm + 2
        lo, hi = self.w - reach, self.w + reach
        if self.invades is not None:
            start, end, radius = self.invades
            lo = np.minimum(lo, np.minimum(start, end) - radius - 1)
            hi = np.maximum(hi, np.maximum(start, end) + radius + 1)
        return lo, hi


def _tumour_geometry(findings: Findings, wall_mm: float) -> tuple[float, float, float]:
    """Long axis, thickness and outer reach (mm, relative to the outer wall surface) of the tumour."""
    reach = -wall_mm * (1 - INVASION_REACH[findings.invasion_depth])
    return float(findings.tumour_size_mm), float(findings.wall_thickness_mm), reach


# --- the procedural anatomy -------------------------------------------------------------------------


def _body(rng: np.random.Generator, findings: Findings, scale: float, centre: np.ndarray) -> _Structure:
    """Body outline with skin, subcutaneous fat, abdominal wall muscle and (above the costal margin) ribs."""
    fat_mm = rng.uniform(10, 24) * (1.2 if findings.sex == "female" else 1.0)
    muscle_mm = rng.uniform(8, 13)
    # the cavity scales with the patient; fat and muscle wrap around it (never squeeze the organs)
    a, b = 96 * scale + 2 + fat_mm + muscle_mm, 72 * scale + 2 + fat_mm + muscle_mm
    back_y = centre[1] + 0.92 * b  # patient lies on the table: flat back
    harmonics = rng.normal(0, 0.03, 4).astype(np.float32)
    rib_period, rib_phase, costal_z = rng.uniform(28, 34), rng.uniform(0, 30), centre[2] + rng.uniform(-10, 20)
    layers = np.array(
        [
            TISSUE_CODE["air"],
            TISSUE_CODE["skin"],
            TISSUE_CODE["subcutaneous_fat"],
            TISSUE_CODE["muscle"],
            TISSUE_CODE["visceral_fat"],
        ],
        np.uint8,
    )
    edges = np.array([0, 2, 2 + fat_mm, 2 + fat_mm + muscle_mm], np.float32)

    def paint(p: np.ndarray) -> np.ndarray:
        x, y = p[0] - np.float32(centre[0]), p[1] - np.float32(centre[1])
        r = np.sqrt(x * x + y * y) + np.float32(1e-3)
        c, s = x / r, y / r
        shape = 1 + harmonics[0] * (c * c - s * s) + harmonics[1] * 2 * c * s + harmonics[2] * c * (4 * c * c - 3)
        shape += harmonics[3] * s * (3 - 4 * s * s)
        rho = np.sqrt((x / np.float32(a)) ** 2 + (y / np.float32(b)) ** 2) / shape
        depth = np.minimum(r * (1 / rho - 1), np.float32(back_y) - p[1])  # mm below the skin
        codes = layers[np.digitize(depth, edges)]
        # ribs: oblique bands just inside the wall, descending anteriorly, below the costal margin absent
        in_ribcage = (p[2] - np.float32(costal_z) + 0.5 * np.maximum(-y, 0)) > 0
        band = np.mod(p[2] - 0.6 * y + np.float32(rib_phase), np.float32(rib_period)) < 10
        shell = (depth > edges[3] - 2) & (depth < edges[3] + 6) & ((np.abs(x) > 45) | (y > 0))
        codes[in_ribcage & band & shell] = TISSUE_CODE["rib"]
        return codes

    reach = np.array([a * 1.15, b * 1.15, 1e4])
    return _Structure(paint, centre - reach, centre + reach)


def _spine(rng: np.random.Generator, scale: float, x0: float, y0: float) -> list[_Structure]:
    """Paraspinal and psoas muscles, then the vertebral column (body, discs, canal, posterior elements)."""
    rx, ry = 21 * scale, 18 * scale
    canal_y, canal_r = y0 + ry + 10 * scale, 8 * scale
    period, disc_mm, disc_phase = 34 * scale, 8 * scale, rng.uniform(0, 34)
    tall = 1e4
    muscle, muscles = TISSUE_CODE["muscle"], []
    for side in (-1, 1):
        paraspinal_xy, psoas_xy = (x0 + side * 32 * scale, canal_y + 22 * scale), (x0 + side * (rx + 14), y0 - 2)
        muscles.append(_cylinder(muscle, paraspinal_xy, (22 * scale, 19 * scale), -tall, tall))
        muscles.append(_cylinder(muscle, psoas_xy, (13 * scale, 12 * scale), -tall, -25 * scale))  # from L1 down

    def paint(p: np.ndarray) -> np.ndarray:
        x, y = p[0] - np.float32(x0), p[1] - np.float32(y0)
        rho = (x / rx) ** 2 + (y / ry) ** 2
        codes = np.where(rho <= 1, np.uint8(TISSUE_CODE["cortical_bone"]), np.uint8(0))
        codes[rho <= ((rx - 2.5) / rx) ** 2] = TISSUE_CODE["cancellous_bone"]
        disc = (rho <= 1) & (np.mod(p[2] - np.float32(disc_phase), np.float32(period)) < disc_mm)
        codes[disc] = TISSUE_CODE["intervertebral_disc"]
        yc = p[1] - np.float32(canal_y)
        ring = x * x + yc * yc
        arch = ring <= (canal_r + 5) ** 2
        arch |= (x / 5) ** 2 + ((yc - canal_r - 18 * scale) / (14 * scale)) ** 2 <= 1  # spinous process
        arch |= ((np.abs(x) - 24 * scale) / (13 * scale)) ** 2 + (yc / 4) ** 2 <= 1  # transverse processes
        codes[arch] = TISSUE_CODE["cortical_bone"]
        codes[ring <= canal_r**2] = TISSUE_CODE["spinal_canal"]
        return codes

    lo = np.array([x0 - 45 * scale, y0 - ry - 1, -tall])
    hi = np.array([x0 + 45 * scale, canal_y + 45 * scale, tall])
    return [*muscles, _Structure(paint, lo, hi, ~_codes_lut("air", "skin"))]


def _cylinder(code: int, centre_xy, radii_xy, z_lo: float, z_hi: float, over=None) -> _Structure:
    cx, cy = (np.float32(v) for v in centre_xy)
    rx, ry = (np.float32(v) for v in radii_xy)

    def paint(p: np.ndarray) -> np.ndarray:
        inside = ((p[0] - cx) / rx) ** 2 + ((p[1] - cy) / ry) ** 2 <= 1
        inside &= (p[2] >= z_lo) & (p[2] <= z_hi)
        return np.where(inside, np.uint8(code), np.uint8(0))

    lo = np.array([cx - rx - 1, cy - ry - 1, z_lo])
    hi = np.array([cx + rx + 1, cy + ry + 1, z_hi])
    return _Structure(paint, lo, hi, over if over is not None else ~_codes_lut("air", "skin"))


def _solid_tube(code: int, controls, radius: float, samples: int = 8) -> _Structure:
    """A vessel, or the pancreas: a tube of constant radius along a smooth curve."""
    tube = _Tube.through(controls, np.full(len(controls), radius), 0.0, samples)

    def paint(p: np.ndarray) -> np.ndarray:
        return np.where(tube.distance(p) <= 0, np.uint8(code), np.uint8(0))

    return _Structure(paint, *tube.bounds(), CAVITY)


@dataclass
class _Anatomy:
    structures: list[_Structure]
    tumour: _Structure
    nodes: list[_Structure]
    roi: tuple[np.ndarray, np.ndarray]
    """Venous-frame box every phase must cover (stomach, tumour, nodes)."""

    @property
    def all(self) -> list[_Structure]:
        return [*self.structures, self.tumour, *self.nodes]


def _labels_at(structures: list[_Structure], points: np.ndarray) -> np.ndarray:
    """Tissue codes at (3, n) venous-frame points."""
    labels = np.zeros(points.shape[1:], np.uint8)
    for s in structures:
        codes = s.paint(points)
        if s.over is not None:
            codes = np.where(s.over[labels], codes, 0)
        np.copyto(labels, codes, where=codes > 0)
    return labels


def _sphere_points(n: int = 26) -> np.ndarray:
    """Unit directions to probe the surroundings of a candidate lesion (deterministic, roughly uniform)."""
    k = np.arange(n) + 0.5
    polar, azimuth = np.arccos(1 - 2 * k / n), np.pi * (1 + 5**0.5) * k
    return np.stack([np.cos(azimuth) * np.sin(polar), np.sin(azimuth) * np.sin(polar), np.cos(polar)], 1)


def _free_of(structures, candidates: np.ndarray, reach_mm: float, allowed: np.ndarray) -> np.ndarray:
    """Which (n, 3) candidate centres have only ``allowed`` tissue within ``reach_mm`` (probed on a sphere)."""
    points = candidates[:, None, :] + np.concatenate([np.zeros((1, 3)), reach_mm * _sphere_points()])[None]
    labels = _labels_at(structures, points.reshape(-1, 3).T.astype(np.float32))
    return allowed[labels].reshape(len(candidates), -1).all(1)


def _greedy_place(points: np.ndarray, usable: np.ndarray, radii, separation_mm: float, placed: list) -> list:
    """For each radius in turn, the first usable (n, 3) point at least ``separation_mm`` clear of all (centre,
    radius) pairs in ``placed``, which it joins; None where no point is left."""
    usable, chosen = usable.copy(), []
    for radius in radii:
        ok = usable.copy()
        for centre, other in placed:
            ok &= np.linalg.norm(points - centre, axis=1) >= radius + other + separation_mm
        hits = np.flatnonzero(ok)
        chosen.append(int(hits[0]) if len(hits) else None)
        if len(hits):
            usable[hits[0]] = False
            placed.append((points[hits[0]], radius))
    return chosen


def _place(structures, candidates, radii, allowed, separation_mm: float, placed: list) -> list[int]:
    """A candidate index per lesion: in allowed tissue where there is room, else anywhere still apart."""
    room = _free_of(structures, candidates, max(radii) + 3, allowed)
    chosen = _greedy_place(candidates, room, radii, separation_mm, placed)
    missing = [k for k, i in enumerate(chosen) if i is None]
    if missing:
        taken = np.ones(len(candidates), bool)
        taken[[i for i in chosen if i is not None]] = False
        fallback = _greedy_place(candidates, taken, [radii[k] for k in missing], separation_mm, placed)
        for k, i in zip(missing, fallback, strict=True):
            chosen[k] = i if i is not None else k  # an impossible cohort config; keep the lesion anyway
    return chosen


def _procedural_anatomy(rng: np.random.Generator, findings: Findings) -> _Anatomy:
    scale = rng.uniform(0.88, 1.05) * (0.96 if findings.sex == "female" else 1.0)
    body_centre = np.array([rng.normal(0, 4), rng.normal(0, 4), 0.0])

    def at(x, y, z, jitter=4.0):  # anatomy template position (mm, scaled) + patient variation
        return body_centre + np.array([x, y, z]) * scale + rng.normal(0, jitter, 3)

    def size(*radii):
        return np.array(radii) * scale * rng.uniform(0.9, 1.1, len(radii))

    # about halfway back: the vertebral body, with the aorta on its anterior left and the IVC on its right
    spine_x, spine_y = body_centre[0] + rng.normal(0, 2), body_centre[1] + 15 * scale
    structures = [_body(rng, findings, scale, body_centre), *_spine(rng, scale, spine_x, spine_y)]
    for side in (-1, 1):
        structures.append(_ellipsoid(rng, TISSUE_CODE["lung"], at(side * 65, 25, 200), size(60, 62, 105), wobble=0.03))
    structures.append(_ellipsoid(rng, TISSUE_CODE["blood_pool"], at(10, -30, 178), size(60, 50, 50)))
    liver_centre, liver_radii = at(-45, -10, 55), size(72, 82, 70)
    liver = _ellipsoid(rng, TISSUE_CODE["liver"], liver_centre, liver_radii, wobble=0.06)
    kidney = {"shell": (TISSUE_CODE["kidney_medulla"], 7), "max_tilt_deg": 15}
    structures += [
        _ellipsoid(rng, TISSUE_CODE["spleen"], at(75, 30, 45), size(24, 45, 52), max_tilt_deg=20),
        _ellipsoid(rng, TISSUE_CODE["kidney_cortex"], at(68, 35, -15), size(25, 27, 52), **kidney),
        _ellipsoid(rng, TISSUE_CODE["kidney_cortex"], at(-66, 37, -30), size(25, 27, 52), **kidney),
        liver,
    ]
    aorta_xy, ivc_xy = (spine_x + 10 * scale, spine_y - 35 * scale), (spine_x - 25 * scale, spine_y - 31 * scale)
    pancreas = [at(-35, -36, -15), at(-5, -42, -2, 2), at(30, -35, 8), at(62, -8, 18)]  # head, neck, body, tail
    confluence, portal = at(-5, -30, -2, 2), TISSUE_CODE["portal_vein"]  # the portal system is one release label
    structures += [
        _cylinder(TISSUE_CODE["aorta"], aorta_xy, (12 * scale, 12 * scale), -1e4, 1e4, CAVITY),
        _cylinder(TISSUE_CODE["ivc"], ivc_xy, (14 * scale, 10 * scale), -1e4, 150 * scale, CAVITY),
        _solid_tube(TISSUE_CODE["pancreas"], pancreas, 11 * scale),
        _solid_tube(portal, [confluence, at(-35, -25, 25), at(-55, -22, 40)], 7 * scale),  # to the liver hilum
        _solid_tube(portal, [confluence, at(30, -24, 6), at(64, 2, 18), at(74, 10, 30)], 4.5 * scale),  # splenic
        _solid_tube(portal, [confluence, at(-8, -35, -60)], 5 * scale),  # superior mesenteric
    ]
    colon = _Tube.through(
        [at(-75, -20, -30), at(-50, -52, -45), at(0, -58, -62), at(50, -52, -45), at(78, -5, 10)],
        size(17, 18, 18, 18, 16),
        2.5,
        samples=10,
    )
    structures.append(colon.structure("colon_wall", "colon_gas", "colon_content", float(at(0, -60, 0)[1])))

    # the stomach: a J from the fundus dome under the left hemidiaphragm to the pylorus right of the midline
    controls = [
        (60, 5, 95),
        (45, -15, 72),
        (58, -38, 45),
        (50, -50, 15),
        (30, -56, -8),
        (2, -52, -15),
        (-22, -48, -10),
        (-35, -40, -4),
    ]
    stomach = _Tube.through(
        [at(*c) for c in controls],
        size(26, 32, 30, 26, 21, 17, 14, 10) * rng.uniform(0.9, 1.1),
        rng.uniform(3.0, 5.0),
    )
    lumen_y = stomach.points[:, 1] - stomach.radii, stomach.points[:, 1] + stomach.radii
    gas_level = lumen_y[0].min() + rng.uniform(0.25, 0.5) * (lumen_y[1].max() - lumen_y[0].min())
    structures.append(stomach.structure("gastric_wall", "gastric_gas", "gastric_fluid", gas_level))

    tumour = _procedural_tumour(rng, findings, stomach, structures)
    tumour_structure = _Structure(
        lambda p: np.where(tumour.inside(p, stomach.distance), np.uint8(TISSUE_CODE["tumour"]), np.uint8(0)),
        *tumour.bounds(),
        TUMOUR_MAY_REPLACE,
        anchor=tumour.centre,
        anchor_code=TISSUE_CODE["tumour"],
    )
    if findings.liver_met_sizes_mm:
        structures += _liver_metastases(rng, findings, liver, [*structures, tumour_structure])
    if findings.ascites:
        structures += _ascites(rng, liver_centre, liver_radii, scale)
    nodes = _lymph_nodes(rng, findings, stomach, tumour, [*structures, tumour_structure])

    lo, hi = stomach.bounds()
    lo, hi = np.minimum(lo, tumour.bounds()[0]), np.maximum(hi, tumour.bounds()[1])
    for node in nodes:
        lo, hi = np.minimum(lo, node.lo), np.maximum(hi, node.hi)
    return _Anatomy(structures, tumour_structure, nodes, (lo, hi))


def _procedural_tumour(rng, findings: Findings, stomach: _Tube, structures) -> _TumourShape:
    s = float(np.clip(LOCATION_ALONG_STOMACH[findings.tumour_location] + rng.uniform(-0.03, 0.03), 0.02, 0.95))
    centre, tangent, radius = stomach.at(s)
    # candidate sites: a ring around the centreline, where the wall is really there (not pressed away by the
    # abdominal wall or an organ painted over it)
    u = np.cross(tangent, [0.0, 0.0, 1.0] if abs(tangent[2]) < 0.9 else [1.0, 0.0, 0.0])
    u /= np.linalg.norm(u)
    angles = np.linspace(0, 2 * np.pi, 48, endpoint=False)
    normals = np.cos(angles)[:, None] * u + np.sin(angles)[:, None] * np.cross(tangent, u)
    mid_wall = centre + (radius - stomach.wall_mm / 2) * normals
    real = _labels_at(structures, mid_wall.T.astype(np.float32)) == TISSUE_CODE["gastric_wall"]
    score = np.where(real, 0.0, -np.inf) if real.any() else np.zeros(len(normals))
    size_mm, thickness, reach = _tumour_geometry(findings, stomach.wall_mm)
    organ_points = np.empty((0, 3))
    if findings.invasion_depth == "adjacent organs":
        axes = [np.arange(c - 80, c + 80, 4.0) for c in centre]
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), 0).reshape(3, -1).astype(np.float32)
        solid = _codes_lut("liver", "spleen", "pancreas", "colon_wall", "kidney_cortex")[_labels_at(structures, grid)]
        organ_points = grid[:, solid].T
    if len(organ_points):
        # T4b: on the side facing the nearest solid organ or the colon, growing into it
        ring = centre + radius * normals
        gaps = np.linalg.norm(ring[:, None, :] - organ_points[None], axis=2)
        k = int(np.argmax(score - gaps.min(1)))
        nearest = organ_points[np.argmin(gaps[k])]
        direction = (nearest - ring[k]) / max(np.linalg.norm(nearest - ring[k]), 1e-6)
        invades = (ring[k], nearest + 10 * direction, max(thickness / 2, 6.0))
    else:
        lesser_centre = stomach.at(0.45)[0] + np.array([-30.0, 0.0, 15.0])  # inside the J's concavity
        toward = {
            "lesser": lesser_centre - centre,
            "greater": centre - lesser_centre,
            "anterior wall": np.array([0.0, -1.0, 0.0]),
            "posterior wall": np.array([0.0, 1.0, 0.0]),
        }[findings.tumour_curvature]
        k, invades = int(np.argmax(score + normals @ (toward / np.linalg.norm(toward)))), None
    w = centre + radius * normals[k]
    return _TumourShape(w, normals[k], tangent, size_mm, thickness, reach, stomach.wall_mm, invades)


def _liver_metastases(rng, findings: Findings, liver: _Structure, structures) -> list[_Structure]:
    centre, half = (liver.lo + liver.hi) / 2, (liver.hi - liver.lo) / 2
    candidates = centre + rng.uniform(-0.6, 0.6, (300, 3)) * half
    radii = [size / 2 for size in findings.liver_met_sizes_mm]
    mets = []
    for i, radius in zip(_place(structures, candidates, radii, _codes_lut("liver"), 4.0, []), radii, strict=True):
        met = _ellipsoid(
            rng, TISSUE_CODE["liver_metastasis"], candidates[i], (radius,) * 3, 0, 0.08, _codes_lut("liver")
        )
        met.anchor, met.anchor_code = candidates[i], TISSUE_CODE["liver_metastasis"]
        mets.append(met)
    return mets


def _ascites(rng, liver_centre: np.ndarray, liver_radii: np.ndarray, scale: float) -> list[_Structure]:
    """Fluid around the liver and in the dependent paracolic gutters, wherever there is intraperitoneal fat."""
    perihepatic = _ellipsoid(rng, TISSUE_CODE["ascites"], liver_centre, liver_radii + 12, 0, 0, FAT)
    gutters = [
        _cylinder(TISSUE_CODE["ascites"], (side * 95 * scale, 35 * scale), (18 * scale, 25 * scale), -1e4, 0, FAT)
        for side in (-1, 1)
    ]
    return [perihepatic, *gutters]


def _lymph_nodes(rng, findings: Findings, stomach: _Tube, tumour: _TumourShape, structures) -> list[_Structure]:
    """Perigastric nodes along the curvatures near the tumour, each in fat and apart from the others."""
    short = np.array(findings.node_short_axes_mm, float)
    if not len(short):
        return []
    long_radii = short * rng.uniform(1.2, 1.5, len(short)) / 2
    n_try = 400
    along = np.clip(LOCATION_ALONG_STOMACH[findings.tumour_location] + rng.normal(0, 0.25, n_try), 0.05, 0.95)
    candidates = np.empty((n_try, 3))
    for i, s in enumerate(along):
        centre, tangent, radius = stomach.at(float(s))
        direction = rng.normal(size=3)
        direction -= (direction @ tangent) * tangent
        direction /= np.linalg.norm(direction)
        candidates[i] = centre + direction * (radius + rng.uniform(4, 14) + long_radii.max())
    # 8 mm apart: never touching, even across a 5 mm slice gap
    placed = [(tumour.centre, tumour.size_mm / 2 + tumour.thickness_mm)]
    nodes = []
    chosen = _place(structures, candidates, long_radii, FAT, 8.0, placed)
    for i, short_axis, long_radius in zip(chosen, short, long_radii, strict=True):
        radii = (short_axis / 2, short_axis / 2, long_radius)
        node = _ellipsoid(rng, TISSUE_CODE["lymph_node"], candidates[i], radii, max_tilt_deg=40, wobble=0.05, over=None)
        node.anchor, node.anchor_code = candidates[i], TISSUE_CODE["lymph_node"]
        nodes.append(node)
    return nodes


# --- rendering --------------------------------------------------------------------------------------


def _render_labels(structures: list[_Structure], grid: _Grid, rigid: _Rigid) -> tuple[np.ndarray, np.ndarray]:
    """Tissue codes on the grid and, for each voxel the tumour took, the code it had before."""
    coords = grid.venous_coords(rigid)
    labels = np.zeros(grid.shape, np.uint8)
    under_tumour = np.zeros(grid.shape, np.uint8)
    for s in structures:
        block = grid.block(rigid, s.lo, s.hi)
        if block is None:
            continue
        view = labels[block]
        codes = s.paint(coords[(slice(None), *block)])
        if s.over is not None:
            codes = np.where(s.over[view], codes, 0)
        if s.anchor is not None and not (codes == s.anchor_code).any():
            index = grid.index_of(rigid, s.anchor)
            if index is not None and all(b.start <= i < b.stop for b, i in zip(block, index, strict=True)):
                codes[tuple(i - b.start for b, i in zip(block, index, strict=True))] = s.anchor_code
        if s.anchor_code == TISSUE_CODE["tumour"]:
            np.copyto(under_tumour[block], view, where=codes > 0)
        np.copyto(view, codes, where=codes > 0)
    return labels, under_tumour


def _release_labels(labels: np.ndarray, under_tumour: np.ndarray) -> np.ndarray:
    lut = np.zeros(256, np.uint8)
    for name, label in _TISSUE_TO_RELEASE.items():
        lut[TISSUE_CODE[name]] = label
    organs = lut[labels]
    # a tumour counts as stomach unless it has grown into another organ, which keeps its own label
    tumour = labels == TISSUE_CODE["tumour"]
    in_organ = ~_codes_lut("visceral_fat", "ascites", "gastric_wall", "gastric_gas", "gastric_fluid")[under_tumour]
    organs[tumour] = np.where(in_organ[tumour], lut[under_tumour[tumour]], RELEASE_LABELS["stomach"])
    return organs


def _phase_tables(rng: np.random.Generator, findings: Findings, config: PhantomConfig) -> dict[str, np.ndarray]:
    """Mean HU per tissue code per phase, for this case: enhancement scaled by a per-phase factor."""
    base = np.array(list(HU_TABLE.values()), np.float32)  # (tissues, phases)
    base[TISSUE_CODE["tumour"], PHASES.index("arterial")] = (
        TUMOUR_ARTERIAL_HYPERENHANCING_HU if findings.arterial_hyperenhancement else HU_TABLE["tumour"][1]
    )
    retains = findings.gross_type == "Borrmann IV"
    base[TISSUE_CODE["tumour"], PHASES.index("delayed")] = (
        TUMOUR_DELAYED_RETAINED_HU if retains else TUMOUR_DELAYED_WASHOUT_HU
    )
    base[TISSUE_CODE["tumour"], 1:] += config.tumour_enhancement_hu
    tables = {}
    for k, phase in enumerate(PHASES):
        factor = 1 + rng.uniform(-config.enhancement_jitter, config.enhancement_jitter)
        lut = np.zeros(256, np.float32)
        lut[: len(TISSUES)] = base[:, 0] + factor * (base[:, k] - base[:, 0])
        tables[phase] = lut
    return tables


def _box(mask: np.ndarray) -> tuple[int, int, int, int, int, int] | None:
    """End-exclusive (z0, y0, x0, z1, y1, x1) of a mask, or None when empty."""
    found = ndimage.find_objects(mask.astype(np.uint8))
    if not found:
        return None
    z, y, x = found[0]
    return z.start, y.start, x.start, z.stop, y.stop, x.stop


def _boxes(phase: str, organs: np.ndarray, tumour: np.ndarray, nodes: np.ndarray) -> list[Box]:
    masks = {"tumour": tumour, "lymph_nodes": nodes, "stomach": organs == RELEASE_LABELS["stomach"]}
    return [Box(level, phase, zyx) for level, mask in masks.items() if (zyx := _box(mask)) is not None]


def _present_phases(rng: np.random.Generator, config: PhantomConfig) -> list[str]:
    with_arterial = rng.random() < config.arterial_probability
    return [p for p in PHASES if p != "arterial" or with_arterial]


def _slice_spacings(rng, config: PhantomConfig, phases: list[str], case_dz: float | None = None) -> dict[str, float]:
    """Slice spacing per phase: the case's (drawn unless given), or now and then the phase's own."""
    drawn = float(np.round(rng.uniform(*config.slice_spacing_mm) * 4) / 4)
    case_dz = drawn if case_dz is None else case_dz
    spacings = {}
    for phase in phases:
        own = phase != REFERENCE_PHASE and rng.random() < config.own_slice_spacing_probability
        spacings[phase] = float(np.round(rng.uniform(*config.slice_spacing_mm) * 4) / 4) if own else case_dz
    return spacings


def _phase_grid(rng, config: PhantomConfig, xy_spacing: float, dz: float, roi, rigid: _Rigid) -> _Grid:
    """A square in-plane field of view on the table centre; slices cover the phase's view of the ROI."""
    n_xy = int(round(config.fov_mm / xy_spacing))
    lo, hi = roi
    corners = np.array([[(lo, hi)[c >> a & 1][a] for a in range(3)] for c in range(8)])
    z_lo, z_hi = rigid.forward(corners)[:, 2].min() - 10, rigid.forward(corners)[:, 2].max() + 10
    n_z = max(int(round(rng.uniform(*config.z_extent_mm) / dz)), int(np.ceil((z_hi - z_lo) / dz)) + 1)
    first = rng.uniform(z_hi - (n_z - 1) * dz, z_lo)
    origin = np.array([-(n_xy - 1) * xy_spacing / 2, -(n_xy - 1) * xy_spacing / 2, first])
    return _Grid(origin, np.array([xy_spacing, xy_spacing, dz]), (n_xy, n_xy, n_z))


def _to_hu(rng: np.random.Generator, labels: np.ndarray, table: np.ndarray, noise_hu: float) -> np.ndarray:
    image = table[labels]
    image = ndimage.gaussian_filter(image, sigma=(0.3, 0.6, 0.6), truncate=2.0)  # partial volume
    image += rng.standard_normal(image.shape, dtype=np.float32) * np.float32(noise_hu)
    return np.clip(np.rint(image), -1024, 3071).astype(np.int16)


def make_phantom(rng: np.random.Generator, findings: Findings, config: PhantomConfig = PhantomConfig()) -> PhantomCase:
    """Render one case's findings as a procedural multi-phase abdominal CT with masks, boxes and known offsets."""
    anatomy = _procedural_anatomy(rng, findings)
    phases = _present_phases(rng, config)
    tables = _phase_tables(rng, findings, config)
    xy_spacing = float(np.round(rng.uniform(*config.in_plane_spacing_mm), 3))
    dz = _slice_spacings(rng, config, phases)
    noise_hu = rng.uniform(*config.noise_hu)

    venous_grid = _phase_grid(rng, config, xy_spacing, dz[REFERENCE_PHASE], anatomy.roi, _Rigid.identity(np.zeros(3)))
    grids, rigids, offsets = {}, {}, {}
    for phase in phases:
        if phase == REFERENCE_PHASE:
            rigids[phase], grids[phase] = _Rigid.identity(venous_grid.centre), venous_grid
        else:
            rigids[phase], offsets[phase] = _sample_offset(rng, config, venous_grid.centre)
            grids[phase] = _phase_grid(rng, config, xy_spacing, dz[phase], anatomy.roi, rigids[phase])

    case = PhantomCase({}, {}, {}, [], offsets)
    for phase in phases:
        grid = grids[phase]
        labels, under_tumour = _render_labels(anatomy.all, grid, rigids[phase])
        organs = _release_labels(labels, under_tumour)
        tumour = labels == TISSUE_CODE["tumour"]
        case.phases[phase] = grid.image(_to_hu(rng, labels, tables[phase], noise_hu))
        case.organ_masks[phase] = grid.image(organs)
        case.tumour_masks[phase] = grid.image(tumour.astype(np.uint8))
        case.tissue_maps[phase] = grid.image(labels)
        case.boxes += _boxes(phase, organs, tumour, labels == TISSUE_CODE["lymph_node"])
    return case


# --- a real CT as template --------------------------------------------------------------------------


def _voxel_coords(image: sitk.Image) -> np.ndarray:
    """(3, z, y, x) physical position (x, y, z in mm) of every voxel centre, any direction."""
    size = image.GetSize()
    axes = np.stack(np.meshgrid(*(np.arange(n, dtype=np.float32) for n in size[::-1]), indexing="ij")[::-1])
    to_physical = np.array(image.GetDirection()).reshape(3, 3) * np.array(image.GetSpacing())
    coords = np.tensordot(to_physical.astype(np.float32), axes, 1)
    return coords + np.array(image.GetOrigin(), np.float32).reshape(3, 1, 1, 1)


def _sampler(image: sitk.Image, values: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Nearest-voxel lookup of a (z, y, x) array on ``image``'s grid at (3, n) physical points."""
    to_index = np.linalg.inv(np.array(image.GetDirection()).reshape(3, 3) * np.array(image.GetSpacing()))
    origin, last = np.array(image.GetOrigin()), np.array(image.GetSize()) - 1

    def sample(points: np.ndarray) -> np.ndarray:
        index = np.rint(to_index @ (points.reshape(3, -1) - origin[:, None])).astype(int)
        index = np.clip(index, 0, last[:, None])
        return values[index[2], index[1], index[0]].reshape(points.shape[1:])

    return sample


def _distance_mm(mask: np.ndarray, reference: sitk.Image) -> np.ndarray:
    """Signed distance (mm, negative inside) from a mask's surface, on ``reference``'s grid."""
    image = sitk.GetImageFromArray(mask.astype(np.uint8))
    image.CopyInformation(reference)
    distance = sitk.SignedMaurerDistanceMap(image, insideIsPositive=False, squaredDistance=False, useImageSpacing=True)
    return sitk.GetArrayFromImage(distance).astype(np.float32)


def _place_in_bands(rng, coords: np.ndarray, bands: list[np.ndarray], radii, placed: list) -> list[int]:
    """A flat voxel index per lesion, tried in the first band (mask) and then in the wider ones."""
    chosen: list[int | None] = [None] * len(radii)
    for band in bands:
        missing = [k for k, i in enumerate(chosen) if i is None]
        if not missing:
            break
        voxels = rng.permutation(np.flatnonzero(band))[:5000]
        points = coords.reshape(3, -1)[:, voxels].T
        picks = _greedy_place(points, np.ones(len(voxels), bool), [radii[k] for k in missing], 8.0, placed)
        for k, i in zip(missing, picks, strict=True):
            chosen[k] = None if i is None else int(voxels[i])
    return [i for i in chosen if i is not None]


@dataclass(frozen=True, kw_only=True)
class _Template:
    """A real CT as findings are placed in it: labels, HU, distance to the stomach's surface (mm), voxel points."""

    ct: sitk.Image
    seg: np.ndarray
    hu: np.ndarray
    surface: np.ndarray
    coords: np.ndarray


def _template_tumour(rng, findings: Findings, template: _Template):
    """The tumour on a real stomach mask, by the phantom's rules: its mask and its shape."""
    ct, seg, surface, coords = template.ct, template.seg, template.surface, template.coords
    stomach = seg == TOTALSEG_STOMACH
    points = coords[:, stomach].T
    centre = points.mean(0)
    axis = np.linalg.svd(points - centre, full_matrices=False)[2][0]
    axis = axis if axis @ [1.0, 0.0, 1.0] < 0 else -axis  # from the fundus (superior, left) to the antrum
    along = (points - centre) @ axis
    along = (along - along.min()) / max(np.ptp(along), 1e-6)
    shell = surface[stomach] > -1.2 * max(ct.GetSpacing())  # the outermost voxel layer
    target = LOCATION_ALONG_STOMACH[findings.tumour_location] + rng.uniform(-0.03, 0.03)
    band = np.flatnonzero(shell & (np.abs(along - target) <= 0.08))
    if not len(band):
        band = np.flatnonzero(shell)
    size_mm, thickness, reach = _tumour_geometry(findings, TEMPLATE_WALL_MM)
    neighbours = np.isin(seg, TOTALSEG_NEIGHBOURS)
    invades = None
    if findings.invasion_depth == "adjacent organs" and neighbours.any():
        # T4b: on the side nearest a neighbour organ, growing into it
        organ_points = coords[:, neighbours].T
        gaps = np.linalg.norm(points[band, None, :] - organ_points[None, ::7], axis=2).min(1)
        k = band[int(np.argmin(gaps))]
        nearest = organ_points[np.argmin(np.linalg.norm(organ_points - points[k], axis=1))]
        direction = (nearest - points[k]) / max(np.linalg.norm(nearest - points[k]), 1e-6)
        invades = (points[k], nearest + 10 * direction, max(thickness / 2, 6.0))
    else:
        toward = {
            "lesser": np.array([-1.0, 0.0, 1.0]),  # the concave side faces up and to the patient's right
            "greater": np.array([1.0, 0.0, -1.0]),
            "anterior wall": np.array([0.0, -1.0, 0.0]),
            "posterior wall": np.array([0.0, 1.0, 0.0]),
        }[findings.tumour_curvature]
        outward = points[band] - centre
        k = band[int(np.argmax((outward / np.linalg.norm(outward, axis=1, keepdims=True)) @ toward))]
    # outward normal: the distance map's gradient, from index axes (x, y, z) to physical ones
    gradient = np.array([np.gradient(surface, axis=a)[stomach][k] for a in (2, 1, 0)])
    normal = np.array(ct.GetDirection()).reshape(3, 3) @ (gradient / np.array(ct.GetSpacing()))
    normal /= np.linalg.norm(normal)
    tangent = axis - (axis @ normal) * normal
    tangent /= np.linalg.norm(tangent)
    shape = _TumourShape(points[k], normal, tangent, size_mm, thickness, reach, TEMPLATE_WALL_MM, invades)
    tumour = shape.inside(coords, _sampler(ct, surface)) & (stomach | (sitk.GetArrayViewFromImage(ct) > -300))
    if not tumour.any():  # smaller than a voxel: it still marks the voxel holding its centre
        tumour.flat[np.argmin(np.linalg.norm(coords - shape.centre.reshape(3, 1, 1, 1), axis=0))] = True
    return tumour, shape


def _template_lesions(rng, findings: Findings, template: _Template, tissue, shape) -> None:
    """Nodes in the perigastric fat, metastases in the liver, ascites around liver and spleen, into ``tissue``."""
    ct, seg, hu, surface, coords = template.ct, template.seg, template.hu, template.surface, template.coords
    free = (seg == 0) & (tissue == 0)
    fat = free & (hu > -190) & (hu < -30)
    if findings.node_short_axes_mm:
        short = np.array(findings.node_short_axes_mm)
        long_radii = short * rng.uniform(1.2, 1.5, len(short)) / 2
        near = surface > 3
        bands = [fat & near & (surface < 25), fat & near & (surface < 50), free & near & (hu > -300)]
        placed = [(shape.centre, shape.size_mm / 2 + shape.thickness_mm)]
        chosen = _place_in_bands(rng, coords, bands, long_radii, placed)
        for i, short_axis, long_radius in zip(chosen, short, long_radii, strict=False):
            radii = np.array([short_axis / 2, short_axis / 2, long_radius]).reshape(3, 1, 1, 1)
            node = (((coords - coords.reshape(3, -1)[:, i, None, None, None]) / radii) ** 2).sum(0) <= 1
            node &= (seg == 0) & (tissue == 0)
            node.flat[i] = True
            pieces = ndimage.label(node)[0]  # one node, even where a vessel cuts through it
            tissue[pieces == pieces.flat[i]] = TISSUE_CODE["lymph_node"]
    if findings.liver_met_sizes_mm:
        liver = seg == TOTALSEG_LIVER
        radii = np.array(findings.liver_met_sizes_mm) / 2
        depth = _distance_mm(liver, ct)
        bands = [liver & (depth < -radii.max() - 2), liver & (depth < -3), liver]
        for i, radius in zip(_place_in_bands(rng, coords, bands, radii, []), radii, strict=False):
            met = (np.linalg.norm(coords - coords.reshape(3, -1)[:, i, None, None, None], axis=0) <= radius) & liver
            met.flat[i] = True
            tissue[met] = TISSUE_CODE["liver_metastasis"]
    if findings.ascites:
        gap = _distance_mm(np.isin(seg, (TOTALSEG_LIVER, 1)), ct)
        tissue[(seg == 0) & (tissue == 0) & (hu > -200) & (hu < 30) & (gap > 0) & (gap <= 10)] = TISSUE_CODE["ascites"]


def _template_grid(ct: sitk.Image, dz: float) -> sitk.Image:
    """The template's grid, over the same extent, with slice spacing ``dz``."""
    spacing = ct.GetSpacing()
    size = [*ct.GetSize()[:2], int(round((ct.GetSize()[2] - 1) * spacing[2] / dz)) + 1]
    grid = sitk.Image(size, sitk.sitkUInt8)
    grid.SetOrigin(ct.GetOrigin())
    grid.SetDirection(ct.GetDirection())
    grid.SetSpacing([spacing[0], spacing[1], dz])
    return grid


def make_from_template(
    rng: np.random.Generator,
    findings: Findings,
    ct: sitk.Image,
    labels: sitk.Image,
    config: PhantomConfig = PhantomConfig(),
) -> PhantomCase:
    """Build a case on a real CT with TotalSegmentator ``labels`` (6 = stomach), taken as the venous anatomy: the
    findings inserted (tumour in the stomach wall, nodes in the perigastric fat, metastases in the liver, ascites),
    each labelled organ set to the phase's :data:`HU_TABLE` enhancement keeping its texture, the other phases
    resampled through known rigid offsets. In ``tissue_maps``, code 0 is unlabelled template tissue, left as scanned."""
    if labels.GetSize() != ct.GetSize() or not np.allclose(labels.GetOrigin(), ct.GetOrigin()):
        labels = sitk.Resample(labels, ct, sitk.Transform(), sitk.sitkNearestNeighbor, 0)
    hu = sitk.GetArrayFromImage(ct).astype(np.float32)
    seg = sitk.GetArrayFromImage(labels).astype(np.uint8)
    if not (seg == TOTALSEG_STOMACH).any():
        raise ValueError(f"the template labels have no stomach (TotalSegmentator label {TOTALSEG_STOMACH})")
    coords = _voxel_coords(ct)

    # each labelled organ keeps its texture around the phase's mean instead of the template's own median
    tissue = np.zeros(seg.shape, np.uint8)
    template_mean = np.zeros(seg.shape, np.float32)
    for label, name in TOTALSEG_TISSUES.items():
        organ = seg == label
        if organ.any():
            tissue[organ], template_mean[organ] = TISSUE_CODE[name], np.median(hu[organ])
    kidneys = np.isin(seg, (2, 3))
    if kidneys.any():
        tissue[kidneys & (_distance_mm(kidneys, ct) < -6)] = TISSUE_CODE["kidney_medulla"]

    template = _Template(ct=ct, seg=seg, hu=hu, surface=_distance_mm(seg == TOTALSEG_STOMACH, ct), coords=coords)
    tumour, shape = _template_tumour(rng, findings, template)
    tissue[tumour] = TISSUE_CODE["tumour"]
    lesions_before = tissue.copy()
    _template_lesions(rng, findings, template, tissue, shape)
    inserted = tumour | (tissue != lesions_before)
    hu[inserted] = rng.normal(0, 4, int(inserted.sum()))  # no template texture to keep: their own, mild
    template_mean[inserted] = 0

    release = np.zeros(256, np.uint8)
    for label, value in TOTALSEG_TO_RELEASE.items():
        release[label] = value
    organs = release[seg]
    # a tumour counts as stomach unless it has grown into another organ, which keeps its own label
    organs[tumour & np.isin(seg, (0, TOTALSEG_STOMACH))] = RELEASE_LABELS["stomach"]

    phases = _present_phases(rng, config)
    tables = _phase_tables(rng, findings, config)
    dz = _slice_spacings(rng, config, phases, ct.GetSpacing()[2])
    centre = np.array(ct.TransformContinuousIndexToPhysicalPoint((np.array(ct.GetSize()) - 1) / 2))
    case = PhantomCase({}, {}, {}, [], {})
    for phase in phases:
        enhanced = np.where(tissue > 0, hu + tables[phase][tissue] - template_mean, hu)
        enhanced += rng.standard_normal(hu.shape, dtype=np.float32) * np.float32(TEMPLATE_EXTRA_NOISE_HU)
        arrays = {
            "image": np.clip(np.rint(enhanced), -1024, 3071).astype(np.int16),
            "organs": organs,
            "tumour": tumour.astype(np.uint8),
            "tissue": tissue,
        }
        images = {key: sitk.GetImageFromArray(array) for key, array in arrays.items()}
        for image in images.values():
            image.CopyInformation(ct)
        if phase != REFERENCE_PHASE:
            _, case.phase_offsets[phase] = _sample_offset(rng, config, centre)
            grid, to_venous = _template_grid(ct, dz[phase]), offset_transform(case.phase_offsets[phase]).GetInverse()
            for key, image in images.items():
                linear = key == "image"
                interpolator = sitk.sitkLinear if linear else sitk.sitkNearestNeighbor
                images[key] = sitk.Resample(image, grid, to_venous, interpolator, -1024.0 if linear else 0.0)
        case.phases[phase], case.organ_masks[phase] = images["image"], images["organs"]
        case.tumour_masks[phase], case.tissue_maps[phase] = images["tumour"], images["tissue"]
        organ_array, tissue_array = (sitk.GetArrayViewFromImage(images[k]) for k in ("organs", "tissue"))
        tumour_array = sitk.GetArrayViewFromImage(images["tumour"]) > 0
        case.boxes += _boxes(phase, organ_array, tumour_array, tissue_array == TISSUE_CODE["lymph_node"])
    return case
