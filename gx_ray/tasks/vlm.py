"""Tasks through a vision-language model (``model.family: vlm``): VQA, report generation, stage classification and
lesion detection asked in words and answered by generation, retrieval through a head on the model's pooled states, so
the training loop, its MLflow logging and checkpoints run unchanged.

:class:`VisionLanguageTaskModel` is the module the loop trains: it makes each case's CT views
(:func:`~gx_ray.modalities.views.ct_images`), puts each question in MedEvalKit's prompt inside the model's chat
template, and returns the answers' cross-entropy while training and the generated answers while evaluating.
:class:`VisionLanguageTask` wraps the trial's own task (its ``prepare``, chance level, primary metric and direction)
and scores the answers with what exists already:

- **vqa**: each question close-ended, scored by the cascade (:func:`score_answer`, :func:`cascade_metrics`), with
  the accuracy per question category;
- **report_generation**: the CT report's first ``max_report_tokens``, scored by report generation's own metric;
- **stage_classification**: a multiple-choice question over the four stage groups: the written letter is scored by
  the cascade, and each letter's log-likelihood (:meth:`~gx_ray.models.vlm.VisionLanguageModel.option_scores`)
  gives class probabilities, hence the ``auc`` (the primary metric, as for the encoder) and ``option_accuracy``;
- **lesion_detection**: the tumour box asked for and written as text (:func:`~gx_ray.modalities.views.box_text`: the
  very words ``views.boxes: prompt`` gives a box in), taught by the answer's cross-entropy; the written box, parsed
  back (:func:`~gx_ray.modalities.views.parse_box_text`) and scored by its likelihood, is the case's one detection,
  scored by lesion detection's own metric (AP at 3D IoU, :func:`gx_ray.metrics.detection_metrics`); a box the model
  did not write in that form is no detection;
- **retrieval** (the paper's "Retrieval Extension"): the model's pooled image and report states
  (:meth:`~gx_ray.models.vlm.VisionLanguageModel.pooled`) projected into one space by retrieval's own head, loss and
  metric (:class:`~gx_ray.tasks.retrieval.RetrievalHead`: symmetric InfoNCE; recall@k both ways).

The lab table (``schema.table: text``) and the box's coordinates (``views.boxes: prompt``) go before the question.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from gx_ray.data.shards import hounsfield
from gx_ray.metrics import classification_metrics
from gx_ray.metrics.cascade import REPORT_PROMPT, Scored, cascade_metrics, question_prompt, score_answer
from gx_ray.modalities import ModalitySchema
from gx_ray.modalities.boxes import tumour_boxes
from gx_ray.modalities.table import abnormal_text
from gx_ray.modalities.views import ViewRecipe, box_text, ct_images, grid_text, parse_box_text
from gx_ray.schema import PHASES, STAGE_GROUPS, VQA_CATEGORIES
from gx_ray.tasks.base import Batch, Outputs, Task, TaskMetric, concat
from gx_ray.tasks.retrieval import RetrievalHead

STAGE_QUESTION = "What is the overall AJCC stage group of this gastric cancer?"
STAGE_OPTIONS: tuple[str, ...] = tuple(f"stage {group}" for group in STAGE_GROUPS)
STAGE_LETTERS: tuple[str, ...] = tuple(string.ascii_uppercase[: len(STAGE_GROUPS)])
DETECTION_QUESTION = (
    "Where is the lesion on this {} grid? Answer with its box as: slices first-last, rows first-last, columns "
    "first-last."
)
OWN_METRIC = ("report_generation", "retrieval", "lesion_detection")
"""Tasks whose own metric scores what the VLM gives (the encoder path's)."""
AIR_HU = -1000.0
"""An absent phase's voxels: below every window, so its image is black (the model still gets one image per phase)."""


@dataclass(frozen=True)
class Item:
    """One question put to the model: the case it is about (its index in the batch), the prompt, the answer taught
    and scored, and what scoring needs besides."""

    case: int
    prompt: str
    answer: str
    question: str = ""
    category: str = ""
    label: int = -1


class VisionLanguageTask:
    """The trial's task asked of a VLM: what the loop needs of a task (loss, metric, predictions, primary metric and
    direction, chance level), the questions from the task's batch columns."""

    def __init__(self, task: Task, max_new_tokens: int = 16):
        self.task = task
        self.name, self.primary_metric, self.mode = task.name, task.primary_metric, task.mode
        self.max_new_tokens = max_new_tokens
        self.column = getattr(task, "column", None)  # VQA's and report generation's batch column

    # --- the task's own parts ---

    def prepare(self, train_rows: Iterable[Mapping[str, Any]]) -> None:
        self.task.prepare(train_rows)

    def chance_level(self, train_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> float:
        return self.task.chance_level(train_rows, test_rows)

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Report generation cuts its targets (and its chance level's) with the model's tokenizer."""
        if self.name == "report_generation":
            self.task.tokenizer = tokenizer

    @property
    def answer_tokens(self) -> int:
        return self.task.max_new_tokens if self.name == "report_generation" else self.max_new_tokens

    # --- questions ---

    def items(self, batch: Batch, training: bool) -> list[Item]:
        """The batch's questions: every VQA question of each case (training draws ``max_questions_per_case``), each
        case's report, each staged case's stage question."""
        if self.name == "vqa":
            pairs = self.task.question_pairs(batch[self.column], training)
            return [
                Item(case, question_prompt("close", q["question"]), str(q["answer"]), q["question"], q["category"])
                for case, q in pairs
            ]
        if self.name == "report_generation":
            reports = self.task.target_texts(batch[self.column])
            return [Item(case, REPORT_PROMPT, report) for case, report in enumerate(reports) if report]
        if self.name == "lesion_detection":
            boxes, present = tumour_boxes(batch["boxes"], batch["box_present"])
            prompt = DETECTION_QUESTION.format(grid_text(batch["ct"].shape))
            return [Item(case, prompt, box_text(boxes[case])) for case in np.flatnonzero(present).tolist()]
        labels = batch["stage_label"].tolist()
        prompt = question_prompt("mcq", STAGE_QUESTION, STAGE_OPTIONS)
        return [Item(case, prompt, STAGE_LETTERS[k], label=k) for case, k in enumerate(labels) if k >= 0]

    # --- what the loop calls ---

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        return self.task.loss(outputs, batch) if self.name == "retrieval" else outputs["loss"]

    def metric(self) -> TaskMetric:
        if self.name in OWN_METRIC:
            return self.task.metric()  # the task's own: generated vs references, the ranking, the boxes
        return AnswerMetric(stage=self.name == "stage_classification")

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        if self.name in ("retrieval", "lesion_detection"):
            return self.task.predict(outputs, batch)
        records = []
        for k, item in enumerate(outputs["items"]):
            record = {"case_id": batch["case_id"][item.case], "prediction": outputs["generated"][k]}
            record["target"] = item.answer if self.name != "stage_classification" else STAGE_GROUPS[item.label]
            if item.question:
                record.update(question=item.question, category=item.category)
            if self.name == "vqa":  # the cascade's verdict, as the metric gave it: the report re-scores from this
                verdict = score_answer("close", record["prediction"], item.answer, question=item.question)
                record["correct"] = bool(verdict.correct)
            if "option_scores" in outputs:
                probabilities = outputs["option_scores"][k].softmax(-1)
                record["probabilities"] = [round(float(p), 4) for p in probabilities]
            records.append(record)
        return records


class VisionLanguageTaskModel(nn.Module):
    """A VLM and the trial's task: ``forward(batch)`` gives ``loss`` (training) or the generated answers (evaluation:
    ``generated``, ``references``, and for stage classification ``option_scores``)."""

    def __init__(self, task: VisionLanguageTask, vlm: nn.Module, recipe: ViewRecipe, schema: ModalitySchema):
        """``vlm``: a :class:`~gx_ray.models.vlm.VisionLanguageModel` or a plug-in of the same protocol
        (:func:`~gx_ray.models.vlm.vlm_protocol_problems`)."""
        super().__init__()
        self.task, self.vlm, self.recipe, self.schema = task, vlm, recipe, schema
        task.bind_tokenizer(vlm.tokenizer)
        if task.name == "retrieval":  # the head's widths: the model's pooled states of a blank case and a word
            blank = [[np.zeros((3, 32, 32), np.float32)] * recipe.images_per_case]
            with torch.no_grad():
                image, text = vlm.pooled(blank, ["report"])
            self.head = RetrievalHead(image.shape[-1], task.task.embedding_dim, task.task.temperature, text.shape[-1])

    def trained_keys(self, prefix: str = "") -> set[str]:
        return {f"{prefix}{name}" for name, parameter in self.named_parameters() if parameter.requires_grad}

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """What trains (the adapters, a tower opened by ``vlm.train_*``, retrieval's head) only: a copy of the frozen
        weights in every checkpoint and best-epoch copy would cost the model's size each time, gigabytes for the hub
        models."""
        full = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        trained = self.trained_keys(prefix)
        for key in [k for k in full if k not in trained]:
            del full[key]
        return full

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Loads what :meth:`state_dict` keeps; ``strict``: exactly the trained parameters, no more and no fewer."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = sorted(set(result.missing_keys) & self.trained_keys())
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"VLM state: trained parameters missing {missing}, unknown {result.unexpected_keys}")
        return result

    def forward(self, batch: Batch) -> Outputs:
        if self.task.name == "retrieval":
            return self._retrieve(batch)
        items = self.task.items(batch, self.training)
        if not items:  # nothing asked of this batch: a zero that still reaches the graph (DDP, backward)
            zero = sum(p.sum() for p in self.vlm.trainable().values()) * 0.0
            outputs = {"loss": zero, "items": [], "generated": [], "references": []}
            if self.task.name == "lesion_detection":
                outputs["detections"] = [no_box()] * len(batch["case_id"])
            return outputs
        images, context = case_views(batch, self.recipe, self.schema)
        pictures = [images[item.case] for item in items]
        prompts = [" ".join(p for p in (context[item.case], item.prompt) if p) for item in items]
        answers = [item.answer for item in items]
        if self.training:
            return {"loss": self.vlm.loss(pictures, prompts, answers), "items": items}
        tokens = self.task.answer_tokens
        if self.task.name == "lesion_detection":  # room for any box on the grid, whatever vlm.max_new_tokens says
            tokens = max(tokens, box_tokens(self.vlm.tokenizer, batch["ct"].shape[-3:]))
        outputs: Outputs = {
            "items": items,
            "generated": self.vlm.generate(pictures, prompts, tokens),
            "references": answers,
        }
        if self.task.name == "stage_classification":
            outputs["option_scores"] = self.vlm.option_scores(pictures, prompts, [STAGE_LETTERS] * len(items)).cpu()
        if self.task.name == "lesion_detection":  # each written box scored by its likelihood, as the model wrote it
            written = [[text] for text in outputs["generated"]]
            likelihood = self.vlm.option_scores(pictures, prompts, written)[:, 0].double().exp().tolist()
            outputs["detections"] = detections(items, outputs["generated"], likelihood, len(batch["case_id"]))
        return outputs

    def _retrieve(self, batch: Batch) -> Outputs:
        """Retrieval's outputs from the VLM's pooled states of each case's views and its report (cases without one
        left out), through retrieval's head: what its loss, metric and predictions read."""
        reports = batch[self.task.column]
        keep = [i for i, report in enumerate(reports) if report]
        if keep:
            images, _ = case_views(batch, self.recipe, self.schema)
            image, text = self.vlm.pooled([images[i] for i in keep], [reports[i] for i in keep])
        else:
            image, text = (torch.zeros(0, layer.in_features) for layer in (self.head.image, self.head.text))
        device = self.head.logit_scale.device
        image, text, scale = self.head(image.to(device).float(), text.to(device).float())
        return {"image": image, "text": text, "scale": scale, "case_ids": [batch["case_id"][i] for i in keep]}


def box_tokens(tokenizer: Any, grid: Sequence[int]) -> int:
    """The tokens the longest box on a ``(D, H, W)`` grid takes in words (every coordinate at its widest), and two
    more: what a written box may need."""
    d, h, w = (int(v) for v in grid)
    return len(tokenizer(box_text([d - 1, h - 1, w - 1, d, h, w]), add_special_tokens=False)["input_ids"]) + 2


def no_box() -> dict[str, np.ndarray]:
    """A case's detections where nothing was found (or asked)."""
    return {"boxes": np.zeros((0, 6)), "scores": np.zeros(0)}


def detections(items: Sequence[Item], written: Sequence[str], scores: Sequence[float], cases: int) -> list[dict]:
    """Lesion detection's per-case detections (as :class:`~gx_ray.tasks.lesion_detection.DetectionMetric` reads
    them) from the boxes the model wrote: each asked case's box parsed from its answer with its score, none where the
    answer holds no box; every case not asked has none."""
    found = [no_box() for _ in range(cases)]
    for item, text, score in zip(items, written, scores, strict=True):
        box = parse_box_text(text)
        if box is not None:
            found[item.case] = {"boxes": box[None], "scores": np.array([score])}
    return found


def case_views(batch: Batch, recipe: ViewRecipe, schema: ModalitySchema) -> tuple[list[list[np.ndarray]], list[str]]:
    """Each case's images under ``recipe`` (RGB ``(3, H, W)`` arrays) and the text its prompt starts with (the lab
    table as descriptors under ``schema.table: text``, the box's coordinates under ``boxes: prompt``). A case without
    a tumour box is centred on its stomach (else on the middle slice) and gets no box; an absent phase is black."""
    phases = [PHASES.index(p) for p in recipe.phases]
    ct = batch["ct"][:, phases].float().cpu().numpy()  # one copy off the device for the batch
    means, stds = batch["ct_hu_mean"][:, phases].numpy(), batch["ct_hu_std"][:, phases].numpy()
    tumour, has_tumour = tumour_boxes(batch["boxes"], batch["box_present"])
    stomachs, has_stomach = tumour_boxes(batch["boxes"], batch["box_present"], "stomach")
    images, context = [], []
    for i in range(len(ct)):
        hu = np.nan_to_num(hounsfield(ct[i], means[i], stds[i]), nan=AIR_HU)
        volumes = dict(zip(recipe.phases, hu, strict=True))
        # no stomach box: the whole grid, whose middle slice is then the centre
        stomach = stomachs[i] if has_stomach[i] else [0, 0, 0, *hu.shape[1:]]
        case_recipe = recipe if has_tumour[i] else replace(recipe, centre="stomach", boxes="off")
        views, box_text = ct_images(volumes, case_recipe, tumour[i].astype(int) if has_tumour[i] else None, stomach)
        images.append(list(views))
        table = abnormal_text(batch["lab_abnormal"][i] or [], schema) if schema.table == "text" else ""
        context.append(" ".join(t for t in (table, box_text) if t))
    return images, context


class AnswerMetric(TaskMetric):
    """Written answers scored by the cascade (VQA: close-ended; stage: multiple choice), with the accuracy per VQA
    category, and for stage classification the option log-likelihoods' AUC and accuracy."""

    def __init__(self, stage: bool = False):
        super().__init__()
        self.stage = stage

    def update(self, outputs: Outputs, batch: Batch) -> None:
        scored = []
        for item, answer in zip(outputs["items"], outputs["generated"], strict=True):
            if self.stage:
                scored.append(score_answer("mcq", answer, item.answer, options=STAGE_OPTIONS))
            else:
                scored.append(score_answer("close", answer, item.answer, question=item.question))
        self.add(scored=scored, categories=[item.category for item in outputs["items"]])
        if self.stage and outputs["items"]:
            self.add(
                probabilities=outputs["option_scores"].float().softmax(-1).numpy(),
                labels=np.array([item.label for item in outputs["items"]], dtype=np.int64),
            )

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        scored: list[Scored] = [s for part in state.get("scored", []) for s in part]
        result = cascade_metrics(scored)
        if self.stage:
            labels = concat(state.get("labels", [])).astype(np.int64)
            probabilities = concat(state.get("probabilities", []), len(STAGE_GROUPS))
            chosen = probabilities.argmax(1) == labels if len(labels) else np.zeros(0, bool)
            # the options' accuracy needs one class only; no AUC can be computed from one class, and the run says so
            result["option_accuracy"] = 100.0 * float(chosen.mean()) if len(labels) else float("nan")
            one_class = len(np.unique(labels)) < 2
            result["auc"] = float("nan") if one_class else classification_metrics(probabilities, labels)["auc"]
            return result
        categories = [c for part in state.get("categories", []) for c in part]
        for category in VQA_CATEGORIES:
            chosen = [bool(s.correct) for s, c in zip(scored, categories, strict=True) if c == category]
            result[f"accuracy_{category}"] = 100.0 * float(np.mean(chosen)) if chosen else float("nan")
        return result
