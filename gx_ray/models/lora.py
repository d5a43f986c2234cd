"""LoRA (through peft) on the text encoder: low-rank adapters train, the pretrained weights stay frozen."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

from torch import nn


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.1
    target_modules: tuple[str, ...] = ("query", "value")
    """Names (suffixes) of the linear layers that get adapters; BERT's attention projections by default."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")
        if not self.target_modules:
            raise ValueError("LoRA needs at least one target module")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoraSettings:
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown LoRA settings {unknown}; valid: {', '.join(f.name for f in fields(cls))}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def apply_lora(model: nn.Module, settings: LoraSettings, exclude: str | None = None) -> nn.Module:
    """``model`` with LoRA adapters on ``settings.target_modules`` (but none in modules whose full name matches the
    regular expression ``exclude``); only the adapters require grad."""
    from peft import LoraConfig, get_peft_model  # peft takes about a second to import: only when LoRA is configured

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        exclude_modules=exclude,
    )
    with warnings.catch_warnings():  # peft asks transformers' deprecated is_gradient_checkpointing: not the user's
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        return get_peft_model(model, config)
