"""Endoscopy frame annotations for the GastroINST-style tasks (site, lesion boxes with their region classes, a
caption): the file a hospital supplies beside its cohort, which the demo cohort also writes.

``COHORT/endoscopy_annotations.json`` (or any path given to preparation)::

    {"format": 1,
     "frames": [{"case_id": "GX0001",
                 "width": 256, "height": 256,            # the frame's pixel size, as the boxes are given
                 "site": "antrum",                       # one of SITES
                 "boxes": [[x0, y0, x1, y1], ...],       # pixels, x to the right, y down, x0 < x1, y0 < y1
                 "region_classes": ["early gastric cancer", ...],   # one of REGION_CLASSES per box
                 "caption": "A depressed reddened lesion ..."}]}

Preparation keeps the valid frames of the included cases in ``SHARDS/endoscopy_annotations.json``, boxes scaled to
[0, 1] of the frame (resized to a square, so they hold at any size); a frame with a bad field is left out with a reason
naming the case, the file and the field. The taxonomy is the stomach's part of GastroINST's (site, finding).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gx_ray import storage

FORMAT = 1
FILE = "endoscopy_annotations.json"
SITES: tuple[str, ...] = ("cardia", "fundus", "body", "angle", "antrum", "pylorus")
REGION_CLASSES: tuple[str, ...] = (
    "early gastric cancer",
    "advanced gastric cancer",
    "gastric ulcer",
    "gastric polyp",
    "gastritis",
)


@dataclass(frozen=True)
class FrameAnnotation:
    case_id: str
    site: str
    boxes: tuple[tuple[float, float, float, float], ...]
    """``(x0, y0, x1, y1)`` as fractions of the frame's width and height."""
    region_classes: tuple[str, ...]
    caption: str


class AnnotationError(ValueError):
    """One frame's annotation is unusable: names the case, the file and the field."""

    def __init__(self, case_id: str, path: Path | str, field: str, problem: str):
        super().__init__(f"{path}: case {case_id}, field {field!r}: {problem}")
        self.case_id, self.path, self.field, self.problem = case_id, str(path), field, problem


def read_annotations(path: Path | str) -> tuple[dict[str, FrameAnnotation], list[AnnotationError]]:
    """The valid frames of an annotation file by case id, and a reason for each frame left out. A file that is not
    an annotation file at all (unreadable, not JSON, another format) raises :class:`AnnotationError`."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AnnotationError("-", path, "-", f"not a readable JSON file: {err}") from err
    if (
        not isinstance(document, dict)
        or document.get("format") != FORMAT
        or not isinstance(document.get("frames"), list)
    ):
        raise AnnotationError("-", path, "format", f'expected {{"format": {FORMAT}, "frames": [...]}}')
    frames: dict[str, FrameAnnotation] = {}
    problems: list[AnnotationError] = []
    for index, entry in enumerate(document["frames"]):
        case_id = entry.get("case_id") if isinstance(entry, dict) else None
        if not isinstance(case_id, str) or not case_id:
            problems.append(AnnotationError(f"#{index}", path, "case_id", "missing or not a string"))
            continue
        if case_id in frames:
            problems.append(AnnotationError(case_id, path, "case_id", "annotated twice: the first is kept"))
            continue
        try:
            frames[case_id] = _frame(case_id, entry, path)
        except AnnotationError as err:
            problems.append(err)
    return frames, problems


def _frame(case_id: str, entry: Mapping[str, Any], path: Path | str) -> FrameAnnotation:
    def fail(field: str, problem: str) -> AnnotationError:
        return AnnotationError(case_id, path, field, problem)

    size = []
    for field in ("width", "height"):
        value = entry.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise fail(field, f"the frame's {field} in pixels must be a positive number, not {value!r}")
        size.append(float(value))
    if entry.get("site") not in SITES:
        raise fail("site", f"{entry.get('site')!r} is not one of {', '.join(SITES)}")
    boxes, classes = entry.get("boxes"), entry.get("region_classes")
    if not isinstance(boxes, list) or not isinstance(classes, list) or len(boxes) != len(classes):
        raise fail("boxes", "boxes and region_classes must be lists of the same length")
    scaled = []
    for i, box in enumerate(boxes):
        numbers = box if isinstance(box, list) and len(box) == 4 else None
        if numbers is None or not all(isinstance(v, int | float) and math.isfinite(v) for v in numbers):
            raise fail(f"boxes[{i}]", f"expected [x0, y0, x1, y1] in pixels, not {box!r}")
        x0, y0, x1, y1 = numbers
        if not (0 <= x0 < x1 <= size[0] and 0 <= y0 < y1 <= size[1]):
            raise fail(f"boxes[{i}]", f"{box} is empty or outside the {size[0]:g} x {size[1]:g} frame")
        scaled.append((x0 / size[0], y0 / size[1], x1 / size[0], y1 / size[1]))
    for i, name in enumerate(classes):
        if name not in REGION_CLASSES:
            raise fail(f"region_classes[{i}]", f"{name!r} is not one of {', '.join(REGION_CLASSES)}")
    caption = entry.get("caption")
    if not isinstance(caption, str) or not caption.strip():
        raise fail("caption", "missing or empty")
    return FrameAnnotation(case_id, entry["site"], tuple(scaled), tuple(classes), caption.strip())


def annotation_entry(
    case_id: str,
    size: tuple[int, int],
    site: str,
    boxes: Iterable[Iterable[float]],
    classes: Iterable[str],
    caption: str,
) -> dict[str, Any]:
    """One frame of the file's format (pixel boxes), as a cohort writes it."""
    return {
        "case_id": case_id,
        "width": size[0],
        "height": size[1],
        "site": site,
        "boxes": [[float(v) for v in box] for box in boxes],
        "region_classes": list(classes),
        "caption": caption,
    }


def write_annotations(path: Path | str, entries: Iterable[Mapping[str, Any]]) -> None:
    document = {"format": FORMAT, "frames": list(entries)}
    Path(path).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def write_prepared(shard_dir: Path, frames: Mapping[str, FrameAnnotation]) -> None:
    """The frames of the included cases beside the shards, boxes as fractions of the frame."""
    document = {"format": FORMAT, "frames": {cid: asdict(frame) for cid, frame in sorted(frames.items())}}
    (Path(shard_dir) / FILE).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def load_prepared(shard_dir: str | Path) -> dict[str, FrameAnnotation]:
    """What :func:`write_prepared` wrote (local or object storage); empty where the cohort has no annotations."""
    location = storage.join(str(shard_dir), FILE)
    if not storage.exists(location):
        return {}
    document = json.loads(storage.read_bytes(location))
    return {
        cid: FrameAnnotation(
            cid, f["site"], tuple(tuple(b) for b in f["boxes"]), tuple(f["region_classes"]), f["caption"]
        )
        for cid, f in document["frames"].items()
    }
