"""Vision-language models that put a case's images before the question as a prefix of visual tokens in a causal
language model's input embeddings (MedVInT's prefix; the 3D Swin tower that replaces LLaVA-Med's vision encoder):
what such a VLM plug-in does once its prefix is made. A subclass gives :meth:`PrefixVLM._prefix` (each question's
images as ``(B, P, D)`` embeddings at the language model's width) and its ``PROMPT``; this class gives the VLM
protocol's loss, generation, option scores and retrieval's pooled states
(:func:`gx_ray.models.vlm.vlm_protocol_problems`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from gx_ray.models.vlm import IGNORE, TEXT_TOKENS

Views = Sequence[Sequence[np.ndarray]]
"""Each question's views: RGB ``(3, H, W)`` arrays in [0, 1]."""


class PrefixVLM(nn.Module):
    """A causal language model (``self.language``, its tokenizer ``self._tokenizer``) read after a visual prefix;
    the prefix is never a target. ``PROMPT`` holds the question (``{question}``) as the model was taught to read it."""

    PROMPT = "Question: {question} Answer:"
    language: nn.Module
    _tokenizer: Any

    def _prefix(self, images: Views) -> torch.Tensor:
        raise NotImplementedError

    @property
    def _device(self) -> torch.device:
        return self.language.get_input_embeddings().weight.device

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def _rows(self, questions: Sequence[str], answers: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """Right-padded input ids, attention mask and labels (the answers' tokens only), the question in
        :data:`PROMPT`'s form."""
        tokenizer, rows, labels = self.tokenizer, [], []
        for question, answer in zip(questions, answers, strict=True):
            prompt = tokenizer(self.PROMPT.format(question=question))["input_ids"]
            said = f" {answer}{tokenizer.eos_token}" if answer else ""  # generation's prompt: no answer yet
            taught = tokenizer(said, add_special_tokens=False)["input_ids"]
            rows.append(torch.tensor(prompt + taught))
            labels.append(torch.tensor([IGNORE] * len(prompt) + taught))
        pad = nn.utils.rnn.pad_sequence
        ids = pad(rows, batch_first=True, padding_value=tokenizer.pad_token_id)
        mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True)
        device = self._device
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
        averaged (what makes it trains), each text's last hidden states in the language model averaged over its
        first ``TEXT_TOKENS``."""
        image = self._prefix(images).float().mean(1)
        encoded = self.tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True,
                                 max_length=TEXT_TOKENS).to(self._device)  # fmt: skip
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
