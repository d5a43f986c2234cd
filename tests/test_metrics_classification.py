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
