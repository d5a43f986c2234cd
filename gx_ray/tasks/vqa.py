"""Visual question answering (Table 2a): answers classified over the training split's answer vocabulary.

Every (case, question) pair is one example: the case's inputs are repeated once per question and the encoder
reads the question as its query. The vocabulary is fitted by :meth:`VisualQuestionAnswering.prepare` from
training rows only, yes/no included; index 0 is ``"<unk>"``, where every answer unseen in training lands. The
head has no logit for ``<unk>`` (its probability is 0), so such an answer always counts as wrong, as it would
for any classifier trained on the training split. Metrics: precision, recall, F1, accuracy and AUC over all
pairs (:func:`gx_ray.metrics.classification_metrics`, macro over the answers that occur) and the accuracy per
question category (``accuracy_<category>``, NaN for a category without questions).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from gx_ray.metrics import CLASSIFICATION_METRICS, classification_metrics
from gx_ray.modalities import ModelInputs
from gx_ray.schema import LANGUAGES, VQA_CATEGORIES
from gx_ray.tasks.base import Batch, Outputs, Task, TaskMetric, check_train_rows, concat, masked_cross_entropy

UNKNOWN_ANSWER = "<unk>"


def vqa_column(language: str) -> str:
    if language not in LANGUAGES:
        raise ValueError(f"unknown language {language!r}; valid: {', '.join(LANGUAGES)}")
    return "vqa" if language == "en" else f"vqa_{language}"


class AnswerHead(nn.Module):
    def __init__(self, dim: int, num_answers: int, dropout: float = 0.1):
        super().__init__()
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, num_answers))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)


@dataclass
class VisualQuestionAnswering(Task):
    name = "vqa"
    primary_metric = "accuracy"
    mode = "max"

    max_questions_per_case: int | None = None
    """Questions per case in a training step (drawn at random); None = all. Evaluation always uses all."""
    language: str = "en"
    dropout: float = 0.1
    seed: int = 0
    """Seeds the draw of questions when ``max_questions_per_case`` caps them."""
    answers: tuple[str, ...] = field(default=(), init=False)
    """The vocabulary, ``"<unk>"`` first; fitted by :meth:`prepare`."""

    def __post_init__(self) -> None:
        self.column = vqa_column(self.language)
        if self.max_questions_per_case is not None and self.max_questions_per_case < 1:
            raise ValueError(f"max_questions_per_case must be at least 1 or None, got {self.max_questions_per_case}")
        self.rng = np.random.default_rng(self.seed)

    def prepare(self, train_rows: Iterable[Mapping[str, Any]]) -> None:
        """The answer vocabulary of the training rows (sorted, so the same rows give the same indices)."""
        rows = check_train_rows(train_rows, self.name)
        items = [item for row in rows if row[self.column] is not None for item in row[self.column]]
        seen = {str(item["answer"]).strip() for item in items}
        if not seen:
            raise ValueError(f"no VQA answers ({self.column}) in the {len(rows)} training rows")
        self.answers = (UNKNOWN_ANSWER, *sorted(seen))
        self._index = {answer: i for i, answer in enumerate(self.answers)}

    def answer_index(self, answer: str) -> int:
        return self._index.get(answer.strip(), 0)

    def build_head(self, dim: int, tokenizer: Any = None, map_channels: Sequence[int] = ()) -> nn.Module:
        if not self.answers:
            raise RuntimeError("the VQA answer vocabulary is not fitted: call prepare(train_rows) first")
        return AnswerHead(dim, len(self.answers) - 1, self.dropout)  # no logit for <unk>

    def question_pairs(self, items: list[list[dict]], training: bool) -> list[tuple[int, dict]]:
        """``(case index in the batch, question)`` for every question asked this step: all of them when evaluating, at
        most ``max_questions_per_case`` a case (drawn with the task's seeded generator) when training."""
        pairs = []
        for case, questions in enumerate(items):
            questions = list(questions or ())
            cap = self.max_questions_per_case
            if training and cap is not None and len(questions) > cap:
                questions = [questions[i] for i in sorted(self.rng.choice(len(questions), cap, replace=False))]
            pairs += [(case, q) for q in questions]
        return pairs

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        pairs = self.question_pairs(batch[self.column], head.training)
        case_index = torch.tensor([case for case, _ in pairs], dtype=torch.long)
        questions = [q["question"] for _, q in pairs]
        if pairs:
            logits = head(encoder(inputs, query=questions, case_index=case_index).pooled)
        else:  # a batch without questions: nothing to answer (the head still joins the graph)
            logits = head(torch.zeros(0, encoder.dim, device=inputs.ct.device))
        return {
            "logits": logits,
            "targets": torch.tensor([self.answer_index(q["answer"]) for _, q in pairs], dtype=torch.long),
            "case_index": case_index,
            "questions": questions,
            "answers": [q["answer"] for _, q in pairs],
            "categories": [q["category"] for _, q in pairs],
        }

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        # logit k is answer k + 1; an unseen answer (index 0) becomes -1 and is ignored: no logit can learn it
        return masked_cross_entropy(outputs["logits"], outputs["targets"] - 1)

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        predicted = outputs["logits"].detach().argmax(-1).cpu().tolist()
        return [
            {
                "case_id": batch["case_id"][case],
                "question": question,
                "category": category,
                "prediction": self.answers[p + 1],
                "target": answer,
            }
            for case, question, category, p, answer in zip(
                outputs["case_index"].tolist(),
                outputs["questions"],
                outputs["categories"],
                predicted,
                outputs["answers"],
                strict=True,
            )
        ]

    def metric(self) -> TaskMetric:
        return VQAMetric(len(self.answers))

    def chance_level(self, train_rows: Sequence[dict], test_rows: Sequence[dict]) -> float:
        """Each test question answered by a guess among the answers the training split gives to the same wording
        (all training answers for a wording it never asks): chance accuracy, averaged over the guesses."""
        options: dict[str, set[int]] = defaultdict(set)
        for row in train_rows:
            for item in row[self.column] or ():
                options[item["question"]].add(self.answer_index(item["answer"]))
        everything = set().union(*options.values()) if options else set()
        hits = []  # per question: the probability that a uniform guess among its choices is right
        for row in test_rows:
            for item in row[self.column] or ():
                choices = options.get(item["question"]) or everything
                hits.append(float(self.answer_index(item["answer"]) in choices) / max(1, len(choices)))
        return 100.0 * float(np.mean(hits)) if hits and everything else float("nan")


def answer_probabilities(logits: torch.Tensor) -> np.ndarray:
    """(N, K) logits over the known answers → (N, K + 1) probabilities with 0 for ``<unk>`` (column 0)."""
    probabilities = logits.detach().float().softmax(-1).cpu().numpy()
    return np.concatenate([np.zeros((len(probabilities), 1)), probabilities], axis=1)


class VQAMetric(TaskMetric):
    def __init__(self, vocabulary_size: int):
        super().__init__()
        self.vocabulary_size = vocabulary_size

    def update(self, outputs: Outputs, batch: Batch) -> None:
        self.add(
            probabilities=answer_probabilities(outputs["logits"]),
            targets=outputs["targets"].numpy(),
            categories=np.asarray(outputs["categories"], dtype=object),
        )

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        targets = concat(state.get("targets", [])).astype(np.int64)
        if not len(targets):
            return dict.fromkeys([*CLASSIFICATION_METRICS, *(f"accuracy_{c}" for c in VQA_CATEGORIES)], float("nan"))
        probabilities = concat(state["probabilities"], self.vocabulary_size)
        categories = concat(state["categories"])
        result = classification_metrics(probabilities, targets)
        correct = probabilities.argmax(1) == targets
        for category in VQA_CATEGORIES:
            chosen = categories == category
            result[f"accuracy_{category}"] = 100.0 * float(correct[chosen].mean()) if chosen.any() else float("nan")
        return result
