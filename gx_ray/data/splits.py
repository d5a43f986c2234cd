"""Patient-level train/val/test splits, stratified by overall stage, deterministic from a seed.

``split.json`` beside the shards is the only source of truth for which patient is in which split; training
and analysis read it, nothing recomputes it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

SPLITS: tuple[str, ...] = ("train", "val", "test")
DEFAULT_FRACTIONS = (0.70, 0.15, 0.15)  # the paper's 70/15/15
SPLIT_FILE = "split.json"
UNSTAGED = "unstaged"


def assign_splits(
    strata: dict[str, str | None], fractions: tuple[float, float, float] = DEFAULT_FRACTIONS, seed: int = 0
) -> dict[str, str]:
    """Map every patient id to a split, each stratum (``strata``: patient id → stage group or None) close to
    ``fractions``. Within a stratum patients are shuffled (seeded by ``seed`` and the stratum's name); then each goes
    to the split furthest below its share of all patients dealt so far: dealt across strata, small strata do not all
    round one split down to nothing (the cohort within one patient of the fractions, each stratum within about two).
    Depends only on the ids, strata, fractions and seed, not on the order of ``strata``."""
    if len(fractions) != len(SPLITS) or any(f < 0 for f in fractions) or not np.isclose(sum(fractions), 1.0):
        raise ValueError(f"split fractions must be three non-negative numbers summing to 1, got {fractions}")
    return {patient: SPLITS[i] for patient, i in _deal(strata, fractions, seed).items()}


def assign_folds(strata: dict[str, str | None], folds: int, seed: int = 0) -> dict[str, int]:
    """Map every patient id to one of ``folds`` cross-validation folds of (near) equal size, each stratum dealt
    across the folds as :func:`assign_splits` deals it across splits."""
    if not isinstance(folds, int) or folds < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {folds!r}")
    if len(strata) < folds:
        raise ValueError(
            f"{folds} folds need at least {folds} patients; the training and validation splits hold {len(strata)}"
        )
    return _deal(strata, (1 / folds,) * folds, seed)


def _deal(strata: dict[str, str | None], fractions: tuple[float, ...], seed: int) -> dict[str, int]:
    by_stratum: dict[str, list[str]] = defaultdict(list)
    for patient, stratum in strata.items():
        by_stratum[stratum or UNSTAGED].append(patient)
    assigned = np.zeros(len(fractions))
    target = np.asarray(fractions, dtype=float)
    result: dict[str, int] = {}
    for stratum in sorted(by_stratum):
        patients = sorted(by_stratum[stratum])
        stratum_seed = [seed, *stratum.encode()]
        for index in np.random.default_rng(stratum_seed).permutation(len(patients)):
            deficit = target * (assigned.sum() + 1) - assigned  # ties go to the earlier split
            choice = int(np.argmax(deficit))
            result[patients[index]] = choice
            assigned[choice] += 1
    return result


def write_split_file(
    path: Path,
    assignment: dict[str, str],
    excluded: dict[str, str],
    fractions: tuple[float, float, float],
    seed: int,
) -> None:
    """``split.json``: patient ids per split (sorted), the excluded patients with their reason, and how."""
    document: dict[str, object] = {
        "stratified_by": "overall stage group (I-IV)",
        "fractions": dict(zip(SPLITS, fractions, strict=True)),
        "seed": seed,
        **{split: sorted(p for p, s in assignment.items() if s == split) for split in SPLITS},
        "excluded": dict(sorted(excluded.items())),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def read_split_file(path: Path) -> dict[str, str]:
    """patient id → split, from ``split.json``; a patient listed twice is an error."""
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    result: dict[str, str] = {}
    for split in SPLITS:
        for patient in document.get(split, []):
            if patient in result:
                raise ValueError(f"{path}: patient {patient} is in both {result[patient]} and {split}")
            result[patient] = split
    return result
