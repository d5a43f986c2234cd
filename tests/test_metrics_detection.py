"""Detection metrics: MONAI's 3D COCO evaluation equals pycocotools where 3D IoU equals 2D IoU, and known values."""

from __future__ import annotations

import numpy as np
import pytest

from gx_ray.metrics import DETECTION_METRICS, detection_metrics, detection_metrics_axial
from gx_ray.metrics.detection import match_detections, summarise_matches

BOTH = [detection_metrics, detection_metrics_axial]


def _boxes(rng: np.random.Generator, count: int, z_range=(4, 12)) -> np.ndarray:
    """Integer ``(z0, y0, x0, z1, y1, x1)`` boxes that all span ``z_range``."""
    y0, x0 = rng.integers(0, 48, count), rng.integers(0, 48, count)
    height, width = rng.integers(2, 16, count), rng.integers(2, 16, count)
    z0, z1 = np.full(count, z_range[0]), np.full(count, z_range[1])
    return np.stack([z0, y0, x0, z1, y0 + height, x0 + width], axis=1)


def predictions_and_targets(seed: int, images: int = 15, targets_per_image: int | None = None):
    """Targets (0-3 per image unless fixed), predictions = jittered targets (some IoUs exactly on COCO
    thresholds) + clutter."""
    rng = np.random.default_rng(seed)
    predictions, targets = [], []
    for _ in range(images):
        truth = _boxes(rng, targets_per_image if targets_per_image is not None else int(rng.integers(0, 4)))
        jittered = truth + rng.integers(-2, 3, truth.shape) * np.array([0, 1, 1, 0, 1, 1])
        jittered[:, 4:] = np.maximum(jittered[:, 4:], jittered[:, 1:3] + 1)
        boxes = np.concatenate([jittered, _boxes(rng, int(rng.integers(0, 4)))])
        scores = np.round(rng.random(len(boxes)), 1)  # coarse: ties across images too
        predictions.append({"boxes": boxes, "scores": scores})
        targets.append({"boxes": truth})
    return predictions, targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_monai_3d_equals_pycocotools_axial_when_z_ranges_coincide(seed):
    predictions, targets = predictions_and_targets(seed)
    three_d = detection_metrics(predictions, targets)
    axial = detection_metrics_axial(predictions, targets)
    assert set(three_d) == set(DETECTION_METRICS)
    assert 0 < three_d["map_50_95"] < three_d["ap_50"] < 100  # a non-trivial case
    for name in DETECTION_METRICS:
        assert three_d[name] == pytest.approx(axial[name], abs=1e-9), name


def test_iou_exactly_on_a_threshold_counts_as_reaching_it_in_both():
    target = np.array([[0, 0, 0, 3, 10, 10]])
    for width in range(5, 11):  # IoU 0.5, 0.6, ..., 1.0 exactly
        prediction = [{"boxes": np.array([[0, 0, 0, 3, 10, width]]), "scores": np.array([0.9])}]
        three_d = detection_metrics(prediction, [{"boxes": target}])
        assert three_d == pytest.approx(detection_metrics_axial(prediction, [{"boxes": target}]))
    assert three_d["map_50_95"] == pytest.approx(100.0)


def _hand_built():
    """Image A: one perfect hit (score 0.9). Image B: a miss (0.8), then a hit with IoU 100/160 = 0.625 (0.7)."""
    target_a, target_b = np.array([[0, 0, 0, 4, 10, 10]]), np.array([[0, 20, 20, 4, 30, 30]])
    predictions = [
        {"boxes": target_a, "scores": np.array([0.9])},
        {"boxes": np.array([[0, 40, 40, 4, 50, 50], [0, 20, 20, 4, 36, 30]]), "scores": np.array([0.8, 0.7])},
    ]
    return predictions, [{"boxes": target_a}, {"boxes": target_b}]


@pytest.mark.parametrize("metric_fn", BOTH)
def test_hand_built_case(metric_fn):
    predictions, targets = _hand_built()
    # ranked TP, FP, TP of 2 targets: precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1; COCO's 101-point
    # interpolation gives precision 1 at the 51 recall points <= 0.5 and 2/3 at the 50 above
    ap_hit = 100 * (51 + 50 * 2 / 3) / 101
    # from IoU 0.65 on, image B's hit is a miss: precision 1 up to recall 0.5, nothing above
    ap_miss = 100 * 51 / 101
    expected = {
        "ap_50": ap_hit,
        "ap_75": ap_miss,
        "map_50_95": (3 * ap_hit + 7 * ap_miss) / 10,  # thresholds 0.50, 0.55, 0.60 <= 0.625
        "f1_50": 80.0,  # best cut keeps all three: 2 * 2 / (3 + 2)
        "loc_acc_50": 50.0,  # A's top box hits, B's top box misses
    }
    assert metric_fn(predictions, targets) == pytest.approx(expected)
    assert metric_fn(predictions, targets, f1_score_threshold=0.75)["f1_50"] == pytest.approx(50.0)  # 2*1/(2+2)
    assert metric_fn(predictions, targets, max_detections=1)["ap_50"] == pytest.approx(100 * 51 / 101)


@pytest.mark.parametrize("metric_fn", BOTH)
def test_perfect_empty_and_undefined(metric_fn):
    _, targets = predictions_and_targets(3)
    perfect = [{"boxes": t["boxes"], "scores": np.linspace(1, 0.5, len(t["boxes"]))} for t in targets]
    assert metric_fn(perfect, targets) == pytest.approx(dict.fromkeys(DETECTION_METRICS, 100.0))
    empty = [{"boxes": np.zeros((0, 6)), "scores": np.zeros(0)} for _ in targets]
    assert metric_fn(empty, targets) == dict.fromkeys(DETECTION_METRICS, 0.0)
    no_targets = metric_fn(perfect, [{"boxes": np.zeros((0, 6))} for _ in targets])
    assert all(np.isnan(value) for value in no_targets.values())


@pytest.mark.parametrize("metric_fn", BOTH)
def test_localization_accuracy_looks_at_as_many_top_predictions_as_targets(metric_fn):
    targets_a = np.array([[0, 0, 0, 2, 10, 10], [0, 30, 30, 2, 40, 40]])
    miss = np.array([[0, 60, 60, 2, 70, 70]])
    # image A, 2 targets: its top 2 are a miss (0.95) and a hit (0.9); the second hit (0.8) comes too late
    # image B, 1 target: its top prediction hits
    predictions = [
        {"boxes": np.concatenate([miss, targets_a]), "scores": np.array([0.95, 0.9, 0.8])},
        {"boxes": targets_a[:1], "scores": np.array([0.5])},
    ]
    result = metric_fn(predictions, [{"boxes": targets_a}, {"boxes": targets_a[:1]}])
    assert result["loc_acc_50"] == pytest.approx(100 * 2 / 3)


def test_3d_iou_uses_z():
    target = np.array([[0, 10, 10, 4, 20, 20]])
    shifted_in_z = [{"boxes": np.array([[6, 10, 10, 10, 20, 20]]), "scores": np.array([1.0])}]
    assert detection_metrics(shifted_in_z, [{"boxes": target}])["ap_50"] == 0.0
    assert detection_metrics_axial(shifted_in_z, [{"boxes": target}])["ap_50"] == pytest.approx(100.0)


def test_monai_coco_metric_agrees_when_recalls_are_exact_in_float32():
    """MONAI's COCOMetric counts true positives in float32; with a power-of-two number of targets every recall
    k/16 is exact in float32, and its AP must then equal ours (elsewhere it may be off by a recall step)."""
    from monai.apps.detection.metrics.coco import COCOMetric
    from monai.apps.detection.metrics.matching import matching_batch

    from gx_ray.metrics.detection import COCO_IOU_THRESHOLDS, box_iou

    predictions, targets = predictions_and_targets(4, images=8, targets_per_image=2)
    ours = detection_metrics(predictions, targets)
    coco = COCOMetric(
        ["lesion"], iou_list=(0.5, 0.75), iou_range=(0.5, 0.95, 0.05), max_detection=(100,), verbose=False
    )
    xyz = [2, 1, 0, 5, 4, 3]
    matched = matching_batch(
        iou_fn=box_iou,
        iou_thresholds=COCO_IOU_THRESHOLDS,
        pred_boxes=[p["boxes"][:, xyz].astype(float) for p in predictions],
        pred_classes=[np.zeros(len(p["boxes"]), int) for p in predictions],
        pred_scores=[p["scores"] for p in predictions],
        gt_boxes=[t["boxes"][:, xyz].astype(float) for t in targets],
        gt_classes=[np.zeros(len(t["boxes"]), int) for t in targets],
    )
    monai = coco(matched)[0]
    assert 0 < ours["ap_50"] < 100
    assert ours["ap_50"] == pytest.approx(100 * monai["AP_IoU_0.50_MaxDet_100"], abs=1e-9)
    assert ours["ap_75"] == pytest.approx(100 * monai["AP_IoU_0.75_MaxDet_100"], abs=1e-9)
    assert ours["map_50_95"] == pytest.approx(100 * monai["mAP_IoU_0.50_0.95_0.05_MaxDet_100"], abs=1e-9)


def test_rejects_malformed_input():
    with pytest.raises(ValueError, match="inverted"):
        detection_metrics([{"boxes": [[0, 5, 0, 1, 4, 1]], "scores": [1.0]}], [{"boxes": [[0, 0, 0, 1, 1, 1]]}])
    with pytest.raises(ValueError, match="scores"):
        detection_metrics([{"boxes": [[0, 0, 0, 1, 1, 1]], "scores": []}], [{"boxes": [[0, 0, 0, 1, 1, 1]]}])
    with pytest.raises(ValueError, match="one per image"):
        detection_metrics_axial([], [{"boxes": [[0, 0, 0, 1, 1, 1]]}])


def test_equivalent_input_forms_give_identical_results():
    """Lists, float32 and ``[]`` for an image without boxes are the same valid input as float64 (K, 6) arrays."""
    predictions, targets = predictions_and_targets(5)
    targets[0], predictions[1] = {"boxes": np.zeros((0, 6))}, {"boxes": np.zeros((0, 6)), "scores": np.zeros(0)}
    as_lists = [{"boxes": p["boxes"].tolist(), "scores": p["scores"].tolist()} for p in predictions]
    as_lists_targets = [{"boxes": t["boxes"].tolist()} for t in targets]
    assert as_lists_targets[0] == {"boxes": []} and as_lists[1] == {"boxes": [], "scores": []}
    as_float32 = [{"boxes": p["boxes"].astype(np.float32), "scores": p["scores"]} for p in predictions]
    for metric_fn in BOTH:
        reference = metric_fn(predictions, targets)
        assert metric_fn(as_lists, as_lists_targets) == reference
        assert metric_fn(as_float32, targets) == reference
        assert metric_fn(tuple(predictions), tuple(targets), max_detections=np.int64(100)) == reference


_BOX = [0, 0, 0, 4, 10, 10]
_GOOD = {"boxes": [_BOX], "scores": [0.9]}


def _inputs(prediction=None, target=None):
    """Two images; the second image's prediction or target replaced."""
    return [_GOOD, _GOOD if prediction is None else prediction], [{"boxes": [_BOX]}, target or {"boxes": [_BOX]}]


@pytest.mark.parametrize("metric_fn", [detection_metrics, detection_metrics_axial, match_detections])
@pytest.mark.parametrize(
    "inputs, message",
    [
        (_inputs({"boxes": [[0, 0, 0, 4, 10, np.nan]], "scores": [0.9]}), r"predictions\[1\]\.boxes\[0, 5\] is nan"),
        (_inputs({"boxes": [_BOX], "scores": [np.nan]}), r"predictions\[1\]\.scores\[0\] is nan"),
        (_inputs({"boxes": [_BOX, [0, 0, np.inf, 4, 10, 10]], "scores": [0.9, 0.8]}), r"boxes\[1, 2\] is inf"),
        (_inputs(target={"boxes": [[0, 0, 0, 4, 10, np.inf]]}), r"targets\[1\]\.boxes\[0, 5\] is inf"),
        (_inputs(target={"boxes": [[-np.inf, 0, 0, 4, 10, 10]]}), r"targets\[1\]\.boxes\[0, 0\] is -inf"),
        (_inputs({"boxes": [_BOX], "scores": [np.inf]}), r"predictions\[1\]\.scores\[0\] is inf"),
        (_inputs({"boxes": "000410", "scores": [0.9]}), r"predictions\[1\]\.boxes must be numbers, got a string"),
        (_inputs({"boxes": [_BOX], "scores": "0.9"}), r"predictions\[1\]\.scores must be numbers, got a string"),
        (_inputs({"boxes": [[str(v) for v in _BOX]], "scores": [0.9]}), r"predictions\[1\]\.boxes must be numbers"),
        (_inputs({"boxes": _BOX + _BOX, "scores": [0.9, 0.8]}), r"predictions\[1\]\.boxes .*\(N, 6\), got \(12,\)"),
        (_inputs({"boxes": _BOX, "scores": [0.9]}), r"predictions\[1\]\.boxes .*\(N, 6\), got \(6,\)"),
        (_inputs(target={"boxes": _BOX}), r"targets\[1\]\.boxes .*\(N, 6\), got \(6,\)"),
        (_inputs({"boxes": [_BOX[:4], _BOX[2:]], "scores": [0.9, 0.8]}), r"predictions\[1\]\.boxes .*got \(2, 4\)"),
        (_inputs({"boxes": [_BOX, _BOX[:4]], "scores": [0.9, 0.8]}), r"predictions\[1\]\.boxes must be a rectangular"),
        (_inputs({"boxes": [_BOX], "scores": [[0.9]]}), r"predictions\[1\]\.scores .*\(N,\), got \(1, 1\)"),
        (_inputs({"boxes": [_BOX], "scores": 0.9}), r"predictions\[1\]\.scores .*\(N,\), got \(\)"),
        (_inputs({"boxes": [_BOX], "scores": [0.9, 0.8]}), r"image 1: 1 predicted boxes but 2 scores"),
        (_inputs({"boxes": [[0, 5, 0, 4, 4, 10]], "scores": [0.9]}), r"predictions\[1\]\.boxes\[0\] .* inverted"),
        (_inputs({"boxes": [_BOX]}), r"predictions\[1\] has no 'scores'"),
        (_inputs("boxes"), r"predictions\[1\] must be a dict"),
        (("predictions", "targets"), r"predictions must be a sequence of dicts"),
        (([_GOOD], {"boxes": [_BOX]}), r"targets must be a sequence of dicts"),
    ],
)
def test_rejects_invalid_boxes_and_scores_naming_the_field(metric_fn, inputs, message):
    with pytest.raises(ValueError, match=message):
        metric_fn(*inputs)


@pytest.mark.parametrize("metric_fn", [detection_metrics, detection_metrics_axial, match_detections])
@pytest.mark.parametrize("max_detections", [-1, 0, 1.5, 100.0, True, "100", None])
def test_max_detections_must_be_a_positive_integer(metric_fn, max_detections):
    predictions, targets = _inputs()
    with pytest.raises(ValueError, match=r"max_detections must be an integer >= 1"):
        metric_fn(predictions, targets, max_detections=max_detections)


def test_summarise_matches_checks_its_settings():
    matches = match_detections(*_inputs())
    assert summarise_matches(matches, max_detections=1)["ap_50"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match=r"max_detections must be an integer >= 1"):
        summarise_matches(matches, max_detections=0)
    with pytest.raises(ValueError, match=r"f1_score_threshold must be None or a number"):
        summarise_matches(matches, f1_score_threshold=float("nan"))
