"""A MedVInT-style vision-language model (PMC-VQA's MedVInT-TD, Zhang et al. 2023) built from transformers and
torch parts, as a VLM plug-in (``vlm.plugin: gx_ray.models.medvint:MedVInTVLM``): a vision encoder's patch features
read by ``queries`` learnt query tokens through a pre-norm transformer decoder (MedVInT's "Q-Former" decoder:
``qformer_query``, ``qformer_decoder``), mapped to the language model's width by MedVInT-TD's two-layer MLP
(``projection``) and put before the question as a prefix of visual tokens, from which a causal language model
(PMC-LLaMA in the paper) writes the answer. Each view of a case adds its own queries to the prefix, so a volume's
slices are read as a sequence of 2D images: the paper's pseudo-3D reading of the CT, with no change to the model.

``vlm.name`` is a folder holding ``medvint.json`` (:class:`MedVInTSettings`: where the vision encoder and the
language model are, the query decoder's sizes, and optionally a released MedVInT-TD ``checkpoint``). The query
decoder and the projections train, with LoRA on the language model when ``vlm.lora`` is on. PMC-CLIP's ResNet-50,
MedVInT's released vision encoder, is open_clip's and not in transformers: give a CLIP vision model in transformers'
format (``CLIPVisionModel``) in its place; ``image_embed`` takes its features to the decoder's width.
:func:`medvint_names` maps a released checkpoint's names (those of ``src/MedVInT_TD/models/QA_model.py`` in
github.com/xiaoman-zhang/PMC-VQA) onto this model's: the queries, the decoder, the projection and the language model
(its LoRA merged); the ResNet-50's weights cannot map and are skipped, and ``image_embed`` is not in it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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
    width: int = 1024
    layers: int = 12
    heads: int = 8
    feedforward: int = 1024
    """MedVInT-TD's query decoder as its released checkpoint was built (PMC-VQA's ``src/MedVInT_TD/test.py`` and
    ``models/QA_model.py``): 32 queries at PMC-CLIP's feature width 1024, 12 pre-norm layers of 8 heads, feed-forward
    1024. No parameter's shape holds the heads: a checkpoint loads whatever ``heads`` says, so keep 8 for it."""
    checkpoint: str = ""
    """A MedVInT-TD state dict (``torch.save``: its ``pytorch_model.bin``), read through :func:`medvint_names`;
    empty: none."""


RELEASED = (("query_embed.weight", "qformer_query"), ("decoder.", "qformer_decoder."),
            ("fc_l1.", "projection.0."), ("fc_l2.", "projection.2."))  # fmt: skip
"""MedVInT-TD's names (``QA_model``) of the query embeddings, the query decoder and the MLP → this model's."""
LANGUAGE = re.compile(r"^llamacasual\.(?:base_model\.model\.)?")
"""MedVInT-TD's LLaMA, bare or wrapped by peft (``get_peft_model``: ``base_model.model.``)."""
LORA = re.compile(r"^(.+)\.lora_([AB])(?:\.default)?\.weight$")
"""A peft LoRA factor: older peft's ``q_proj.lora_A.weight``, newer peft's ``q_proj.lora_A.default.weight``."""
LORA_ALPHA = 32
"""MedVInT-TD's LoRA alpha (``QA_model.py``'s ``get_peft_config``); the rank is read from the factors' shapes."""


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
        # DETR's pre-norm layer, as MedVInT-TD's: torch's with norm_first has its parameters under the same names
        layer = nn.TransformerDecoderLayer(
            width, settings.heads, dim_feedforward=settings.feedforward, dropout=0.0, norm_first=True, batch_first=True
        )
        self.qformer_decoder = nn.TransformerDecoder(layer, settings.layers, norm=nn.LayerNorm(width))
        hidden = self.language.config.get_text_config().hidden_size
        self.projection = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, hidden))  # fc_l1, fc_l2

    @classmethod
    def from_config(cls, config: VLMConfig, device: torch.device, views: int = 1) -> MedVInTVLM:
        """The model ``config.name``'s ``medvint.json`` describes, its checkpoint loaded, LoRA added; bf16 on a GPU.
        Any number of views: each adds its queries to the prefix."""
        folder = Path(local_weights(config.name))
        settings = read_settings(MedVInTSettings, folder / "medvint.json")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = cls(folder, settings, dtype)
        if settings.checkpoint:  # mapped from disk, not read into memory: the released file holds the whole 7B model
            state = torch.load(folder / settings.checkpoint, map_location="cpu", weights_only=True, mmap=True)
            model.load_medvint(state)
        if (lora := config.lora_settings()) is not None:
            model.language = apply_lora(model.language, lora)  # after the checkpoint: its names are the bare model's
        return model.to(device=device, dtype=dtype)

    def load_medvint(self, state: Mapping[str, torch.Tensor]) -> None:
        """Loads a released MedVInT-TD state (:func:`medvint_names`); raises ``ValueError`` naming the parameters it
        has that this model lacks or holds at another shape, or the queries', decoder's and projection's it lacks."""
        mapped, own = medvint_names(state), self.state_dict()
        unknown = sorted(set(mapped) - set(own))
        reshaped = sorted(f"{k} {tuple(v.shape)}, here {tuple(own[k].shape)}" for k, v in mapped.items()
                          if k in own and v.shape != own[k].shape)  # fmt: skip
        lacking = sorted(k for k in own if k.startswith(("qformer_", "projection.")) and k not in mapped)
        if unknown or reshaped or lacking:
            raise ValueError(
                f"MedVInT-TD checkpoint: parameters this model lacks {unknown[:8]}, at another shape {reshaped[:8]}, "
                f"query-decoder or projection parameters it lacks {lacking[:8]}"
            )
        self.load_state_dict(mapped, strict=False)

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


def medvint_names(state: Mapping[str, torch.Tensor], lora_alpha: float = LORA_ALPHA) -> dict[str, torch.Tensor]:
    """A released MedVInT-TD checkpoint's parameters (``QA_model``'s ``state_dict``) under :class:`MedVInTVLM`'s
    names: ``query_embed.weight`` → ``qformer_query``, ``decoder.*`` → ``qformer_decoder.*``, ``fc_l1.*``/``fc_l2.*``
    → ``projection.0.*``/``projection.2.*``; the LLaMA's ``llamacasual.base_model.model.X`` (or, without peft,
    ``llamacasual.X``) → ``language.X``, newer peft's ``*.base_layer.weight`` → ``*.weight``, and each LoRA pair
    merged into the weight it adapts (``W + alpha / rank · B A``, peft's merge). Left out: ``vision_model.*``
    (PMC-CLIP's ResNet-50, open_clip's: no CLIP vision model can take it) and ``rotary_emb.inv_freq`` (a buffer older
    transformers saved, computed from the config). Raises ``ValueError`` for a LoRA factor without its pair or base."""
    mapped, lora = {}, {}
    for key, value in state.items():
        if key.startswith("vision_model.") or key.endswith("rotary_emb.inv_freq"):
            continue
        if match := LORA.match(key):
            lora.setdefault(match[1], {})[match[2]] = value
            continue
        key = LANGUAGE.sub("language.", key).replace(".base_layer.", ".")
        for released, ours in RELEASED:
            if key.startswith(released):
                key = ours + key.removeprefix(released)
                break
        mapped[key] = value
    for layer, pair in lora.items():
        name = LANGUAGE.sub("language.", layer) + ".weight"
        if name not in mapped or set(pair) != {"A", "B"}:
            raise ValueError(f"MedVInT-TD checkpoint: the LoRA factors {sorted(pair)} of {layer} lack their pair "
                             "or the weight they adapt")  # fmt: skip
        down, up = pair["A"].float(), pair["B"].float()  # (rank, in), (out, rank)
        mapped[name] = (mapped[name].float() + lora_alpha / down.shape[0] * up @ down).to(mapped[name].dtype)
    return mapped
