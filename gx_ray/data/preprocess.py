"""Appendix-B preprocessing of one case: register the CT phases to venous, resample, window, match, crop, normalise.

:func:`preprocess_case` is a pure function of one :class:`~gx_ray.schema.Case` and a :class:`PreprocessConfig`;
the shard driver runs it as one Ray task per case. The order is chosen so that every output image is
interpolated exactly once:

1. load every present phase (QC: missing, unreadable, NaN/inf voxels, not a real geometry, a gzip bomb) and check
   it holds anatomy (QC ``no_anatomy``: neighbouring voxels must correlate, which noise and blank images do not);
2. the reference grid: the venous field of view at the configured spacing;
3. rigid 6-DOF registration of each phase in ``register_phases`` to venous (QC: misalignment), then every phase
   must correlate with venous where they overlap (QC ``no_anatomy``);
4. every phase is resampled from its raw voxels straight onto the crop through its registration (trilinear);
5. clip to the HU window, histogram-match each phase to venous;
6. the crop is centred on the stomach (stomach box, else the venous organ mask's stomach label, else the body),
   padded with the window minimum where it leaves the venous field of view;
7. per-phase z-score over the crop, stored as float16 (with the phase's HU mean and sd, to recover HU);
8. boxes are carried from their own phase's raw grid into the crop (QC: outside the volume or the crop).

Registration transforms follow SimpleITK's convention: they map a point of the fixed (venous) image to the
matching point of the moving phase, so they are exactly what :func:`sitk.Resample` needs, and boxes travel the
other way through their inverse.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import SimpleITK as sitk
from scipy import ndimage

from gx_ray.data.volumes import load_volume
from gx_ray.schema import PHASES, REFERENCE_PHASE, REQUIRED_PHASES, Box, Case, CaseError

STOMACH_LABEL = 6
"""Stomach in the organ masks (the public release and TotalSegmentator agree)."""
BODY_THRESHOLD_HU = -500.0
"""Above this a voxel is tissue, below it air: finds the body when nothing marks the stomach."""
_EDGE_TOLERANCE = 1e-3
"""Voxels of slack when rounding a mapped box outward, so float noise never adds a whole voxel."""


@dataclass(frozen=True)
class PreprocessConfig:
    """Settings of the Appendix-B pipeline; :meth:`preset` gives the paper's and two smaller ones.

    ``register_phases``: the paper registers arterial and delayed to venous; non-contrast is registered too by default,
    as it is read voxel by voxel beside the others and, taken before the injection, is at least as far from venous
    (breathing, table motion). A phase left out is resampled in scanner coordinates (identity transform).
    """

    spacing_zyx_mm: tuple[float, float, float] = (1.0, 1.0, 1.0)
    shape_zyx: tuple[int, int, int] = (192, 288, 288)
    """The paper's crop (D, H, W)."""
    hu_window: tuple[float, float] = (-100.0, 300.0)
    register_phases: tuple[str, ...] = ("non_contrast", "arterial", "delayed")
    histogram_match: bool = True
    histogram_levels: int = 256
    histogram_match_points: int = 7
    max_misalignment_mm: float = 20.0
    """QC: a phase whose registration moved the stomach region further than this is excluded."""
    min_structure: float = 0.5
    """QC (``no_anatomy``): a phase whose neighbouring voxels (as registration sees them) correlate less than this
    along any axis holds no anatomy. Real CT scores 0.94-0.99 (the real test CT: 0.946 at least), the demo phantom
    0.97-0.99, uniform noise 0.00."""
    min_reference_correlation: float = 0.5
    """QC (``no_anatomy``): a phase that, moved onto venous through its registration, correlates less than this with
    venous where they overlap shows other anatomy or none. Phases of one study score above 0.9; noise about 0."""

    registration_window_hu: tuple[float, float] = (-1000.0, 1000.0)
    """Intensities are clipped to this before registration: keeps air/body edges, drops metal and bone extremes."""
    registration_spacing_mm: float = 2.0
    """Finest registration level: both images are bin-shrunk to about this spacing (or the output's, if coarser).
    Finer voxels add time, not accuracy: at 2 mm the transform is found to 0.2-0.3 mm on the real test CT."""
    registration_shrink_factors: tuple[int, ...] = (4, 2, 1)
    """Pyramid levels, coarse to fine, each smoothed with a Gaussian of sigma ``factor / 2`` voxels (none at 1)."""
    registration_samples: int = 10_000
    """Voxels sampled per level for the metric: the cost per iteration is the same whatever the image size."""
    registration_iterations: int = 100
    """Cap per level; the optimiser usually stops earlier on a too-small step."""
    registration_bins: int = 32
    registration_step_mm: float = 2.0
    """First step of the regular-step gradient descent, in mm of voxel shift (scales from physical shift)."""
    registration_min_step_mm: float = 1e-3
    align_centres: bool = False
    """False: start from identity in scanner coordinates (phases of one study share the scanner frame; centres
    of different z ranges would start half the coverage difference off). True: start with the centres on each other,
    for files whose origins were lost. Either way the rotation centre is the venous image's centre."""
    seed: int = 1
    """Seed of the metric's voxel sampling; >= 1, as SimpleITK reads 0 as "seed from the wall clock"."""
    num_threads: int | None = 1
    """SimpleITK threads during one case (None: one per core). Ray gives each task one core, so ITK's default pool
    would oversubscribe the node; and its metric sums per-thread histograms, so a fixed count gives the same bytes."""

    def __post_init__(self) -> None:
        if len(self.spacing_zyx_mm) != 3 or min(self.spacing_zyx_mm) <= 0:
            raise ValueError(f"spacing_zyx_mm needs 3 positive values, got {self.spacing_zyx_mm}")
        if len(self.shape_zyx) != 3 or min(self.shape_zyx) < 1:
            raise ValueError(f"shape_zyx needs 3 positive sizes, got {self.shape_zyx}")
        for name in ("hu_window", "registration_window_hu"):
            low, high = getattr(self, name)
            if not low < high:
                raise ValueError(f"{name} must be (low, high) with low < high, got {(low, high)}")
        bad = [p for p in self.register_phases if p not in PHASES or p == REFERENCE_PHASE]
        if bad:
            valid = [p for p in PHASES if p != REFERENCE_PHASE]
            raise ValueError(f"register_phases {bad} not registrable to {REFERENCE_PHASE}; valid: {', '.join(valid)}")
        if self.seed < 1:
            raise ValueError(f"seed must be >= 1 (SimpleITK takes 0 to mean a wall-clock seed), got {self.seed}")
        for name in ("min_structure", "min_reference_correlation"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a correlation threshold in [-1, 1], got {getattr(self, name)}")
        if self.registration_spacing_mm <= 0:
            raise ValueError(f"registration_spacing_mm must be positive, got {self.registration_spacing_mm}")
        if not self.registration_shrink_factors or min(self.registration_shrink_factors) < 1:
            raise ValueError(f"registration_shrink_factors must be >= 1, got {self.registration_shrink_factors}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> PreprocessConfig:
        """``"paper"`` (1 mm, 192x288x288), ``"demo"`` or ``"bench"`` (2 mm, 64x128x128: the benchmark shape).

        ``"demo"`` keeps the paper crop's field of view (192x288x288 mm, the stomach region) at 6x4.5x4.5 mm
        voxels, 32x64x64, so a CPU trains on it in seconds and no stomach is cut off."""
        if name not in _PRESETS:
            raise ValueError(f"unknown preprocessing preset {name!r}; valid: {', '.join(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})


_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    "demo": {
        "spacing_zyx_mm": (6.0, 4.5, 4.5),
        "shape_zyx": (32, 64, 64),
        "registration_shrink_factors": (2, 1),
        "registration_samples": 3000,
    },
    "bench": {"spacing_zyx_mm": (2.0, 2.0, 2.0), "shape_zyx": (64, 128, 128)},
}


@dataclass
class PreprocessedCase:
    """One case on the training grid: what the shard driver writes as one row."""

    case_id: str
    volume: np.ndarray
    """float16, ``(len(PHASES), D, H, W)`` in :data:`~gx_ray.schema.PHASES` order; zeros where a phase is absent."""
    phase_present: tuple[bool, ...]
    boxes: list[Box]
    """On the crop (all phases share it), end-exclusive, clipped to the crop."""
    registration: dict[str, dict]
    """Per registered phase: Euler3D parameters, fixed parameters, metric, misalignment_mm, iterations, stop."""
    crop_origin_zyx: tuple[int, int, int]
    """Index on the reference (resampled venous) grid where the crop starts; negative where it pads."""
    warnings: list[str] = field(default_factory=list)
    anatomy: dict[str, dict] = field(default_factory=dict)
    """Per phase: ``structure`` (:func:`structure_score`) and, for non-venous phases, ``reference_correlation``
    and ``overlap`` (:func:`reference_correlation`)."""
    hu_mean: tuple[float, ...] = ()
    hu_std: tuple[float, ...] = ()
    """Per phase (PHASES order, NaN where absent): the HU mean and sd over the crop that the z-score divided out,
    so ``volume * hu_std + hu_mean`` gives HU back (within the clip window) for windowed views."""
    source_spacing_zyx: tuple[float, ...] = ()
    source_shape_zyx: tuple[int, ...] = ()
    """The reference phase's voxel spacing (mm) and shape as acquired, before resampling (the cohort's fingerprint)."""


# --- grids ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """A voxel grid without voxels (SimpleITK order: x, y, z); maps continuous indices to physical points."""

    origin: tuple[float, ...]
    spacing: tuple[float, ...]
    direction: tuple[float, ...]
    size: tuple[int, ...]

    @classmethod
    def of(cls, image: sitk.Image) -> Grid:
        return cls(image.GetOrigin(), image.GetSpacing(), image.GetDirection(), image.GetSize())

    @property
    def _matrix(self) -> np.ndarray:
        return np.reshape(self.direction, (3, 3)) * np.asarray(self.spacing)

    def to_points(self, index_xyz: np.ndarray) -> np.ndarray:
        return np.asarray(index_xyz, float) @ self._matrix.T + np.asarray(self.origin)

    def to_index(self, points: np.ndarray) -> np.ndarray:
        return np.linalg.solve(self._matrix, (np.asarray(points, float) - np.asarray(self.origin)).T).T

    def centre(self) -> np.ndarray:
        return self.to_points((np.asarray(self.size) - 1) / 2)

    def corners(self) -> np.ndarray:
        """The 8 outer corners (voxel edges, not centres) as physical points."""
        return self.to_points(_box_corners(np.full(3, -0.5), np.asarray(self.size) - 0.5))

    def resampled(self, spacing_xyz: tuple[float, ...]) -> Grid:
        """The same field of view, edge to edge, at another spacing."""
        extent = np.asarray(self.size) * np.asarray(self.spacing)
        size = np.maximum(1, np.ceil(extent / np.asarray(spacing_xyz) - _EDGE_TOLERANCE)).astype(int)
        first_centre = self.to_points(np.full(3, -0.5)) + np.reshape(self.direction, (3, 3)) @ (
            np.asarray(spacing_xyz) / 2
        )
        return Grid(tuple(first_centre), tuple(spacing_xyz), self.direction, tuple(int(s) for s in size))

    def window(self, start_xyz: np.ndarray, size_xyz: tuple[int, ...]) -> Grid:
        """The sub-grid (or super-grid: negative start pads) starting at integer index ``start_xyz``."""
        return Grid(tuple(self.to_points(start_xyz)), self.spacing, self.direction, tuple(int(s) for s in size_xyz))


def _box_corners(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return np.array(list(itertools.product(*zip(low, high, strict=True))), float)


def resample_onto(
    image: sitk.Image, grid: Grid, transform: sitk.Transform | None = None, *, mask: bool = False, default: float = 0.0
) -> sitk.Image:
    """``image`` on ``grid``, read through ``transform`` (grid point → image point): trilinear, or nearest for masks."""
    return sitk.Resample(
        image,
        grid.size,
        transform or sitk.Transform(),
        sitk.sitkNearestNeighbor if mask else sitk.sitkLinear,
        grid.origin,
        grid.spacing,
        grid.direction,
        default,
        image.GetPixelID() if mask else sitk.sitkFloat32,
    )


# --- registration -----------------------------------------------------------------------------------


def register_rigid(
    fixed: sitk.Image, moving: sitk.Image, config: PreprocessConfig
) -> tuple[sitk.Euler3DTransform, dict]:
    """Rigid 6-DOF transform mapping points of ``fixed`` onto the same anatomy in ``moving`` (both raw images, as
    :func:`_registration_copy` sees them): Mattes mutual information, regular-step gradient descent, a shrink/smooth
    pyramid, seeded voxel samples. Raises SimpleITK's ``RuntimeError`` when it cannot run (no overlap)."""
    fixed, moving = _registration_copy(fixed, config), _registration_copy(moving, config)

    transform = sitk.Euler3DTransform()
    if config.align_centres:
        transform = sitk.Euler3DTransform(
            sitk.CenteredTransformInitializer(
                fixed, moving, transform, sitk.CenteredTransformInitializerFilter.GEOMETRY
            )
        )
    else:
        transform.SetCenter(tuple(Grid.of(fixed).centre()))

    shrinks = list(config.registration_shrink_factors)
    voxel_mm = max(fixed.GetSpacing())  # smoothing in mm, the same for both images whatever their spacing
    n_voxels = float(np.prod(fixed.GetSize()))
    method = sitk.ImageRegistrationMethod()
    if config.num_threads is not None:
        method.SetNumberOfThreads(config.num_threads)
    method.SetMetricAsMattesMutualInformation(config.registration_bins)
    # gradients only at the sampled voxels: whole-image gradient filters per level cost more than the sampled metric
    method.SetMetricUseFixedImageGradientFilter(False)
    method.SetMetricUseMovingImageGradientFilter(False)
    method.SetMetricSamplingStrategy(method.RANDOM)
    method.SetMetricSamplingPercentagePerLevel(
        [min(1.0, config.registration_samples * s**3 / n_voxels) for s in shrinks], config.seed
    )
    method.SetInterpolator(sitk.sitkLinear)
    method.SetOptimizerAsRegularStepGradientDescent(
        learningRate=config.registration_step_mm,
        minStep=config.registration_min_step_mm,
        numberOfIterations=config.registration_iterations,
        gradientMagnitudeTolerance=1e-8,
    )
    method.SetOptimizerScalesFromPhysicalShift()
    method.SetShrinkFactorsPerLevel(shrinks)
    method.SetSmoothingSigmasPerLevel([s / 2 * voxel_mm if s > 1 else 0.0 for s in shrinks])
    method.SmoothingSigmasAreSpecifiedInPhysicalUnitsOn()
    method.SetInitialTransform(transform, inPlace=True)
    iterations = [0]
    method.AddCommand(sitk.sitkIterationEvent, lambda: iterations.__setitem__(0, iterations[0] + 1))
    method.Execute(fixed, moving)

    info = {
        "parameters": list(transform.GetParameters()),
        "parameter_names": ["angle_x_rad", "angle_y_rad", "angle_z_rad", "tx_mm", "ty_mm", "tz_mm"],
        "fixed_parameters": list(transform.GetFixedParameters()),
        "rotation_deg": float(np.degrees(np.abs(transform.GetParameters()[:3])).max()),
        "metric": float(method.GetMetricValue()),
        "iterations": iterations[0],
        "stop_reason": method.GetOptimizerStopConditionDescription(),
    }
    return transform, info


def _bin_shrunk(image: sitk.Image, spacing_xyz: np.ndarray) -> sitk.Image:
    """``image`` averaged over blocks of whole voxels, to about ``spacing_xyz`` (never finer than it was)."""
    factors = np.maximum(1, np.floor(spacing_xyz / np.asarray(image.GetSpacing()) + _EDGE_TOLERANCE)).astype(int)
    return sitk.BinShrink(image, [int(f) for f in factors]) if factors.max() > 1 else image


def _registration_copy(image: sitk.Image, config: PreprocessConfig) -> sitk.Image:
    """``image`` as registration sees it: bin-shrunk to about the registration spacing, clipped to its window."""
    target_xyz = np.maximum(config.registration_spacing_mm, config.spacing_zyx_mm[::-1])
    low, high = config.registration_window_hu
    return sitk.Clamp(_bin_shrunk(image, target_xyz), sitk.sitkFloat32, low, high)


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation; 0 where either side is constant (a blank image has no structure)."""
    a, b = a.astype(np.float64, copy=False).ravel(), b.astype(np.float64, copy=False).ravel()
    if a.size < 2:
        return 0.0
    a, b = a - a.mean(), b - b.mean()
    denominator = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denominator) if denominator > 0 else 0.0


def structure_score(image: sitk.Image, config: PreprocessConfig) -> float:
    """How much a CT looks like an image of something: the smallest, over the three axes, correlation of each
    voxel with its neighbour, on the registration copy. Anatomy is smooth at a few mm (0.94+); noise is not (0)."""
    values = sitk.GetArrayFromImage(_registration_copy(image, config))  # a copy: a view dies with its image
    scores = [
        _correlation(np.take(values, range(n - 1), axis), np.take(values, range(1, n), axis))
        for axis, n in enumerate(values.shape)
        if n > 1
    ]
    return min(scores) if scores else 0.0


def reference_correlation(
    reference: sitk.Image, image: sitk.Image, transform: sitk.Transform | None, config: PreprocessConfig
) -> tuple[float, float]:
    """Correlation of ``image`` moved onto ``reference`` through ``transform`` (reference point → image point) with
    ``reference``, both as registration sees them, over the voxels where they overlap; and that overlap as a
    fraction of the reference's voxels."""
    fixed = _registration_copy(reference, config)
    moved = sitk.Resample(
        _registration_copy(image, config), fixed, transform or sitk.Transform(), sitk.sitkLinear, np.nan
    )
    moved_values = sitk.GetArrayViewFromImage(moved)
    overlap = np.isfinite(moved_values)
    fraction = float(overlap.mean())
    return _correlation(sitk.GetArrayViewFromImage(fixed)[overlap], moved_values[overlap]), fraction


def mean_displacement_mm(transform: sitk.Transform, points: np.ndarray) -> float:
    """How far ``transform`` moves ``points`` on average: the misalignment it corrected."""
    moved = np.array([transform.TransformPoint(tuple(p)) for p in points])
    return float(np.linalg.norm(moved - points, axis=1).mean())


# --- the pipeline -----------------------------------------------------------------------------------


@contextmanager
def _itk_threads(count: int | None) -> Iterator[None]:
    if count is None:
        yield
        return
    previous = sitk.ProcessObject.GetGlobalDefaultNumberOfThreads()
    sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(count)
    try:
        yield
    finally:
        sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(previous)


def preprocess_case(case: Case, config: PreprocessConfig) -> PreprocessedCase:
    """The Appendix-B pipeline on one case; any QC failure is a :class:`~gx_ray.schema.CaseError`."""
    with _itk_threads(config.num_threads):
        return _preprocess(case, config)


def _preprocess(case: Case, config: PreprocessConfig) -> PreprocessedCase:
    warnings: list[str] = []
    images = _load_phases(case, warnings)
    venous = images[REFERENCE_PHASE]
    anatomy = _check_structure(case, images, config)
    reference = Grid.of(venous).resampled(tuple(reversed(config.spacing_zyx_mm)))
    for index, box in enumerate(case.boxes):  # before the costly part
        _check_box(case, index, box, images)
    # the stomach box on venous if there is one (it needs no transform), else on another phase
    stomach_box = min(
        (b for b in case.boxes if b.level == "stomach"), key=lambda b: b.phase != REFERENCE_PHASE, default=None
    )
    mask_stomach = None if stomach_box else _mask_stomach_corners(case)

    # phases share the scanner frame, so the stomach region is good enough for the misalignment before registration
    if stomach_box:
        region = _raw_box_corners(stomach_box, images[stomach_box.phase])
    else:
        region = mask_stomach if mask_stomach is not None else Grid.of(venous).corners()
    transforms: dict[str, sitk.Transform] = {}
    registration: dict[str, dict] = {}
    for phase in (p for p in config.register_phases if p in images):
        path = case.phases[phase]
        try:
            transform, info = register_rigid(venous, images[phase], config)
        except RuntimeError as err:
            message = f"registration to {REFERENCE_PHASE} failed: {str(err).strip().splitlines()[-1]}"
            raise CaseError(case.case_id, path, phase, message, reason="misaligned") from err
        info["misalignment_mm"] = mean_displacement_mm(transform, region)
        if info["misalignment_mm"] > config.max_misalignment_mm:
            message = (
                f"{phase} is {info['misalignment_mm']:.1f} mm from {REFERENCE_PHASE} "
                f"(limit {config.max_misalignment_mm:g} mm)"
            )
            raise CaseError(case.case_id, path, phase, message, reason="misaligned")
        transforms[phase], registration[phase] = transform, info

    _check_reference_correlation(case, images, transforms, config, anatomy)

    # boxes onto the reference grid, as continuous (z, y, x) edges
    mapped = [_box_on_reference(box, images[box.phase], transforms.get(box.phase), reference) for box in case.boxes]

    # crop centre: stomach box, else the organ mask's stomach, else the body
    shape = np.asarray(config.shape_zyx)
    if stomach_box:
        low_edge, high_edge = mapped[case.boxes.index(stomach_box)]
        centre = (low_edge + high_edge) / 2
    elif mask_stomach is not None:
        centre = reference.to_index(mask_stomach).mean(axis=0)[::-1]
    else:
        centre = _body_centre(venous, reference, warnings)
    crop_origin = np.floor(centre - (shape - 1) / 2 + 0.5).astype(int)
    crop = reference.window(crop_origin[::-1], tuple(shape[::-1]))

    volume, present, (hu_mean, hu_std) = _phase_volumes(images, transforms, crop, config, warnings)
    boxes = [
        _box_on_crop(case, i, box, edges, crop_origin, shape, warnings)
        for i, (box, edges) in enumerate(zip(case.boxes, mapped, strict=True))
    ]
    return PreprocessedCase(
        case_id=case.case_id,
        volume=volume,
        phase_present=present,
        boxes=boxes,
        registration=registration,
        crop_origin_zyx=_ints(crop_origin),
        warnings=warnings,
        anatomy=anatomy,
        hu_mean=hu_mean,
        hu_std=hu_std,
        source_spacing_zyx=tuple(float(s) for s in reversed(venous.GetSpacing())),
        source_shape_zyx=tuple(int(s) for s in reversed(venous.GetSize())),
    )


def _check_structure(case: Case, images: dict[str, sitk.Image], config: PreprocessConfig) -> dict[str, dict]:
    """Every phase must hold an image of something (QC ``no_anatomy``), checked before registration runs on it."""
    anatomy = {}
    for phase, image in images.items():
        score = structure_score(image, config)
        if not score >= config.min_structure:
            message = (
                f"no anatomy (noise or a blank image?): neighbouring voxels correlate {score:.2f}, at least "
                f"{config.min_structure:g} expected ({score:.4f})"
            )
            raise CaseError(case.case_id, case.phases[phase], phase, message, reason="no_anatomy")
        anatomy[phase] = {"structure": round(score, 4)}
    return anatomy


def _check_reference_correlation(
    case: Case,
    images: dict[str, sitk.Image],
    transforms: dict[str, sitk.Transform],
    config: PreprocessConfig,
    anatomy: dict[str, dict],
) -> None:
    """Every phase, once registered, must show the venous anatomy where the two overlap (QC ``no_anatomy``)."""
    for phase, image in images.items():
        if phase == REFERENCE_PHASE:
            continue
        correlation, overlap = reference_correlation(images[REFERENCE_PHASE], image, transforms.get(phase), config)
        anatomy[phase].update(reference_correlation=round(correlation, 4), overlap=round(overlap, 4))
        if not correlation >= config.min_reference_correlation:
            message = (
                f"does not show the {REFERENCE_PHASE} anatomy after registration: correlation "
                f"{correlation:.2f} over {overlap:.0%} of {REFERENCE_PHASE}, at least "
                f"{config.min_reference_correlation:g} expected ({correlation:.4f})"
            )
            raise CaseError(case.case_id, case.phases[phase], phase, message, reason="no_anatomy")


def _load_phases(case: Case, warnings: list[str]) -> dict[str, sitk.Image]:
    for phase in REQUIRED_PHASES:
        if phase not in case.phases:
            raise CaseError(case.case_id, None, phase, f"required CT phase {phase!r} is missing", reason="missing_part")
    for phase in case.phases:
        if phase not in PHASES:
            warnings.append(f"unknown phase {phase!r} ignored")
    images = {}
    for phase in PHASES:
        if phase not in case.phases:
            continue
        path = Path(case.phases[phase])
        if not path.exists():
            raise CaseError(case.case_id, path, phase, f"{phase} phase file does not exist", reason="missing_part")
        image = load_volume(path, case.case_id, field_name=phase)
        if image.GetDimension() != 3 or image.GetNumberOfComponentsPerPixel() != 1:
            message = f"expected a 3D single-channel CT, got {image.GetDimension()}D {image.GetPixelIDTypeAsString()}"
            raise CaseError(case.case_id, path, phase, message)
        if image.GetPixelID() in (sitk.sitkFloat32, sitk.sitkFloat64):  # integer voxels cannot be NaN
            bad = int((~np.isfinite(sitk.GetArrayViewFromImage(image))).sum())
            if bad:
                raise CaseError(case.case_id, path, phase, f"{bad} NaN or infinite voxels", reason="nan_values")
        images[phase] = sitk.Cast(image, sitk.sitkFloat32)
    return images


def _raw_box_corners(box: Box, image: sitk.Image) -> np.ndarray:
    """Physical corners of the region a raw-grid box covers (voxel edges: index - 0.5 .. end - 0.5)."""
    z0, y0, x0, z1, y1, x1 = box.zyx
    return Grid.of(image).to_points(_box_corners(np.array([x0, y0, z0]) - 0.5, np.array([x1, y1, z1]) - 0.5))


def _mask_stomach_corners(case: Case) -> np.ndarray | None:
    """Physical corners of the stomach label in the venous organ mask, or None without one."""
    path = case.organ_masks.get(REFERENCE_PHASE)
    if path is None:
        return None
    mask = load_volume(Path(path), case.case_id, field_name=f"organ_masks.{REFERENCE_PHASE}")
    stomach = np.argwhere(sitk.GetArrayViewFromImage(mask) == STOMACH_LABEL)
    if len(stomach) == 0:
        return None
    low, high = stomach.min(axis=0)[::-1], stomach.max(axis=0)[::-1]  # zyx → xyz
    return Grid.of(mask).to_points(_box_corners(low - 0.5, high + 0.5))


def _body_centre(venous: sitk.Image, reference: Grid, warnings: list[str]) -> np.ndarray:
    body = sitk.GetArrayViewFromImage(venous) > BODY_THRESHOLD_HU
    if not body.any():
        warnings.append("no stomach box, no stomach mask and no body above -500 HU: crop centred on the image")
        return (np.asarray(reference.size[::-1]) - 1) / 2
    warnings.append("no stomach box or stomach mask: crop centred on the body")
    centre_zyx = np.asarray(ndimage.center_of_mass(body))
    return reference.to_index(Grid.of(venous).to_points(centre_zyx[::-1]))[::-1]


def _box_field(index: int, box: Box) -> str:
    return f"boxes[{index}] ({box.level} on {box.phase})"


def _check_box(case: Case, index: int, box: Box, images: dict[str, sitk.Image]) -> None:
    if box.phase not in images:
        message = f"box on the {box.phase} phase, which the case does not have"
        raise CaseError(case.case_id, None, _box_field(index, box), message, reason="missing_part")
    shape_zyx = images[box.phase].GetSize()[::-1]
    if not box.inside(shape_zyx):
        message = f"box {box.zyx} is outside its {box.phase} volume of shape {tuple(shape_zyx)}"
        raise CaseError(
            case.case_id, case.phases[box.phase], _box_field(index, box), message, reason="box_outside_volume"
        )


def _box_on_reference(
    box: Box, image: sitk.Image, transform: sitk.Transform | None, reference: Grid
) -> tuple[np.ndarray, np.ndarray]:
    """The box's continuous (z, y, x) low and high edges on the reference grid."""
    points = _raw_box_corners(box, image)
    if transform is not None:  # moving-phase point → venous point
        inverse = transform.GetInverse()
        points = np.array([inverse.TransformPoint(tuple(p)) for p in points])
    edges = reference.to_index(points)[:, ::-1]
    return edges.min(axis=0), edges.max(axis=0)


def _box_on_crop(
    case: Case,
    index: int,
    box: Box,
    edges: tuple[np.ndarray, np.ndarray],
    crop_origin: np.ndarray,
    shape: np.ndarray,
    warnings: list[str],
) -> Box:
    # voxel i spans edges i - 0.5 .. i + 0.5: keep every voxel the box touches (outward rounding)
    start = np.floor(edges[0] - crop_origin + 0.5 + _EDGE_TOLERANCE).astype(int)
    stop = np.ceil(edges[1] - crop_origin + 0.5 - _EDGE_TOLERANCE).astype(int)
    clipped_start, clipped_stop = np.clip(start, 0, shape), np.clip(stop, 0, shape)
    if np.any(clipped_stop <= clipped_start):
        message = (
            f"the crop misses the box (on the crop grid it spans {_ints(start)}..{_ints(stop)}, crop {_ints(shape)})"
        )
        raise CaseError(
            case.case_id, case.phases[box.phase], _box_field(index, box), message, reason="box_outside_volume"
        )
    if np.any(clipped_start != start) or np.any(clipped_stop != stop):
        warnings.append(
            f"{_box_field(index, box)} clipped to the crop {_ints(shape)}: it spans {_ints(start)}..{_ints(stop)}"
        )
    return dataclasses.replace(box, zyx=_ints((*clipped_start, *clipped_stop)))


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _phase_volumes(
    images: dict[str, sitk.Image],
    transforms: dict[str, sitk.Transform],
    crop: Grid,
    config: PreprocessConfig,
    warnings: list[str],
) -> tuple[np.ndarray, tuple[bool, ...], tuple[tuple[float, ...], tuple[float, ...]]]:
    low, high = config.hu_window
    windowed = {
        phase: sitk.Clamp(resample_onto(image, crop, transforms.get(phase), default=low), sitk.sitkFloat32, low, high)
        for phase, image in images.items()
    }
    volume = np.zeros((len(PHASES), *config.shape_zyx), np.float16)
    mean, sd = [math.nan] * len(PHASES), [math.nan] * len(PHASES)
    for phase, image in windowed.items():
        if config.histogram_match and phase != REFERENCE_PHASE:
            matched = sitk.HistogramMatching(
                image,
                windowed[REFERENCE_PHASE],
                numberOfHistogramLevels=config.histogram_levels,
                numberOfMatchPoints=config.histogram_match_points,
                thresholdAtMeanIntensity=True,  # leaves the air/padding floor out of the match
            )
            image = sitk.Clamp(matched, sitk.sitkFloat32, low, high)
        values = sitk.GetArrayViewFromImage(image).astype(np.float64)
        std = values.std()
        if std == 0:
            warnings.append(f"{phase} is constant over the crop")
        volume[PHASES.index(phase)] = (values - values.mean()) / (std or 1.0)
        mean[PHASES.index(phase)], sd[PHASES.index(phase)] = float(values.mean()), float(std or 1.0)
    return volume, tuple(p in images for p in PHASES), (tuple(mean), tuple(sd))
