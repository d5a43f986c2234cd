"""What a model is given: the inputs a modality schema selects from a collated shard batch, on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelInputs:
    """One batch of model inputs, built by :func:`gx_ray.modalities.build_inputs` (:mod:`gx_ray.modalities.build` says
    what each holds: absent phases are zeros, box-mask channels follow the phases); read by the encoders."""

    ct: torch.Tensor
    """(B, C, D, H, W) float32."""
    phase_mask: torch.Tensor
    """(B, len(schema.phases)) bool: which phase channels hold a scan."""
    endoscopy: torch.Tensor | None = None
    """(B, 3, S, S) float32, ImageNet-normalised RGB."""
    text: list[str] | None = None
    table: torch.Tensor | None = None
    """(B, 2 * n_variables) float32."""

    @property
    def batch_size(self) -> int:
        return self.ct.shape[0]
