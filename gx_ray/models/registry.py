"""One registry that builds the multimodal encoder of a trial from a model config and a modality schema.

Configs are data (:meth:`ModelConfig.from_dict`) whose names index the vision, text and fusion registries.
:func:`param_groups` gives the optimiser the paper's recipe: the text side at a multiple of the base learning rate, no
weight decay on biases and norms.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from gx_ray.modalities import ModalitySchema, ModelInputs, input_channels, table_width
from gx_ray.models.encoded import Encoded
from gx_ray.models.fusion import FUSIONS, build_fusion, mlp
from gx_ray.models.lora import LoraSettings, apply_lora
from gx_ray.models.text import TextEncoder, build_text_encoder, check_text_name, masked_mean
from gx_ray.models.vision import ENDOSCOPY_ENCODERS, VISION_ENCODERS, build_endoscopy_encoder, build_vision_encoder

MODEL_FAMILIES: tuple[str, ...] = ("encoder", "vlm")
"""``encoder``: the multimodal encoder with a task head (:class:`MultimodalEncoder`); ``vlm``: a vision-language model
that answers in words (:class:`~gx_ray.models.vlm.VisionLanguageModel`, set by the trial's ``vlm.*`` keys)."""


@dataclass(frozen=True)
class ModelConfig:
    vision: str = "resnet18_3d"
    text: str = "bert_tiny"
    fusion: str = "concat"
    hidden: int = 256
    endoscopy: str = "resnet18_2d"
    lora: LoraSettings | None = None
    vision_kwargs: dict[str, Any] = field(default_factory=dict)
    """E.g. swin3d: ``feature_size``, ``depths``, ``num_heads``, ``window_size``, ``implementation`` (``gx``, the
    default, or ``monai``: :class:`~gx_ray.models.vision.Swin3d`); multichannel2d: ``slices``."""
    text_kwargs: dict[str, Any] = field(default_factory=dict)
    """``max_length`` (256), and for bert_tiny any ``BertConfig`` field."""
    fusion_kwargs: dict[str, Any] = field(default_factory=dict)
    """cross_attention: ``heads``, ``dropout``."""
    gradient_checkpointing: bool = False
    """MONAI's ``use_checkpoint`` for swin3d: what fits the paper's 192 x 288 x 288 crop on one GPU."""
    compile: bool = False
    """``torch.compile`` the CT encoder, the step's dominant cost (in place: its state-dict keys stay the same, so
    checkpoints load either way). Costs a compilation in each new process; pays on GPUs over a whole trial."""
    family: str = "encoder"
    """:data:`MODEL_FAMILIES`: with ``vlm`` the fields above are unused (the trial's ``vlm.*`` keys name the model)."""

    def __post_init__(self) -> None:
        if self.family not in MODEL_FAMILIES:
            raise ValueError(f"unknown model.family {self.family!r}; valid: {', '.join(MODEL_FAMILIES)}")
        for key, registry in (("vision", VISION_ENCODERS), ("fusion", FUSIONS), ("endoscopy", ENDOSCOPY_ENCODERS)):
            if getattr(self, key) not in registry:
                raise ValueError(f"unknown {key} model {getattr(self, key)!r}; valid: {', '.join(registry)}")
        check_text_name(self.text)
        if self.hidden < 1:
            raise ValueError(f"hidden must be positive, got {self.hidden}")
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoraSettings.from_dict(self.lora))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; valid: {', '.join(valid)}")
        return cls(**values)


def compile_in_place(module: nn.Module) -> None:
    """``module.compile()``, also under an ASCII locale (``LC_ALL=C``): :func:`gx_ray.compat.import_inductor`."""
    from gx_ray.compat import import_inductor  # Ray's import with it: only where a model is compiled

    import_inductor()
    module.compile()


class MultimodalEncoder(nn.Module):
    """CT encoder (+ endoscopy encoder, + lab-table MLP) and text encoder, fused into one :class:`Encoded`."""

    def __init__(self, config: ModelConfig, schema: ModalitySchema):
        super().__init__()
        self.config = config
        self.schema = schema
        self.dim = config.hidden
        self.in_channels = input_channels(schema)
        self.vision = build_vision_encoder(
            config.vision, self.in_channels, config.gradient_checkpointing, **config.vision_kwargs
        )
        if config.compile:
            compile_in_place(self.vision)
        # Always built: a task may send a query (VQA) or encode reports (retrieval) under a text-free schema.
        self.text = build_text_encoder(config.text, **config.text_kwargs)
        if config.lora is not None:
            self.text.model = apply_lora(self.text.model, config.lora)
        self.text_projection = nn.Linear(self.text.dim, config.hidden)
        self.endoscopy = None
        if schema.endoscopy:
            encoder = build_endoscopy_encoder(config.endoscopy)
            self.endoscopy = nn.Sequential(encoder, nn.Linear(encoder.dim, config.hidden))
        self.table = mlp(table_width(schema), config.hidden) if table_width(schema) else None
        self.fusion = build_fusion(
            config.fusion,
            config.hidden,
            self.vision.channels,
            endoscopy=schema.endoscopy,
            table=self.table is not None,
            **config.fusion_kwargs,
        )

    @property
    def tokenizer(self):
        return self.text.tokenizer

    def text_tokens(self, texts: list[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, dim) projected text tokens and their (B, L) mask."""
        hidden, mask = self.text(texts)
        return self.text_projection(hidden), mask

    def encode_text(self, texts: list[str | None]) -> torch.Tensor:
        """(B, dim) mean-pooled text embedding with the same encoder the fusion uses (retrieval's text side)."""
        return masked_mean(*self.text_tokens(texts))

    def forward(
        self, inputs: ModelInputs, query: list[str] | None = None, case_index: torch.Tensor | None = None
    ) -> Encoded:
        """``case_index``: the case each query asks about (VQA: several questions per case). Each case is then
        encoded once and its features repeated per query, rather than the volume encoded once per question."""
        self._check(inputs, query if case_index is None else None)
        maps = self.vision(inputs.ct)
        endoscopy = None if self.endoscopy is None else self.endoscopy(inputs.endoscopy)
        # Missing lab values must never turn into NaN features.
        table = None if self.table is None else self.table(torch.nan_to_num(inputs.table))
        context = self.text_tokens(inputs.text) if self.schema.has_text else None
        if case_index is not None:
            if query is not None and len(query) != len(case_index):
                raise ValueError(f"{len(query)} queries for {len(case_index)} case indices")
            index = case_index.to(inputs.ct.device)
            maps = [m.index_select(0, index) for m in maps]
            endoscopy, table = (None if x is None else x.index_select(0, index) for x in (endoscopy, table))
            context = None if context is None else tuple(x.index_select(0, index) for x in context)
        # Context tokens, then query tokens; with neither, the text encoder is not run at all.
        parts = [p for p in (context, None if query is None else self.text_tokens(query)) if p is not None]
        text = text_mask = query_mask = None
        if parts:
            text, text_mask = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
            # which text tokens are the query's (the last part), for fusions that pool context and query apart
            query_mask = torch.zeros_like(text_mask)
            if query is not None:
                query_mask[:, text_mask.shape[1] - parts[-1][1].shape[1] :] = True
        return self.fusion(maps, text, text_mask, endoscopy=endoscopy, table=table, query_mask=query_mask)

    def _check(self, inputs: ModelInputs, query: list[str] | None) -> None:
        name = self.schema.name
        if inputs.ct.ndim != 5 or inputs.ct.shape[1] != self.in_channels:
            raise ValueError(
                f"CT of shape {tuple(inputs.ct.shape)}: schema {name!r} gives (B, {self.in_channels}, D, H, W)"
            )
        required = {"endoscopy": self.schema.endoscopy, "table": self.table is not None, "text": self.schema.has_text}
        missing = [key for key, needed in required.items() if needed and getattr(inputs, key) is None]
        if missing:
            raise ValueError(f"schema {name!r} needs inputs {', '.join(missing)}, which the batch lacks")
        if query is not None and len(query) != inputs.batch_size:
            raise ValueError(f"{len(query)} queries for a batch of {inputs.batch_size}")


def build_encoder(config: ModelConfig, schema: ModalitySchema) -> MultimodalEncoder:
    return MultimodalEncoder(config, schema)


def _no_decay(name: str, parameter: nn.Parameter) -> bool:
    # Biases, norm scales (1-D) and Swin's relative-position bias tables: decaying them only hurts.
    return parameter.ndim <= 1 or "bias" in name.rsplit(".", 1)[-1]


def param_groups(
    model: nn.Module, base_lr: float, weight_decay: float, text_lr_multiplier: float
) -> list[dict[str, Any]]:
    """AdamW groups: every trainable parameter once; text-encoder ones (found by module type, also inside a task
    model) at ``base_lr * text_lr_multiplier``. Empty groups are left out."""
    text_ids = {id(p) for m in model.modules() if isinstance(m, TextEncoder) for p in m.parameters()}
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            key = (id(parameter) in text_ids, _no_decay(name, parameter))
            groups.setdefault(key, []).append(parameter)
    return [
        {
            "name": f"{'text' if text else 'other'}_{'no_decay' if no_decay else 'decay'}",
            "params": params,
            "lr": base_lr * (text_lr_multiplier if text else 1.0),
            "weight_decay": 0.0 if no_decay else weight_decay,
        }
        for (text, no_decay), params in sorted(groups.items())
    ]
