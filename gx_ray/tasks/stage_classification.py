"""Stage classification (Table 5): the overall AJCC stage group I-IV from the fused representation.

A linear head on ``Encoded.pooled`` gives four logits (:data:`gx_ray.schema.STAGE_GROUPS`); cases without a
stage (``stage_label`` -1) add nothing to the loss or the metric. Optional auxiliary heads predict the T, N and M
categories (multi-task regularisation; their cross-entropies are added with ``tnm_weight``). Metrics:
precision, recall, F1 and one-vs-rest AUC (macro) and accuracy of the softmax probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from gx_ray.metrics import CLASSIFICATION_METRICS, classification_metrics
from gx_ray.modalities import ModelInputs
from gx_ray.schema import M_CATEGORIES, N_CATEGORIES, STAGE_GROUPS, T_CATEGORIES
from gx_ray.tasks.base import Batch, Outputs, Task, TaskMetric, concat, masked_cross_entropy

TNM_CATEGORIES: dict[str, tuple[str, ...]] = {"t": T_CATEGORIES, "n": N_CATEGORIES, "m": M_CATEGORIES}


class StageHead(nn.Module):
    """Dropout and one linear layer per target: ``stage`` (4 groups), and ``t``, ``n``, ``m`` when asked."""

    def __init__(self, dim: int, tnm_heads: bool = False, dropout: float = 0.1):
        super().__init__()
        sizes = {"stage": len(STAGE_GROUPS), **({k: len(v) for k, v in TNM_CATEGORIES.items()} if tnm_heads else {})}
        self.dropout = nn.Dropout(dropout)
        self.classifiers = nn.ModuleDict({name: nn.Linear(dim, size) for name, size in sizes.items()})

    def forward(self, pooled: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.dropout(pooled)
        return {name: classifier(features) for name, classifier in self.classifiers.items()}


def tnm_labels(values: Sequence[str | None], categories: tuple[str, ...]) -> torch.Tensor:
    """Indices of T (or N, M) categories; -1 where unknown."""
    return torch.tensor([categories.index(v) if v in categories else -1 for v in values], dtype=torch.long)


@dataclass
class StageClassification(Task):
    name = "stage_classification"
    short_name = "stage"
    primary_metric = "auc"
    mode = "max"

    tnm_heads: bool = False
    """Auxiliary T, N and M heads."""
    tnm_weight: float = 0.5
    dropout: float = 0.1

    def build_head(self, dim: int, tokenizer: Any = None, map_channels: Sequence[int] = ()) -> nn.Module:
        return StageHead(dim, self.tnm_heads, self.dropout)

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        return {"logits": head(encoder(inputs).pooled)}

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        logits = outputs["logits"]
        loss = masked_cross_entropy(logits["stage"], batch["stage_label"])
        for key, categories in TNM_CATEGORIES.items():
            if key in logits:
                loss = loss + self.tnm_weight * masked_cross_entropy(logits[key], tnm_labels(batch[key], categories))
        return loss

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        probabilities = outputs["logits"]["stage"].detach().float().softmax(-1).cpu().numpy()
        labels = batch["stage_label"].tolist()
        return [
            {
                "case_id": case_id,
                "prediction": STAGE_GROUPS[int(p.argmax())],
                "target": STAGE_GROUPS[label] if label >= 0 else None,
                "probabilities": [float(x) for x in p],  # unrounded: AUC ties from rounding move the score
            }
            for case_id, p, label in zip(batch["case_id"], probabilities, labels, strict=True)
        ]

    def metric(self) -> TaskMetric:
        return StageMetric()

    def combine(self, members: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """An ensemble's records: the members' mean probabilities, the stage they make most likely, and the members'
        standard deviation of each probability (``spread``: how much the models disagree)."""
        combined = []
        for records in zip(*members, strict=True):
            if len({r["case_id"] for r in records}) != 1:
                raise ValueError(f"ensemble members disagree on the case: {[r['case_id'] for r in records]}")
            probabilities = np.array([r["probabilities"] for r in records], dtype=np.float64)
            mean = probabilities.mean(0)
            combined.append({
                **records[0],
                "prediction": STAGE_GROUPS[int(mean.argmax())],
                "probabilities": [float(x) for x in mean],
                "spread": [float(x) for x in probabilities.std(0)],
                "members": len(records),
            })  # fmt: skip
        return combined

    def chance_level(self, train_rows: Sequence[dict], test_rows: Sequence[dict]) -> float:
        """Every test case given the training split's stage frequencies: an AUC of 50 whatever the frequencies."""
        train = np.array([r["stage_label"] for r in train_rows if r["stage_label"] >= 0], dtype=np.int64)
        test = np.array([r["stage_label"] for r in test_rows if r["stage_label"] >= 0], dtype=np.int64)
        if not len(train) or not len(test):
            return float("nan")
        prior = np.bincount(train, minlength=len(STAGE_GROUPS)) / len(train)
        return classification_metrics(np.tile(prior, (len(test), 1)), test)[self.primary_metric]

    def figures(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The test split's confusion matrix (rows: true stage, columns: predicted)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        counts = np.zeros((len(STAGE_GROUPS), len(STAGE_GROUPS)), dtype=int)
        for record in records:
            if record["target"] is not None:
                counts[STAGE_GROUPS.index(record["target"]), STAGE_GROUPS.index(record["prediction"])] += 1
        figure, axes = plt.subplots(figsize=(3.6, 3.2))
        axes.imshow(counts, cmap="Blues")
        for (row, column), count in np.ndenumerate(counts):
            axes.text(column, row, str(count), ha="center", va="center")
        ticks = range(len(STAGE_GROUPS))
        axes.set(xticks=ticks, yticks=ticks, xticklabels=STAGE_GROUPS, yticklabels=STAGE_GROUPS)
        axes.set(xlabel="predicted stage", ylabel="true stage", title="test confusion matrix")
        figure.tight_layout()  # MLflow saves the figure as it is: without this the x label is cut off
        return {"confusion_matrix": figure}


class StageMetric(TaskMetric):
    """Classification metrics of the labelled cases; ``t_accuracy`` etc. when the T/N/M heads are on."""

    def update(self, outputs: Outputs, batch: Batch) -> None:
        logits = {k: v.detach().float().cpu() for k, v in outputs["logits"].items()}
        labels = batch["stage_label"].cpu()
        known = labels >= 0
        self.add(probabilities=logits["stage"][known].softmax(-1).numpy(), labels=labels[known].numpy())
        for key, categories in TNM_CATEGORIES.items():
            if key in logits:
                target = tnm_labels(batch[key], categories)
                self.add(**{f"{key}_correct": (logits[key].argmax(-1) == target)[target >= 0].numpy()})

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        labels = concat(state.get("labels", [])).astype(np.int64)
        if len(labels):
            result = classification_metrics(concat(state["probabilities"], len(STAGE_GROUPS)), labels)
        else:
            result = dict.fromkeys(CLASSIFICATION_METRICS, float("nan"))
        for key in TNM_CATEGORIES:
            if f"{key}_correct" in state:
                correct = concat(state[f"{key}_correct"])
                result[f"{key}_accuracy"] = 100.0 * float(correct.mean()) if len(correct) else float("nan")
        return result
