"""A 3D Swin transformer with exactly MONAI's parameters and outputs, laid out for speed on GPUs.

:class:`SwinTransformer` takes the arguments of MONAI's ``monai.networks.nets.swin_unetr.SwinTransformer`` (3D) and has
the same modules, parameter names, shapes and registration order: MONAI's state dict loads into it with
``strict=True`` and back, and ``forward(x, normalize=True)`` returns the same five stage outputs (B, C_i, d_i, h_i,
w_i), MONAI's quirks included: zero-padded tokens attend and are attended to in unshifted windows, a window shrinks to
a stage no larger than it (taking the first rows and columns of the full window's relative position index), shifted
windows are masked with -100, not -inf. What differs is how the arithmetic runs:

- **Attention** is one ``scaled_dot_product_attention`` call per block, the relative position bias (and shift mask)
  one additive bias in the compute dtype, its last axis padded to 8 so that PyTorch does not copy it to align it. On
  CUDA the memory-efficient kernel computes the bias gradient without an fp32 score matrix (MONAI's explicit softmax
  makes one). In a shifted block the windows go in as heads of one row per image (``B × (windows·heads)``), so the
  per-window bias broadcasts over the images; the shift mask is cached per stage shape (eager) or built in the graph.
  The two other ``attention_backend`` paths (:data:`ATTENTION_BACKENDS`), equal to MONAI's, were slower on an H200
  (torch 2.11, stage 1's shifted block at micro-batch 8, forward and backward with the bias gradient: this path
  26.8 ms). ``split``: cuDNN's fused kernel with a constant bias (12.1 ms) plus the bias gradient from a recomputed
  softmax, 24.8 ms in all (the compiler folds the 16-wide products into its reductions, off the tensor cores).
  ``flex`` (FlexAttention, shift as block mask, bias gradient summed by atomic adds): 29–34 ms, its forward alone
  twice the memory-efficient kernel's, and a compilation per stage shape.
- **No fp32 round trips under autocast**: block norms run in the compute dtype (statistics accumulate in fp32 in the
  kernel), the bias is gathered and cast once per block (heads × n × n, not per window), nothing is upcast before a
  matrix product; the five stage outputs are normalised as MONAI does (fp32 under autocast).
- **Layout**: channels-last (B, D, H, W, C) from the patch embedding (a reshape and one matrix product, equal to
  MONAI's stride-``patch`` convolution) to the patch merging; stage outputs are (B, C, D, H, W) views. In eager mode
  pad, cyclic shift and window partition are one gather with a cached index (and their reverse another, a gather as
  backward instead of a scatter-add); under ``torch.compile`` plain pad/roll/permute ops are left to the compiler.

``use_checkpoint`` recomputes each block's attention and MLP halves, as MONAI's does (``use_reentrant=False``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

MASK_VALUE = -100.0
"""MONAI's additive mask between tokens of different regions of a shifted window."""
BIAS_ALIGNMENT = 8
"""Elements the attention bias's rows are padded to: the memory-efficient kernel copies a bias not aligned to it."""
ATTENTION_BACKENDS = ("auto", "sdpa", "split", "flex")
"""How the window attention runs; ``auto`` is ``sdpa``, the fastest measured (module docstring):

- ``sdpa``: one ``scaled_dot_product_attention`` call with the bias as a trained input (on CUDA the memory-efficient
  kernel, which writes the bias gradient once per window and image before it is summed);
- ``split``: the same call with the bias as a constant, so that cuDNN's fused kernel runs it forward and backward,
  and the bias gradient computed apart (:class:`_BiasGradient`, compiled on CUDA);
- ``flex``: FlexAttention, the shift as a block mask and the bias as a score modification (its fused kernels and
  its backward are GPU-only; on a CPU the reference implementation, forward only)."""
FLEX_KERNEL_OPTIONS: dict[str, Any] = {
    "ROWS_GUARANTEED_SAFE": True,  # a token always attends to its own shift region
    **{f"bwd_{key}": value for key, value in {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64}.items()},
    "bwd_num_warps": 4,
    "bwd_num_stages": 2,
}
"""FlexAttention's ``kernel_options``: the best of the backward block sizes tried for 343-token windows and 16-wide
heads on an H200 (stage 1's shifted block, forward and backward, 29.0 ms against 34.2 with torch 2.11's defaults)."""


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run a matrix product on ``x`` in, or ``x``'s own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` in the compute dtype: under CUDA autocast LayerNorm would return fp32, which the next matrix
    product casts straight back; the kernel accumulates its statistics in fp32 either way."""
    if not torch.is_autocast_enabled(x.device.type):
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    dtype = torch.get_autocast_dtype(x.device.type)
    with torch.autocast(x.device.type, enabled=False):
        return F.layer_norm(x.to(dtype), norm.normalized_shape, norm.weight.to(dtype), norm.bias.to(dtype), norm.eps)


def get_window_size(
    size: Sequence[int], window: Sequence[int], shift: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """MONAI's rule: along an axis no longer than the window, the window shrinks to the axis and does not shift."""
    window, shift = list(window), list(shift)
    for i, extent in enumerate(size):
        if extent <= window[i]:
            window[i], shift[i] = extent, 0
    return tuple(window), tuple(shift)


@dataclass(frozen=True)
class Windows:
    """How one block tiles a (D, H, W) stage: its window and cyclic shift (after MONAI's shrinking)."""

    size: tuple[int, int, int]
    window: tuple[int, int, int]
    shift: tuple[int, int, int]

    @property
    def padded(self) -> tuple[int, int, int]:
        return tuple(-(-s // w) * w for s, w in zip(self.size, self.window, strict=True))

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(p // w for p, w in zip(self.padded, self.window, strict=True))

    @property
    def count(self) -> int:
        """Windows per image."""
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def tokens(self) -> int:
        """Tokens per window."""
        return self.window[0] * self.window[1] * self.window[2]

    @property
    def shifted(self) -> bool:
        return any(s > 0 for s in self.shift)

    @property
    def needs_padding(self) -> bool:
        return self.padded != self.size


def partition_order(t: torch.Tensor, windows: Windows) -> torch.Tensor:
    """A (B, Dp, Hp, Wp, ...) tensor's voxels in window order: (B, windows, tokens, ...) (one copy at most)."""
    (gd, gh, gw), (wd, wh, ww) = windows.grid, windows.window
    rest = t.shape[4:]
    t = t.reshape(t.shape[0], gd, wd, gh, wh, gw, ww, *rest)
    t = t.permute(0, 1, 3, 5, 2, 4, 6, *range(7, 7 + len(rest)))
    return t.reshape(t.shape[0], windows.count, windows.tokens, *rest)


def reverse_order(t: torch.Tensor, windows: Windows) -> torch.Tensor:
    """:func:`partition_order` undone: (B, windows, tokens, C) → (B, Dp, Hp, Wp, C)."""
    (gd, gh, gw), (wd, wh, ww) = windows.grid, windows.window
    t = t.reshape(t.shape[0], gd, gh, gw, wd, wh, ww, t.shape[-1]).permute(0, 1, 4, 2, 5, 3, 6, 7)
    return t.reshape(t.shape[0], *windows.padded, t.shape[-1])


def partition_plain(x: torch.Tensor, windows: Windows) -> torch.Tensor:
    """(B, D, H, W, C) → (B, windows, tokens, C) as MONAI does it: zero-pad, roll by -shift, partition."""
    pads = [p - s for p, s in zip(windows.padded, windows.size, strict=True)]
    if any(pads):
        x = F.pad(x, (0, 0, 0, pads[2], 0, pads[1], 0, pads[0]))
    if windows.shifted:
        x = torch.roll(x, shifts=tuple(-s for s in windows.shift), dims=(1, 2, 3))
    return partition_order(x, windows)


def reverse_plain(y: torch.Tensor, windows: Windows) -> torch.Tensor:
    """(B, windows, tokens, C) → (B, D, H, W, C): reverse the partition, roll back, crop the padding."""
    x = reverse_order(y, windows)
    if windows.shifted:
        x = torch.roll(x, shifts=windows.shift, dims=(1, 2, 3))
    d, h, w = windows.size
    return x[:, :d, :h, :w] if windows.needs_padding else x


@functools.lru_cache(maxsize=64)
def gather_indices(windows: Windows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Indices that do :func:`partition_plain` as one gather: ``gather`` (each window-order position's source voxel, 0
    for padding), ``scatter`` (each voxel's window-order position), ``padding`` (the padded positions, or None)."""
    d, h, w = windows.size
    # torch.roll(x, -s)[i] = x[(i + s) % P]: each padded-volume coordinate's source along one axis
    axes = [(torch.arange(p, device=device) + s) % p for p, s in zip(windows.padded, windows.shift, strict=True)]
    cd, ch, cw = axes[0][:, None, None], axes[1][None, :, None], axes[2][None, None, :]
    valid = (cd < d) & (ch < h) & (cw < w)
    source = torch.where(valid, cd * (h * w) + ch * w + cw, 0)
    source = partition_order(source.unsqueeze(0), windows).reshape(-1)
    valid = partition_order(valid.unsqueeze(0), windows).reshape(-1)
    positions = torch.arange(source.numel(), device=device)
    scatter = torch.empty(d * h * w, dtype=torch.long, device=device)
    scatter[source[valid]] = positions[valid]
    padding = positions[~valid] if windows.needs_padding else None
    return source, scatter, padding


class _Gather(torch.autograd.Function):
    """``x.index_select(1, index)`` with the rows at ``zero`` set to 0, and as backward the inverse gather (never a
    scatter-add: the index is a permutation of the real tokens plus padding)."""

    @staticmethod
    def forward(ctx, x, index, zero, inverse, inverse_zero):
        ctx.inverse, ctx.inverse_zero = inverse, inverse_zero
        y = x.index_select(1, index)
        if zero is not None:
            y.index_fill_(1, zero, 0)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.index_select(1, ctx.inverse)
        if ctx.inverse_zero is not None:
            grad.index_fill_(1, ctx.inverse_zero, 0)
        return grad, None, None, None, None


def partition(x: torch.Tensor, windows: Windows) -> torch.Tensor:
    """:func:`partition_plain`; in eager mode one gather (pad, roll and partition in one copy)."""
    if torch.compiler.is_compiling():
        return partition_plain(x, windows)
    b, c = x.shape[0], x.shape[-1]
    gather, scatter, padding = gather_indices(windows, x.device)
    y = _Gather.apply(x.reshape(b, -1, c), gather, padding, scatter, None)
    return y.view(b, windows.count, windows.tokens, c)


def reverse(y: torch.Tensor, windows: Windows) -> torch.Tensor:
    """:func:`reverse_plain`; in eager mode one gather (reverse, roll back and crop in one copy)."""
    if torch.compiler.is_compiling():
        return reverse_plain(y, windows)
    b, c = y.shape[0], y.shape[-1]
    gather, scatter, padding = gather_indices(windows, y.device)
    x = _Gather.apply(y.reshape(b, -1, c), scatter, None, gather, padding)
    return x.view(b, *windows.size, c)


def aligned(n: int) -> int:
    return -(-n // BIAS_ALIGNMENT) * BIAS_ALIGNMENT


def build_shift_mask(windows: Windows, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """MONAI's ``compute_mask`` as (windows, 1, n, aligned(n)): -100 between tokens of different shift regions, 0 in
    the padding columns. A region is a product of three slabs per axis, [0, P-w), [P-w, P-s), [P-s, P); an axis that
    does not shift (s = 0) does not split regions (MONAI's third slab then covers the whole axis)."""
    region = shift_regions(windows, device)  # (windows, n)
    n = windows.tokens
    mask = torch.zeros(windows.count, 1, n, aligned(n), device=device, dtype=dtype)
    mask[..., :n].masked_fill_((region[:, :, None] != region[:, None, :]).unsqueeze(1), MASK_VALUE)
    return mask


@functools.lru_cache(maxsize=16)
def cached_shift_mask(windows: Windows, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return build_shift_mask(windows, device, dtype)


def shift_mask(windows: Windows, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The shift mask of a shifted block (None for an unshifted one): cached in eager mode, built inside the graph
    under ``torch.compile`` (a compiled graph must not read a Python-side cache)."""
    if not windows.shifted:
        return None
    if torch.compiler.is_compiling():
        return build_shift_mask(windows, device, dtype)
    return cached_shift_mask(windows, device, dtype)


def shift_regions(windows: Windows, device: torch.device) -> torch.Tensor:
    """(windows, n) shift region of each token of each window (:func:`build_shift_mask`'s regions)."""
    ids = []
    for p, w, s in zip(windows.padded, windows.window, windows.shift, strict=True):
        i = torch.arange(p, device=device)
        ids.append(((i >= p - w).long() + (i >= p - s).long()) if s > 0 else torch.zeros_like(i))
    region = ids[0][:, None, None] * 9 + ids[1][None, :, None] * 3 + ids[2][None, None, :]
    return partition_order(region.unsqueeze(0), windows)[0].to(torch.int32)


def build_block_mask(windows: Windows, device: torch.device) -> BlockMask:
    """FlexAttention's block mask of a shifted block, the windows as its batch: a token attends to its own shift
    region's tokens; blocks within one region run unmasked, blocks between regions only are skipped. MONAI's -100
    where this masks to -inf gives the same softmax (e^-100 is below fp32's resolution beside a non-empty region)."""
    region = shift_regions(windows, device)

    def same_region(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return region[b, q] == region[b, kv]

    n = windows.tokens
    return create_block_mask(same_region, windows.count, None, n, n, device=device)


@functools.lru_cache(maxsize=16)
def cached_block_mask(windows: Windows, device: torch.device) -> BlockMask:
    return build_block_mask(windows, device)


def block_mask(windows: Windows, device: torch.device) -> BlockMask | None:
    """The block mask of a shifted block (None for an unshifted one), cached in eager mode as the shift mask is."""
    if not windows.shifted:
        return None
    if torch.compiler.is_compiling():
        return build_block_mask(windows, device)
    return cached_block_mask(windows, device)


@functools.cache
def compiled_flex_attention() -> Any:
    """``flex_attention`` compiled once per process: uncompiled it runs an unfused reference that materialises
    the scores. One graph per stage shape (shifted or not, training or not); the default limit of 8 recompilations
    of one function would send a four-stage network's later shapes back to the reference, so it is raised."""
    config = torch.compiler.config
    config.recompile_limit = max(config.recompile_limit, 64)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 512)
    return torch.compile(flex_attention, dynamic=False)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``flex_attention``: fused (compiled) on CUDA in eager mode, traced into the graph under ``torch.compile``; on
    other devices the reference implementation (forward only, to check the arithmetic)."""
    if torch.compiler.is_compiling() or not q.is_cuda:
        return flex_attention(q, k, v, **kwargs)
    return compiled_flex_attention()(q, k, v, **kwargs)


def bias_gradient(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    out: torch.Tensor,
    grad: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The gradient of an additive attention bias, summed over the batch: Σ_b P ⊙ (dP − rowsum(dO ⊙ O)), with
    P = softmax(scale · q kᵀ + bias) and dP = dO vᵀ. The products run in the inputs' dtype (bf16 under autocast), the
    softmax and the sum in fp32; compiled on CUDA, the softmax, the product with dP and the sum over the batch are
    fused passes over the scores."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias.float()
    probabilities = torch.softmax(scores, -1)
    delta = (grad.float() * out.float()).sum(-1, keepdim=True)
    return (probabilities * (torch.matmul(grad, v.transpose(-1, -2)).float() - delta)).sum(0)


@functools.cache
def compiled_bias_gradient() -> Any:
    return torch.compile(bias_gradient, dynamic=False)


class _BiasGradient(torch.autograd.Function):
    """Passes the attention output through unchanged and, in backward, gives ``bias`` its gradient from the saved
    q, k, v, output and the output's gradient (:func:`bias_gradient`). The attention call itself takes the bias
    detached, so that its own backward (cuDNN's) computes q, k and v's gradients only."""

    @staticmethod
    def forward(ctx, out, bias, q, k, v, scale):
        ctx.save_for_backward(out, bias, q, k, v)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        out, bias, q, k, v = ctx.saved_tensors
        compute = bias_gradient if torch.compiler.is_compiling() or not grad.is_cuda else compiled_bias_gradient()
        dbias = compute(q, k, v, bias, out, grad, ctx.scale)
        return grad, dbias.to(bias.dtype).reshape(bias.shape), None, None, None, None


def cudnn_first() -> list[SDPBackend]:
    """SDPA's backends with cuDNN's first: it takes an additive bias that needs no gradient, and on an H200 runs
    the windows' attention forward and backward in less than half the memory-efficient kernel's time."""
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def relative_position_index(window: Sequence[int]) -> torch.Tensor:
    """MONAI's (n, n) index into the (2w-1)^3 relative position table of a 3D window."""
    coords = torch.stack(torch.meshgrid(*(torch.arange(w) for w in window), indexing="ij")).flatten(1)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    for axis, w in enumerate(window):
        relative[:, :, axis] += w - 1
    relative[:, :, 0] *= (2 * window[1] - 1) * (2 * window[2] - 1)
    relative[:, :, 1] *= 2 * window[2] - 1
    return relative.sum(-1)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth as MONAI's ``DropPath`` (per sample, scaled by the keep probability)."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)


class WindowAttention(nn.Module):
    """MONAI's ``WindowAttention`` parameters; forward through SDPA or FlexAttention (see the module docstring)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: Sequence[int],
        qkv_bias: bool,
        attn_drop: float,
        drop: float,
        backend: str = "auto",
    ):
        super().__init__()
        self.dim, self.num_heads, self.window_size = dim, num_heads, tuple(window_size)
        self.backend = backend
        self.scale = (dim // num_heads) ** -0.5
        table = (2 * window_size[0] - 1) * (2 * window_size[1] - 1) * (2 * window_size[2] - 1)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(table, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window_size))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def position_bias(self, n: int, dtype: torch.dtype, columns: int | None = None) -> torch.Tensor:
        """(heads, n, columns) relative position bias in ``dtype``, ``columns`` ≥ n (default aligned(n)); MONAI takes
        the first n rows and columns of the full window's index also where the window has shrunk. The padding
        columns hold finite values, never read."""
        index = F.pad(self.relative_position_index[:n, :n], (0, (columns or aligned(n)) - n))
        return self.relative_position_bias_table.to(dtype)[index].permute(2, 0, 1).contiguous()

    def path(self, x: torch.Tensor) -> str:
        """The attention path this call takes: :data:`ATTENTION_BACKENDS`'s choice, ``sdpa`` for attention dropout
        in training (neither FlexAttention nor the split gradient has one)."""
        if self.training and self.attn_drop > 0:
            return "sdpa"
        return "sdpa" if self.backend == "auto" else self.backend

    def forward(self, x: torch.Tensor, windows: Windows) -> torch.Tensor:
        """(B, windows, n, C) → the same."""
        qkv = self.qkv(x)
        path = self.path(x)
        out = self.flex(qkv, windows) if path == "flex" else self.sdpa(qkv, windows, split=path == "split")
        return self.proj_drop(self.proj(out))

    def flex(self, qkv: torch.Tensor, windows: Windows) -> torch.Tensor:
        """The windows as FlexAttention's batch and images × heads as its heads, so that the shift's block mask (per
        window) and the position bias (per head) broadcast over the images. The bias is read in fp32 in the score
        modification and its gradient summed over the windows in the backward kernel, never written per window."""
        b, nw, n, c3 = qkv.shape
        heads, c = self.num_heads, c3 // 3
        q, k, v = qkv.view(b, nw, n, 3, heads, c // heads).permute(3, 1, 0, 4, 2, 5).reshape(3, nw, b * heads, n, -1)
        bias = self.position_bias(n, torch.float32, n)

        def add_bias(
            score: torch.Tensor, w: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
        ) -> torch.Tensor:
            return score + bias[h % heads, i, j]

        out = flex(
            q,
            k,
            v,
            score_mod=add_bias,
            block_mask=block_mask(windows, qkv.device),
            scale=self.scale,
            kernel_options=FLEX_KERNEL_OPTIONS,
        )
        return out.view(nw, b, heads, n, -1).permute(1, 0, 3, 2, 4).reshape(b, nw, n, c)

    def sdpa(self, qkv: torch.Tensor, windows: Windows, split: bool = False) -> torch.Tensor:
        """One ``scaled_dot_product_attention`` call with the bias (and the shift mask) in the compute dtype; with
        ``split`` the bias goes in as a constant (cuDNN's kernel, no bias gradient written per window) and
        :class:`_BiasGradient` gives the bias table its gradient."""
        b, nw, n, c3 = qkv.shape
        heads, c = self.num_heads, c3 // 3
        mask = shift_mask(windows, qkv.device, qkv.dtype)
        dropout = self.attn_drop if self.training else 0.0
        bias = self.position_bias(n, qkv.dtype)
        if mask is None:  # windows as the batch; q, k, v stay views of the projection
            q, k, v = qkv.view(b * nw, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
            bias = bias.unsqueeze(0)
        else:  # windows × heads as the heads of one row per image: the per-window bias broadcasts over images
            q, k, v = (
                qkv.view(b, nw, n, 3, heads, c // heads).permute(3, 0, 1, 4, 2, 5).reshape(3, b, nw * heads, n, -1)
            )
            bias = (bias.unsqueeze(0) + mask.to(bias.dtype)).view(1, nw * heads, n, -1)
        if split:
            out = self.split_attention(q, k, v, bias)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[..., :n], dropout_p=dropout, scale=self.scale)
        if mask is None:
            return out.transpose(1, 2).reshape(b, nw, n, c)
        return out.view(b, nw, heads, n, -1).transpose(2, 3).reshape(b, nw, n, c)

    def split_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n = q.shape[-2]
        constant = bias.detach()[..., :n]
        if q.is_cuda and not torch.compiler.is_compiling():  # cuDNN's kernel first where it takes the shapes
            with sdpa_kernel(cudnn_first(), set_priority=True):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=constant, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=constant, scale=self.scale)
        if not bias.requires_grad:
            return out
        # (1, heads, n, n), or in a shifted block (1, windows × heads, n, n): autograd sums the windows' gradients
        # through the view that made it
        return _BiasGradient.apply(out, bias[..., :n], q.detach(), k.detach(), v.detach(), self.scale)


class Mlp(nn.Module):
    """MONAI's ``MLPBlock`` (GELU, "swin" dropout) with its parameter names."""

    def __init__(self, dim: int, hidden: int, drop: float):
        super().__init__()
        self.linear1 = nn.Linear(dim, hidden)
        self.linear2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.linear2(self.drop(F.gelu(self.linear1(x)))))


class SwinTransformerBlock(nn.Module):
    def __init__(self, config: SwinConfig, dim: int, num_heads: int, drop_path: float):
        super().__init__()
        self.use_checkpoint = config.use_checkpoint
        self.drop_path = drop_path
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(
            dim, num_heads, config.window_size, config.qkv_bias, config.attn_drop_rate, config.drop_rate,
            config.attention_backend,
        )  # fmt: skip
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * config.mlp_ratio), config.drop_rate)

    def attention_part(self, x: torch.Tensor, windows: Windows) -> torch.Tensor:
        h = self.attn(partition(layer_norm(x, self.norm1), windows), windows)
        return reverse(h, windows)

    def mlp_part(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(layer_norm(x, self.norm2))

    def forward(self, x: torch.Tensor, windows: Windows) -> torch.Tensor:
        """(B, D, H, W, C) → the same."""
        if self.use_checkpoint:
            x = x + drop_path(checkpoint(self.attention_part, x, windows, use_reentrant=False), *self._drop)
            return x + drop_path(checkpoint(self.mlp_part, x, use_reentrant=False), *self._drop)
        x = x + drop_path(self.attention_part(x, windows), *self._drop)
        return x + drop_path(self.mlp_part(x), *self._drop)

    @property
    def _drop(self) -> tuple[float, bool]:
        return self.drop_path, self.training


class PatchMerging(nn.Module):
    """MONAI's ``PatchMerging`` (``v2=False``: v0.9's neighbour order) or ``PatchMergingV2``; channels-last."""

    ORDER = ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1), (1, 1, 1))

    def __init__(self, dim: int, v2: bool = False):
        super().__init__()
        self.v2 = v2
        self.reduction = nn.Linear(8 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(8 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, d, h, w, _ = x.shape
        if d % 2 or h % 2 or w % 2:
            x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2, 0, d % 2))
        order = itertools.product(range(2), range(2), range(2)) if self.v2 else self.ORDER
        x = torch.cat([x[:, i::2, j::2, k::2, :] for i, j, k in order], -1)
        return self.reduction(layer_norm(x, self.norm))


class BasicLayer(nn.Module):
    """One stage: a block per ``drop_path`` rate (odd ones shifted) then the patch merging; channels-last in and out."""

    def __init__(self, config: SwinConfig, dim: int, num_heads: int, drop_path: Sequence[float]):
        super().__init__()
        self.window_size = config.window_size
        self.shift_size = tuple(w // 2 for w in config.window_size)
        self.blocks = nn.ModuleList(SwinTransformerBlock(config, dim, num_heads, p) for p in drop_path)
        self.downsample = PatchMerging(dim, config.downsample == "mergingv2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = tuple(x.shape[1:4])
        window, shift = get_window_size(size, self.window_size, self.shift_size)
        plain, shifted = Windows(size, window, (0, 0, 0)), Windows(size, window, shift)
        for i, block in enumerate(self.blocks):
            x = block(x, shifted if i % 2 else plain)
        return self.downsample(x)


class PatchEmbed(nn.Module):
    """MONAI's ``PatchEmbed`` (a stride-``patch`` convolution, zero-padding the input to a multiple of the patch)
    computed as one matrix product over the patches, channels-last out."""

    def __init__(self, patch_size: Sequence[int], in_chans: int, embed_dim: int, patch_norm: bool):
        super().__init__()
        self.patch_size = tuple(patch_size)
        self.proj = nn.Conv3d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.norm = nn.LayerNorm(embed_dim) if patch_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, *size = x.shape
        pads = [-s % p for s, p in zip(size, self.patch_size, strict=True)]
        if any(pads):
            x = F.pad(x, (0, pads[2], 0, pads[1], 0, pads[0]))
        x = x.to(compute_dtype(x))  # cast before the patch reshape's copy, not after
        (pd, ph, pw), (d, h, w) = self.patch_size, (s // p for s, p in zip(x.shape[2:], self.patch_size, strict=True))
        patches = x.view(b, c, d, pd, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, d, h, w, -1)
        x = F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)
        return x if self.norm is None else layer_norm(x, self.norm)


UNSUPPORTED = {"use_hyena": False, "hyena_stages": None}


@dataclass(frozen=True, kw_only=True)
class SwinConfig:
    """The arguments of MONAI's 3D ``SwinTransformer`` that gx-ray's takes, and ``attention_backend`` (not MONAI's):
    :data:`ATTENTION_BACKENDS`. ``use_flash_attention`` (MONAI's switch for its fused attention without gradients) is
    accepted and ignored: this network always runs fused. 2D and norm layers other than LayerNorm are refused."""

    in_chans: int
    embed_dim: int
    window_size: Sequence[int]
    patch_size: Sequence[int]
    depths: Sequence[int]
    num_heads: Sequence[int]
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    norm_layer: type[nn.Module] = nn.LayerNorm
    patch_norm: bool = False
    use_checkpoint: bool = False
    spatial_dims: int = 3
    downsample: str = "merging"
    use_v2: bool = False
    use_flash_attention: bool = False
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        dims, window_size, patch_size, depths, num_heads = (
            self.spatial_dims, self.window_size, self.patch_size, self.depths, self.num_heads
        )  # fmt: skip
        if dims != 3 or len(window_size) != 3 or len(patch_size) != 3:
            raise ValueError(f"gx-ray's SwinTransformer is 3D only: spatial_dims {dims}, window {window_size}")
        if len(depths) != 4 or len(num_heads) != 4:
            raise ValueError(f"MONAI's SwinTransformer has four stages: depths {depths}, num_heads {num_heads}")
        if self.norm_layer is not nn.LayerNorm:
            raise ValueError(f"gx-ray's SwinTransformer normalises with nn.LayerNorm only, not {self.norm_layer}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
        if self.downsample not in ("merging", "mergingv2"):
            raise ValueError(f"downsample {self.downsample!r}: gx-ray's SwinTransformer has 'merging' and 'mergingv2'")
        for name in ("window_size", "patch_size", "depths", "num_heads"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def of(cls, **arguments: Any) -> SwinConfig:
        """From MONAI's keyword arguments; its Hyena blocks' only at their defaults."""
        names = {f.name for f in fields(cls)}
        unsupported = {k: v for k, v in arguments.items() if k not in names}
        bad = sorted(k for k in unsupported if k not in UNSUPPORTED and not k.startswith("hyena_"))
        if bad:
            raise TypeError(f"SwinTransformer got unexpected arguments {bad}")
        used = sorted(k for k, v in unsupported.items() if v != UNSUPPORTED.get(k, v))
        if used:
            raise ValueError(f"gx-ray's SwinTransformer has no Hyena blocks ({used}); use implementation 'monai'")
        return cls(**{k: v for k, v in arguments.items() if k in names})


class SwinTransformer(nn.Module):
    """MONAI's 3D ``SwinTransformer`` (same arguments, parameters and outputs), faster: see the module docstring.
    Built from a :class:`SwinConfig` or from MONAI's keyword arguments (its fields)."""

    def __init__(self, config: SwinConfig | None = None, **arguments: Any):
        super().__init__()
        self.config = config = config or SwinConfig.of(**arguments)
        depths, embed_dim = config.depths, config.embed_dim
        self.patch_embed = PatchEmbed(config.patch_size, config.in_chans, embed_dim, config.patch_norm)
        self.pos_drop = nn.Dropout(p=config.drop_rate)
        rates = [x.item() for x in torch.linspace(0, config.drop_path_rate, sum(depths))]
        self.use_v2 = config.use_v2
        self.layers1, self.layers2, self.layers3, self.layers4 = (nn.ModuleList() for _ in range(4))
        if self.use_v2:
            self.layers1c, self.layers2c, self.layers3c, self.layers4c = (nn.ModuleList() for _ in range(4))
        for i in range(4):
            width, stage_rates = embed_dim * 2**i, rates[sum(depths[:i]) : sum(depths[: i + 1])]
            getattr(self, f"layers{i + 1}").append(BasicLayer(config, width, config.num_heads[i], stage_rates))
            if self.use_v2:
                from monai.networks.blocks import UnetrBasicBlock  # MONAI's residual conv block, its parameters

                block = UnetrBasicBlock(3, width, width, 3, 1, "instance", res_block=True)
                getattr(self, f"layers{i + 1}c").append(block)

    @staticmethod
    def proj_out(x: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """A channels-last stage output as (B, C, D, H, W), layer-normalised over C (no affine) as MONAI's."""
        if normalize:
            x = F.layer_norm(x, x.shape[-1:])
        return x.permute(0, 4, 1, 2, 3)

    def forward(self, x: torch.Tensor, normalize: bool = True) -> list[torch.Tensor]:
        x = self.pos_drop(self.patch_embed(x))
        outputs = [self.proj_out(x, normalize)]
        for i in range(4):
            if self.use_v2:  # MONAI's conv block reads (B, C, D, H, W): a channels-last view, and back
                x = getattr(self, f"layers{i + 1}c")[0](x.permute(0, 4, 1, 2, 3)).permute(0, 2, 3, 4, 1).contiguous()
            x = getattr(self, f"layers{i + 1}")[0](x)
            outputs.append(self.proj_out(x, normalize))
        return outputs
