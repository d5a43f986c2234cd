"""What the multimodal encoder hands to a task head."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Encoded:
    """The encoder's view of one batch, all features of width ``dim`` (the model config's ``hidden``). ``pooled``: the
    fused representation a classifier reads and retrieval aligns with the report; ``tokens``: the fused sequence a text
    decoder cross-attends to (image, then text-context and query tokens); ``image``: the image side alone (vision and
    its cues, before any text); ``feature_maps``: the spatial vision features a detector reads."""

    pooled: torch.Tensor
    """(B, dim)."""
    tokens: torch.Tensor
    """(B, T, dim)."""
    token_mask: torch.Tensor
    """(B, T) bool, True where a token is real."""
    image: torch.Tensor
    """(B, dim)."""
    feature_maps: list[torch.Tensor]
    """Vision feature maps, finest first, each (B, C_i, d_i, h_i, w_i), after the schema's cues were applied:
    what a dense head (lesion detection) reads."""
