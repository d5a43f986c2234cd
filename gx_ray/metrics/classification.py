"""Classification metrics for stage classification (Table 5) and VQA (Table 2a), on the paper's percent scale.

Computed from the confusion matrix (numpy) and ranks (scipy), so that scikit-learn is an independent reference.
Precision, recall, F1 and AUC are averaged over the classes that occur in ``labels`` (scikit-learn's
``labels=np.unique(y_true)``): a prediction of an absent class still counts as an error, but the absent class's own
precision and recall, which have no ground truth, are left out (scikit-learn's default would average them in as 0).
"""

from __future__ import annotations

import numpy as np

CLASSIFICATION_METRICS: tuple[str, ...] = ("precision", "recall", "f1", "accuracy", "auc")
AVERAGES: tuple[str, ...] = ("macro", "weighted", "binary")


def classification_metrics(probabilities: np.ndarray, labels: np.ndarray, average: str = "macro") -> dict[str, float]:
    """``{precision, recall, f1, accuracy, auc}`` in percent (one-vs-rest AUC) of ``(N, C)`` class ``probabilities``
    (AUC ranks each column as given: pass probabilities, not logits; the prediction is the arg-max) against ``(N,)``
    integer ``labels`` in ``[0, C)``. ``average``: ``macro`` (over the classes present in ``labels``), ``weighted`` (by
    support) or ``binary`` (``C == 2``, class 1 positive). A class never predicted has precision 0; AUC is NaN with
    fewer than two classes in ``labels``; per-class F1 is averaged, as scikit-learn does. A ValueError names the first
    bad value (not numeric, not finite, wrong shape, a label outside ``[0, C)``) or an unknown ``average``.
    """
    probabilities, labels = _validated(probabilities, labels)
    n, num_classes = probabilities.shape
    if average not in AVERAGES:
        raise ValueError(f"unknown average {average!r}; valid: {', '.join(AVERAGES)}")
    if average == "binary" and num_classes != 2:
        raise ValueError(f"average='binary' needs C == 2, got C = {num_classes}")

    predictions = probabilities.argmax(axis=1)
    confusion = np.bincount(labels * num_classes + predictions, minlength=num_classes**2).reshape(
        num_classes, num_classes
    )  # rows: true class, columns: predicted class
    true_positives = np.diag(confusion).astype(np.float64)
    support = confusion.sum(axis=1)
    predicted = confusion.sum(axis=0)
    precision = np.divide(true_positives, predicted, out=np.zeros(num_classes), where=predicted > 0)
    recall = np.divide(true_positives, support, out=np.zeros(num_classes), where=support > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros(num_classes), where=precision + recall > 0)
    auc = np.array([_one_vs_rest_auc(probabilities[:, k], labels == k) for k in range(num_classes)])

    if average == "binary":
        weights = np.array([0.0, 1.0])
    else:
        present = support > 0
        weights = present / present.sum() if average == "macro" else support / support.sum()
    auc_weights = weights * ~np.isnan(auc)
    return {
        "precision": 100.0 * float(weights @ precision),
        "recall": 100.0 * float(weights @ recall),
        "f1": 100.0 * float(weights @ f1),
        "accuracy": 100.0 * float(true_positives.sum() / n),
        "auc": 100.0 * float(np.nansum(auc * auc_weights) / auc_weights.sum()) if auc_weights.sum() > 0 else np.nan,
    }


def _validated(probabilities, labels) -> tuple[np.ndarray, np.ndarray]:
    """``probabilities`` as finite float64 ``(N, C)`` and ``labels`` as int64 ``(N,)`` in ``[0, C)``, or ValueError.
    int64: uint8 labels with 17 or more classes would overflow the confusion index ``label * C + prediction``."""
    where = "classification_metrics"
    probabilities, labels = np.asarray(probabilities), np.asarray(labels)
    if probabilities.dtype.kind not in "biuf":
        raise ValueError(f"{where}: probabilities must be numbers, got an array of dtype {probabilities.dtype}")
    if probabilities.ndim != 2 or labels.shape != (probabilities.shape[0],):
        raise ValueError(
            f"{where}: need probabilities (N, C) and labels (N,), got {probabilities.shape} and {labels.shape}"
        )
    n, num_classes = probabilities.shape
    if n == 0:
        raise ValueError(f"{where}: no samples")
    if num_classes == 0:
        raise ValueError(f"{where}: probabilities have no class columns (shape {probabilities.shape})")
    probabilities = probabilities.astype(np.float64)
    finite = np.isfinite(probabilities)
    if not finite.all():
        row, column = (int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(
            f"{where}: probabilities must be finite; probabilities[{row}, {column}] is {probabilities[row, column]}"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{where}: labels must be integers in [0, {num_classes}) (class indices), got an array of dtype "
            f"{labels.dtype}" + _first_non_integer(labels)
        )
    outside = (labels < 0) | (labels >= num_classes)
    if outside.any():
        index = int(np.flatnonzero(outside)[0])
        raise ValueError(f"{where}: labels must be integers in [0, {num_classes}); labels[{index}] is {labels[index]}")
    return probabilities, labels.astype(np.int64)


def _first_non_integer(labels: np.ndarray) -> str:
    """``": labels[i] is v"`` for the first label that is not a whole number, or ``""``."""
    for index, value in enumerate(labels.tolist()):
        if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer():
            return f": labels[{index}] is {value!r}"
    return ""


def _one_vs_rest_auc(scores: np.ndarray, is_positive: np.ndarray) -> float:
    """ROC AUC of one class against the rest via the Mann-Whitney U statistic (tied scores count one half)."""
    from scipy.stats import rankdata  # scipy.stats takes a second to import: only when needed

    num_positive = int(is_positive.sum())
    num_negative = len(scores) - num_positive
    if num_positive == 0 or num_negative == 0:
        return np.nan
    ranks = rankdata(scores)
    return float((ranks[is_positive].sum() - num_positive * (num_positive + 1) / 2) / (num_positive * num_negative))
