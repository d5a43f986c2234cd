"""A prepared cohort's fingerprint, after nnU-Net's and Auto3DSeg's data analysers: what the images, boxes, labels and
lab variables look like, written beside the shard manifest as ``fingerprint.json``.

Each case contributes its own numbers while it is preprocessed (:func:`case_fingerprint`, in the case's Ray task);
:func:`cohort_fingerprint` summarises them once every case is done: voxel spacing and shape before resampling and
after, intensity percentiles per phase inside the stomach (its box on the crop, else the whole crop; in HU, within
the preprocessing's clip window), box sizes per level in mm, stage groups per split, age and sex per split where the
cohort has them, and the share of cases missing each catalogue variable. The manifest records the fingerprint's
SHA-256, so the manifest's hash covers it; a resumed sweep compares fingerprints and names what changed
(:mod:`gx_ray.sweep.resume`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gx_ray import storage
from gx_ray.schema import BOX_LEVELS, PHASES, REFERENCE_PHASE

if TYPE_CHECKING:
    from gx_ray.data.preprocess import PreprocessedCase  # SimpleITK's import: not for a reader of fingerprints

FINGERPRINT_FILE = "fingerprint.json"
FINGERPRINT_FORMAT = 1
PERCENTILES = (0.5, 5, 50, 95, 99.5)
"""The intensity percentiles kept per phase (nnU-Net clips its CT normalisation at 0.5 and 99.5)."""


def case_fingerprint(
    case: PreprocessedCase, spacing_zyx: Sequence[float], labs: Mapping[str, Any], variables: Sequence[str]
) -> dict[str, Any]:
    """One case's numbers: its reference phase's spacing and shape as acquired, its intensities inside the stomach
    per phase (HU), its boxes' sizes (mm, on the training grid ``spacing_zyx``), and which catalogue ``variables`` its
    ``labs`` lack."""
    boxes = case.boxes  # on the crop, shared by every phase (registered): the reference phase's stomach box, else any's
    stomach = min((b for b in boxes if b.level == "stomach"), key=lambda b: b.phase != REFERENCE_PHASE, default=None)
    region = (
        (slice(None),) * 3 if stomach is None else tuple(slice(stomach.zyx[i], stomach.zyx[i + 3]) for i in range(3))
    )
    intensity = {}
    for p, phase in enumerate(PHASES):
        if not case.phase_present[p]:
            continue
        hu = case.volume[p][region].astype(np.float32) * float(case.hu_std[p]) + float(case.hu_mean[p])
        values = np.percentile(hu, PERCENTILES) if hu.size else [np.nan] * len(PERCENTILES)
        intensity[phase] = {"mean": float(hu.mean()), "sd": float(hu.std()), **_percentiles(values)}
    sizes: dict[str, list[float]] = {}
    for box in boxes:
        extent = np.subtract(box.zyx[3:], box.zyx[:3]) * np.asarray(spacing_zyx, dtype=float)
        sizes.setdefault(box.level, []).append(round(float(extent.max()), 2))
    return {
        "source_spacing_zyx": [round(float(s), 4) for s in case.source_spacing_zyx],
        "source_shape_zyx": [int(s) for s in case.source_shape_zyx],
        "intensity_region": "stomach box" if stomach is not None else "crop",
        "intensity_hu": intensity,
        "box_long_axis_mm": sizes,
        "missing": sorted(v for v in variables if labs.get(v) in (None, "") or _is_nan(labs.get(v))),
    }


def cohort_fingerprint(
    cases: Mapping[str, Mapping[str, Any]],
    splits: Mapping[str, str],
    stages: Mapping[str, str | None],
    demographics: Mapping[str, Mapping[str, Any]],
    spacing_zyx: Sequence[float],
    shape_zyx: Sequence[int],
    variables: Sequence[str],
) -> dict[str, Any]:
    """The cohort's fingerprint from its included cases' :func:`case_fingerprint` (``cases``: case id → numbers),
    their split and stage group, and their age and sex (``demographics``: case id → ``{"age", "sex"}``)."""
    ids = sorted(cases)
    spacing = np.array([cases[c]["source_spacing_zyx"] for c in ids], dtype=float).reshape(-1, 3)
    shape = np.array([cases[c]["source_shape_zyx"] for c in ids], dtype=float).reshape(-1, 3)
    intensity = {}
    for phase in PHASES:
        kept = [cases[c]["intensity_hu"][phase] for c in ids if phase in cases[c]["intensity_hu"]]
        if kept:  # the median over cases of each case's statistic: robust to a few odd scans
            intensity[phase] = {k: round(float(np.nanmedian([v[k] for v in kept])), 1) for k in kept[0]}
            intensity[phase]["cases"] = len(kept)
    boxes = {}
    for level in BOX_LEVELS:
        sizes = [s for c in ids for s in cases[c]["box_long_axis_mm"].get(level, [])]
        if sizes:
            boxes[level] = {"boxes": len(sizes), **_percentiles(np.percentile(sizes, (5, 50, 95)), (5, 50, 95))}
    split_names = sorted(set(splits.values()))
    per_split: dict[str, Any] = {}
    for split in split_names:
        members = [c for c in ids if splits.get(c) == split]
        ages = [float(demographics[c]["age"]) for c in members if _number(demographics.get(c, {}).get("age"))]
        per_split[split] = {
            "cases": len(members),
            "stage_groups": dict(sorted(Counter(stages.get(c) or "unstaged" for c in members).items())),
            "sex": dict(sorted(Counter(str(demographics.get(c, {}).get("sex") or "unknown") for c in members).items())),
            "age": _percentiles(np.percentile(ages, (5, 50, 95)), (5, 50, 95)) if ages else None,
        }
    missing = Counter(v for c in ids for v in cases[c]["missing"])
    return {
        "format": FINGERPRINT_FORMAT,
        "cases": len(ids),
        "spacing_zyx_mm": {
            "source_median": _round(np.median(spacing, axis=0)) if len(ids) else None,
            "source_min": _round(spacing.min(axis=0)) if len(ids) else None,
            "source_max": _round(spacing.max(axis=0)) if len(ids) else None,
            "training": [float(s) for s in spacing_zyx],
        },
        "shape_zyx": {
            "source_median": _round(np.median(shape, axis=0)) if len(ids) else None,
            "source_min": _round(shape.min(axis=0)) if len(ids) else None,
            "source_max": _round(shape.max(axis=0)) if len(ids) else None,
            "training": [int(s) for s in shape_zyx],
        },
        "intensity_hu": intensity,
        "box_long_axis_mm": boxes,
        "splits": per_split,
        "missing_share": {v: round(missing[v] / len(ids), 4) for v in variables if len(ids)},
    }


def write_fingerprint(shard_dir: Path, fingerprint: Mapping[str, Any]) -> dict[str, str]:
    """Write ``fingerprint.json`` beside the manifest; returns the manifest's entry for it (file and SHA-256)."""
    text = json.dumps(fingerprint, indent=1, sort_keys=True) + "\n"
    (Path(shard_dir) / FINGERPRINT_FILE).write_text(text, encoding="utf-8")
    return {"file": FINGERPRINT_FILE, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def read_fingerprint(shards: str, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cohort's fingerprint, or None for a cohort prepared before fingerprints were written. A file that does
    not match the manifest's SHA-256 is refused, naming it."""
    entry = manifest.get("fingerprint")
    if not entry:
        return None
    location = storage.join(shards, entry["file"])
    data = storage.read_bytes(location)
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"{location}: its SHA-256 does not match the manifest's: the fingerprint was altered")
    return json.loads(data)


def differences(before: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """Every key whose value differs, as ``key: before → now`` (nested keys dotted)."""
    changes = []
    for key in sorted(set(before) | set(now)):
        name = f"{prefix}{key}"
        a, b = before.get(key, "<absent>"), now.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            changes += differences(a, b, f"{name}.")
        elif _canonical(a) != _canonical(b):
            label = {"manifest_sha256": "the cohort (its shard manifest)"}.get(name, name)
            changes.append(f"{label}: {_short(a)} → {_short(b)}")
    return changes


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _short(value: Any) -> str:
    text = _canonical(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _percentiles(values: Sequence[float], levels: Sequence[float] = PERCENTILES) -> dict[str, float]:
    return {f"p{level:g}": round(float(v), 1) for level, v in zip(levels, values, strict=True)}


def _round(values: np.ndarray) -> list[float]:
    return [round(float(v), 3) for v in values]


def _number(value: Any) -> bool:
    try:
        return value is not None and value != "" and np.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and np.isnan(value)
