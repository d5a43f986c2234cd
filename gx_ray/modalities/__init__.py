"""What a model may see: modality schemas, leakage rules, and the inputs built from a shard batch."""

from gx_ray.modalities.build import build_inputs, input_channels
from gx_ray.modalities.inputs import ModelInputs
from gx_ray.modalities.schemas import (
    DECLARED_RULE,
    INPUT_NAMES,
    LEAKAGE_RULES,
    PRESETS,
    LeakageError,
    ModalitySchema,
    check_leakage,
    given_inputs,
    input_name_problems,
    resolve_schema,
)
from gx_ray.modalities.table import table_width

__all__ = [
    "DECLARED_RULE",
    "INPUT_NAMES",
    "LEAKAGE_RULES",
    "PRESETS",
    "LeakageError",
    "ModalitySchema",
    "ModelInputs",
    "build_inputs",
    "check_leakage",
    "given_inputs",
    "input_name_problems",
    "input_channels",
    "resolve_schema",
    "table_width",
]
