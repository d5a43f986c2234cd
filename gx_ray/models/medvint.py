"""A MedVInT-style vision-language model (PMC-VQA's MedVInT-TD, Zhang et al. 2023) built from transformers and
torch parts, as a VLM plug-in (``vlm.plugin: gx_ray.models.medvint:MedVInTVLM``): a vision encoder's patch features
read by ``queries`` learnt query tokens through a transformer decoder (MedVInT's "Q-Former" decoder:
``qformer_query``, ``qformer_decoder``), mapped to the language model's width and put before the question as a prefix
of visual tokens, from which a causal language model (PMC-LLaMA in the paper) writes the answer. Each view of a case
adds its own queries to the prefix, so a volume's slices are read as a sequence of 2D images: the paper's pseudo-3D
reading of the CT, with no change to the model.

``vlm.name`` is a folder holding ``medvint.json`` (:class:`MedVInTSettings`: where the vision encoder and the
language model are, the query decoder's sizes). The query decoder and the projections train, with LoRA on the
language model when ``vlm.lora`` is on. PMC-CLIP's ResNet-50, MedVInT's released vision encoder, is open_clip's and
not in transformers: give a CLIP vision model in transformers' format (``CLIPVisionModel``) in its place. A released
MedVInT checkpoint is not read (its parameter names are not mapped here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gx_ray.models.lora import apply_lora
from gx_ray.models.prefix import PrefixVLM, Views
from gx_ray.models.tiny_vlms import local_weights
from gx_ray.models.vlm import VLMConfig, read_settings


@dataclass(frozen=True)
class MedVInTSettings:
    """``medvint.json`` in the folder ``vlm.name`` names; paths are relative to it (or hub names)."""

    vision: str
    """A CLIP vision model and its image processor, in transformers' format."""
    language: str
    """A causal language model and its tokenizer (MedVInT: PMC-LLaMA)."""
    queries: int = 32
    width: int = 768
    layers: int = 12
    heads: int = 4
    """MedVInT's query decoder: 32 queries, width 768, 12 layers of 4 heads (its feed-forward as wide as the layer)."""


class MedVInTVLM(PrefixVLM):
    """The VLM plug-in: the vision encoder and the language model frozen; the query decoder and the two projections
    trained (LoRA on the language model too where ``vlm.lora``)."""

    PROMPT = "Question: {question} The Answer is:"

    def __init__(self, folder: Path, settings: MedVInTSettings, dtype: torch.dtype | None = None):
        super().__init__()
        from transformers import CLIPImageProcessor, CLIPVisionModel

        def located(name: str) -> str:  # a folder beside medvint.json, else a hub name
            return str(folder / name) if (folder / name).exists() else name

        self._load_language(located(settings.language), dtype)
        self.image_processor = CLIPImageProcessor.from_pretrained(located(settings.vision))
        self.vision_encoder = CLIPVisionModel.from_pretrained(located(settings.vision), dtype=dtype)
        self.requires_grad_(False)
        width = settings.width
        self.image_embed = nn.Linear(self.vision_encoder.config.hidden_size, width)
        self.qformer_query = nn.Parameter(torch.randn(settings.queries, width) * width**-0.5)
        layer = nn.TransformerDecoderLayer(
            width, settings.heads, dim_feedforward=width, dropout=0.0, norm_first=True, batch_first=True
        )
        self.qformer_decoder = nn.TransformerDecoder(layer, settings.layers, norm=nn.LayerNorm(width))
        self.projection = nn.Linear(width, self.language.config.get_text_config().hidden_size)

    @classmethod
    def from_config(cls, config: VLMConfig, device: torch.device, views: int = 1) -> MedVInTVLM:
        """The model ``config.name``'s ``medvint.json`` describes, LoRA added; bf16 on a GPU. Any number of views:
        each adds its queries to the prefix."""
        folder = Path(local_weights(config.name))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = cls(folder, read_settings(MedVInTSettings, folder / "medvint.json"), dtype)
        if (lora := config.lora_settings()) is not None:
            model.language = apply_lora(model.language, lora)
        return model.to(device=device, dtype=dtype)

    def _prefix(self, images: Views) -> torch.Tensor:
        """(B, views x queries, D): each view's patch features read by the queries, at the language model's width."""
        from gx_ray.models.vlm import to_pil

        flat = [to_pil(view) for case in images for view in case]
        pixels = self.image_processor(images=flat, return_tensors="pt")["pixel_values"]
        parameter = self.qformer_query
        with torch.no_grad():
            patches = self.vision_encoder(pixel_values=pixels.to(parameter.device, parameter.dtype)).last_hidden_state
        memory = self.image_embed(patches[:, 1:])  # the patch tokens, not the class token (MedVInT's [:, 1:])
        read = self.qformer_decoder(parameter.expand(len(flat), -1, -1), memory)
        return self.projection(read).unflatten(0, (len(images), -1)).flatten(1, 2)
