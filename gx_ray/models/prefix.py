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

from gx_ray.models.vlm import IGNORE, answer_log_likelihood, answer_rows, greedy_answer, mean_text_state

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

    def _load_language(self, name: str, dtype: torch.dtype | None) -> None:
        """``self.language`` (frozen) and ``self._tokenizer`` from a causal language model's folder or hub name."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from gx_ray.models.text import quiet_loading

        quiet_loading()
        self._tokenizer = AutoTokenizer.from_pretrained(name)
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        self.language = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).requires_grad_(False)

    def _rows(self, questions: Sequence[str], answers: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """:func:`answer_rows` of the questions in ``PROMPT``'s form."""
        prompts = [self.PROMPT.format(question=question) for question in questions]
        return answer_rows(self.tokenizer, prompts, answers, self._device)

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
        return image, mean_text_state(self.language, self.tokenizer, texts, self._device)

    @torch.no_grad()
    def option_scores(self, images: Views, questions: Sequence[str], options: Sequence[Sequence[str]]) -> torch.Tensor:
        prefix, columns = self._prefix(images), []
        for k in range(len(options[0])):
            ids, mask, labels = self._rows(questions, [choices[k] for choices in options])
            logits = self._run(prefix, ids, mask).logits[:, prefix.shape[1] : -1]
            columns.append(answer_log_likelihood(logits, labels[:, 1:]))
        return torch.stack(columns, 1)

    @torch.no_grad()
    def generate(self, images: Views, questions: Sequence[str], max_new_tokens: int = 16) -> list[str]:
        """Greedy answers, a question at a time, the prefix and the text so far run again each token."""
        answers = []
        for k, question in enumerate(questions):
            prefix = self._prefix(images[k : k + 1])
            ids, mask, _ = self._rows([question], [""])
            logits_of = lambda ids, mask, prefix=prefix: self._run(prefix, ids, mask).logits  # noqa: E731
            answers.append(greedy_answer(logits_of, ids, mask, self.tokenizer, max_new_tokens))
        return answers
