"""Patient-level cross-validation folds: dealt disjoint and stratified over the training and validation patients, the
test split untouched, files of one's own checked and refused when they leak, and each fold's rows read exactly."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gx_ray.data.folds import (
    FoldError,
    check_folds,
    cohort_splits,
    fold_patients,
    read_custom_folds,
    read_fold_file,
    write_fold_file,
)
from gx_ray.data.shards import MANIFEST_FILE, TensorLayout, read_manifest
from gx_ray.data.splits import assign_folds
from gx_ray.data.stream import DataConfig, Reader, SplitStream, split_pieces, split_rows
from gx_ray.sweep.spaces import SpaceError, load_space
from tests.common import brighter_venous_phase


@pytest.mark.parametrize("seed", range(30))
def test_dealt_folds_hold_every_patient_once_in_near_equal_stratified_folds(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(10, 400)), int(rng.integers(2, 8))
    strata = {f"P{i:04d}": rng.choice(["I", "II", "III", "IV", None]) for i in range(n)}
    folds = assign_folds(strata, k, seed)
    assert set(folds) == set(strata) and set(folds.values()) <= set(range(k))
    sizes = Counter(folds.values())
    assert max(sizes.values()) - min(sizes[f] for f in range(k)) <= 1
    for stratum in {s or "unstaged" for s in strata.values()}:
        members = [p for p, s in strata.items() if (s or "unstaged") == stratum]
        per_fold = Counter(folds[p] for p in members)
        assert all(abs(per_fold[f] - len(members) / k) <= 2 for f in range(k)), (stratum, per_fold)
    shuffled = dict(sorted(strata.items(), key=lambda _: rng.random()))
    assert assign_folds(shuffled, k, seed) == folds  # the ids, strata and seed decide; not the order


def test_folds_need_two_and_enough_patients():
    with pytest.raises(ValueError, match="at least 2 folds"):
        assign_folds({"a": "I", "b": "I"}, 1)
    with pytest.raises(ValueError, match="at least 5 patients"):
        assign_folds({"a": "I", "b": "I"}, 5)


def test_the_cohorts_folds_partition_its_training_and_validation_patients_and_never_touch_test(demo_prepared):
    shards = str(demo_prepared.shard_dir)
    splits = cohort_splits(shards)
    folds = fold_patients(shards, 3)
    members = [p for fold in folds for p in fold]
    assert len(members) == len(set(members))
    assert set(members) == {p for p, s in splits.items() if s in ("train", "val")}
    check_folds(folds, splits, "dealt")


def test_a_fold_file_of_ones_own_is_refused_when_it_leaks_or_leaves_a_patient_out(demo_prepared, tmp_path):
    shards = str(demo_prepared.shard_dir)
    splits = cohort_splits(shards)
    good = fold_patients(shards, 2)
    test_patient = next(p for p, s in splits.items() if s == "test")
    cases = {
        "in fold 0 and fold 1": [good[0], [*good[1], good[0][0]]],
        f"patient {test_patient} .* is a test patient": [[*good[0], test_patient], good[1]],
        "in no fold": [good[0][1:], good[1]],
        "is not in this cohort": [[*good[0], "nobody"], good[1]],
        "at least 2 folds": [good[0] + good[1]],
    }
    for message, folds in cases.items():
        with pytest.raises(FoldError, match=message):
            check_folds(folds, splits, "my folds")
    # nnU-Net's splits_final.json is read as it is, and a fold that trains on a patient it validates is refused
    nnunet = [{"train": good[1 - k], "val": good[k]} for k in range(2)]
    path = tmp_path / "splits_final.json"
    path.write_text(json.dumps(nnunet), encoding="utf-8")
    assert read_custom_folds(str(path)) == good
    nnunet[0]["train"] = [*good[1], good[0][0]]
    path.write_text(json.dumps(nnunet), encoding="utf-8")
    with pytest.raises(FoldError, match=f"fold 0 trains and validates on patient {good[0][0]}"):
        read_custom_folds(str(path))


def test_a_fold_file_is_named_by_its_hash_and_belongs_to_its_cohort(demo_prepared, tmp_path):
    shards = str(demo_prepared.shard_dir)
    folds = fold_patients(shards, 2)
    location = write_fold_file(shards, str(tmp_path), folds, {"dealt": {"folds": 2}})
    assert location == write_fold_file(shards, str(tmp_path), folds, {"dealt": {"folds": 2}})  # same folds, same file
    assert read_fold_file(location, shards) == tuple(tuple(f) for f in folds)
    other = write_fold_file(shards, str(tmp_path), folds[::-1], {"dealt": {"folds": 2, "seed": 1}})
    assert other != location
    document = json.loads(Path(location).read_text(encoding="utf-8"))
    document["manifest_sha256"] = "0" * 64
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(FoldError, match="made for another cohort"):
        read_fold_file(str(forged), shards)


def test_a_cohort_re_prepared_at_the_same_path_has_its_old_folds_refused_in_the_same_process(demo_prepared, tmp_path):
    # a long-lived process (a notebook, a driver) reads the folds, the cohort is prepared again where it was: the
    # folds made for the old cohort are refused, and a fold file rewritten in place is read anew
    shards = tmp_path / "shards"
    shutil.copytree(demo_prepared.shard_dir, shards)
    folds = fold_patients(str(shards), 2)
    location = write_fold_file(str(shards), str(tmp_path), folds, {"dealt": {"folds": 2}})
    assert read_fold_file(location, str(shards)) == tuple(tuple(f) for f in folds)
    document = json.loads(Path(location).read_text(encoding="utf-8"))
    Path(location).write_text(json.dumps({**document, "fold_patients": folds[::-1]}), encoding="utf-8")
    assert read_fold_file(location, str(shards)) == tuple(tuple(f) for f in folds[::-1])
    manifest = json.loads((shards / MANIFEST_FILE).read_text(encoding="utf-8"))
    (shards / MANIFEST_FILE).write_text(json.dumps({**manifest, "prepared_again": True}), encoding="utf-8")
    with pytest.raises(FoldError, match="made for another cohort"):
        read_fold_file(location, str(shards))


def _case_ids(rows: list[dict]) -> list[str]:
    return sorted(r["case_id"] for r in rows)


def test_each_fold_reads_the_other_folds_to_train_and_its_own_to_validate(ray_cluster, demo_prepared, tmp_path):
    """Over the folds every training and validation patient is validated once; the rows a fold's stream yields (kept
    in memory or streamed through Ray Data) are exactly its patients', and the test split is the cohort's own."""
    shards = str(demo_prepared.shard_dir)
    folds = fold_patients(shards, 3)
    location = write_fold_file(shards, str(tmp_path), folds, {"dealt": {"folds": 3}})
    everyone = _case_ids(split_rows(shards, "train") + split_rows(shards, "val"))
    manifest = read_manifest(shards)
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    validated = []
    for k, patients in enumerate(folds):
        train = split_rows(shards, "train", location, k)
        val = split_rows(shards, "val", location, k)
        assert {r["patient_id"] for r in val} == set(patients)
        assert not {r["patient_id"] for r in train} & set(patients)
        assert _case_ids(train + val) == everyone
        assert {r["split"] for r in train} == {"train"} and {r["split"] for r in val} == {"val"}  # learnt from: train
        assert _case_ids(split_rows(shards, "test", location, k)) == _case_ids(split_rows(shards, "test"))
        validated += _case_ids(val)
        for in_memory in (True, False):
            data = DataConfig(shards=shards, folds_file=location, fold=k, in_memory=in_memory, shuffle_buffer=2)
            assert sum(p["rows"] for p in split_pieces(data, "train")) == len(train)
            stream = SplitStream(data, "train", layout, 2, seed=0, reader=Reader(device=torch.device("cpu")))
            seen = sorted(c for batch in stream.batches(0) for c in batch["case_id"])
            assert seen == _case_ids(train), (k, in_memory)
    assert sorted(validated) == everyone


def _cv_space(tmp_path, cv: dict, **extra) -> str:
    path = tmp_path / "cv.yaml"
    document = {"fixed": {"task": "stage_classification"}, "grid": {"seed": [0, 1]}, "cv": cv, **extra}
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return str(path)


def test_a_space_with_cv_runs_every_cell_on_every_fold_and_refuses_what_it_cannot(tmp_path):
    space = load_space(_cv_space(tmp_path, {"folds": 4}))
    assert space.grid["data.fold"] == [0, 1, 2, 3] and space.trial_count() == 8
    assert space.cv == {"folds": 4, "stratify": ["stage"], "seed": 0}
    refused = {
        "cv.folds": {"folds": 1},
        "cv.stratify": {"folds": 3, "stratify": ["hospital"]},
        "cv: unknown key": {"fold": 3},
    }
    for where, cv in refused.items():
        with pytest.raises(SpaceError, match=where.replace("cv: ", "")):
            load_space(_cv_space(tmp_path, cv))
    assert space.folds_in_trial == 0  # a grid without a scheduler: each fold a trial of its own
    sample = {"optimiser.lr": {"type": "loguniform", "low": 1e-5, "high": 1e-3}}
    searched = {  # a searcher or a scheduler optimises the folds' mean: each trial trains every fold
        "optuna": {"searcher": "optuna", "sample": sample, "grid": {}, "budget": {"samples": 5}},
        "grid + asha": {"scheduler": "asha"},
        "random + pbt": {"searcher": "random", "scheduler": "pbt", "sample": sample},
    }
    for name, extra in searched.items():
        space = load_space(_cv_space(tmp_path, {"folds": 3}, **extra))
        assert space.folds_in_trial == 3 and "data.fold" not in space.grid, name
    with pytest.raises(SpaceError, match="cv: .* side by side in one process: resources.workers must be 1"):
        load_space(_cv_space(tmp_path, {"folds": 3}, scheduler="asha", resources={"workers": 2}))
    with pytest.raises(SpaceError, match="sets data.fold and data.folds_file itself"):
        load_space(_cv_space(tmp_path, {"folds": 3}, fixed={"task": "stage_classification", "data.fold": 0}))
    with pytest.raises(SpaceError, match="cross-validation .* is not built for it"):
        load_space(_cv_space(tmp_path, {"folds": 3}, fixed={"task": "lesion_qa"}))


def test_a_fold_file_made_for_a_cohort_whose_fingerprint_changed_is_refused_naming_what_changed(
    demo_prepared, tmp_path
):
    """gx-ray's own fold file names its cohort: given as cv.file for a cohort re-prepared since (another scanner's
    intensities, say), it is refused naming the fingerprint's changed keys."""
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(demo_prepared.shard_dir, shards)
    location = write_fold_file(str(shards), str(tmp_path), fold_patients(str(shards), 2), {"dealt": {"folds": 2}})
    assert read_custom_folds(location, str(shards)) == [list(f) for f in read_fold_file(location, str(shards))]
    brighter_venous_phase(shards)  # the same cohort re-prepared from another scanner
    with pytest.raises(FoldError, match=r"another cohort .* fingerprint\.intensity_hu\.venous\.p50: [\d.-]+ → [\d.-]+"):
        read_custom_folds(location, str(shards))
