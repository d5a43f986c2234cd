"""Patient-level cross-validation folds over a prepared cohort's training and validation patients.

The test split is never touched: folds partition the patients of ``train`` and ``val`` (``split.json``). A trial of
fold ``k`` trains on every other fold's patients and validates on fold ``k``'s, so over the folds every training
patient is predicted once by a model that never saw it (its out-of-fold prediction).

A fold assignment is a versioned file named by its content's SHA-256 (:func:`write_fold_file`,
``folds/<cohort>/folds-<sha>.json`` under the sweep's output, logged on every run), dealt by gx-ray (stratified as
the splits are) or one's own: gx-ray's format or nnU-Net's ``splits_final.json``. A file that puts a patient in two
folds, leaves one out or touches the test split is refused, naming the patient. :func:`fold_rows` tells, row group by
row group, which rows a fold reads: the shards stay as they are, no copy per fold.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from gx_ray import storage
from gx_ray.data.fingerprint import differences, read_fingerprint
from gx_ray.data.shards import MANIFEST_FILE, open_shard, read_shard, split_files
from gx_ray.data.splits import SPLIT_FILE, SPLITS, assign_folds

FOLD_FORMAT = 1
FOLDED_SPLITS = ("train", "val")
"""The splits whose patients the folds partition; ``test`` is never touched."""
STRATA_COLUMNS = ("stage",)
"""Row columns a fold assignment may be stratified by (``stage``: the overall stage group)."""


class FoldError(ValueError):
    """A fold assignment that would leak (a patient in two folds, a test patient) or leave a patient out."""


def cohort_splits(shards: str) -> dict[str, str]:
    """patient id → split, from the cohort's ``split.json``."""
    document = json.loads(storage.read_text(storage.join(shards, SPLIT_FILE)))
    return {patient: split for split in SPLITS for patient in document.get(split, [])}


def fold_patients(shards: str, folds: int, stratify: Sequence[str] = ("stage",), seed: int = 0) -> list[list[str]]:
    """Deal the cohort's training and validation patients into ``folds`` folds, stratified by ``stratify``."""
    unknown = sorted(set(stratify) - set(STRATA_COLUMNS))
    if unknown:
        raise FoldError(f"cannot stratify folds by {unknown}; valid: {', '.join(STRATA_COLUMNS)}")
    strata: dict[str, str | None] = {}
    for split in FOLDED_SPLITS:
        for path in split_files(shards, split):
            for row in read_shard(path, columns=["patient_id", "stage_label", *stratify]).to_pylist():
                key = "|".join(str(_stratum(row, column)) for column in stratify)
                strata[row["patient_id"]] = key or None
    assignment = assign_folds(strata, folds, seed)
    return [sorted(p for p, f in assignment.items() if f == k) for k in range(folds)]


def _stratum(row: Mapping[str, Any], column: str) -> Any:
    if column == "stage":  # the stage group the splits are stratified by (-1: unstaged)
        return row["stage_label"]
    return row.get(column)


def read_custom_folds(location: str, shards: str | None = None) -> list[list[str]]:
    """The validation patients of each fold in a file of one's own: gx-ray's fold file, or nnU-Net's
    ``splits_final.json`` (a list of folds, each ``{"train": [...], "val": [...]}``). A gx-ray fold file made for
    another cohort than ``shards`` is refused, naming what changed in the cohort's fingerprint."""
    try:
        document = json.loads(storage.read_text(location))
    except (OSError, ValueError) as err:
        raise FoldError(f"{location}: not a readable JSON fold file ({err})") from err
    if isinstance(document, dict) and "fold_patients" in document:
        if shards is not None:
            _same_cohort(document, shards, location)
        return [list(fold) for fold in document["fold_patients"]]
    if isinstance(document, list) and all(isinstance(f, dict) and "val" in f for f in document):
        for k, fold in enumerate(document):
            overlap = sorted(set(fold.get("train", [])) & set(fold["val"]))
            if overlap:
                raise FoldError(f"{location}: fold {k} trains and validates on patient {overlap[0]}")
        return [list(fold["val"]) for fold in document]
    raise FoldError(f"{location}: expected gx-ray's fold file or nnU-Net's list of {{'train', 'val'}} folds")


def _same_cohort(document: Mapping[str, Any], shards: str, location: str) -> None:
    manifest = storage.read_bytes(storage.join(shards, MANIFEST_FILE))
    if document.get("manifest_sha256") in (None, hashlib.sha256(manifest).hexdigest()):
        return
    changed = differences(document.get("fingerprint") or {}, read_fingerprint(shards, json.loads(manifest)) or {})
    raise FoldError(
        f"{location}: made for another cohort than {shards}; its fingerprint changed since: "
        + "; ".join(f"fingerprint.{c}" for c in changed[:5] or ["(none recorded)"])
    )


def check_folds(folds: Sequence[Sequence[str]], splits: Mapping[str, str], where: str) -> None:
    """Refuse folds that put a patient in two folds, touch the test split, name an unknown patient or leave a
    training or validation patient out, naming the patient and the folds."""
    if len(folds) < 2:
        raise FoldError(f"{where}: cross-validation needs at least 2 folds, got {len(folds)}")
    seen: dict[str, int] = {}
    for k, fold in enumerate(folds):
        if not fold:
            raise FoldError(f"{where}: fold {k} has no patients")
        for patient in fold:
            if patient in seen:
                raise FoldError(f"{where}: patient {patient} is in fold {seen[patient]} and fold {k}")
            split = splits.get(patient)
            if split is None:
                raise FoldError(f"{where}: patient {patient} (fold {k}) is not in this cohort")
            if split not in FOLDED_SPLITS:
                raise FoldError(f"{where}: patient {patient} (fold {k}) is a {split} patient: folds never touch it")
            seen[patient] = k
    missing = sorted(p for p, s in splits.items() if s in FOLDED_SPLITS and p not in seen)
    if missing:
        raise FoldError(f"{where}: {len(missing)} training patients are in no fold, e.g. {missing[0]}")


def write_fold_file(shards: str, root: str, folds: Sequence[Sequence[str]], how: Mapping[str, Any]) -> str:
    """Check ``folds`` against the cohort and write them as ``root/folds/<cohort>/folds-<sha>.json`` (kept if there);
    ``how`` says how they were made (``{"dealt": {...}}`` or ``{"file": location}``). Returns the location."""
    check_folds(folds, cohort_splits(shards), str(how.get("file", "the folds")))
    manifest_sha = hashlib.sha256(storage.read_bytes(storage.join(shards, MANIFEST_FILE))).hexdigest()
    manifest = json.loads(storage.read_bytes(storage.join(shards, MANIFEST_FILE)))
    document = {
        "format": FOLD_FORMAT,
        "folds": len(folds),
        "manifest_sha256": manifest_sha,
        "fingerprint": read_fingerprint(shards, manifest),
        "how": dict(how),
        "fold_patients": [sorted(fold) for fold in folds],
    }
    text = json.dumps(document, indent=1, sort_keys=True) + "\n"
    sha = hashlib.sha256(text.encode()).hexdigest()
    location = storage.join(root, "folds", manifest_sha[:16], f"folds-{sha[:16]}.json")
    if not storage.exists(location):
        storage.write_text(location, text)
    return location


def read_fold_file(location: str, shards: str) -> tuple[tuple[str, ...], ...]:
    """The folds' patients, refused unless the file is of this format and of the cohort at ``shards``."""
    document = json.loads(storage.read_text(location))
    if document.get("format") != FOLD_FORMAT:
        raise FoldError(f"{location}: fold file format {document.get('format')!r}, this gx-ray reads {FOLD_FORMAT}")
    manifest_sha = hashlib.sha256(storage.read_bytes(storage.join(shards, MANIFEST_FILE))).hexdigest()
    if document.get("manifest_sha256") != manifest_sha:
        raise FoldError(f"{location}: made for another cohort than {shards} (its shard manifest differs)")
    return tuple(tuple(fold) for fold in document["fold_patients"])


def fold_sha256(location: str) -> str:
    """What names a fold file (and tags every run that used it)."""
    return hashlib.sha256(storage.read_bytes(location)).hexdigest()


def fold_rows(shards: str, split: str, folds_file: str, fold: int) -> dict[tuple[str, int], list[int]]:
    """For fold ``fold`` of ``folds_file``: (shard file, row group) → the rows ``split`` reads there. ``train`` is
    every other fold's patients, ``val`` this fold's, both drawn from the training and validation shards; ``test``
    is not folded (every row of the test shards)."""
    folds = read_fold_file(folds_file, shards)
    if not 0 <= fold < len(folds):
        raise FoldError(f"data.fold {fold} is not a fold of {folds_file} (0 to {len(folds) - 1})")
    if split == "test":
        raise FoldError("the test split is not folded")
    if split not in FOLDED_SPLITS:
        raise FoldError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    wanted = set(folds[fold]) if split == "val" else {p for k, f in enumerate(folds) if k != fold for p in f}
    kept: dict[tuple[str, int], list[int]] = {}
    for source in FOLDED_SPLITS:
        for path in split_files(shards, source):
            table = read_shard(path, columns=["patient_id"])
            groups = _group_starts(path)
            patients = table["patient_id"].to_pylist()
            for group, (start, end) in enumerate(groups):
                rows = [i - start for i in range(start, end) if patients[i] in wanted]
                if rows:
                    kept[(str(path), group)] = rows
    return kept


def _group_starts(path: str) -> list[tuple[int, int]]:
    """Each row group's first and last-plus-one row in its file."""
    metadata = open_shard(path).metadata
    bounds, start = [], 0
    for i in range(metadata.num_row_groups):
        rows = metadata.row_group(i).num_rows
        bounds.append((start, start + rows))
        start += rows
    return bounds
