"""LoRA (through peft) on a text encoder or a vision-language model's language model: low-rank adapters train, the
pretrained weights stay frozen. Which linear layers get adapters is the model's to say (:data:`LORA_TARGETS`, by its
language model's family) unless the settings name them."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "bert": ("query", "value"),
    "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "qwen2_vl_text": ("q_proj", "v_proj"),
    "gemma": ("q_proj", "v_proj"),
    "opt": ("q_proj", "v_proj"),  # OPT's self_attn.{q,v}_proj (its output projection is out_proj, its MLP fc1/fc2)
    "t5": ("q", "v"),  # T5 and Flan-T5: SelfAttention.{q,v} and EncDecAttention.{q,v}
}
"""Attention query and value projections by language-model family (``model_type`` of the language model's config):
the adapters LoRA's paper puts there. Other families take peft's own table of defaults."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.1
    target_modules: tuple[str, ...] = ()
    """Names (suffixes) of the linear layers that get adapters; empty: the model's language-model family's
    (:func:`family_targets`: BERT's ``query``/``value``, LLaMA's ``q_proj``/``v_proj``, T5's ``q``/``v``, …)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoraSettings:
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown LoRA settings {unknown}; valid: {', '.join(f.name for f in fields(cls))}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def apply_lora(model: nn.Module, settings: LoraSettings, exclude: str | None = None) -> nn.Module:
    """``model`` with LoRA adapters on ``settings.target_modules``, or where none are named on its family's
    (:func:`family_targets`), but none in modules whose full name matches the regular expression ``exclude``; only the
    adapters require grad."""
    from peft import LoraConfig, get_peft_model  # peft takes about a second to import: only when LoRA is configured

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules or family_targets(model)),
        exclude_modules=exclude,
    )
    with warnings.catch_warnings():  # peft asks transformers' deprecated is_gradient_checkpointing: not the user's
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def language_family(model: nn.Module) -> str:
    """The ``model_type`` of ``model``'s language model: its config's ``text_config`` (a vision-language model's), else
    its config's own (a text model's); empty when it has no transformers config."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    return str(getattr(config, "model_type", "") or "")


def family_targets(model: nn.Module) -> tuple[str, ...]:
    """The linear layers LoRA adapts by default in ``model``: :data:`LORA_TARGETS` of its language model's family,
    else peft's default for that family. Raises ``ValueError`` naming the family where neither knows it."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    family = language_family(model)
    targets = LORA_TARGETS.get(family) or PEFT_TARGETS.get(family)
    if not targets:
        raise ValueError(
            f"no default LoRA targets for language model family {family or '(no transformers config)'!r}: name the "
            "modules (vlm.lora_targets, or model.lora's target_modules)"
        )
    return tuple(targets)
