"""What a model may see: modality schemas, leakage rules, and the inputs built from a shard batch."""

from gx_ray.modalities.build import build_inputs, input_channels
from gx_ray.modalities.inputs import ModelInputs
from gx_ray.modalities.schemas import (
    LEAKAGE_RULES,
    PRESETS,
    LeakageError,
    ModalitySchema,
    check_leakage,
    resolve_schema,
)
from gx_ray.modalities.table import table_width

__all__ = [
    "LEAKAGE_RULES",
    "PRESETS",
    "LeakageError",
    "ModalitySchema",
    "ModelInputs",
    "build_inputs",
    "check_leakage",
    "input_channels",
    "resolve_schema",
    "table_width",
]
