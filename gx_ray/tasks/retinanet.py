"""The MONAI half of :mod:`gx_ray.tasks.lesion_detection`: RetinaNet's head and detector on the encoder's maps.

Apart from the task so that importing the task (its name, metric and options: a sweep driver, a report) does not
import MONAI, whose package import loads every submodule (seconds); the process that builds the head pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from monai.apps.detection.networks.retinanet_detector import RetinaNetDetector
from monai.apps.detection.networks.retinanet_network import RetinaNetClassificationHead, RetinaNetRegressionHead
from monai.apps.detection.utils.anchor_utils import AnchorGeneratorWithAnchorShape
from torch import nn

CLS_KEY, BOX_REG_KEY = "classification", "box_regression"
"""The network's outputs, by the keys ``RetinaNetDetector`` reads them under (its ``cls_key``, ``box_reg_key``)."""


class DetectionHead(nn.Module):
    """A 1x1x1 projection of one feature map, then MONAI's RetinaNet classification and regression heads."""

    def __init__(self, in_channels: int, channels: int, num_anchors: int, feature_level: int):
        super().__init__()
        self.feature_level = feature_level
        # read by RetinaNetDetector
        self.spatial_dims, self.num_classes, self.num_anchors = 3, 1, num_anchors
        self.cls_key, self.box_reg_key = CLS_KEY, BOX_REG_KEY
        self.project = nn.Sequential(nn.Conv3d(in_channels, channels, 1), nn.GroupNorm(8, channels), nn.ReLU())
        self.classification = RetinaNetClassificationHead(channels, num_anchors, 1, spatial_dims=3)
        self.regression = RetinaNetRegressionHead(channels, num_anchors, spatial_dims=3)

    def forward(self, feature_maps: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        features = [self.project(feature_maps[self.feature_level])]
        return {CLS_KEY: self.classification(features), BOX_REG_KEY: self.regression(features)}


class ATSSRetinaNetDetector(RetinaNetDetector):
    """MONAI's ``RetinaNetDetector`` matching anchors with its ATSS matcher alone: MONAI's own first checks for
    torchvision's ``Matcher``, which fails without torchvision (optional, and needed nowhere else); its ATSS branch
    below is MONAI's, unchanged."""

    def compute_anchor_matched_idxs(
        self,
        anchors: list[torch.Tensor],
        targets: list[dict[str, torch.Tensor]],
        num_anchor_locs_per_level: Sequence[int],
    ) -> list[torch.Tensor]:
        matched = []
        for anchors_per_image, targets_per_image in zip(anchors, targets, strict=True):
            boxes = targets_per_image[self.target_box_key].to(anchors_per_image.device)
            if boxes.numel() == 0:
                matched.append(torch.full((len(anchors_per_image),), -1, dtype=torch.long, device=boxes.device))
                continue
            _, matched_per_image = self.proposal_matcher(
                boxes, anchors_per_image, num_anchor_locs_per_level, self.num_anchors_per_loc
            )
            matched.append(matched_per_image)
        return matched


def build_detector(
    in_channels: int, channels: int, anchor_shapes: Sequence[Sequence[float]], feature_level: int
) -> ATSSRetinaNetDetector:
    """A detector whose network is a :class:`DetectionHead` on ``feature_level``, with one anchor per shape."""
    head = DetectionHead(in_channels, channels, len(anchor_shapes), feature_level)
    anchors = AnchorGeneratorWithAnchorShape(feature_map_scales=(1,), base_anchor_shapes=anchor_shapes)
    return ATSSRetinaNetDetector(head, anchors)
