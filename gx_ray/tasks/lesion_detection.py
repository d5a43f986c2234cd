"""Lesion detection (Table 6): the 3D tumour box from the encoder's vision feature maps, RetinaNet-style.

MONAI's RetinaNet heads run on one of ``Encoded.feature_maps`` (the second finest by default: gastric tumours are
small against the crop), and a ``RetinaNetDetector`` holding them supplies anchors, the ATSS matcher, hard-negative
sampling, the box coder, the losses (BCE, smooth L1) and inference's box selection. Its own ``forward`` would run
its network on the image, so the task calls its public pieces (``generate_anchors``, ``compute_loss``,
``postprocess_detections``) on the feature maps the multimodal encoder made, through which schema cues reach it.

The target is the venous tumour box, end-exclusive ``(z0, y0, x0, z1, y1, x1)`` on the CT grid (MONAI's corner
convention for (z, y, x) arrays). :meth:`prepare` fits the anchor shapes to the training boxes' per-axis quantiles.
A case without a tumour box is unannotated, not tumour-free (every patient has gastric cancer): it adds nothing to
the loss or the metric (:func:`gx_ray.metrics.detection_metrics`, with 3D IoU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from gx_ray.metrics import DETECTION_METRICS, detection_metrics
from gx_ray.modalities import ModelInputs
from gx_ray.modalities.boxes import TARGET_PHASE, tumour_boxes
from gx_ray.tasks.base import Batch, Outputs, Task, TaskMetric, check_train_rows

if TYPE_CHECKING:
    from gx_ray.tasks.retinanet import ATSSRetinaNetDetector

BOX_KEY, LABEL_KEY, SCORE_KEY = "boxes", "labels", "labels_scores"  # RetinaNetDetector's default keys
ANCHOR_QUANTILES = (0.2, 0.5, 0.8)


def flatten_maps(maps: list[torch.Tensor], num_anchors: int) -> torch.Tensor:
    """(B, A * C, d, h, w) maps → (B, d * h * w * A, C): locations, then anchors, as MONAI orders its anchors."""
    flat = []
    for m in maps:
        b, _, d, h, w = m.shape
        per_anchor = m.view(b, num_anchors, -1, d, h, w).permute(0, 3, 4, 5, 1, 2)  # (B, d, h, w, A, C)
        flat.append(per_anchor.reshape(b, d * h * w * num_anchors, -1))
    return torch.cat(flat, dim=1)


@dataclass
class LesionDetection(Task):
    name = "lesion_detection"
    short_name = "lesion"
    report_imports = ("monai.apps.detection.metrics.matching",)
    """The report rescoring detection trials matches boxes with MONAI; importing it imports all of MONAI (5-14 s)."""
    primary_metric = "ap_50"
    mode = "max"
    # ATSS matching and hard-negative sampling per image wait on the GPU many times a step: three packed on one H200
    # trained at 3.8 samples/s each against 33.9 alone, while the other tasks kept their summed rate (cluster benchmark)
    shares_a_gpu = False

    feature_level: int = 1
    """Which of ``Encoded.feature_maps`` the head reads (0 = finest): 1 is stride 4 for the 3D ResNets and Swin,
    fine enough for small tumours while the head's four 3x3x3 convolutions stay affordable at the paper's crop."""
    head_channels: int = 64
    score_threshold: float = 0.02
    nms_threshold: float = 0.22
    detections_per_case: int = 20
    atss_candidates: int = 4
    negatives_per_case: int = 64
    """Anchors sampled per case for the classification loss (hard negatives and positives)."""
    anchor_shapes: tuple[tuple[float, float, float], ...] = field(default=(), init=False)
    """(z, y, x) sizes in voxels, fitted by :meth:`prepare`."""

    def prepare(self, train_rows: Iterable[Mapping[str, Any]]) -> None:
        """Anchor shapes: the per-axis 20/50/80 % quantiles of the training tumour boxes' sizes."""
        rows = check_train_rows(train_rows, self.name)
        sizes = []
        for row in rows:
            boxes, present = tumour_boxes(row["boxes"], row["box_present"])
            sizes += [b[3:] - b[:3] for b in boxes[present]]
        if not sizes:
            raise ValueError(f"no {TARGET_PHASE} tumour boxes in the {len(rows)} training rows")
        quantiles = np.quantile(np.asarray(sizes), ANCHOR_QUANTILES, axis=0)
        # MONAI rounds half-sizes to whole voxels: keep every anchor at least 2 voxels wide
        self.anchor_shapes = tuple(tuple(float(max(s, 2.0)) for s in q) for q in quantiles)

    def build_head(self, dim: int, tokenizer: Any = None, map_channels: Sequence[int] = ()) -> nn.Module:
        if not self.anchor_shapes:
            raise RuntimeError("anchor shapes are not fitted: call prepare(train_rows) first")
        if not map_channels:
            raise ValueError("lesion detection needs the channels of the encoder's feature maps (map_channels)")
        from gx_ray.tasks.retinanet import build_detector  # MONAI: imported by the process that trains, not by all

        detector = build_detector(
            map_channels[self.feature_level], self.head_channels, self.anchor_shapes, self.feature_level
        )
        detector.set_atss_matcher(num_candidates=self.atss_candidates, center_in_gt=False)
        detector.set_hard_negative_sampler(
            batch_size_per_image=self.negatives_per_case, positive_fraction=0.3, pool_size=20, min_neg=16
        )
        detector.set_box_selector_parameters(
            score_thresh=self.score_threshold,
            topk_candidates_per_level=1000,
            nms_thresh=self.nms_threshold,
            detections_per_img=self.detections_per_case,
        )
        return detector

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        maps = head.network(encoder(inputs).feature_maps)
        head.generate_anchors(inputs.ct, maps)  # strides = CT size // map size, so anchors live on the CT grid
        locations = [m.shape[2:].numel() for m in maps[head.cls_key]]
        # float32 from here on: under bf16 autocast, decoded boxes would otherwise be rounded to bf16 (steps of
        # 1-2 voxels at the paper's crop size)
        flat = {
            key: flatten_maps(maps[key], head.num_anchors_per_loc).float() for key in (head.cls_key, head.box_reg_key)
        }
        # the matcher, sampler and loss functions live in the detector: the loss terms are computed here
        outputs = {"losses": self._losses(head, flat, locations, batch)}
        if not head.training:
            sizes = [list(inputs.ct.shape[2:])] * inputs.batch_size
            with torch.no_grad():
                detections = head.postprocess_detections(
                    {k: v.detach() for k, v in flat.items()}, head.anchors, sizes, locations
                )
            outputs["detections"] = [
                {"boxes": d[BOX_KEY].float().cpu().numpy(), "scores": d[SCORE_KEY].float().cpu().numpy()}
                for d in detections
            ]
        return outputs

    @staticmethod
    def _losses(
        detector: ATSSRetinaNetDetector, flat: dict[str, torch.Tensor], locations: list[int], batch: Batch
    ) -> list[torch.Tensor]:
        boxes, present = tumour_boxes(batch["boxes"], batch["box_present"])
        if not present.any():
            return [sum(v.sum() for v in flat.values()) * 0.0]
        keep = np.flatnonzero(present)
        device = flat[detector.cls_key].device
        index = torch.as_tensor(keep, device=device)
        targets = [
            {
                BOX_KEY: torch.as_tensor(boxes[i : i + 1], device=device),
                LABEL_KEY: torch.zeros(1, dtype=torch.long, device=device),
            }
            for i in keep
        ]
        losses = detector.compute_loss(
            {key: value.index_select(0, index) for key, value in flat.items()},
            targets,
            [detector.anchors[i] for i in keep],
            locations,
        )
        return [losses[detector.cls_key], losses[detector.box_reg_key]]

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        """Anchor classification (BCE over sampled anchors) plus box regression (smooth L1)."""
        return sum(outputs["losses"])

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        if "detections" not in outputs:
            raise ValueError("detections need the model in eval mode (box selection runs only there)")
        boxes, present = tumour_boxes(batch["boxes"], batch["box_present"])
        return [
            {
                "case_id": case_id,
                "prediction": {
                    "boxes": np.round(d["boxes"].astype(float), 1).tolist(),
                    "scores": np.round(d["scores"].astype(float), 4).tolist(),
                },
                "target": boxes[i].astype(int).tolist() if present[i] else None,
            }
            for i, (case_id, d) in enumerate(zip(batch["case_id"], outputs["detections"], strict=True))
        ]

    def metric(self) -> TaskMetric:
        return DetectionMetric()

    def chance_level(self, train_rows: Sequence[dict], test_rows: Sequence[dict]) -> float:
        """The training tumours' median box (each corner's median) predicted for every test case, one score."""
        train = [tumour_boxes(r["boxes"], r["box_present"]) for r in train_rows]
        train_boxes = [boxes[0] for boxes, present in train if present[0]]
        test = [tumour_boxes(r["boxes"], r["box_present"]) for r in test_rows]
        targets = [{"boxes": boxes} for boxes, present in test if present[0]]
        if not train_boxes or not targets:
            return float("nan")
        prior = {"boxes": np.median(np.stack(train_boxes), axis=0)[None], "scores": np.ones(1)}
        return detection_metrics([prior] * len(targets), targets)[self.primary_metric]


class DetectionMetric(TaskMetric):
    """COCO-style 3D detection metrics over the cases that have a tumour box."""

    def update(self, outputs: Outputs, batch: Batch) -> None:
        if "detections" not in outputs:
            raise ValueError("detection metrics need the model in eval mode (box selection runs only there)")
        boxes, present = tumour_boxes(batch["boxes"], batch["box_present"])
        for i in np.flatnonzero(present):
            self.add(predictions=outputs["detections"][i], targets={"boxes": boxes[i : i + 1]})

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        if not state.get("targets"):
            return dict.fromkeys(DETECTION_METRICS, float("nan"))
        return detection_metrics(state["predictions"], state["targets"])
