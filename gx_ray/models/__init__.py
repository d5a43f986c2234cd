"""Models: vision, text and fusion registries, LoRA, and the multimodal encoder built from a config."""

from gx_ray.models.encoded import Encoded
from gx_ray.models.fusion import FUSIONS
from gx_ray.models.lora import LoraSettings
from gx_ray.models.registry import ModelConfig, MultimodalEncoder, build_encoder, param_groups
from gx_ray.models.text import TEXT_ENCODERS
from gx_ray.models.vision import ENDOSCOPY_ENCODERS, VISION_ENCODERS

__all__ = [
    "ENDOSCOPY_ENCODERS",
    "FUSIONS",
    "TEXT_ENCODERS",
    "VISION_ENCODERS",
    "Encoded",
    "LoraSettings",
    "ModelConfig",
    "MultimodalEncoder",
    "build_encoder",
    "param_groups",
]
