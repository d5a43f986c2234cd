"""GastroINST-style endoscopy tasks on each case's frame, after the upper-GI endoscopy paper (families,
``family``):

- ``cls``: the frame → its anatomical site (:data:`~gx_ray.data.endoscopy_annotations.SITES`); accuracy;
- ``reg``: the frame with a region's box drawn in → the region's class
  (:data:`~gx_ray.data.endoscopy_annotations.REGION_CLASSES`); accuracy;
- ``rec``: the frame and a referring expression ("the early gastric cancer in the antrum") → the region's box;
  accuracy is the share of boxes found at IoU >= 0.5 (the paper's criterion), beside COCO's mAP@[.5:.95] from
  pycocotools (:func:`~gx_ray.metrics.detection.detection_metrics_axial`) and the mean IoU;
- ``cap``: the frame → its caption (the annotation file's); ROUGE-L (primary) and BLEU-4 every epoch, METEOR and
  BERTScore-F1 too with ``full_metrics`` (:func:`~gx_ray.metrics.text_generation_metrics`, as report generation).

**Material**: the cohort's frame annotations (:mod:`gx_ray.data.endoscopy_annotations`, beside the shards); ``reg``
and ``rec`` ask about a frame's first box. A case without what its family needs gets a reason instead
(:attr:`Endoscopy.skipped`, logged with the trial).

**Model**: a 2D MONAI ResNet on the ImageNet-normalised frame; a linear head over classes; for ``rec`` the frame's
features beside the expression's into a box head (sigmoid centre and size; L1 plus MONAI's GIoU loss); for ``cap``
report generation's small decoder (:func:`~gx_ray.tasks.report_generation.build_decoder`) cross-attending to the
frame's features, taught the first ``caption_tokens`` tokens, greedy at evaluation. The frame is every family's
input, and no report is (the endoscopy report names the site and the lesion: rule ``reports_in_endoscopy``).

**Chance**: the training split's most frequent class (``cls``, ``reg``); the median training box (``rec``); a random
training caption per test frame, averaged over five draws (``cap``: a writer who never looks at the frame).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.data.endoscopy_annotations import REGION_CLASSES, SITES, FrameAnnotation, load_prepared
from gx_ray.metrics import FAST_TEXT_METRICS, MCQ_METRICS, TEXT_METRICS, mcq_metrics, text_generation_metrics
from gx_ray.metrics.detection import box_iou, detection_metrics_axial
from gx_ray.modalities import ModelInputs
from gx_ray.modalities.boxes import box_outlines
from gx_ray.modalities.build import imagenet_normalised
from gx_ray.modalities.views import OVERLAY_COLOUR
from gx_ray.models.vision import Endoscopy2d
from gx_ray.tasks.base import Batch, Outputs, Task, TaskMetric
from gx_ray.tasks.report_generation import DecoderConfig, ReportMetric, build_decoder, cut_texts, teacher_forced_loss

FAMILIES: dict[str, tuple[str, ...]] = {"cls": SITES, "reg": REGION_CLASSES, "rec": (), "cap": ()}
"""Family → the classes it chooses among (``rec`` finds a box, ``cap`` writes the caption)."""
CAPTION_METRIC = "rouge_l"
COCO_SCALE = 1000.0
"""Boxes are fractions of the frame; pycocotools gets them in a 1000 x 1000 frame (its area ranges are in pixels)."""


def rec_metrics(predicted: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """REC on paired ``(n, 4)`` boxes (fractions of the frame): accuracy at IoU >= 0.5 and mAP@[.5:.95] through
    pycocotools (one scored box per frame), both in percent, and the mean IoU."""
    if not len(target):
        return {"accuracy": float("nan"), "map_50_95": float("nan"), "mean_iou": float("nan")}

    def entry(box: np.ndarray) -> list[float]:
        x0, y0, x1, y1 = (box * COCO_SCALE).tolist()
        return [0.0, y0, x0, 1.0, y1, x1]  # a 2D box as detection_metrics_axial's (z, y, x) box one slice deep

    coco = detection_metrics_axial(
        [{"boxes": [entry(p)], "scores": [1.0]} for p in predicted], [{"boxes": [entry(t)]} for t in target]
    )
    return {
        "accuracy": coco["loc_acc_50"],
        "map_50_95": coco["map_50_95"],
        "mean_iou": 100 * float(np.diag(box_iou(predicted, target)).mean()),
    }


class EndoscopyHead(nn.Module):
    def __init__(self, dim: int, depth: int, family: str, view_kwargs: dict[str, Any]):
        super().__init__()
        self.view = Endoscopy2d(depth, in_channels=3, **view_kwargs)
        width, classes = self.view.dim, len(FAMILIES[family])
        self.classify = nn.Linear(width, classes) if classes else None
        box = family == "rec"
        self.box = nn.Sequential(nn.Linear(width + dim, dim), nn.GELU(), nn.Linear(dim, 4)) if box else None
        self.caption = None  # cap: the decoder (Endoscopy.build_head)


@dataclass
class Endoscopy(Task):
    name = "endoscopy"
    primary_metric = "accuracy"
    mode = "max"
    label_options = ("family",)

    family: str = "cls"
    view_depth: int = 18
    view_kwargs: dict[str, Any] = field(default_factory=dict)
    """MONAI ResNet arguments of the frame encoder (``block_inplanes`` for a CPU-sized one)."""
    caption_tokens: int = 64
    """``cap``: the decoder is taught (and scored on) each caption's first ``caption_tokens`` tokens."""
    max_new_tokens: int = 64
    decoder_width: int = 128
    decoder_layers: int = 2
    decoder_heads: int = 2
    full_metrics: bool = False
    """``cap``: METEOR and BERTScore-F1 besides ROUGE-L and BLEU-4."""
    frames: dict[str, FrameAnnotation] = field(default_factory=dict, init=False)
    skipped: dict[str, str] = field(default_factory=dict, init=False)
    training_captions: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown endoscopy family {self.family!r}; valid: {', '.join(FAMILIES)}")
        if self.caption_tokens < 2 or self.max_new_tokens < 1:
            raise ValueError("caption_tokens must be at least 2 and max_new_tokens at least 1")
        self.primary_metric = self.primary_metric_for({"family": self.family})

    @classmethod
    def primary_metric_for(cls, options: Mapping[str, Any]) -> str:
        return CAPTION_METRIC if options.get("family") == "cap" else cls.primary_metric

    def attach_splits(
        self, rows: Mapping[str, Sequence[Mapping[str, Any]]], manifest: Mapping[str, Any], shards: str | None = None
    ) -> None:
        annotations = load_prepared(shards) if shards else {}
        if not annotations:
            raise ValueError(
                f"the endoscopy tasks need frame annotations beside the shards ({shards}): prepare the cohort with "
                "its endoscopy_annotations.json (python jobs/prepare_data.py --endoscopy-annotations FILE)"
            )
        self.frames, self.skipped = {}, {}
        for row in (r for split in rows.values() for r in split):
            case = row["case_id"]
            frame = annotations.get(case)
            if frame is None:
                self.skipped[case] = "no endoscopy annotation"
            elif self.family != "cls" and not frame.boxes:
                self.skipped[case] = "no region box on the frame"
            else:
                self.frames[case] = frame
        train = [self.frames[r["case_id"]] for r in rows.get("train", ()) if r["case_id"] in self.frames]
        self.training_captions = [frame.caption for frame in train]

    def build_head(self, dim: int, tokenizer: Any = None, map_channels: Sequence[int] = ()) -> nn.Module:
        head = EndoscopyHead(dim, self.view_depth, self.family, self.view_kwargs)
        if self.family == "cap":
            if not self.training_captions:
                raise ValueError("no training frame has a caption: attach the splits first (attach_splits)")
            self.tokenizer = tokenizer  # the chance level's captions are cut with it
            config = DecoderConfig(
                width=self.decoder_width, layers=self.decoder_layers, heads=self.decoder_heads,
                max_positions=max(512, self.caption_tokens, self.max_new_tokens + 1), max_tokens=self.caption_tokens,
            )  # fmt: skip
            head.caption = build_decoder(tokenizer, head.view.dim, config, self.training_captions)
        return head

    def target(self, frame: FrameAnnotation) -> Any:
        if self.family == "cap":
            return frame.caption
        if self.family == "cls":
            return SITES.index(frame.site)
        if self.family == "reg":
            return REGION_CLASSES.index(frame.region_classes[0])
        return frame.boxes[0]

    def _frames(self, batch: Batch, asked: list[int], device: torch.device) -> torch.Tensor:
        rgb = batch["endoscopy"][asked].to(device).float() / 255.0
        if self.family == "reg":  # the region asked about, outlined in the overlay colour (one slice deep)
            size = rgb.shape[-1]
            corners = [[round(v * size) for v in self.frames[batch["case_id"][i]].boxes[0]] for i in asked]
            boxes = torch.tensor([[0, y0, x0, 1, max(y1, y0 + 1), max(x1, x0 + 1)] for x0, y0, x1, y1 in corners])
            outline = box_outlines(boxes.to(device), (1, size, size))[:, 0, None]  # (n, 1, S, S)
            colour = torch.tensor(OVERLAY_COLOUR, device=device)[None, :, None, None]
            rgb = torch.where(outline, colour, rgb)
        return imagenet_normalised(rgb)

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        present = batch["endoscopy_present"].tolist()
        asked = [i for i, c in enumerate(batch["case_id"]) if c in self.frames and present[i]]
        cases = [batch["case_id"][i] for i in asked]
        device = next(head.parameters()).device
        if not asked:
            empty = next(head.parameters()).new_zeros(0, len(FAMILIES[self.family]) or 4)
            out = {"out": empty + sum(p.sum() * 0 for p in head.parameters()), "asked": []}
            return {**out, "generated": [], "references": []} if self.family == "cap" else out
        features = head.view(self._frames(batch, asked, device))
        if self.family == "cap":
            return self._caption(head, features, cases)
        if self.family != "rec":
            return {"out": head.classify(features), "asked": cases}
        frames = [self.frames[c] for c in cases]
        expressions = [f"the {f.region_classes[0]} in the {f.site}" for f in frames]
        raw = torch.sigmoid(head.box(torch.cat([features, encoder.encode_text(expressions).float()], -1)).float())
        centre, extent = raw[:, :2], raw[:, 2:] / 2
        return {"out": torch.cat([centre - extent, centre + extent], -1).clamp(0, 1), "asked": cases}

    def _caption(self, head: EndoscopyHead, features: torch.Tensor, cases: list[str]) -> Outputs:
        """Teacher-forced logits of the frames' captions; in evaluation also the captions written greedily."""
        decoder = head.caption
        captions = [self.frames[c].caption for c in cases]
        memory = features[:, None, :]  # the frame as one token
        memory_mask = torch.ones(memory.shape[:2], dtype=torch.bool, device=memory.device)
        logits, labels = decoder.teach(captions, self.caption_tokens, memory, memory_mask)
        outputs = {"logits": logits, "labels": labels, "asked": cases}
        if not head.training:
            outputs["generated"] = decoder.generate(memory, memory_mask, max_new_tokens=self.max_new_tokens)
            outputs["references"] = cut_texts(decoder.tokenizer, captions, self.caption_tokens)
        return outputs

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        if not outputs["asked"]:
            return outputs["out"].sum() * 0.0
        if self.family == "cap":
            return teacher_forced_loss(outputs["logits"], outputs["labels"])
        out = outputs["out"]
        targets = [self.target(self.frames[c]) for c in outputs["asked"]]
        if self.family != "rec":
            return F.cross_entropy(out.float(), torch.tensor(targets, device=out.device))
        from monai.losses import BoxGIoULoss

        boxes = torch.tensor(targets, device=out.device, dtype=torch.float32)
        return F.l1_loss(out, boxes) + BoxGIoULoss()(out, boxes)

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        if self.family == "cap":
            if "generated" not in outputs:
                raise ValueError("caption predictions need the model in eval mode (generation runs only there)")
            return [
                {"case_id": case, "prediction": written, "target": reference}
                for case, written, reference in zip(
                    outputs["asked"], outputs["generated"], outputs["references"], strict=True
                )
            ]
        records = []
        for case, out in zip(outputs["asked"], outputs["out"].detach().float().cpu().numpy(), strict=True):
            target = self.target(self.frames[case])
            if self.family == "rec":
                iou = float(box_iou(out[None], np.asarray([target]))[0, 0])
                records.append(
                    {"case_id": case, "prediction": out.round(4).tolist(), "target": list(target), "iou": iou}
                )
            else:
                names = FAMILIES[self.family]
                chosen = int(out.argmax())
                records.append(
                    {"case_id": case, "prediction": names[chosen], "target": names[target], "correct": chosen == target}
                )
        return records

    def metric(self) -> TaskMetric:
        if self.family == "cap":
            return ReportMetric("en", TEXT_METRICS if self.full_metrics else FAST_TEXT_METRICS)
        return EndoscopyMetric(self)

    def documents(self) -> dict[str, Any]:
        """Which cases were asked and why the others were not: logged with the trial."""
        asked = sorted(self.frames)
        return {"endoscopy/samples.json": {"family": self.family, "asked": asked, "skipped": self.skipped}}

    def chance_level(self, train_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> float:
        train = [self.target(self.frames[r["case_id"]]) for r in train_rows if r["case_id"] in self.frames]
        test = [self.target(self.frames[r["case_id"]]) for r in test_rows if r["case_id"] in self.frames]
        if not train or not test:
            return float("nan")
        if self.family == "cap":
            train, test = (cut_texts(self.tokenizer, texts, self.caption_tokens) for texts in (train, test))
            rng = np.random.default_rng(0)
            draws = [[train[i] for i in rng.integers(0, len(train), len(test))] for _ in range(5)]
            scores = [text_generation_metrics(d, test, "en", [CAPTION_METRIC])[CAPTION_METRIC] for d in draws]
            return float(np.mean(scores))
        if self.family == "rec":
            median = np.median(np.asarray(train), axis=0)
            return rec_metrics(np.repeat(median[None], len(test), 0), np.asarray(test))["accuracy"]
        common = Counter(train).most_common(1)[0][0]
        return 100.0 * float(np.mean([t == common for t in test]))


class EndoscopyMetric(TaskMetric):
    """Accuracy with its Wilson interval (``cls``, ``reg``); REC's accuracy at IoU >= 0.5, mAP and mean IoU."""

    def __init__(self, task: Endoscopy):
        self.task = task
        super().__init__()

    def update(self, outputs: Outputs, batch: Batch) -> None:
        if outputs["asked"]:
            targets = [self.task.target(self.task.frames[c]) for c in outputs["asked"]]
            out = outputs["out"].detach().float().cpu().numpy()
            chosen = out.tolist() if self.task.family == "rec" else out.argmax(1).tolist()
            self.add(chosen=chosen, answers=[list(t) if isinstance(t, tuple) else t for t in targets])

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        chosen = [c for part in state.get("chosen", []) for c in part]
        answers = [a for part in state.get("answers", []) for a in part]
        if self.task.family == "rec":
            return {**rec_metrics(np.asarray(chosen), np.asarray(answers)), "questions": float(len(answers))}
        if not answers:
            return dict.fromkeys((*MCQ_METRICS, "questions"), float("nan"))
        return {**mcq_metrics(chosen, answers), "questions": float(len(answers))}
