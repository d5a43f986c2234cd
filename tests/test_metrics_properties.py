"""Property tests: every metric function against independent references on hundreds of seeded random cases.

Each case is drawn from ``np.random.default_rng([SEED, i])``, so a failure names a case that can be rebuilt
alone. The cases deliberately include the corners where implementations part ways: ties (in probabilities,
similarities, detection scores and IoUs exactly on a COCO threshold), absent classes, single-class label sets,
empty images, empty reports and identical prediction/reference corpora.

References:

* classification: scikit-learn (``precision_recall_fscore_support`` with ``labels=np.unique(y_true)``,
  ``roc_auc_score``), as the module documents for absent classes.
* retrieval: a one-query-at-a-time ranking written here, and torchmetrics' retrieval metrics (with ``indexes``).
* detection: a brute-force COCO AP / F1 / localization accuracy on 3D boxes written here from the module's
  documented definitions, and pycocotools' own ``COCOeval`` end to end on axial (2D) cases.
* text: a brute-force corpus BLEU (Papineni et al. 2002), torchmetrics' BLEU, nltk's ``corpus_bleu``, rouge-score
  on the raw text, a brute-force LCS ROUGE-L, and nltk's ``meteor_score``, all on tokens known by construction
  (the random texts are rendered from token lists), so the module's tokenizer is checked too.

BERTScore against the ``bert-score`` package is in test_metrics_bertscore.py (30 random corpora); the encoder
is too slow for hundreds more here. No CIDEr: the module does not compute it.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from gx_ray.metrics import (
    CLASSIFICATION_METRICS,
    DETECTION_METRICS,
    RETRIEVAL_METRICS,
    classification_metrics,
    detection_metrics,
    detection_metrics_axial,
    retrieval_metrics,
    text_generation_metrics,
)
from gx_ray.metrics.detection import average_precision_of_matches, match_detections, summarise_matches
from gx_ray.metrics.text import _NoStemming, _NoSynonyms

SEED = 20260


def _rng(section: int, case: int) -> np.random.Generator:
    return np.random.default_rng([SEED, section, case])


def _same(ours: float, expected: float, tolerance: float = 1e-9) -> bool:
    """Equal within ``tolerance`` (percent points), or both NaN."""
    if math.isnan(ours) or math.isnan(expected):
        return math.isnan(ours) and math.isnan(expected)
    return abs(ours - expected) <= tolerance


# --------------------------------------------------------------------------------------------------------------
# classification_metrics vs scikit-learn

CLASSIFICATION_CASES = 300


def _classification_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random ``(N, C)`` probabilities and labels: C in 2-8, N in 1-200, labels drawn from a random subset of
    the classes (absent classes; one class only in about one case in eight), probabilities with many ties."""
    num_classes, n = int(rng.integers(2, 9)), int(rng.integers(1, 201))
    present = rng.choice(num_classes, size=int(rng.integers(1, num_classes + 1)), replace=False)
    labels = rng.choice(present, n)
    if rng.random() < 0.4:  # small integer weights: ties everywhere, in AUC ranks and in the arg-max
        weights = rng.integers(0, 4, (n, num_classes)).astype(np.float64)
        weights[weights.sum(axis=1) == 0] = 1.0
        return weights / weights.sum(axis=1, keepdims=True), labels
    logits = rng.normal(size=(n, num_classes)) + rng.uniform(0, 3) * np.eye(num_classes)[labels]
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    if rng.random() < 0.5:  # rounded: ties, and rows that no longer sum to exactly 1
        probabilities = np.round(probabilities, int(rng.integers(1, 3)))
    return probabilities, labels


def _sklearn_classification(probabilities: np.ndarray, labels: np.ndarray, average: str) -> dict[str, float]:
    from sklearn.metrics import accuracy_score, precision_recall_fscore_support, roc_auc_score

    # the module's documented prediction: the arg-max column (numpy's, the first of tied maxima)
    predictions = probabilities.argmax(axis=1)
    present = np.unique(labels)
    if average == "binary":
        # sklearn's binary: class 1 positive; with class 1 absent its recall is 0/0, zero_division gives 0
        scores = precision_recall_fscore_support(labels, predictions, average="binary", zero_division=0)[:3]
        auc = roc_auc_score(labels, probabilities[:, 1]) if len(present) == 2 else np.nan
    else:
        # the module's documented rule for absent classes: average over the classes present in labels
        scores = precision_recall_fscore_support(labels, predictions, labels=present, average=average, zero_division=0)
        scores = scores[:3]
        if len(present) < 2:
            auc = np.nan  # one-vs-rest AUC needs both kinds of sample
        else:
            per_class = [roc_auc_score(labels == k, probabilities[:, k]) for k in present]
            support = np.bincount(labels)[present]
            auc = np.average(per_class, weights=support if average == "weighted" else None)
    precision, recall, f1 = scores
    accuracy = accuracy_score(labels, predictions)
    return {
        name: 100 * float(value)
        for name, value in zip(CLASSIFICATION_METRICS, (precision, recall, f1, accuracy, auc), strict=True)
    }


def test_classification_equals_sklearn_on_random_cases():
    from sklearn.metrics import roc_auc_score

    compared = Counter()
    for case in range(CLASSIFICATION_CASES):
        probabilities, labels = _classification_case(_rng(1, case))
        num_classes, present = probabilities.shape[1], np.unique(labels)
        averages = ["macro", "weighted"] + (["binary"] if num_classes == 2 else [])
        for average in averages:
            ours = classification_metrics(probabilities, labels, average=average)
            expected = _sklearn_classification(probabilities, labels, average)
            assert list(ours) == list(CLASSIFICATION_METRICS)
            for name in CLASSIFICATION_METRICS:
                assert _same(ours[name], expected[name]), (case, average, name, ours[name], expected[name])
            compared[average] += 1
        compared["absent class"] += len(present) < num_classes
        compared["single class (AUC NaN)"] += len(present) == 1
        # sklearn's own multi-class one-vs-rest AUC, where it applies (all classes present, rows summing to 1)
        if len(present) == num_classes > 2 and np.allclose(probabilities.sum(axis=1), 1):
            for average in ("macro", "weighted"):
                expected_auc = 100 * roc_auc_score(labels, probabilities, multi_class="ovr", average=average)
                assert _same(classification_metrics(probabilities, labels, average)["auc"], expected_auc), case
            compared["sklearn multi_class='ovr'"] += 1
    # the generator reached every corner it is meant to
    assert compared["macro"] == CLASSIFICATION_CASES and compared["binary"] >= 20
    assert compared["absent class"] >= 100 and compared["single class (AUC NaN)"] >= 20
    assert compared["sklearn multi_class='ovr'"] >= 20


def test_classification_is_invariant_to_sample_order_and_nan_only_without_two_classes():
    for case in range(100):
        rng = _rng(2, case)
        probabilities, labels = _classification_case(rng)
        order = rng.permutation(len(labels))
        ours = classification_metrics(probabilities, labels)
        shuffled = classification_metrics(probabilities[order], labels[order])
        for name in CLASSIFICATION_METRICS:
            assert _same(ours[name], shuffled[name], 1e-9), (case, name)
        assert math.isnan(ours["auc"]) == (len(np.unique(labels)) < 2), case
        assert all(not math.isnan(ours[name]) for name in CLASSIFICATION_METRICS if name != "auc"), case
        assert all(0 <= value <= 100 for value in ours.values() if not math.isnan(value)), case


@pytest.mark.parametrize("num_classes", range(1, 9))
def test_classification_refuses_empty_input(num_classes):
    with pytest.raises(ValueError, match="no samples"):
        classification_metrics(np.zeros((0, num_classes)), np.zeros(0, dtype=int))


def test_classification_refuses_nan_and_inf_wherever_they_are():
    for case in range(50):
        rng = _rng(3, case)
        probabilities, labels = _classification_case(rng)
        row, column = int(rng.integers(probabilities.shape[0])), int(rng.integers(probabilities.shape[1]))
        bad = probabilities.copy()
        bad[row, column] = rng.choice([np.nan, np.inf, -np.inf])
        first = tuple(int(i) for i in np.argwhere(~np.isfinite(bad))[0])
        with pytest.raises(ValueError, match=rf"probabilities\[{first[0]}, {first[1]}\] is -?(nan|inf)"):
            classification_metrics(bad, labels)


# --------------------------------------------------------------------------------------------------------------
# retrieval_metrics vs a one-query-at-a-time ranking and torchmetrics

RETRIEVAL_CASES = 300


def _retrieval_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """Random ``(Q, G)`` similarities (Q 1-30, G 1-40), integer-valued (many ties) or continuous, and positives:
    the diagonal (``None``), or random with several per query and some queries with none."""
    queries, gallery = int(rng.integers(1, 31)), int(rng.integers(1, 41))
    if rng.random() < 0.25:
        gallery = queries  # square: the diagonal default applies
    if rng.random() < 0.6:
        similarity = rng.integers(-2, int(rng.integers(-1, 5)), (queries, gallery)).astype(np.float64)
    else:
        similarity = rng.normal(size=(queries, gallery))
    if queries == gallery and rng.random() < 0.5:
        return similarity, None
    positives = rng.random((queries, gallery)) < rng.uniform(0.02, 0.4)
    if not positives.any():
        positives[int(rng.integers(queries)), int(rng.integers(gallery))] = True
    return similarity, positives


def _ranking_reference(similarity: np.ndarray, positives: np.ndarray, optimistic: bool = False) -> dict[str, float]:
    """Each query's gallery sorted by Python's ``sorted``: descending similarity, ties between a positive and a
    negative broken against the positive (the module's documented pessimistic rule), or for it."""
    first_ranks, average_precisions = [], []
    for scores, is_positive in zip(similarity.tolist(), positives.tolist(), strict=True):
        if not any(is_positive):
            continue  # documented: queries without a positive are left out
        ranked = sorted(zip(scores, is_positive, strict=True), key=lambda item: (-item[0], item[1] != optimistic))
        hits = [p for _, p in ranked]
        first_ranks.append(hits.index(True) + 1)
        found, precisions = 0, []
        for position, hit in enumerate(hits, start=1):
            if hit:
                found += 1
                precisions.append(found / position)
        average_precisions.append(sum(precisions) / len(precisions))
    return {
        **{f"recall_at_{k}": 100 * float(np.mean([r <= k for r in first_ranks])) for k in (1, 5, 10)},
        "median_rank": float(np.median(first_ranks)),
        "mean_rank": float(np.mean(first_ranks)),
        "map": 100 * float(np.mean(average_precisions)),
        "mrr": 100 * float(np.mean([1 / r for r in first_ranks])),
    }


def _torchmetrics_retrieval(similarity: np.ndarray, positives: np.ndarray) -> dict[str, float]:
    """torchmetrics' HitRate@K (= our recall@K: is any positive in the top K; its RetrievalRecall is instead the
    fraction of all positives in the top K), MAP and MRR, queries without positives skipped as ours are."""
    from torchmetrics.retrieval import RetrievalHitRate, RetrievalMAP, RetrievalMRR

    queries, gallery = similarity.shape
    preds = torch.from_numpy(similarity.ravel().copy())
    target = torch.from_numpy(positives.ravel().copy())
    indexes = torch.arange(queries).repeat_interleave(gallery)
    metrics = {f"recall_at_{k}": RetrievalHitRate(top_k=k, empty_target_action="skip") for k in (1, 5, 10)}
    metrics.update(map=RetrievalMAP(empty_target_action="skip"), mrr=RetrievalMRR(empty_target_action="skip"))
    return {name: 100 * float(metric(preds, target, indexes=indexes)) for name, metric in metrics.items()}


def _pessimistic_scores(similarity: np.ndarray, positives: np.ndarray) -> np.ndarray:
    """Scores ranking as ``similarity`` does, with every positive/negative tie broken against the positive, and all
    > 0: torchmetrics 1.9's retrieval functions drop positives scored <= 0 (``target = where(preds > 0, ...)``;
    https://github.com/Lightning-AI/torchmetrics/pull/3104 makes that the documented rule), which cosine
    similarities routinely are. torchmetrics leaves the order of tied scores to ``torch.topk``/``argsort``."""
    dense_rank = np.stack([np.unique(row, return_inverse=True)[1] for row in similarity])  # 0 = least similar
    return 2.0 * dense_rank + 2.0 - positives  # a tied positive lands between its negatives and the next lower score


def test_retrieval_equals_ranking_reference_and_torchmetrics_on_random_cases():
    compared = Counter()
    for case in range(RETRIEVAL_CASES):
        similarity, positives = _retrieval_case(_rng(4, case))
        ours = retrieval_metrics(similarity, positives)
        if positives is None:
            positives = np.eye(len(similarity), dtype=bool)
            compared["diagonal default"] += 1
        assert list(ours) == list(RETRIEVAL_METRICS)
        pessimistic = _ranking_reference(similarity, positives)
        for name in RETRIEVAL_METRICS:
            assert ours[name] == pytest.approx(pessimistic[name], abs=1e-9), (case, name)

        # torchmetrics, given the same tie-breaking as explicit scores, computes the same numbers
        answerable = positives.any(axis=1)
        untied = _torchmetrics_retrieval(_pessimistic_scores(similarity, positives), positives)
        for name in ("recall_at_1", "recall_at_5", "recall_at_10", "map"):
            assert ours[name] == pytest.approx(untied[name], abs=1e-4), (case, name)  # torchmetrics' float32
        one_positive_each = (positives[answerable].sum(axis=1) == 1).all()
        if one_positive_each:  # documented: mAP is then the mean reciprocal rank
            assert ours["map"] == pytest.approx(untied["mrr"], abs=1e-4), case
            compared["map = mrr"] += 1

        # on the raw, tied scores torchmetrics orders ties its own way: never better than the optimistic
        # ranking, never worse than ours (pessimistic); without ties all three coincide
        shifted = similarity - similarity.min() + 1.0  # > 0, same order (see _pessimistic_scores)
        raw = _torchmetrics_retrieval(shifted, positives)
        optimistic = _ranking_reference(similarity, positives, optimistic=True)
        ties = any(len(np.unique(row)) < len(row) for row in similarity)
        compared["with ties"] += ties
        for name in ("recall_at_1", "recall_at_5", "recall_at_10", "map", "mrr"):
            assert pessimistic[name] - 1e-4 <= raw[name] <= optimistic[name] + 1e-4, (case, name)
            if not ties:
                assert raw[name] == pytest.approx(pessimistic[name], abs=1e-4), (case, name)
    assert compared["with ties"] >= 100 and compared["diagonal default"] >= 20 and compared["map = mrr"] >= 30


def test_retrieval_is_invariant_to_gallery_order_and_refuses_unanswerable_input():
    for case in range(100):
        rng = _rng(5, case)
        similarity, positives = _retrieval_case(rng)
        positives = np.eye(len(similarity), dtype=bool) if positives is None else positives
        columns = rng.permutation(similarity.shape[1])
        assert retrieval_metrics(similarity[:, columns], positives[:, columns]) == pytest.approx(
            retrieval_metrics(similarity, positives), abs=1e-9
        ), case
        with pytest.raises(ValueError, match="no query has a positive"):
            retrieval_metrics(similarity, np.zeros_like(positives))
        constant = retrieval_metrics(np.zeros_like(similarity), positives)  # every tie against the positives
        infinite = similarity.copy()  # only NaN is refused: +-inf rank first or last, and tie among themselves
        mask = rng.random(similarity.shape) < 0.2
        infinite[mask] = rng.choice([np.inf, -np.inf], int(mask.sum()))
        assert retrieval_metrics(infinite, positives) == pytest.approx(
            {name: value for name, value in _ranking_reference(infinite, positives).items() if name != "mrr"}, abs=1e-9
        ), case
        first_ranks = [similarity.shape[1] - row.sum() + 1 for row in positives if row.any()]
        assert constant["mean_rank"] == pytest.approx(np.mean(first_ranks)), case


# --------------------------------------------------------------------------------------------------------------
# detection_metrics vs a brute-force COCO evaluation of 3D boxes, and pycocotools end to end on axial cases

DETECTION_CASES = 400
AXIAL_CASES = 150
# pycocotools' thresholds, as floats: both the IoU thresholds 0.50:0.95 and the 101 recall points are compared
# as these floats, not as the decimals they print as. It matters for the recall points: 0.70 is stored as
# 0.7000000000000001, so a recall of exactly 7/10 does not reach it (and COCO takes the precision at the next
# higher recall there). The module documents pycocotools' accumulation, so the brute force follows the floats.
IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10).tolist()
RECALL_POINTS = np.linspace(0.0, 1.0, 101).tolist()


def _random_box(rng: np.random.Generator, flat_z: bool) -> list[float]:
    """A box on a coarse half-voxel grid, so that overlaps are common and IoUs often land exactly on a threshold
    (multiples of 0.5 keep every volume exact in float64)."""
    low = rng.integers(0, 12, 3) / 2
    size = rng.integers(1, 9, 3) / 2
    if flat_z:
        low[0], size[0] = 0.0, 2.0
    return [*low.tolist(), *(low + size).tolist()]


def _jittered(rng: np.random.Generator, box: list[float], flat_z: bool) -> list[float]:
    jittered = np.array(box) + rng.integers(-1, 2, 6) / 2
    if flat_z:
        jittered[[0, 3]] = box[0], box[3]
    jittered[3:] = np.maximum(jittered[3:], jittered[:3] + 0.5)
    return jittered.tolist()


def _detection_case(rng: np.random.Generator, flat_z: bool = False) -> tuple[list[dict], list[dict], int, float | None]:
    """1-8 images with 0-5 targets and 0-8 predictions each (near-copies of targets and clutter), scores with
    ties; sometimes no target in any image, sometimes no prediction in any; random max_detections and F1 cut."""
    images = int(rng.integers(1, 9))
    no_targets, no_predictions = rng.random() < 0.06, rng.random() < 0.06
    tied_scores = rng.random() < 0.6
    predictions, targets = [], []
    for _ in range(images):
        truth = [] if no_targets else [_random_box(rng, flat_z) for _ in range(int(rng.integers(0, 6)))]
        boxes = []
        for _ in range(0 if no_predictions else int(rng.integers(0, 9))):
            if truth and rng.random() < 0.6:
                boxes.append(_jittered(rng, truth[int(rng.integers(len(truth)))], flat_z))
            else:
                boxes.append(_random_box(rng, flat_z))
        scores = rng.integers(0, 4, len(boxes)) / 4 if tied_scores else rng.random(len(boxes))
        predictions.append({"boxes": boxes, "scores": scores.tolist()})
        targets.append({"boxes": truth})
    max_detections = int(rng.choice([100, 100, 100, 1, 2, 3, 5]))
    f1_threshold = None if rng.random() < 0.7 else float(rng.choice([0.0, 0.25, 0.5, 0.6, 1.0]))
    return predictions, targets, max_detections, f1_threshold


def _iou(a: list[float], b: list[float]) -> float:
    dims = len(a) // 2
    intersection = volume_a = volume_b = 1.0
    for d in range(dims):
        intersection *= max(0.0, min(a[d + dims], b[d + dims]) - max(a[d], b[d]))
        volume_a *= a[d + dims] - a[d]
        volume_b *= b[d + dims] - b[d]
    return intersection / (volume_a + volume_b - intersection)


def _greedy_hits(boxes: list, targets: list, threshold: float) -> list[bool]:
    """COCO's matching of one image at one IoU threshold: predictions (already in descending score order) each
    take the unmatched target of highest IoU >= threshold; among equal IoUs the later target, as COCO's loop
    (``if iou < best: continue``) does."""
    matched, hits = set(), []
    for box in boxes:
        best, best_iou = None, threshold
        for j, target in enumerate(targets):
            if j in matched:
                continue
            iou = _iou(box, target)
            if iou >= best_iou:
                best, best_iou = j, iou
        if best is not None:
            matched.add(best)
        hits.append(best is not None)
    return hits


def _brute_force_detection(
    predictions: list[dict], targets: list[dict], max_detections: int, f1_threshold: float | None
) -> dict[str, float]:
    """The module's documented definitions, from scratch: COCO AP at 101 recall points per IoU threshold, pooled
    over images; F1@0.5 best over (or at) a score threshold; localization accuracy of each image's top k."""
    num_targets = sum(len(t["boxes"]) for t in targets)
    if num_targets == 0:
        return dict.fromkeys(DETECTION_METRICS, math.nan)  # documented: undefined without targets
    kept = []  # per image: the top max_detections (stable descending score order, as COCO sorts) and scores
    for prediction in predictions:
        order = sorted(range(len(prediction["scores"])), key=lambda j: -prediction["scores"][j])[:max_detections]
        kept.append(([prediction["boxes"][j] for j in order], [prediction["scores"][j] for j in order]))

    def pooled_hits(threshold: float) -> list[tuple[float, bool]]:
        # images in order, each in its score order, then a stable sort on score: COCO's tie order across images
        pooled = []
        for (boxes, scores), target in zip(kept, targets, strict=True):
            pooled += zip(scores, _greedy_hits(boxes, target["boxes"], threshold), strict=True)
        return sorted(pooled, key=lambda item: -item[0])

    def average_precision(threshold: float) -> float:
        true_positives, points = 0, []  # (recall, precision) after each prediction
        for rank, (_, hit) in enumerate(pooled_hits(threshold), start=1):
            true_positives += hit
            points.append((true_positives / num_targets, true_positives / rank))
        interpolated = [max((p for r, p in points if r >= point), default=0.0) for point in RECALL_POINTS]
        return 100 * sum(interpolated) / len(interpolated)

    ap = [average_precision(t) for t in IOU_THRESHOLDS]
    at_50 = pooled_hits(IOU_THRESHOLDS[0])
    # at the given threshold, or at every distinct score and one above them all (no prediction kept: F1 0)
    cuts = [f1_threshold] if f1_threshold is not None else sorted({score for score, _ in at_50}) + [math.inf]
    f1 = max(
        200 * sum(hit for score, hit in at_50 if score >= cut) / (sum(score >= cut for score, _ in at_50) + num_targets)
        for cut in cuts
    )
    localized = sum(
        sum(_greedy_hits(boxes[: len(target["boxes"])], target["boxes"], IOU_THRESHOLDS[0]))
        for (boxes, _), target in zip(kept, targets, strict=True)
    )
    return {
        "ap_50": ap[0],
        "ap_75": ap[IOU_THRESHOLDS.index(0.75)],
        "f1_50": f1,
        "map_50_95": sum(ap) / len(ap),
        "loc_acc_50": 100 * localized / num_targets,
    }


def test_detection_equals_brute_force_coco_on_random_3d_cases():
    compared = Counter()
    for case in range(DETECTION_CASES):
        predictions, targets, max_detections, f1_threshold = _detection_case(_rng(6, case))
        ours = detection_metrics(predictions, targets, max_detections, f1_threshold)
        expected = _brute_force_detection(predictions, targets, max_detections, f1_threshold)
        assert list(ours) == list(DETECTION_METRICS)
        for name in DETECTION_METRICS:
            assert _same(ours[name], expected[name]), (case, name, ours[name], expected[name])
        compared["images"] += len(targets)
        compared["empty images"] += sum(not t["boxes"] for t in targets)
        compared["images without predictions"] += sum(not p["boxes"] for p in predictions)
        compared["no target anywhere (NaN)"] += math.isnan(expected["ap_50"])
        compared["no prediction anywhere"] += all(not p["boxes"] for p in predictions) and not math.isnan(ours["ap_50"])
        compared["0 < AP50 < 100"] += 0 < expected["ap_50"] < 100
        compared["max_detections < 100"] += max_detections < 100

        # the bootstrap's path: matches of resampled images (repeats allowed) give the metrics of that resample
        rng = _rng(7, case)
        draw = rng.integers(0, len(targets), len(targets)).tolist()
        matches = match_detections(predictions, targets, max_detections)
        resampled = summarise_matches([matches[i] for i in draw], max_detections, f1_threshold)
        direct = detection_metrics(
            [predictions[i] for i in draw], [targets[i] for i in draw], max_detections, f1_threshold
        )
        for name in DETECTION_METRICS:
            assert _same(resampled[name], direct[name]), (case, name)
        for name, threshold in (("ap_50", 0.5), ("ap_75", 0.75)):  # the bootstrap's one-threshold headline
            alone = average_precision_of_matches([matches[i] for i in draw], threshold, max_detections)
            assert _same(alone, direct[name]), (case, name, alone, direct[name])
    assert compared["images"] >= 1000 and compared["empty images"] >= 100
    assert compared["images without predictions"] >= 100 and compared["no target anywhere (NaN)"] >= 5
    assert compared["no prediction anywhere"] >= 5 and compared["0 < AP50 < 100"] >= 100
    assert compared["max_detections < 100"] >= 50


def _pycocotools_ap(predictions: list[dict], targets: list[dict], max_detections: int) -> dict[str, float]:
    """pycocotools' own COCOeval end to end (loadRes, evaluate, accumulate) on the axial (y, x) boxes: AP as
    ``summarize`` reports it (area range "all", mean over the entries > -1)."""
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(box: list[float]) -> list[float]:
        _, y0, x0, _, y1, x1 = box
        return [x0, y0, x1 - x0, y1 - y0]

    annotations, detections = [], []
    for image_id, (prediction, target) in enumerate(zip(predictions, targets, strict=True)):
        for box in target["boxes"]:
            bbox = xywh(box)
            annotations.append(
                {"id": len(annotations) + 1, "image_id": image_id, "category_id": 1, "bbox": bbox, "iscrowd": 0}
            )
            annotations[-1]["area"] = bbox[2] * bbox[3]
        for box, score in zip(prediction["boxes"], prediction["scores"], strict=True):
            detections.append({"image_id": image_id, "category_id": 1, "bbox": xywh(box), "score": score})
    with contextlib.redirect_stdout(io.StringIO()):
        ground_truth = COCO()
        ground_truth.dataset = {
            "images": [{"id": i} for i in range(len(targets))],
            "categories": [{"id": 1}],
            "annotations": annotations,
        }
        ground_truth.createIndex()
        evaluation = COCOeval(ground_truth, ground_truth.loadRes(detections), iouType="bbox")
        evaluation.params.maxDets = [max_detections]
        evaluation.evaluate()
        evaluation.accumulate()
    precision = evaluation.eval["precision"][:, :, 0, 0, 0]  # [IoU, recall point], category 1, area "all"
    assert (precision > -1).all()  # there are targets, so every entry is defined

    return {
        "ap_50": 100 * float(precision[0].mean()),
        "ap_75": 100 * float(precision[IOU_THRESHOLDS.index(0.75)].mean()),
        "map_50_95": 100 * float(precision.mean()),
    }


def test_detection_axial_equals_pycocotools_and_3d_on_random_flat_cases():
    """All boxes span z in [0, 2]: 3D IoU equals axial IoU, so the 3D path, the axial path and pycocotools agree."""
    compared = 0
    for case in range(AXIAL_CASES):
        predictions, targets, max_detections, f1_threshold = _detection_case(_rng(8, case), flat_z=True)
        axial = detection_metrics_axial(predictions, targets, max_detections, f1_threshold)
        three_d = detection_metrics(predictions, targets, max_detections, f1_threshold)
        expected = _brute_force_detection(predictions, targets, max_detections, f1_threshold)
        for name in DETECTION_METRICS:
            assert _same(axial[name], three_d[name]) and _same(axial[name], expected[name]), (case, name)
        if any(t["boxes"] for t in targets) and any(p["boxes"] for p in predictions):
            # (pycocotools' loadRes cannot take an empty detection list)
            reference = _pycocotools_ap(predictions, targets, max_detections)
            for name, value in reference.items():
                assert _same(axial[name], value), (case, name, axial[name], value)
            compared += 1
    assert compared >= 100


# --------------------------------------------------------------------------------------------------------------
# text_generation_metrics vs brute-force BLEU and ROUGE-L, torchmetrics, nltk and rouge-score

TEXT_CASES = 300
ENGLISH_WORDS = """
the a stomach gastric wall thickening thickened thick lesion tumor tumour mass large small lymph node nodes enlarged
antrum body fundus cardia invasion invades serosa no evidence of distant metastasis liver ascites irregular ulcer
ulcerated mucosa enhancement enhancing 3 cm ct t3 n1 is seen
""".split()  # noqa: SIM905
CHINESE_WORDS = "胃 胃窦 胃壁 增厚 明显 提示 期 肝 未见 转移 溃疡 淋巴结 肿大 浆膜 侵犯 腹水 小弯侧 病灶".split()  # noqa: SIM905
LATIN_IN_CHINESE = ["CT", "T3", "N1", "3", "cm"]


def _render_english(rng: np.random.Generator, words: list[str]) -> str:
    """Words joined by punctuation and spaces, in random case: its tokens are the lower-cased words."""
    text = ""
    for i, word in enumerate(words):
        word = str(rng.choice([word, word.upper(), word.capitalize()], p=[0.7, 0.1, 0.2]))
        text += ("" if i == 0 else str(rng.choice([" ", " ", ", ", ". ", "; ", "-", " (", ") ", "/"]))) + word
    return str(rng.choice(["", " ", "- "])) + text + str(rng.choice(["", ".", "!", " ;"]))


def _render_chinese(rng: np.random.Generator, words: list[str]) -> str:
    """Chinese words with or without Chinese punctuation between them; a Latin word needs a non-alphanumeric
    separator only where it meets another Latin word."""
    text = ""
    for word in words:
        latin_meets_latin = text[-1:].isascii() and text[-1:].isalnum() and word[0].isascii()
        separator = str(rng.choice(["", "", "，", "。", " "]))
        text += (" " if latin_meets_latin and separator == "" else separator) + word
    return text + str(rng.choice(["", "。"]))


def _tokens_of(words: list[str]) -> list[str]:
    """The tokens the module documents: lower-cased Latin words, one token per CJK ideograph."""
    tokens = []
    for word in words:
        tokens += [word.lower()] if word.isascii() else list(word)
    return tokens


def _text_corpus(
    rng: np.random.Generator, language: str
) -> tuple[list[str], list[str], list[list[str]], list[list[str]]]:
    """A corpus of 1-40 report pairs of 0-30 words: predictions identical, edited (substitute, drop, insert,
    reorder), unrelated or empty; in one corpus in ten every prediction is identical to its reference."""
    vocabulary = ENGLISH_WORDS if language == "en" else CHINESE_WORDS + LATIN_IN_CHINESE
    render = _render_english if language == "en" else _render_chinese
    all_identical = rng.random() < 0.1
    predictions, references, predicted_tokens, reference_tokens = [], [], [], []
    for _ in range(int(rng.integers(1, 41))):
        reference = [str(w) for w in rng.choice(vocabulary, int(rng.integers(0, 31)))]
        kind = "identical" if all_identical else rng.choice(["identical", "edited", "edited", "unrelated", "empty"])
        if kind == "identical":
            prediction = list(reference)
        elif kind == "edited":
            prediction = [str(rng.choice(vocabulary)) if rng.random() < 0.2 else w for w in reference]
            prediction = [w for w in prediction if rng.random() > 0.15]
            for _ in range(int(rng.integers(0, 4))):
                prediction.insert(int(rng.integers(0, len(prediction) + 1)), str(rng.choice(vocabulary)))
            if rng.random() < 0.2:
                rng.shuffle(prediction)
        elif kind == "unrelated":
            prediction = [str(w) for w in rng.choice(vocabulary, int(rng.integers(0, 31)))]
        else:
            prediction = []
        predictions.append(render(rng, prediction))
        references.append(render(rng, reference))
        predicted_tokens.append(_tokens_of(prediction))
        reference_tokens.append(_tokens_of(reference))
    return predictions, references, predicted_tokens, reference_tokens


def _brute_force_bleu(predicted: list[list[str]], reference: list[list[str]]) -> float:
    """Corpus BLEU-4 (Papineni et al. 2002): clipped n-gram counts summed over the corpus, uniform weights,
    brevity penalty on total lengths, no smoothing (0 if any order has no match, or no n-gram at all)."""
    log_precision = 0.0
    for n in range(1, 5):
        matched = total = 0
        for p, r in zip(predicted, reference, strict=True):
            p_ngrams = Counter(tuple(p[i : i + n]) for i in range(len(p) - n + 1))
            r_ngrams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            matched += sum((p_ngrams & r_ngrams).values())
            total += sum(p_ngrams.values())
        if matched == 0:
            return 0.0
        log_precision += math.log(matched / total) / 4
    candidate, reference_length = sum(map(len, predicted)), sum(map(len, reference))
    brevity = 1.0 if candidate > reference_length else math.exp(1 - reference_length / candidate)
    return 100 * brevity * math.exp(log_precision)


def _brute_force_rouge_l(predicted: list[list[str]], reference: list[list[str]]) -> float:
    """Mean over pairs of the LCS F-measure; a pair with an empty side scores 0 (rouge-score's rule)."""
    scores = []
    for p, r in zip(predicted, reference, strict=True):
        if not p or not r:
            scores.append(0.0)
            continue
        lcs = [[0] * (len(r) + 1) for _ in range(len(p) + 1)]
        for i in range(len(p)):
            for j in range(len(r)):
                lcs[i + 1][j + 1] = lcs[i][j] + 1 if p[i] == r[j] else max(lcs[i][j + 1], lcs[i + 1][j])
        precision, recall = lcs[-1][-1] / len(p), lcs[-1][-1] / len(r)
        scores.append(2 * precision * recall / (precision + recall) if lcs[-1][-1] else 0.0)
    return 100 * float(np.mean(scores))


def _nltk_meteor(predicted: list[list[str]], reference: list[list[str]], language: str) -> float:
    from nltk.corpus import wordnet
    from nltk.stem.porter import PorterStemmer
    from nltk.translate.meteor_score import meteor_score

    # the module documents: English with Porter stems and WordNet synonyms, Chinese with exact matches only
    if language == "en":
        matchers = {"stemmer": PorterStemmer(), "wordnet": wordnet}
    else:
        matchers = {"stemmer": _NoStemming(), "wordnet": _NoSynonyms()}  # the module's own stand-ins
    return 100 * float(np.mean([meteor_score([r], p, **matchers) for p, r in zip(predicted, reference, strict=True)]))


@pytest.mark.parametrize("language", ["en", "zh"])
def test_text_metrics_equal_references_on_random_corpora(language):
    from nltk.translate.bleu_score import corpus_bleu
    from rouge_score import rouge_scorer
    from torchmetrics.functional.text import bleu_score

    scorer = rouge_scorer.RougeScorer(["rougeL"])  # rouge-score as users call it: its own tokenizer, raw text
    compared = Counter()
    for case in range(TEXT_CASES // 2):
        rng = _rng(9 if language == "en" else 10, case)
        predictions, references, predicted, reference = _text_corpus(rng, language)
        with_meteor = case % 2 == 0  # nltk's METEOR looks up WordNet for every unmatched word: half the corpora
        metrics = ("rouge_l", "bleu_4", "meteor") if with_meteor else ("rouge_l", "bleu_4")
        ours = text_generation_metrics(predictions, references, language=language, metrics=metrics)
        where = (language, case)

        expected_bleu = _brute_force_bleu(predicted, reference)
        assert ours["bleu_4"] == pytest.approx(expected_bleu, abs=1e-9), where
        joined = [" ".join(t) for t in predicted], [[" ".join(t)] for t in reference]
        assert ours["bleu_4"] == pytest.approx(100 * float(bleu_score(*joined, n_gram=4)), abs=1e-4), where
        # nltk's modified_precision divides by max(1, number of hypothesis n-grams): a hypothesis shorter than n
        # adds 1 to the denominator where Papineni's BLEU (sacrebleu, torchmetrics) adds nothing, so ["a b c d",
        # "a"] against itself scores 70.7 in nltk and 100 elsewhere. So nltk checks the pairs whose prediction
        # has at least 4 tokens; its method0 also turns "no match" into ~1e-75 rather than 0.
        long = [i for i, t in enumerate(predicted) if len(t) >= 4]
        if long:
            subset = text_generation_metrics(
                [predictions[i] for i in long], [references[i] for i in long], language=language, metrics=("bleu_4",)
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # nltk warns about zero n-gram matches
                nltk_bleu = 100 * corpus_bleu([[reference[i]] for i in long], [predicted[i] for i in long])
            assert subset["bleu_4"] == pytest.approx(nltk_bleu, abs=1e-9), where
            compared["nltk corpus_bleu"] += 1

        assert ours["rouge_l"] == pytest.approx(_brute_force_rouge_l(predicted, reference), abs=1e-9), where
        if language == "en":
            scores = [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references, strict=True)]
            assert ours["rouge_l"] == pytest.approx(100 * float(np.mean(scores)), abs=1e-9), where

        if with_meteor:
            assert ours["meteor"] == pytest.approx(_nltk_meteor(predicted, reference, language), abs=1e-9), where
            compared["meteor"] += 1

        if predicted == reference:  # identical corpora: the top score each metric can give
            compared["identical corpus"] += 1
            if any(len(t) >= 4 for t in predicted):  # BLEU-4 needs at least one 4-gram
                assert ours["bleu_4"] == pytest.approx(100.0), where
            if all(predicted):  # rouge-score scores a pair with an empty side 0, even against itself
                assert ours["rouge_l"] == pytest.approx(100.0), where
            if with_meteor:  # one chunk of m matches: fragmentation penalty 0.5 / m^3; nltk scores empty pairs 0
                per_pair = [1 - 0.5 / len(t) ** 3 if t else 0.0 for t in predicted]
                assert ours["meteor"] == pytest.approx(100 * float(np.mean(per_pair)), abs=1e-9), where
        compared["empty prediction"] += any(not t for t in predicted)
    assert compared["nltk corpus_bleu"] >= 100 and compared["meteor"] == TEXT_CASES // 4
    assert compared["identical corpus"] >= 8 and compared["empty prediction"] >= 80


def test_empty_inputs_are_refused_or_undefined_as_documented():
    for shape in [(0, 0), (0, 5), (3, 0)]:  # no query, or no gallery: no query can have a positive
        with pytest.raises(ValueError, match="no query has a positive"):
            retrieval_metrics(np.zeros(shape), np.zeros(shape, dtype=bool))
    with pytest.raises(ValueError, match="no reports to score"):
        text_generation_metrics([], [])
    with pytest.raises(ValueError, match="need probabilities"):
        classification_metrics(np.zeros(0), np.zeros(0, dtype=int))
    # detection: no image means no target box, which the module documents as undefined (NaN), not 0
    for metric_fn in (detection_metrics, detection_metrics_axial):
        assert all(math.isnan(value) for value in metric_fn([], []).values())
