"""Lesion-detection metrics (Table 6): COCO-style AP on 3D boxes, F1@0.5 and localization accuracy@0.5.

:func:`detection_metrics` matches boxes in 3D with MONAI's port of COCO's matching and turns the matches into AP
with pycocotools' own accumulation (float64; MONAI's ``COCOMetric`` counts in float32: :func:`_coco_precision`).
:func:`detection_metrics_axial` gives the same metrics from pycocotools alone on the axial (y, x) projection. Both
use COCO's settings: IoU 0.50:0.95:0.05, 101 recall points, the ``max_detections`` (100) highest-scoring
predictions per image, greedy matching by descending score, no area ranges. At IoU 0.5:

* ``f1_50``: the best F1 = 2 TP / (predictions kept + target boxes), pooled over images, over score thresholds (a
  threshold never splits tied scores), or at ``f1_score_threshold`` when set.
* ``loc_acc_50``: in an image with ``k`` target boxes, the ``k`` highest-scoring predictions are matched one-to-one
  and each target matched counts as localized (one target: "the top prediction hits it"); images without targets
  do not count.

All values are percent. With no target box at all every metric is NaN (undefined); with targets but no
predictions every metric is 0. Single class (lesion); boxes are :class:`gx_ray.schema.Box` coordinates.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

DETECTION_METRICS: tuple[str, ...] = ("ap_50", "ap_75", "f1_50", "map_50_95", "loc_acc_50")
# As pycocotools builds them (np.linspace with a rounded count): both back ends compare IoUs to identical floats.
COCO_IOU_THRESHOLDS = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)
AP_IOU_THRESHOLDS: dict[str, float] = {"ap_50": 0.5, "ap_75": 0.75}
"""The metrics that are AP at one IoU threshold, and that threshold."""


def detection_metrics(
    predictions: Sequence[dict],
    targets: Sequence[dict],
    max_detections: int = 100,
    f1_score_threshold: float | None = None,
) -> dict[str, float]:
    """``{ap_50, ap_75, f1_50, map_50_95, loc_acc_50}`` in percent of 3D boxes, one dict per image (case):
    ``predictions`` ``{"boxes": (K, 6), "scores": (K,)}`` and ``targets`` ``{"boxes": (M, 6)}``, boxes end-exclusive
    ``(z0, y0, x0, z1, y1, x1)`` on the voxel grid (``[]`` for none; one box is ``[[...]]``, never a flat list). The
    ``max_detections`` (>= 1) highest-scoring predictions per image are kept; ``f1_score_threshold``: None for the best
    F1 over score thresholds. A ValueError names the field (``predictions[3].boxes``) of a box not ``(N, 6)``, empty or
    inverted, scores not one per box, or a value not a finite number.
    """
    return summarise_matches(match_detections(predictions, targets, max_detections), max_detections, f1_score_threshold)


def match_detections(
    predictions: Sequence[dict], targets: Sequence[dict], max_detections: int = 100
) -> list[tuple[dict | None, int]]:
    """Each image's COCO matching at every IoU threshold and its number of target boxes: the per-image half of
    :func:`detection_metrics`. Matching never looks across images, so a resample of images (the bootstrap over
    patients) needs only :func:`summarise_matches` of the matched images it draws, not a new matching."""
    from monai.apps.detection.metrics.matching import matching_batch

    max_detections = _max_detections(max_detections)
    pred_boxes, pred_scores, target_boxes = _validated(predictions, targets)
    to_xyz = [2, 1, 0, 5, 4, 3]  # MONAI's boxes are (x0, y0, z0, x1, y1, z1)
    matched = matching_batch(
        iou_fn=box_iou,
        iou_thresholds=COCO_IOU_THRESHOLDS,
        pred_boxes=[b[:, to_xyz] for b in pred_boxes],
        pred_classes=[np.zeros(len(b), dtype=int) for b in pred_boxes],
        pred_scores=pred_scores,
        gt_boxes=[b[:, to_xyz] for b in target_boxes],
        gt_classes=[np.zeros(len(b), dtype=int) for b in target_boxes],
        max_detections=max_detections,
    )
    # MONAI's per-image results have pycocotools' per-image layout (dtMatches, dtScores, gtIgnore, dtIgnore)
    return [(result.get(0), len(boxes)) for result, boxes in zip(matched, target_boxes, strict=True)]


def summarise_matches(
    matches: Sequence[tuple[dict | None, int]], max_detections: int = 100, f1_score_threshold: float | None = None
) -> dict[str, float]:
    """The metrics of :func:`detection_metrics` from images matched by :func:`match_detections` (repeats allowed)."""
    max_detections, f1_score_threshold = _max_detections(max_detections), _score_threshold(f1_score_threshold)
    return _summarise([m for m, _ in matches], [n for _, n in matches], max_detections, f1_score_threshold)


def average_precision_of_matches(
    matches: Sequence[tuple[dict | None, int]], iou_threshold: float, max_detections: int = 100
) -> float:
    """``ap_50`` or ``ap_75`` of :func:`summarise_matches` alone: pycocotools' ``accumulate`` at that one IoU
    threshold instead of COCO's ten, a tenth of the work (what a bootstrap rescoring a thousand resamples asks)."""
    max_detections = _max_detections(max_detections)
    (at,) = np.flatnonzero(np.isclose(COCO_IOU_THRESHOLDS, iou_threshold))
    if sum(n for _, n in matches) == 0:
        return float("nan")
    one = [
        {**m, "dtMatches": np.asarray(m["dtMatches"])[at : at + 1], "dtIgnore": np.asarray(m["dtIgnore"])[at : at + 1]}
        if m
        else None
        for m, _ in matches
    ]
    return 100.0 * float(_coco_precision(one, max_detections, COCO_IOU_THRESHOLDS[at : at + 1])[0].mean())


def detection_metrics_axial(
    predictions: Sequence[dict],
    targets: Sequence[dict],
    max_detections: int = 100,
    f1_score_threshold: float | None = None,
) -> dict[str, float]:
    """The metrics of :func:`detection_metrics` from pycocotools on the boxes' axial ``(y0, x0, y1, x1)``
    projection: equal to them where all boxes of an image share one z range."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    max_detections, f1_score_threshold = _max_detections(max_detections), _score_threshold(f1_score_threshold)
    pred_boxes, pred_scores, target_boxes = _validated(predictions, targets)

    def annotations(boxes_per_image, scores_per_image=None):
        anns = []
        for image_id, boxes in enumerate(boxes_per_image):
            for j, (_, y0, x0, _, y1, x1) in enumerate(boxes.tolist()):
                ann = {"image_id": image_id, "category_id": 1, "bbox": [x0, y0, x1 - x0, y1 - y0]}
                ann.update(area=(x1 - x0) * (y1 - y0), iscrowd=0, id=len(anns) + 1)  # id 0 means "unmatched"
                if scores_per_image is not None:
                    ann["score"] = float(scores_per_image[image_id][j])
                anns.append(ann)
        return anns

    images = [{"id": i} for i in range(len(target_boxes))]
    categories = [{"id": 1}]
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        ground_truth, detected = COCO(), COCO()
        ground_truth.dataset = {"images": images, "categories": categories, "annotations": annotations(target_boxes)}
        detected.dataset = {
            "images": images,
            "categories": categories,
            "annotations": annotations(pred_boxes, pred_scores),
        }
        ground_truth.createIndex()
        detected.createIndex()
        evaluation = COCOeval(ground_truth, detected, iouType="bbox")
        evaluation.params.maxDets = [max_detections]
        evaluation.evaluate()
    if not np.array_equal(evaluation.params.iouThrs, COCO_IOU_THRESHOLDS):
        raise RuntimeError(f"pycocotools' IoU thresholds {evaluation.params.iouThrs} are not COCO's")
    per_image = evaluation.evalImgs[: len(images)]  # the one category, area range "all", images in id order
    return _summarise(per_image, [len(b) for b in target_boxes], max_detections, f1_score_threshold)


def _summarise(
    per_image: list[dict | None], num_targets: list[int], max_detections: int, f1_score_threshold: float | None
) -> dict[str, float]:
    """All metrics from per-image COCO matching results (None for an image without boxes of either kind)."""
    if sum(num_targets) == 0:
        return dict.fromkeys(DETECTION_METRICS, np.nan)
    precision = _coco_precision(per_image, max_detections)  # [IoU threshold, recall point]
    at_50, at_75 = (int(np.flatnonzero(AP_IOU_THRESHOLDS[k] == COCO_IOU_THRESHOLDS)[0]) for k in ("ap_50", "ap_75"))
    # per image: was each kept prediction (in descending score order) a true positive at IoU 0.5
    hits = [np.asarray(e["dtMatches"])[at_50] > 0 if e else np.zeros(0, bool) for e in per_image]
    scores = [np.asarray(e["dtScores"], dtype=np.float64) if e else np.zeros(0) for e in per_image]
    return {
        "ap_50": 100.0 * float(precision[at_50].mean()),
        "ap_75": 100.0 * float(precision[at_75].mean()),
        "f1_50": _f1(hits, scores, sum(num_targets), f1_score_threshold),
        "map_50_95": 100.0 * float(precision.mean()),
        "loc_acc_50": _localization_accuracy(hits, num_targets),
    }


def _coco_precision(
    per_image: list[dict | None], max_detections: int, iou_thresholds: np.ndarray = COCO_IOU_THRESHOLDS
) -> np.ndarray:
    """COCO's interpolated precision at its 101 recall points, by pycocotools' own ``accumulate``; for 3D too, as
    MONAI counts in float32, where a recall exactly on a recall point (3 of 25) can round below it (AP off by ~1)."""
    from pycocotools.cocoeval import COCOeval

    evaluation = COCOeval(iouType="bbox")
    params = evaluation.params
    params.imgIds, params.catIds, params.maxDets = list(range(len(per_image))), [1], [max_detections]
    params.areaRng, params.areaRngLbl = [[0, np.inf]], ["all"]  # boxes are filtered by nothing but score
    params.iouThrs = iou_thresholds  # the rows of the images' dtMatches
    evaluation._paramsEval = copy.deepcopy(params)
    evaluation.evalImgs = per_image
    with contextlib.redirect_stdout(io.StringIO()):
        evaluation.accumulate()
    return evaluation.eval["precision"][:, :, 0, 0, 0]


def _validated(
    predictions: Sequence[dict], targets: Sequence[dict]
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per image: predicted boxes ``(K, 6)``, their scores ``(K,)`` and target boxes ``(M, 6)``, all finite
    float64, or a ValueError that names the offending field (``predictions[3].boxes``)."""
    predictions, targets = _images(predictions, "predictions"), _images(targets, "targets")
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} prediction entries but {len(targets)} target entries (one per image)")
    pred_boxes, pred_scores, target_boxes = [], [], []
    for i, (prediction, target) in enumerate(zip(predictions, targets, strict=True)):
        pred_boxes.append(_boxes(_field(prediction, "predictions", i, "boxes"), f"predictions[{i}].boxes"))
        pred_scores.append(_scores(_field(prediction, "predictions", i, "scores"), f"predictions[{i}].scores"))
        target_boxes.append(_boxes(_field(target, "targets", i, "boxes"), f"targets[{i}].boxes"))
        if len(pred_boxes[i]) != len(pred_scores[i]):
            raise ValueError(
                f"image {i}: {len(pred_boxes[i])} predicted boxes but {len(pred_scores[i])} scores "
                f"(predictions[{i}].boxes and predictions[{i}].scores)"
            )
    return pred_boxes, pred_scores, target_boxes


def _images(entries: Sequence[dict], name: str) -> list:
    """``entries`` as a list of per-image dicts: a string or a single dict is not a sequence of images."""
    if isinstance(entries, str | bytes | Mapping) or not isinstance(entries, Iterable):
        raise ValueError(f"{name} must be a sequence of dicts, one per image, got {type(entries).__name__}")
    return list(entries)


def _field(entry: object, name: str, index: int, key: str) -> object:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{name}[{index}] must be a dict with {key!r}, got {type(entry).__name__}")
    if key not in entry:
        raise ValueError(f"{name}[{index}] has no {key!r}")
    return entry[key]


def _numbers(value: object, field: str) -> np.ndarray:
    """``value`` as a float64 array of finite numbers; strings, ragged lists and NaN or inf are refused."""
    if isinstance(value, str | bytes):
        raise ValueError(f"{field} must be numbers, got a string: {value!r:.40}")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as error:  # ragged nested lists
        raise ValueError(f"{field} must be a rectangular array of numbers: {error}") from None
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{field} must be numbers, got an array of dtype {array.dtype}")
    array = array.astype(np.float64)
    finite = np.isfinite(array)
    if not finite.all():
        position = tuple(int(i) for i in np.argwhere(~finite)[0])
        where = ", ".join(map(str, position))
        raise ValueError(f"{field} must be finite; {field}[{where}] is {array[position]}")
    return array


def _boxes(value: object, field: str) -> np.ndarray:
    """``(N, 6)`` boxes; an empty sequence (``[]``) is no boxes, but a flat list of numbers is not a box list."""
    boxes = _numbers(value, field)
    if boxes.shape == (0,):
        return boxes.reshape(0, 6)
    if boxes.ndim != 2 or boxes.shape[1] != 6:
        hint = ": wrap a single box as [[z0, y0, x0, z1, y1, x1]]" if boxes.ndim == 1 else ""
        raise ValueError(f"{field} must have shape (N, 6), got {boxes.shape}{hint}")
    inverted = (boxes[:, 3:] <= boxes[:, :3]).any(axis=1)
    if inverted.any():
        j = int(np.flatnonzero(inverted)[0])
        raise ValueError(
            f"{field}[{j}] = {boxes[j].tolist()} is an empty or inverted box (end-exclusive: z1 > z0, y1 > y0, x1 > x0)"
        )
    return boxes


def _scores(value: object, field: str) -> np.ndarray:
    scores = _numbers(value, field)
    if scores.ndim != 1:
        raise ValueError(f"{field} must have shape (N,), got {scores.shape}")
    return scores


def _max_detections(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"max_detections must be an integer >= 1, got {value!r}")
    return int(value)


def _score_threshold(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) or np.isnan(value):
        raise ValueError(f"f1_score_threshold must be None or a number, got {value!r}")
    return float(value)


def box_iou(boxes1: np.ndarray, boxes2: np.ndarray) -> np.ndarray:
    """Pairwise IoU of corner boxes ``(N, 2d)`` × ``(M, 2d)`` in float64. MONAI's float32 ``box_iou`` with an
    epsilon puts an IoU exactly on a COCO threshold (3/5 with voxel boxes) on either side; pycocotools counts it."""
    dims = boxes1.shape[1] // 2
    low = np.maximum(boxes1[:, None, :dims], boxes2[None, :, :dims])
    high = np.minimum(boxes1[:, None, dims:], boxes2[None, :, dims:])
    intersection = np.prod(np.clip(high - low, 0, None), axis=-1)
    volume1 = np.prod(boxes1[:, dims:] - boxes1[:, :dims], axis=-1)
    volume2 = np.prod(boxes2[:, dims:] - boxes2[:, :dims], axis=-1)
    return intersection / (volume1[:, None] + volume2[None, :] - intersection)


def _f1(hits: list[np.ndarray], scores: list[np.ndarray], num_targets: int, score_threshold: float | None) -> float:
    """F1 of pooled predictions at IoU 0.5: at ``score_threshold``, or the best over thresholds."""
    hits_all, scores_all = np.concatenate(hits).astype(bool), np.concatenate(scores)
    if score_threshold is not None:
        kept = scores_all >= score_threshold
        return 100.0 * 2 * hits_all[kept].sum() / (kept.sum() + num_targets)
    order = np.argsort(-scores_all, kind="mergesort")
    true_positives = np.cumsum(hits_all[order])
    kept = np.arange(1, len(order) + 1)
    # a threshold keeps all tied scores or none: evaluate only after the last of each run of equal scores
    ends = np.append(np.diff(scores_all[order]) != 0, True) if len(order) else np.zeros(0, bool)
    f1 = 2 * true_positives[ends] / (kept[ends] + num_targets)
    return 100.0 * float(f1.max(initial=0.0))


def _localization_accuracy(hits: list[np.ndarray], num_targets: list[int]) -> float:
    localized = sum(int(h[:k].sum()) for h, k in zip(hits, num_targets, strict=True))
    return 100.0 * localized / sum(num_targets)
