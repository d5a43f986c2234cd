"""LLaVA-Med v1.5 as the Gastric-X paper adapts it to CT: its vision encoder replaced by a 3D Swin Transformer
(gx-ray's ``swin3d``, MONAI's SwinUNETR encoder) that reads the volume itself, one stage's tokens mapped by
LLaVA-1.5's two-layer projector into the language model before the question. A VLM plug-in
(``vlm.plugin: gx_ray.models.swin_vlm:Swin3dVLM``).

The protocol hands a plug-in each case's 2D views; this one stacks them back into the slab they were cut from:
``views.phase_layout: images`` and ``views.mode: stack`` give a case's ``phases x views.slices`` images, phase-major,
which become a ``(phases, slices, H, W)`` volume (the views' grey level), resized to ``depth x size x size``
(multiples of 32, as the Swin's stages need). ``vlm.name`` is a folder holding ``swin_vlm.json``
(:class:`Swin3dVLMSettings`). The projector trains, the Swin too under ``vlm.train_vision`` (the paper fine-tunes it
from pre-trained weights: ``checkpoint``, a state dict of MONAI's ``SwinTransformer`` keys, bare or under
SwinUNETR's ``swinViT.``), and LoRA on the language model under ``vlm.lora``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.models.lora import apply_lora
from gx_ray.models.prefix import PrefixVLM, Views
from gx_ray.models.tiny_vlms import local_weights
from gx_ray.models.vision import Swin3d
from gx_ray.models.vlm import VLMConfig, read_settings


@dataclass(frozen=True)
class Swin3dVLMSettings:
    """``swin_vlm.json`` in the folder ``vlm.name`` names; ``language`` relative to it (or a hub name)."""

    language: str
    """A causal language model and its tokenizer (LLaVA-Med v1.5's Mistral-7B, taken out of its LLaVA checkpoint)."""
    phases: int = 4
    """The phases a case's views hold (``schema.phases``): its views are ``phases x views.slices``."""
    depth: int = 32
    size: int = 128
    stage: int = -1
    """Which of the Swin's five stage outputs becomes the prefix (-1, the deepest: ``depth/32 x (size/32)²`` tokens)."""
    swin: dict[str, Any] = field(default_factory=dict)
    """swin3d's ``vision_kwargs`` (``feature_size``, ``depths``, ``num_heads``, ``window_size``, ...)."""
    checkpoint: str = ""
    prompt: str = "[INST] {question} [/INST]"
    """LLaVA-Med v1.5's Mistral instruction format."""


class Swin3dVLM(PrefixVLM):
    """The VLM plug-in: the 3D Swin (frozen unless ``train_vision``), the projector, the language model frozen but
    for LoRA."""

    def __init__(self, folder: Path, settings: Swin3dVLMSettings, dtype: torch.dtype | None = None,
                 train_vision: bool = False):  # fmt: skip
        super().__init__()
        language = str(folder / settings.language) if (folder / settings.language).exists() else settings.language
        self._load_language(language, dtype)
        self.settings, self.PROMPT = settings, settings.prompt
        self.vision = Swin3d(settings.phases, **settings.swin).requires_grad_(train_vision)
        if settings.checkpoint:
            self.load_swin(torch.load(folder / settings.checkpoint, map_location="cpu", weights_only=True))
        width, dim = self.vision.channels[settings.stage], self.language.config.get_text_config().hidden_size
        self.projector = nn.Sequential(nn.Linear(width, dim), nn.GELU(), nn.Linear(dim, dim))  # LLaVA's mlp2x_gelu

    @classmethod
    def from_config(cls, config: VLMConfig, device: torch.device, views: int = 1) -> Swin3dVLM:
        """The model ``config.name``'s ``swin_vlm.json`` describes, LoRA added; bf16 on a GPU. ``views`` must be
        the settings' phases times the slab's slices."""
        folder = Path(local_weights(config.name))
        settings = read_settings(Swin3dVLMSettings, folder / "swin_vlm.json")
        if views % settings.phases:
            raise ValueError(
                f"{config.name}: a case's {views} views are not {settings.phases} phases of one slab each: set "
                "views.phase_layout: images, views.mode: stack and the schema's phases to swin_vlm.json's phases"
            )
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = cls(folder, settings, dtype, config.train_vision)
        if (lora := config.lora_settings()) is not None:
            model.language = apply_lora(model.language, lora)
        return model.to(device=device, dtype=dtype)

    def load_swin(self, state: dict[str, torch.Tensor]) -> None:
        """MONAI ``SwinTransformer`` weights, bare or as SwinUNETR keeps them (``swinViT.``; its decoder's keys left
        out); raises ``ValueError`` naming the Swin's parameters the state lacks."""
        own = self.vision.backbone.state_dict()
        bare = {k.removeprefix("swinViT."): v for k, v in state.items()}
        result = self.vision.backbone.load_state_dict({k: v for k, v in bare.items() if k in own}, strict=False)
        if result.missing_keys:
            raise ValueError(f"3D Swin checkpoint: parameters it lacks {result.missing_keys[:8]}")

    def _prefix(self, images: Views) -> torch.Tensor:
        """(B, tokens, D): each case's views stacked back into its volume, through the Swin and the projector."""
        parameter = self.projector[0].weight
        grey = torch.as_tensor(np.stack([np.stack(case) for case in images])).mean(2)  # (B, V, H, W)
        volume = grey.unflatten(1, (self.settings.phases, -1)).to(parameter.device, parameter.dtype)
        volume = F.interpolate(volume, size=(self.settings.depth, self.settings.size, self.settings.size),
                               mode="trilinear", align_corners=False)  # fmt: skip
        with torch.set_grad_enabled(torch.is_grad_enabled() and any(p.requires_grad for p in self.vision.parameters())):
            stage = self.vision(volume)[self.settings.stage]
        return self.projector(stage.flatten(2).transpose(1, 2))
