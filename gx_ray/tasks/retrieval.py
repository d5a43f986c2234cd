"""Cross-modal retrieval (Table 4): CLIP-style image-report matching in both directions.

``Encoded.pooled`` (the CT with whatever else the schema gives, no query) and the encoder's text embedding of the CT
report are projected, L2-normalised and trained with CLIP's symmetric InfoNCE loss under a learnable temperature, over
a batch's cases that have a report. The metric ranks every report for every image of the whole evaluation set (every
rank's) and vice versa, a case's own report its only positive: ``image_to_text_<metric>`` and
``text_to_image_<metric>`` of :func:`gx_ray.metrics.retrieval_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.metrics import RETRIEVAL_METRICS, retrieval_metrics
from gx_ray.modalities import ModelInputs
from gx_ray.modalities.schemas import REPORT_TARGETS
from gx_ray.tasks.base import Batch, Outputs, Task, TaskMetric, concat, report_column

DIRECTIONS: tuple[str, ...] = ("image_to_text", "text_to_image")
MAX_LOGIT_SCALE = math.log(100.0)
"""CLIP clips the learnt inverse temperature at 100 to keep training stable."""


class RetrievalHead(nn.Module):
    """Projections of both sides into one embedding space and the learnable temperature (as log 1/T). ``text_dim``:
    the text side's width where it differs from the image side's ``dim`` (a VLM's vision features and language
    model)."""

    def __init__(self, dim: int, embedding_dim: int = 128, temperature: float = 0.07, text_dim: int | None = None):
        super().__init__()
        self.image = nn.Linear(dim, embedding_dim)
        self.text = nn.Linear(text_dim or dim, embedding_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1), scale


def info_nce(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE of matched rows: cross-entropy of image→text and text→image similarities, averaged."""
    logits = scale * image @ text.T
    targets = torch.arange(len(image), device=image.device)
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


@dataclass
class Retrieval(Task):
    name = "retrieval"
    primary_metric = "image_to_text_recall_at_5"
    mode = "max"

    language: str = "en"
    embedding_dim: int = 128
    temperature: float = 0.07
    """Initial temperature (CLIP's)."""

    def __post_init__(self) -> None:
        self.column = report_column(REPORT_TARGETS[self.name], self.language)

    def build_head(self, dim: int, tokenizer: Any = None, map_channels: Sequence[int] = ()) -> nn.Module:
        return RetrievalHead(dim, self.embedding_dim, self.temperature)

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        reports = batch[self.column]
        keep = [i for i, report in enumerate(reports) if report]  # a case without its report has nothing to match
        pooled = encoder(inputs).pooled[keep]
        text = encoder.encode_text([reports[i] for i in keep]) if keep else pooled.new_zeros(0, encoder.dim)
        image, text, scale = head(pooled, text)
        return {"image": image, "text": text, "scale": scale, "case_ids": [batch["case_id"][i] for i in keep]}

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        image, text, scale = outputs["image"], outputs["text"], outputs["scale"]
        if len(image) < 2:  # one pair has no negative to contrast with
            return (image.sum() + text.sum() + scale) * 0.0
        return info_nce(image, text, scale)

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        """The report of the batch that each image retrieves first, by case id, and both embeddings (with them
        the analysis ranks every query against the whole test gallery, as the metric does)."""
        image, text = outputs["image"].detach().float().cpu(), outputs["text"].detach().float().cpu()
        similarity = image @ text.T
        case_ids = outputs["case_ids"]
        best = similarity.argmax(1).tolist() if len(case_ids) else []
        return [
            {
                "case_id": case_id,
                "prediction": case_ids[j],
                "target": case_id,
                "similarity": float(similarity[i, j]),
                "image_embedding": image[i].tolist(),
                "text_embedding": text[i].tolist(),
            }
            for i, (case_id, j) in enumerate(zip(case_ids, best, strict=True))
        ]

    def metric(self) -> TaskMetric:
        return RetrievalMetric()

    def chance_level(self, train_rows: Sequence[dict], test_rows: Sequence[dict]) -> float:
        """A random ranking of the test gallery, in expectation: query ``i`` finds its report at rank ``i + 1``, so
        the ranks 1..N occur once each, as they do on average under random similarities (R@K = K/N)."""
        n = sum(1 for row in test_rows if row[self.column])
        if not n:
            return float("nan")
        metrics = retrieval_metrics(-np.tile(np.arange(n, dtype=float), (n, 1)))
        return metrics[self.primary_metric.split("_", 3)[-1]]


class RetrievalMetric(TaskMetric):
    """Retrieval metrics over every gathered (image, report) pair of the evaluation set, both directions."""

    def update(self, outputs: Outputs, batch: Batch) -> None:
        self.add(
            image=outputs["image"].detach().float().cpu().numpy(),
            text=outputs["text"].detach().float().cpu().numpy(),
        )

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        image, text = concat(state.get("image", [])), concat(state.get("text", []))
        if not len(image):
            return {f"{d}_{m}": float("nan") for d in DIRECTIONS for m in RETRIEVAL_METRICS}
        similarity = image.astype(np.float64) @ text.astype(np.float64).T
        result = {f"image_to_text_{k}": v for k, v in retrieval_metrics(similarity).items()}
        result.update({f"text_to_image_{k}": v for k, v in retrieval_metrics(similarity.T).items()})
        return result
