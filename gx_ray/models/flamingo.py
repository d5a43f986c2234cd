"""A Flamingo-style vision-language model (OpenFlamingo, Med-Flamingo) built from transformers parts, as a VLM
plug-in (``vlm.plugin: gx_ray.models.flamingo:FlamingoVLM``): a CLIP vision encoder, a perceiver resampler, and gated
cross-attention blocks before every ``every``-th decoder layer of a frozen causal language model (forward pre-hooks,
so the language model keeps its own modules and names). A question's views are an interleaved image sequence (one
``<image>`` token each, the pseudo-3D reading of a CT that Med-Flamingo gets); text after an image attends to that
image's latents only, as OpenFlamingo's ``only_attend_immediate_media``.

``vlm.name`` is a folder holding ``flamingo.json`` (:class:`FlamingoSettings`: where the vision encoder and the
language model are, the resampler's and blocks' sizes, and optionally an OpenFlamingo-format ``checkpoint``). The
resampler and the blocks train (Flamingo's recipe), with LoRA on the language model when ``vlm.lora`` is on.
:func:`openflamingo_names` maps a released checkpoint's parameter names onto this model's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gx_ray.models.lora import apply_lora
from gx_ray.models.tiny_vlms import local_weights
from gx_ray.models.vlm import (
    VLMConfig,
    answer_log_likelihood,
    answer_rows,
    greedy_answer,
    mean_text_state,
    read_settings,
)

SECOND_NAME = re.compile(r"lang_encoder\.model\.layers\.\d+\.gated_cross_attn_layer\.")
"""OpenFlamingo's second name for each gated block (its wrapper of the decoder layer holds the block too)."""
Views = Sequence[Sequence[np.ndarray]]
"""Each question's views: RGB ``(3, H, W)`` arrays in [0, 1]."""
MEDIA_TOKEN = "<image>"
END_OF_CHUNK = "<|endofchunk|>"


@dataclass(frozen=True)
class FlamingoSettings:
    """``flamingo.json`` in the folder ``vlm.name`` names; paths are relative to it (or hub names)."""

    vision: str
    """A CLIP vision model and its image processor (Med-Flamingo: ``openai/clip-vit-large-patch14``)."""
    language: str
    """A causal language model and its tokenizer (Med-Flamingo: LLaMA-7B)."""
    every: int = 4
    """A gated cross-attention block before every ``every``-th decoder layer (OpenFlamingo-9B's 4)."""
    latents: int = 64
    depth: int = 6
    heads: int = 8
    head_dim: int = 64
    checkpoint: str = ""
    """An OpenFlamingo-format state dict (``torch.save``), read through :func:`openflamingo_names`; empty: none."""


def feed_forward(dim: int, mult: int = 4) -> nn.Sequential:
    """OpenFlamingo's feed-forward (its parameter names: ``0`` the norm, ``1`` and ``3`` the linear layers)."""
    return nn.Sequential(
        nn.LayerNorm(dim), nn.Linear(dim, dim * mult, bias=False), nn.GELU(), nn.Linear(dim * mult, dim, bias=False)
    )


class PerceiverAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.norm_media, self.norm_latents = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * heads * head_dim, bias=False)
        self.to_out = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, media: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """``media`` (B, T, v, D), ``latents`` (B, T, n, D): the latents attend to the media and to themselves."""
        latents_normed = self.norm_latents(latents)
        q = self.to_q(latents_normed)
        k, v = self.to_kv(torch.cat([self.norm_media(media), latents_normed], -2)).chunk(2, -1)
        q, k, v = (x.unflatten(-1, (self.heads, -1)).transpose(-3, -2) for x in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(-3, -2).flatten(-2))


class PerceiverResampler(nn.Module):
    """Each image's tokens (B, T, v, D) resampled to ``latents`` learnt queries (B, T, latents, D)."""

    def __init__(self, dim: int, settings: FlamingoSettings):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(settings.latents, dim))
        self.layers = nn.ModuleList(
            nn.ModuleList([PerceiverAttention(dim, settings.heads, settings.head_dim), feed_forward(dim)])
            for _ in range(settings.depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, media: torch.Tensor) -> torch.Tensor:
        latents = self.latents.expand(*media.shape[:2], *self.latents.shape)
        for attention, ff in self.layers:
            latents = attention(media, latents) + latents
            latents = ff(latents) + latents
        return self.norm(latents)


class MaskedCrossAttention(nn.Module):
    def __init__(self, dim: int, visual: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_kv = nn.Linear(visual, 2 * heads * head_dim, bias=False)
        self.to_out = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, text: torch.Tensor, media: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
        """``text`` (B, L, D) attends to the latents (B, T, n, Dv) of the image its span follows (``locations``:
        (B, L), true at each image token); text before any image gets nothing."""
        b, t, n, _ = media.shape
        q = self.to_q(self.norm(text)).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k, v = (x.unflatten(-1, (self.heads, -1)).transpose(1, 2) for x in self.to_kv(media.flatten(1, 2)).chunk(2, -1))
        text_time = locations.cumsum(-1)  # (B, L): which image each token follows
        media_time = torch.arange(1, t + 1, device=text.device).repeat_interleave(n)  # (T * n,)
        allowed = (text_time[:, None, :, None] == media_time).expand(b, self.heads, -1, -1)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        weights = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).softmax(-1)
        weights = weights.masked_fill((text_time == 0)[:, None, :, None], 0.0)
        return self.to_out((weights @ v).transpose(1, 2).flatten(2))


class GatedCrossAttentionBlock(nn.Module):
    """Cross-attention and a feed-forward, each added through a tanh gate that starts closed (the language model's
    output is unchanged until the gates learn to open)."""

    def __init__(self, dim: int, visual: int, settings: FlamingoSettings):
        super().__init__()
        self.attn = MaskedCrossAttention(dim, visual, settings.heads, settings.head_dim)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ff = feed_forward(dim)
        self.ff_gate = nn.Parameter(torch.zeros(1))

    def forward(self, text: torch.Tensor, media: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
        text = self.attn(text, media, locations) * self.attn_gate.tanh() + text
        return self.ff(text) * self.ff_gate.tanh() + text


class FlamingoVLM(nn.Module):
    """The VLM plug-in: the vision encoder and the language model frozen, the resampler and the gated blocks
    trained (LoRA on the language model too where ``vlm.lora``; ``vlm.train_vision`` and ``vlm.train_language`` are
    not read)."""

    def __init__(self, folder: Path, settings: FlamingoSettings, dtype: torch.dtype | None = None):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel

        def located(name: str) -> str:  # a folder beside flamingo.json, else a hub name
            return str(folder / name) if (folder / name).exists() else name

        self.image_processor = CLIPImageProcessor.from_pretrained(located(settings.vision))
        self.vision_encoder = CLIPVisionModel.from_pretrained(located(settings.vision), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(located(settings.language))
        tokenizer.add_special_tokens({"additional_special_tokens": [MEDIA_TOKEN, END_OF_CHUNK]})
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self._tokenizer, self.media_id = tokenizer, tokenizer.convert_tokens_to_ids(MEDIA_TOKEN)
        self.language = AutoModelForCausalLM.from_pretrained(located(settings.language), dtype=dtype)
        self.language.resize_token_embeddings(len(tokenizer))
        self.requires_grad_(False)
        dim, visual = self.language.config.get_text_config().hidden_size, self.vision_encoder.config.hidden_size
        self.perceiver = PerceiverResampler(visual, settings)
        layers = self.language.get_decoder().layers
        self.gated_cross_attn_layers = nn.ModuleDict(
            {str(i): GatedCrossAttentionBlock(dim, visual, settings) for i in range(len(layers))
             if (i + 1) % settings.every == 0}
        )  # fmt: skip
        for key, block in self.gated_cross_attn_layers.items():
            layers[int(key)].register_forward_pre_hook(self._conditioned(block), with_kwargs=True)
        self._media: torch.Tensor | None = None
        self._locations: torch.Tensor | None = None

    def _conditioned(self, block: GatedCrossAttentionBlock) -> Any:
        """A decoder layer's pre-hook: its input hidden states through ``block`` while media are set."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if self._media is None:
                return None
            if args:
                return (block(args[0], self._media, self._locations), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": block(kwargs["hidden_states"], self._media, self._locations)}

        return hook

    @classmethod
    def from_config(cls, config: VLMConfig, device: torch.device, views: int = 1) -> FlamingoVLM:
        """The model ``config.name``'s ``flamingo.json`` describes, its checkpoint loaded, LoRA added; bf16 on a GPU.
        Any number of views: each is an image of the interleaved sequence."""
        folder = Path(local_weights(config.name))
        settings = read_settings(FlamingoSettings, folder / "flamingo.json")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = cls(folder, settings, dtype)
        if settings.checkpoint:
            model.load_openflamingo(torch.load(folder / settings.checkpoint, map_location="cpu", weights_only=True))
        if (lora := config.lora_settings()) is not None:
            model.language = apply_lora(model.language, lora)  # after the checkpoint: its names are the bare model's
        return model.to(device=device, dtype=dtype)

    def load_openflamingo(self, state: Mapping[str, torch.Tensor]) -> None:
        """Loads an OpenFlamingo-format state (:func:`openflamingo_names`); raises ``ValueError`` naming the
        parameters it has that this model lacks, or the resampler's and blocks' parameters it lacks."""
        result = self.load_state_dict(openflamingo_names(state), strict=False)
        trained = [k for k in result.missing_keys if k.startswith(("perceiver.", "gated_cross_attn_layers."))]
        if result.unexpected_keys or trained:
            raise ValueError(
                f"OpenFlamingo checkpoint: parameters this model lacks {result.unexpected_keys[:8]}, resampler or "
                f"gated-block parameters it lacks {trained[:8]}"
            )

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def _latents(self, images: Views) -> torch.Tensor:
        """(B, T, latents, D): each question's views through the frozen vision encoder and the resampler."""
        from gx_ray.models.vlm import to_pil

        flat = [to_pil(view) for case in images for view in case]
        pixels = self.image_processor(images=flat, return_tensors="pt")["pixel_values"]
        parameter = self.perceiver.latents
        with torch.no_grad():
            hidden = self.vision_encoder(pixel_values=pixels.to(parameter.device, parameter.dtype)).last_hidden_state
            # the patch tokens after the final norm, as open_clip gives OpenFlamingo its tokens (not the class token)
            tokens = self.vision_encoder.post_layernorm(hidden[:, 1:])
        return self.perceiver(tokens.unflatten(0, (len(images), -1)))

    def _rows(self, views: int, questions: Sequence[str], answers: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """:func:`answer_rows` of ``views`` image tokens and the question in Med-Flamingo's ``Question: ... Answer:``
        form."""
        prompts = [f"{MEDIA_TOKEN * views}Question: {question} Answer:" for question in questions]
        return answer_rows(self.tokenizer, prompts, answers, self.perceiver.latents.device)

    def _run(self, latents: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, labels: Any = None) -> Any:
        """The language model's output, its gated blocks conditioned on ``latents`` at the image tokens of ``ids``."""
        self._media, self._locations = latents, ids == self.media_id
        try:
            return self.language(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        finally:
            self._media = self._locations = None

    def loss(self, images: Views, questions: Sequence[str], answers: Sequence[str]) -> torch.Tensor:
        ids, mask, labels = self._rows(len(images[0]), questions, answers)
        return self._run(self._latents(images), ids, mask, labels).loss

    def pooled(self, images: Views, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Retrieval's two sides (:meth:`gx_ray.models.vlm.VisionLanguageModel.pooled`): each case's resampled
        latents averaged over its views and latents (the resampler trains), each text's last hidden states in the
        language model (no image: the gated blocks pass it through) averaged over its first ``TEXT_TOKENS``."""
        image = self._latents(images).float().mean((1, 2))
        return image, mean_text_state(self.language, self.tokenizer, texts, self.perceiver.latents.device)

    @torch.no_grad()
    def option_scores(self, images: Views, questions: Sequence[str], options: Sequence[Sequence[str]]) -> torch.Tensor:
        latents, columns = self._latents(images), []
        for k in range(len(options[0])):
            ids, mask, labels = self._rows(len(images[0]), questions, [choices[k] for choices in options])
            columns.append(answer_log_likelihood(self._run(latents, ids, mask).logits[:, :-1], labels[:, 1:]))
        return torch.stack(columns, 1)

    @torch.no_grad()
    def generate(self, images: Views, questions: Sequence[str], max_new_tokens: int = 16) -> list[str]:
        """Greedy answers, a question at a time, the whole sequence run again each token (no key-value cache: the
        gated blocks read the media locations of the whole sequence)."""
        answers = []
        for k, question in enumerate(questions):
            latents = self._latents(images[k : k + 1])
            ids, mask, _ = self._rows(len(images[k]), [question], [""])
            logits_of = lambda ids, mask, latents=latents: self._run(latents, ids, mask).logits  # noqa: E731
            answers.append(greedy_answer(logits_of, ids, mask, self.tokenizer, max_new_tokens))
        return answers


def openflamingo_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An OpenFlamingo / Med-Flamingo checkpoint's parameters under :class:`FlamingoVLM`'s names: ``perceiver.*`` as
    they are; ``lang_encoder.gated_cross_attn_layers.N.*`` → ``gated_cross_attn_layers.N.*``; the language model's
    ``lang_encoder.X`` → ``language.X``, its wrapped decoder layers' ``model.layers.N.decoder_layer.*`` →
    ``model.layers.N.*``. Left out: ``lang_encoder.model.layers.N.gated_cross_attn_layer.*`` (the same tensors as
    ``gated_cross_attn_layers.N``) and ``vision_encoder.*`` (open_clip's names: the vision encoder is read from its
    own folder)."""
    mapped = {}
    for key, value in state.items():
        if key.startswith("vision_encoder.") or SECOND_NAME.match(key):
            continue
        key = re.sub(r"^lang_encoder\.gated_cross_attn_layers\.", "gated_cross_attn_layers.", key)
        key = re.sub(r"^lang_encoder\.(model\.layers\.\d+)\.decoder_layer\.", r"language.\1.", key)
        mapped[re.sub(r"^lang_encoder\.", "language.", key)] = value
    return mapped
