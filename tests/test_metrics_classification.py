"""Classification metrics equal scikit-learn's, including absent classes, ties in scores and the binary case."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, precision_recall_fscore_support, roc_auc_score

from gx_ray.metrics import CLASSIFICATION_METRICS, classification_metrics


def _random_case(seed: int, n: int = 300, num_classes: int = 4, decimals: int | None = None):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n)
    logits = rng.normal(size=(n, num_classes)) + 1.5 * np.eye(num_classes)[labels]  # better than chance
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    if decimals is not None:  # coarse scores: many ties, which AUC must count as one half
        probabilities = np.round(probabilities, decimals)
    return probabilities, labels


def _sklearn(probabilities, labels, average):
    predictions = probabilities.argmax(axis=1)
    precision, recall, f1, _ = precision_recall_fscore_support(
        labels, predictions, labels=np.unique(labels), average=average, zero_division=0
    )
    present = np.unique(labels)
    per_class_auc = [roc_auc_score(labels == k, probabilities[:, k]) for k in present]
    auc = np.average(per_class_auc, weights=np.bincount(labels)[present] if average == "weighted" else None)
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "accuracy": accuracy_score(labels, predictions),
        "auc": auc,
    }


@pytest.mark.parametrize("average", ["macro", "weighted"])
@pytest.mark.parametrize("seed, decimals", [(0, None), (1, None), (2, 1)])
def test_multiclass_equals_sklearn(seed, decimals, average):
    probabilities, labels = _random_case(seed, decimals=decimals)
    ours = classification_metrics(probabilities, labels, average=average)
    expected = _sklearn(probabilities, labels, average)
    assert set(ours) == set(CLASSIFICATION_METRICS)
    for name in CLASSIFICATION_METRICS:
        assert ours[name] == pytest.approx(100 * expected[name], abs=1e-9), name
    if decimals is None:  # rows sum to 1, as sklearn's own multi-class OvR insists
        assert ours["auc"] == pytest.approx(
            100 * roc_auc_score(labels, probabilities, multi_class="ovr", average=average)
        )


def test_absent_class_is_left_out_of_the_averages():
    probabilities, labels = _random_case(3, num_classes=4)
    labels = np.where(labels == 2, 0, labels)  # class 2 never occurs in the labels but is still predicted
    assert (probabilities.argmax(axis=1) == 2).any()
    ours = classification_metrics(probabilities, labels)
    expected = _sklearn(probabilities, labels, "macro")  # averages over the present classes 0, 1, 3
    for name in CLASSIFICATION_METRICS:
        assert ours[name] == pytest.approx(100 * expected[name], abs=1e-9), name
    # sklearn's default would also average in the predicted-only class with precision 0
    default_precision = precision_recall_fscore_support(
        labels, probabilities.argmax(axis=1), average="macro", zero_division=0
    )[0]
    assert ours["precision"] > 100 * default_precision


def test_binary_case():
    probabilities, labels = _random_case(4, num_classes=2)
    predictions = probabilities.argmax(axis=1)
    binary = classification_metrics(probabilities, labels, average="binary")
    precision, recall, f1, _ = precision_recall_fscore_support(labels, predictions, average="binary")
    assert binary["precision"] == pytest.approx(100 * precision)
    assert binary["recall"] == pytest.approx(100 * recall)
    assert binary["f1"] == pytest.approx(100 * f1)
    assert binary["auc"] == pytest.approx(100 * roc_auc_score(labels, probabilities[:, 1]))
    macro = classification_metrics(probabilities, labels)
    assert macro["f1"] == pytest.approx(100 * precision_recall_fscore_support(labels, predictions, average="macro")[2])
    assert macro["auc"] == pytest.approx(binary["auc"])  # both columns rank the samples the same way


def test_perfect_and_degenerate_cases():
    labels = np.array([0, 1, 2, 2, 1, 0])
    perfect = classification_metrics(np.eye(3)[labels], labels)
    assert all(value == pytest.approx(100.0) for value in perfect.values())
    one_class = classification_metrics(np.eye(3)[[0, 0, 1]], np.array([0, 0, 0]))
    assert np.isnan(one_class["auc"]) and one_class["recall"] == pytest.approx(200 / 3)


def test_rejects_malformed_input():
    with pytest.raises(ValueError, match="labels must be integers"):
        classification_metrics(np.full((2, 3), 1 / 3), np.array([0, 3]))
    with pytest.raises(ValueError, match="C == 2"):
        classification_metrics(np.full((2, 3), 1 / 3), np.array([0, 1]), average="binary")
    with pytest.raises(ValueError, match="need probabilities"):
        classification_metrics(np.full((2, 3), 1 / 3), np.array([0, 1, 2]))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int32, np.uint64])
def test_narrow_integer_labels_are_widened(dtype):
    """uint8 labels with 17 or more classes overflowed in the confusion-matrix index ``label * C + prediction``."""
    probabilities, labels = _random_case(5, n=400, num_classes=20)
    ours = classification_metrics(probabilities, labels.astype(dtype))
    assert ours == classification_metrics(probabilities, labels.astype(np.int64))
    expected = _sklearn(probabilities, labels, "macro")
    for name in CLASSIFICATION_METRICS:
        assert ours[name] == pytest.approx(100 * expected[name], abs=1e-9), name


@pytest.mark.parametrize("seed", range(5))
def test_equivalent_input_forms_give_identical_results(seed):
    """Lists, float32 probabilities and narrower integer labels are the same valid input as float64 / int64."""
    probabilities, labels = _random_case(seed, n=50, num_classes=3, decimals=2 if seed % 2 else None)
    reference = classification_metrics(probabilities, labels)
    assert classification_metrics(probabilities.tolist(), labels.tolist()) == reference
    assert classification_metrics(probabilities, labels.astype(np.int16)) == reference
    as_float32 = probabilities.astype(np.float32)
    assert classification_metrics(as_float32, labels) == classification_metrics(as_float32.astype(np.float64), labels)


def _with(array, index, value):
    array = np.array(array)
    array[index] = value
    return array


_PROBABILITIES = np.full((4, 3), 1 / 3)
_LABELS = np.array([0, 1, 2, 1])


@pytest.mark.parametrize(
    "probabilities, labels, message",
    [
        (_with(_PROBABILITIES, (2, 1), np.nan), _LABELS, r"probabilities\[2, 1\] is nan"),
        (_with(_PROBABILITIES, (0, 2), np.inf), _LABELS, r"probabilities\[0, 2\] is inf"),
        (_with(_PROBABILITIES, (3, 0), -np.inf), _LABELS, r"probabilities\[3, 0\] is -inf"),
        (_PROBABILITIES.astype(str), _LABELS, r"probabilities must be numbers"),
        (_PROBABILITIES[:, 0], _LABELS, r"need probabilities \(N, C\).*\(4,\)"),
        (_PROBABILITIES[None], _LABELS, r"need probabilities \(N, C\).*\(1, 4, 3\)"),
        (_PROBABILITIES[:, :0], _LABELS, r"no class columns"),
        (_PROBABILITIES, _LABELS[:3], r"labels \(N,\), got \(4, 3\) and \(3,\)"),
        (_PROBABILITIES, _LABELS[:, None], r"labels \(N,\), got \(4, 3\) and \(4, 1\)"),
        (_PROBABILITIES, np.array([0, 0.5, 1, 2]), r"labels must be integers.*dtype float64: labels\[1\] is 0\.5"),
        (_PROBABILITIES, np.array(["0", "1", "2", "a"]), r"labels must be integers.*labels\[0\] is '0'"),
        (_PROBABILITIES, np.array([0, 1, -1, 2]), r"labels must be integers in \[0, 3\); labels\[2\] is -1"),
        (_PROBABILITIES, np.array([0, 1, 2, 3], dtype=np.uint8), r"in \[0, 3\); labels\[3\] is 3"),
    ],
)
def test_rejects_invalid_input_naming_what_is_wrong(probabilities, labels, message):
    with pytest.raises(ValueError, match=r"^classification_metrics: .*" + message):
        classification_metrics(probabilities, labels)
