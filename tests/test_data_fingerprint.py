"""The cohort's fingerprint: written at preparation beside the manifest (which holds its SHA-256), true to the cases'
own numbers, refused when altered, and named when a resumed sweep finds it changed."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from gx_ray.data.catalogue import load_catalogue
from gx_ray.data.fingerprint import FINGERPRINT_FILE, PERCENTILES, case_fingerprint, read_fingerprint
from gx_ray.data.preprocess import PreprocessedCase
from gx_ray.data.shards import read_manifest
from gx_ray.schema import PHASES, Box
from gx_ray.sweep.resume import ResumeError, check_resumable, record_inputs, sweep_inputs
from gx_ray.sweep.spaces import load_space
from tests.common import brighter_venous_phase


def test_preparation_writes_the_fingerprint_and_the_manifest_holds_its_hash(demo_prepared):
    shards = str(demo_prepared.shard_dir)
    manifest = read_manifest(shards)
    text = (Path(shards) / FINGERPRINT_FILE).read_bytes()
    assert manifest["fingerprint"] == {"file": FINGERPRINT_FILE, "sha256": hashlib.sha256(text).hexdigest()}
    fingerprint = read_fingerprint(shards, manifest)
    assert fingerprint["cases"] == sum(manifest["rows"].values())
    assert {s: v["cases"] for s, v in fingerprint["splits"].items()} == {s: n for s, n in manifest["rows"].items() if n}
    for split in fingerprint["splits"].values():  # every case of a split counted once in its stage groups and sexes
        assert sum(split["stage_groups"].values()) == sum(split["sex"].values()) == split["cases"]
    preprocess = manifest["preprocess"]
    assert fingerprint["spacing_zyx_mm"]["training"] == preprocess["spacing_zyx_mm"]
    assert fingerprint["shape_zyx"]["training"] == preprocess["shape_zyx"]
    low, median, high = (fingerprint["spacing_zyx_mm"][k] for k in ("source_min", "source_median", "source_max"))
    assert all(a <= b <= c for a, b, c in zip(low, median, high, strict=True))
    assert set(fingerprint["intensity_hu"]) <= set(PHASES) and "venous" in fingerprint["intensity_hu"]
    venous = fingerprint["intensity_hu"]["venous"]
    assert venous["p0.5"] <= venous["p50"] <= venous["p99.5"]
    assert "tumour" in fingerprint["box_long_axis_mm"]
    assert set(fingerprint["missing_share"]) == set(load_catalogue().names)
    assert all(0 <= share <= 1 for share in fingerprint["missing_share"].values())


@pytest.mark.parametrize("seed", range(25))
def test_a_cases_intensities_are_the_percentiles_of_its_stomach_in_hu(seed):
    """On random volumes, z-scored as preprocessing stores them: the fingerprint's percentiles are those of the HU
    inside the stomach box (the whole crop without one), per present phase; box sizes are long axes in mm."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(s) for s in rng.integers(6, 14, size=3))
    volume = rng.standard_normal((len(PHASES), *shape)).astype(np.float16)
    present = [bool(p) for p in rng.integers(0, 2, size=len(PHASES))]
    present[PHASES.index("venous")] = True
    mean, sd = rng.uniform(-50, 100, len(PHASES)), rng.uniform(20, 200, len(PHASES))
    spacing = tuple(float(s) for s in rng.uniform(0.5, 3, size=3))
    low = [int(rng.integers(0, s - 2)) for s in shape]
    high = [int(rng.integers(a + 1, s + 1)) for a, s in zip(low, shape, strict=True)]
    stomach = Box("stomach", "venous", (*low, *high))
    tumour = Box("tumour", "venous", (*low, *[a + 1 for a in low]))
    boxes = [tumour, stomach] if rng.random() < 0.7 else [tumour]
    labs = {"age": 61, "sex": "", "cea": float("nan")}
    case = PreprocessedCase(
        "c", volume, tuple(present), boxes, {}, (0, 0, 0), hu_mean=tuple(mean), hu_std=tuple(sd),
        source_spacing_zyx=(2.5, 0.7, 0.7), source_shape_zyx=(80, 512, 512),
    )  # fmt: skip
    numbers = case_fingerprint(case, spacing, labs, ("age", "sex", "cea", "ca199"))
    region = tuple(slice(a, b) for a, b in zip(low, high, strict=True)) if stomach in boxes else (slice(None),) * 3
    assert set(numbers["intensity_hu"]) == {p for p, here in zip(PHASES, present, strict=True) if here}
    for phase, values in numbers["intensity_hu"].items():
        p = PHASES.index(phase)
        hu = volume[p][region].astype(np.float32) * sd[p] + mean[p]
        expected = np.percentile(hu, PERCENTILES)
        assert [values[f"p{q:g}"] for q in PERCENTILES] == pytest.approx(expected, abs=0.051)
    assert numbers["box_long_axis_mm"]["tumour"] == [pytest.approx(max(spacing), abs=0.005)]
    assert numbers["missing"] == ["ca199", "cea", "sex"]  # absent, NaN and empty are missing; 61 is not


def _copy(shards: Path, to: Path) -> Path:
    shutil.copytree(shards, to)
    return to


def test_an_altered_fingerprint_is_refused_naming_its_file(demo_prepared, tmp_path):
    shards = _copy(Path(demo_prepared.shard_dir), tmp_path / "shards")
    path = shards / FINGERPRINT_FILE
    path.write_text(path.read_text(encoding="utf-8").replace('"cases"', '"cases" '), encoding="utf-8")
    with pytest.raises(ValueError, match=f"{FINGERPRINT_FILE}: its SHA-256 does not match"):
        read_fingerprint(str(shards), read_manifest(shards))


def test_a_resume_on_a_cohort_whose_fingerprint_changed_is_refused_naming_what_changed(demo_prepared, tmp_path):
    shards = _copy(Path(demo_prepared.shard_dir), tmp_path / "shards")
    space_file = tmp_path / "space.yaml"
    space_file.write_text(yaml.safe_dump({"fixed": {"task": "stage_classification"}, "grid": {"seed": [0]}}))
    space = load_space(str(space_file))
    for sweep in ("sweep", "again"):
        (tmp_path / "out" / sweep).mkdir(parents=True)
    record_inputs(tmp_path / "out" / "sweep", sweep_inputs(space, str(shards)))
    brighter_venous_phase(shards)  # the same cohort re-prepared from another scanner
    with pytest.raises(ResumeError, match=r"fingerprint\.intensity_hu\.venous\.p50: [-\d.]+ → [-\d.]+"):
        check_resumable(tmp_path / "out", "sweep", sweep_inputs(space, str(shards)))
    # a space that differs only in its description and budget still resumes
    space_file.write_text(yaml.safe_dump({"description": "x", "fixed": {"task": "stage_classification"},
                                          "grid": {"seed": [0]}, "budget": {"time_s": 60}}))  # fmt: skip
    record_inputs(tmp_path / "out" / "again", sweep_inputs(space, str(shards)))
    check_resumable(tmp_path / "out", "again", sweep_inputs(load_space(str(space_file)), str(shards)))
