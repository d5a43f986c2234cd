"""Patient-level, stage-stratified, deterministic splits."""

import json
from collections import Counter

import numpy as np
import pytest

from gx_ray.data.splits import SPLITS, assign_splits, read_split_file, write_split_file


def patient_stages(n: int, seed: int = 0) -> dict[str, str | None]:
    """``n`` patients' stage groups (a few unknown), drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    return {f"P{i:04d}": rng.choice(["I", "II", "III", "IV", None], p=[0.2, 0.25, 0.4, 0.1, 0.05]) for i in range(n)}


def test_every_patient_in_exactly_one_split_at_70_15_15():
    strata = patient_stages(400)
    assignment = assign_splits(strata)
    assert set(assignment) == set(strata)
    counts = Counter(assignment.values())
    for split, fraction in zip(SPLITS, (0.7, 0.15, 0.15), strict=True):
        assert abs(counts[split] - fraction * len(strata)) <= 1


def test_each_stage_is_spread_over_the_splits_in_proportion():
    strata = patient_stages(400)
    assignment = assign_splits(strata)
    for stratum in ("I", "II", "III", "IV"):
        members = [p for p, s in strata.items() if s == stratum]
        counts = Counter(assignment[p] for p in members)
        for split, fraction in zip(SPLITS, (0.7, 0.15, 0.15), strict=True):
            assert abs(counts[split] - fraction * len(members)) <= 2, (stratum, split, counts)


def test_small_strata_do_not_starve_val_and_test():
    # eight strata of four patients: rounding each stratum alone would leave val and test empty
    strata = {f"P{i}": f"S{i % 8}" for i in range(32)}
    counts = Counter(assign_splits(strata).values())
    assert counts["val"] >= 4 and counts["test"] >= 4


def test_deterministic_and_independent_of_input_order_but_not_of_seed():
    strata = patient_stages(100)
    first = assign_splits(strata, seed=3)
    assert first == assign_splits(dict(reversed(list(strata.items()))), seed=3)
    assert first != assign_splits(strata, seed=4)


def test_split_file_round_trip_and_refuses_a_patient_twice(tmp_path):
    assignment = assign_splits(patient_stages(30))
    path = tmp_path / "split.json"
    write_split_file(path, assignment, {"P9999": "unreadable"}, (0.7, 0.15, 0.15), 0)
    assert read_split_file(path) == assignment
    assert json.loads(path.read_text())["excluded"] == {"P9999": "unreadable"}
    document = json.loads(path.read_text())
    document["test"].append(document["train"][0])
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="both train and test"):
        read_split_file(path)


def test_bad_fractions_are_refused():
    with pytest.raises(ValueError, match="summing to 1"):
        assign_splits({"P1": "I"}, (0.5, 0.2, 0.2))
