"""A vision-language model from outside gx-ray and outside transformers' classes: the tests' VLM plug-in
(``vlm.plugin: tests.plugins.prefix_vlm:PrefixVLM``).

A tiny random LLaMA (frozen) reads each of a question's views as one prefix embedding (the view average-pooled to
4 x 4 and mapped by a trained linear layer) before the question's tokens: the shape of a model whose code a user
brings. It implements the VLM protocol (:func:`gx_ray.models.vlm.vlm_protocol_problems`) and nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.models.vlm import IGNORE, VLMConfig

POOLED = 4
WIDTH = 32


class PrefixVLM(nn.Module):
    def __init__(self, tokenizer: Any):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self._tokenizer = tokenizer
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id, initializer_range=1.0,
        )  # fmt: skip
        self.language = LlamaForCausalLM(config).requires_grad_(False)
        self.projector = nn.Linear(3 * POOLED * POOLED, WIDTH)

    @classmethod
    def from_config(cls, config: VLMConfig, device: torch.device, views: int = 1) -> PrefixVLM:
        """``config.name`` would locate the weights; this one is random (seeded) and reads any number of views."""
        from tests.vlm_fixtures import trained_tokenizer

        torch.manual_seed(0)
        return cls(trained_tokenizer()).to(device)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def _rows(self, images: Sequence[Sequence[np.ndarray]], questions: Sequence[str], answers: Sequence[str]):
        """Embeddings, attention mask and labels: each question's view prefixes, its tokens and its answer's."""
        device = self.projector.weight.device
        embed = self.language.get_input_embeddings()
        rows, labels = [], []
        for views, question, answer in zip(images, questions, answers, strict=True):
            pixels = torch.as_tensor(np.stack(views), dtype=torch.float32, device=device)
            prefix = self.projector(F.adaptive_avg_pool2d(pixels, POOLED).flatten(1))
            prompt = self.tokenizer(question)["input_ids"]
            said = answer + self.tokenizer.eos_token if answer else ""  # generation's prompt: no answer yet
            taught = self.tokenizer(said, add_special_tokens=False)["input_ids"]
            ids = torch.tensor(prompt + taught, device=device)
            rows.append(torch.cat([prefix, embed(ids)]))
            labels.append(torch.tensor([IGNORE] * (len(prefix) + len(prompt)) + taught, device=device))
        mask = [torch.ones(len(row), dtype=torch.long, device=device) for row in rows]
        pad = nn.utils.rnn.pad_sequence
        return pad(rows, batch_first=True), pad(mask, batch_first=True), pad(labels, True, IGNORE)

    def loss(self, images, questions, answers) -> torch.Tensor:
        embeds, mask, labels = self._rows(images, questions, answers)
        return self.language(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss

    @torch.no_grad()
    def option_scores(self, images, questions, options) -> torch.Tensor:
        columns = []
        for k in range(len(options[0])):
            embeds, mask, labels = self._rows(images, questions, [choices[k] for choices in options])
            logits = self.language(inputs_embeds=embeds, attention_mask=mask).logits[:, :-1].float()
            targets = labels[:, 1:]
            log_probs = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
            columns.append((log_probs * (targets != IGNORE)).sum(1))
        return torch.stack(columns, 1)

    @torch.no_grad()
    def generate(self, images, questions, max_new_tokens: int = 16) -> list[str]:
        """Greedy answers, one question at a time (no padding to get wrong)."""
        answers = []
        for views, question in zip(images, questions, strict=True):
            embeds, _, _ = self._rows([views], [question], [""])
            tokens: list[int] = []
            for _ in range(max_new_tokens):
                token = int(self.language(inputs_embeds=embeds).logits[0, -1].argmax())
                if token == self.tokenizer.eos_token_id:
                    break
                tokens.append(token)
                step = self.language.get_input_embeddings()(torch.tensor([[token]], device=embeds.device))
                embeds = torch.cat([embeds, step], 1)
            answers.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return answers
