"""What a model is given: the inputs a modality schema selects from a collated shard batch, on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelInputs:
    """One batch of model inputs. Built by :func:`gx_ray.modalities.build_inputs`; read by the encoders.

    ``ct`` holds the schema's phases (absent phases are zeros, see ``phase_mask``) followed by one box-mask
    channel per box level when the schema asks for box cues as channels; with overlay cues the boxes are drawn
    into the phase channels instead. ``text`` is the schema's text context per sample (abnormal lab values as
    descriptors, input reports), ``None`` when the schema has none. ``table`` is the numeric lab vector
    (normalised values, then missing flags) when the schema asks for numbers.
    """

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

    def to(self, device: torch.device | str) -> ModelInputs:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return ModelInputs(move(self.ct), move(self.phase_mask), move(self.endoscopy), self.text, move(self.table))
