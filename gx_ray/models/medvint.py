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

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gx_ray.models.lora import apply_lora
from gx_ray.models.tiny_vlms import local_weights
from gx_ray.models.vlm import IGNORE, TEXT_TOKENS, VLMConfig

Views = Sequence[Sequence[np.ndarray]]
"""Each question's views: RGB ``(3, H, W)`` arrays in [0, 1]."""


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

    @classmethod
    def read(cls, folder: Path) -> MedVInTSettings:
        values = json.loads((folder / "medvint.json").read_text(encoding="utf-8"))
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{folder / 'medvint.json'}: unknown keys {unknown}")
        return cls(**values)


class MedVInTVLM(nn.Module):
    """The VLM plug-in: the vision encoder and the language model frozen; the query decoder and the two projections
    trained (LoRA on the language model too where ``vlm.lora``)."""

    def __init__(self, folder: Path, settings: MedVInTSettings, dtype: torch.dtype | None = None):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel

        def located(name: str) -> str:  # a folder beside medvint.json, else a hub name
            return str(folder / name) if (folder / name).exists() else name

        self.image_processor = CLIPImageProcessor.from_pretrained(located(settings.vision))
        self.vision_encoder = CLIPVisionModel.from_pretrained(located(settings.vision), dtype=dtype)
        self._tokenizer = AutoTokenizer.from_pretrained(located(settings.language))
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        self.language = AutoModelForCausalLM.from_pretrained(located(settings.language), dtype=dtype)
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
        model = cls(folder, MedVInTSettings.read(folder), dtype)
        if (lora := config.lora_settings()) is not None:
            model.language = apply_lora(model.language, lora)
        return model.to(device=device, dtype=dtype)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

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

    def _rows(self, questions: Sequence[str], answers: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """Right-padded input ids, attention mask and labels (the answers' tokens only), in MedVInT-TD's
        ``Question: ... The Answer is:`` form."""
        tokenizer, rows, labels = self.tokenizer, [], []
        for question, answer in zip(questions, answers, strict=True):
            prompt = tokenizer(f"Question: {question} The Answer is:")["input_ids"]
            said = f" {answer}{tokenizer.eos_token}" if answer else ""  # generation's prompt: no answer yet
            taught = tokenizer(said, add_special_tokens=False)["input_ids"]
            rows.append(torch.tensor(prompt + taught))
            labels.append(torch.tensor([IGNORE] * len(prompt) + taught))
        pad = nn.utils.rnn.pad_sequence
        ids = pad(rows, batch_first=True, padding_value=tokenizer.pad_token_id)
        mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True)
        device = self.qformer_query.device
        return ids.to(device), mask.to(device), pad(labels, batch_first=True, padding_value=IGNORE).to(device)

    def _run(self, prefix: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, labels: Any = None) -> Any:
        """The language model on the visual prefix, then the text; the prefix is never a target."""
        text = self.language.get_input_embeddings()(ids)
        embeds = torch.cat([prefix.to(text.dtype), text], 1)
        seen = torch.ones(prefix.shape[:2], dtype=mask.dtype, device=mask.device)
        if labels is not None:
            labels = torch.cat([torch.full(prefix.shape[:2], IGNORE, device=labels.device), labels], 1)
        return self.language(inputs_embeds=embeds, attention_mask=torch.cat([seen, mask], 1), labels=labels,
                             use_cache=False)  # fmt: skip

    def loss(self, images: Views, questions: Sequence[str], answers: Sequence[str]) -> torch.Tensor:
        ids, mask, labels = self._rows(questions, answers)
        return self._run(self._prefix(images), ids, mask, labels).loss

    def pooled(self, images: Views, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Retrieval's two sides (:meth:`gx_ray.models.vlm.VisionLanguageModel.pooled`): each case's visual prefix
        averaged (the query decoder trains), each text's last hidden states in the language model averaged over its
        first ``TEXT_TOKENS``."""
        image = self._prefix(images).float().mean(1)
        encoded = self.tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True,
                                 max_length=TEXT_TOKENS).to(self.qformer_query.device)  # fmt: skip
        mask = encoded["attention_mask"]
        output = self.language(input_ids=encoded["input_ids"], attention_mask=mask, output_hidden_states=True,
                               use_cache=False)  # fmt: skip
        hidden = output.hidden_states[-1].float()
        return image, (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)

    @torch.no_grad()
    def option_scores(self, images: Views, questions: Sequence[str], options: Sequence[Sequence[str]]) -> torch.Tensor:
        prefix, columns = self._prefix(images), []
        for k in range(len(options[0])):
            ids, mask, labels = self._rows(questions, [choices[k] for choices in options])
            logits = self._run(prefix, ids, mask).logits[:, prefix.shape[1] : -1].float()
            targets = labels[:, 1:]
            log_probs = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
            columns.append((log_probs * (targets != IGNORE)).sum(1))
        return torch.stack(columns, 1)

    @torch.no_grad()
    def generate(self, images: Views, questions: Sequence[str], max_new_tokens: int = 16) -> list[str]:
        """Greedy answers, a question at a time, the prefix and the text so far run again each token."""
        answers = []
        for k, question in enumerate(questions):
            prefix = self._prefix(images[k : k + 1])
            ids, mask, _ = self._rows([question], [""])
            start = ids.shape[1]
            for _ in range(max_new_tokens):
                token = self._run(prefix, ids, mask).logits[:, -1].argmax(-1, keepdim=True)
                if int(token) == self.tokenizer.eos_token_id:
                    break
                ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
            answers.append(self.tokenizer.decode(ids[0, start:], skip_special_tokens=True))
        return answers
