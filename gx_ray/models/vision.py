"""Vision encoders: the multi-phase CT as a list of feature maps, and the endoscopy image as one vector.

Each CT encoder wraps one MONAI network (``backbone``; swin3d by default gx-ray's equal one, :mod:`gx_ray.models.swin`),
keeps its ``backbone_arguments`` for the model benchmark, and returns 5D maps ``(B, C_i, d_i, h_i, w_i)``, finest first
(``channels`` lists the ``C_i``). MONAI is imported when an encoder is built: ``import monai`` loads all of MONAI,
seconds that a process which only reads the registry's names (a sweep driver validating configs) need not pay.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.models.swin import SwinTransformer as GxSwinTransformer

if TYPE_CHECKING:
    from monai.networks.nets.resnet import ResNet

RESNET_DEPTHS: dict[int, tuple[str, list[int]]] = {
    10: ("basic", [1, 1, 1, 1]),
    18: ("basic", [2, 2, 2, 2]),
    34: ("basic", [3, 4, 6, 3]),
    50: ("bottleneck", [3, 4, 6, 3]),
}
RESNET_WIDTHS = [64, 128, 256, 512]


def resnet_arguments(depth: int, spatial_dims: int, in_channels: int, **overrides: Any) -> dict[str, Any]:
    """Arguments of MONAI's ``ResNet`` for a ResNet-``depth`` without its classifier (``feed_forward=False``)."""
    block, layers = RESNET_DEPTHS[depth]
    return {
        "block": block,
        "layers": layers,
        "block_inplanes": RESNET_WIDTHS,
        "spatial_dims": spatial_dims,
        "n_input_channels": in_channels,
        "feed_forward": False,
        **overrides,
    }


def monai_resnet(**arguments: Any) -> ResNet:
    """MONAI's ``ResNet`` built from ``arguments`` (MONAI imported here, on first use: see the module docstring)."""
    from monai.networks.nets.resnet import ResNet

    return ResNet(**arguments)


def resnet_feature_maps(net: ResNet, x: torch.Tensor) -> list[torch.Tensor]:
    """MONAI's ``ResNet.forward`` up to (not including) the pooling, keeping every stage's output."""
    x = net.act(net.bn1(net.conv1(x)))
    if not net.no_max_pool:
        x = net.maxpool(x)
    maps = []
    for layer in (net.layer1, net.layer2, net.layer3, net.layer4):
        x = layer(x)
        maps.append(x)
    return maps


def swin_arguments(
    in_channels: int, gradient_checkpointing: bool, feature_size: int = 48, depths: tuple[int, ...] = (2, 2, 2, 2),
    num_heads: tuple[int, ...] = (3, 6, 12, 24), window_size: int = 7, patch_size: int = 2, **overrides: Any,
) -> dict[str, Any]:  # fmt: skip
    """Arguments of MONAI's 3D ``SwinTransformer`` from swin3d's ``vision_kwargs`` (cubic windows and patches)."""
    return {
        "in_chans": in_channels,
        "embed_dim": feature_size,
        "window_size": (window_size,) * 3,
        "patch_size": (patch_size,) * 3,
        "depths": tuple(depths),
        "num_heads": tuple(num_heads),
        "spatial_dims": 3,
        "use_checkpoint": gradient_checkpointing,
        **overrides,
    }


class Swin3d(nn.Module):
    """MONAI's 3D ``SwinTransformer`` (the SwinUNETR encoder); its five normalised stage outputs are the maps. Spatial
    sizes must be multiples of 32 (patch 2, then four 2x merges). ``implementation``: ``gx`` (default) builds
    :class:`gx_ray.models.swin.SwinTransformer` (MONAI's parameters, keys and outputs, laid out for speed); ``monai``
    MONAI's own class, whose ``attention`` is ``fused`` (PyTorch's ``scaled_dot_product_attention`` also in training,
    bias and shift mask additive, as timm's Swin) or ``explicit`` (MONAI's own score matrices; alone, it selects MONAI's
    class). ``backbone_arguments`` and ``monai_class`` are MONAI's either way, so the model benchmark can build the raw
    network beside either."""

    def __init__(
        self, in_channels: int, gradient_checkpointing: bool = False, attention: str = "fused",
        implementation: str | None = None, **arguments: Any,
    ):  # fmt: skip
        super().__init__()
        self.backbone_arguments = swin_arguments(in_channels, gradient_checkpointing, **arguments)
        from monai.networks.nets.swin_unetr import SwinTransformer, WindowAttention  # on first use: module docstring

        if attention not in SWIN_ATTENTION:
            raise ValueError(f"unknown swin3d attention {attention!r}; valid: {', '.join(SWIN_ATTENTION)}")
        implementation = implementation or ("monai" if attention == "explicit" else "gx")
        if implementation not in SWIN_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown swin3d implementation {implementation!r}; valid: {', '.join(SWIN_IMPLEMENTATIONS)}"
            )
        if implementation == "gx" and attention != "fused":
            raise ValueError(f"swin3d attention {attention!r} is MONAI's: set implementation 'monai' with it")
        if "use_flash_attention" in inspect.signature(SwinTransformer).parameters:  # MONAI >= 1.5
            # MONAI's fused attention (PyTorch's scaled_dot_product_attention) where no gradient is taken: evaluation
            # at batch 32 on one H200 ran 1.7-2x faster and peaked at 43 GiB instead of 62
            self.backbone_arguments.setdefault("use_flash_attention", True)

        self.monai_class = SwinTransformer
        self.implementation = implementation
        backbone = GxSwinTransformer if implementation == "gx" else SwinTransformer
        self.backbone = backbone(**self.backbone_arguments)
        if implementation == "monai" and attention == "fused":  # the same parameters and keys: only the arithmetic
            for module in self.backbone.modules():
                if isinstance(module, WindowAttention):
                    module.__class__ = fused_window_attention()
        width, stages = self.backbone_arguments["embed_dim"], len(self.backbone_arguments["depths"])
        self.channels = [width * 2**i for i in range(stages + 1)]

    def forward(self, ct: torch.Tensor) -> list[torch.Tensor]:
        return self.backbone(ct)


SWIN_ATTENTION: tuple[str, ...] = ("fused", "explicit")
SWIN_IMPLEMENTATIONS: tuple[str, ...] = ("gx", "monai")
"""``vision_kwargs.implementation`` of swin3d: gx-ray's equal, faster network (the default) or MONAI's own."""


@functools.cache
def fused_window_attention() -> type:
    """MONAI's ``WindowAttention`` with its forward through ``scaled_dot_product_attention`` with or without a
    gradient. A shifted block's windows go in as heads of one batch row per image (``nw × heads``), so the bias of
    its ``nw`` window masks broadcasts over the images instead of being copied once per image."""
    from monai.networks.nets.swin_unetr import WindowAttention

    def forward(self: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, c = x.shape
        heads = self.num_heads
        q, k, v = self.qkv(x).reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)  # each (b, heads, n, d)
        index = self.relative_position_index[:n, :n].reshape(-1)
        bias = self.relative_position_bias_table[index].reshape(n, n, heads).permute(2, 0, 1)  # (heads, n, n)
        dropout = self.attn_drop.p if self.training else 0.0
        if mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.unsqueeze(0).to(q.dtype), dropout_p=dropout, scale=self.scale
            )
        else:
            windows = mask.shape[0]
            bias = (bias.unsqueeze(0) + mask.unsqueeze(1).to(bias.dtype)).reshape(1, windows * heads, n, n)
            q, k, v = (t.reshape(b // windows, windows * heads, n, -1) for t in (q, k, v))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout, scale=self.scale
            ).reshape(b, heads, n, -1)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))

    # named as this module's attribute (see __getattr__ below), so a model holding it pickles
    return type("FusedWindowAttention", (WindowAttention,), {"forward": forward, "__module__": __name__})


def __getattr__(name: str) -> Any:
    if name == "FusedWindowAttention":  # built on first use, as MONAI is imported
        return fused_window_attention()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ResNet3d(nn.Module):
    """MONAI's 3D ResNet (``n_input_channels`` = the schema's channels); the four stage outputs are the maps."""

    def __init__(self, in_channels: int, depth: int = 18, **overrides: Any):
        super().__init__()
        self.backbone_arguments = resnet_arguments(depth, 3, in_channels, **overrides)
        self.backbone = monai_resnet(**self.backbone_arguments)
        self.channels = [w * self.backbone.layer1[0].expansion for w in self.backbone_arguments["block_inplanes"]]

    def forward(self, ct: torch.Tensor) -> list[torch.Tensor]:
        return resnet_feature_maps(self.backbone, ct)


class MultiChannel2d(nn.Module):
    """The paper's adaptation for 2D VLMs (LLaVA, BLIP-2): depth averaged to ``slices`` slabs (a fixed channel count
    whatever the depth) stacked as ``C * slices`` channels of a MONAI 2D ResNet; its maps get a singleton depth axis."""

    def __init__(self, in_channels: int, slices: int = 16, depth: int = 18, **overrides: Any):
        super().__init__()
        self.slices = slices
        self.backbone_arguments = resnet_arguments(depth, 2, in_channels * slices, **overrides)
        self.backbone = monai_resnet(**self.backbone_arguments)
        self.channels = [w * self.backbone.layer1[0].expansion for w in self.backbone_arguments["block_inplanes"]]

    def forward(self, ct: torch.Tensor) -> list[torch.Tensor]:
        return [m.unsqueeze(2) for m in resnet_feature_maps(self.backbone, stack_slices(ct, self.slices))]


def stack_slices(ct: torch.Tensor, slices: int) -> torch.Tensor:
    """(B, C, D, H, W) → (B, C * slices, H, W): depth averaged into ``slices`` slabs, phase-major channels."""
    b, c, _, h, w = ct.shape
    return F.adaptive_avg_pool3d(ct, (slices, h, w)).reshape(b, c * slices, h, w)


class Endoscopy2d(nn.Module):
    """MONAI 2D ResNet on a (B, C, S, S) image, globally pooled to one vector of width ``dim``: the endoscopy frame
    (C = 3), or a stack of RGB CT views (C = 3 x slices, lesion QA)."""

    def __init__(self, depth: int = 18, in_channels: int = 3, **overrides: Any):
        super().__init__()
        self.backbone_arguments = resnet_arguments(depth, 2, in_channels, **overrides)
        self.backbone = monai_resnet(**self.backbone_arguments)
        self.dim = self.backbone_arguments["block_inplanes"][-1] * self.backbone.layer1[0].expansion

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.backbone(image)


def _resnet3d(depth: int) -> Callable[..., ResNet3d]:
    def build(in_channels: int, gradient_checkpointing: bool = False, **kwargs: Any) -> ResNet3d:
        _no_checkpointing(f"resnet{depth}_3d", gradient_checkpointing)
        return ResNet3d(in_channels, depth, **kwargs)

    return build


def _multichannel2d(in_channels: int, gradient_checkpointing: bool = False, **kwargs: Any) -> MultiChannel2d:
    _no_checkpointing("multichannel2d", gradient_checkpointing)
    return MultiChannel2d(in_channels, **kwargs)


def _no_checkpointing(name: str, gradient_checkpointing: bool) -> None:
    # Recomputing a BatchNorm stage would update its running statistics twice; the memory problem is Swin's.
    if gradient_checkpointing:
        raise ValueError(f"gradient checkpointing is available for swin3d only, not {name}")


VISION_ENCODERS: dict[str, Callable[..., nn.Module]] = {
    "swin3d": Swin3d,
    "resnet10_3d": _resnet3d(10),  # the CPU demo's encoder (with narrow widths): 3D convolutions train slowly on CPUs
    "resnet18_3d": _resnet3d(18),
    "resnet50_3d": _resnet3d(50),
    "multichannel2d": _multichannel2d,
}
"""name → builder(in_channels, gradient_checkpointing=False, **vision_kwargs) of a CT encoder."""

ENDOSCOPY_ENCODERS: dict[str, Callable[..., nn.Module]] = {
    "resnet18_2d": lambda **kwargs: Endoscopy2d(18, **kwargs),
    "resnet50_2d": lambda **kwargs: Endoscopy2d(50, **kwargs),
}
"""name → builder(**kwargs) of the endoscopy-image encoder."""


def build_vision_encoder(name: str, in_channels: int, gradient_checkpointing: bool = False, **kwargs: Any) -> nn.Module:
    return choose(VISION_ENCODERS, name, "vision encoder")(
        in_channels, gradient_checkpointing=gradient_checkpointing, **kwargs
    )


def build_endoscopy_encoder(name: str, **kwargs: Any) -> nn.Module:
    return choose(ENDOSCOPY_ENCODERS, name, "endoscopy encoder")(**kwargs)


def choose(registry: dict[str, Any], name: str, what: str) -> Any:
    """``registry[name]``, or a ValueError that lists the valid names."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(registry)}")
    return registry[name]
