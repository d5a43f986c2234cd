"""Model benchmark: training samples/s and peak memory of a registry-built encoder against the raw MONAI network.

Both sides train on the same fixed random batch with the same AMP setting: the registry side is
:func:`~gx_ray.models.build_encoder` with a linear head on ``Encoded.pooled`` and :func:`param_groups`; the raw
side is the same MONAI class instantiated with the same arguments, its deepest features mean-pooled into a
linear head, and a plain AdamW. Warm-up steps are not timed; the device is synchronised before every clock
read. Their ratio is the cost of the platform's wrapping; for ``swin3d``
it also holds the registry's fused window attention against MONAI's explicit one in training (``--attention
explicit`` on the registry side leaves the wrapping alone).

Peak memory is ``torch.cuda.max_memory_allocated`` on a GPU. On the CPU it is the largest rise of the
process's resident set over its value before the model was built, sampled every few milliseconds: a rough
figure, since the allocator may keep freed memory from an earlier run.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from gx_ray.modalities.inputs import ModelInputs
from gx_ray.modalities.schemas import ModalitySchema
from gx_ray.models.registry import ModelConfig, build_encoder, compile_in_place, param_groups
from gx_ray.models.swin import WindowAttention
from gx_ray.models.vision import VISION_ENCODERS, stack_slices
from gx_ray.schema import BOX_LEVELS, PHASES

AMP_MODES = ("bf16", "off")


@dataclass(frozen=True)
class ModelBenchmarkConfig:
    model: str = "swin3d"
    """A vision encoder name (:data:`~gx_ray.models.vision.VISION_ENCODERS`)."""
    shape: tuple[int, int, int, int] = (4, 64, 128, 128)
    """(C, D, H, W) of one CT sample; C ≤ 4 are phases, 5-7 add box-mask channels."""
    batch: int = 8
    steps: int = 10
    warmup: int = 3
    amp: str = "bf16"
    fusion: str = "concat"
    classes: int = 4
    lr: float = 5e-5
    weight_decay: float = 0.01
    gradient_checkpointing: bool = False
    compile: bool = False
    """``torch.compile`` the CT network on both sides (the registry's ``model.compile``)."""
    vision_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in VISION_ENCODERS:
            raise ValueError(f"unknown model {self.model!r}; valid: {', '.join(VISION_ENCODERS)}")
        if self.amp not in AMP_MODES:
            raise ValueError(f"unknown amp {self.amp!r}; valid: {', '.join(AMP_MODES)}")
        if len(self.shape) != 4 or min(self.shape) < 1:
            raise ValueError(f"shape must be four positive sizes C,D,H,W; got {self.shape}")
        if self.batch < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError("batch and steps must be positive and warmup non-negative")


@dataclass(frozen=True)
class Timing:
    samples_per_s: float
    peak_memory_bytes: int
    seconds: float
    warmup_seconds: float = 0.0
    """Building the model and its untimed steps: where a compiled model pays its compilation."""


@dataclass(frozen=True)
class ModelBenchmarkResult:
    config: ModelBenchmarkConfig
    device: str
    registry: Timing
    raw: Timing
    flops_per_sample: dict[str, float] = field(default_factory=dict)
    """Training FLOPs of one sample (forward and backward) per side, counted by ``FlopCounterMode`` on an eager step."""
    matmul_peak_flops: float | None = None
    """A bf16 8192³ matrix product's rate on this GPU, measured in the same run: the ceiling the shares are of."""
    differences: dict[str, float] = field(default_factory=dict)
    """swin3d, eager: gx-ray's network against MONAI's with the same weights (:func:`swin_differences`)."""
    kernels: dict[str, str] = field(default_factory=dict)
    """On a GPU: the registry side's costliest kernels in one training step (:func:`kernel_profile`)."""
    bytes_per_sample: dict[str, float] = field(default_factory=dict)
    """Memory traffic of one sample's training per side, estimated by :class:`BytesMoved` on an eager step."""
    copy_bandwidth: float | None = None
    """Bytes/s of a large device-to-device copy (read + write) on this GPU, in the same run: the bandwidth ceiling."""

    @property
    def ratio(self) -> float:
        """Registry samples/s over raw samples/s: 1.0 means the wrapping costs nothing."""
        return self.registry.samples_per_s / self.raw.samples_per_s

    def tflops(self, side: str) -> float:
        """The side's training TFLOP/s: its FLOPs a sample times its samples/s."""
        return self.flops_per_sample[side] * getattr(self, side).samples_per_s / 1e12

    def share_of_peak(self, side: str) -> float | None:
        return self.tflops(side) * 1e12 / self.matmul_peak_flops if self.matmul_peak_flops else None

    def bandwidth(self, side: str) -> float | None:
        """The side's estimated memory traffic in bytes/s: its bytes a sample times its samples/s."""
        moved = self.bytes_per_sample.get(side)
        return None if moved is None else moved * getattr(self, side).samples_per_s

    def share_of_bandwidth(self, side: str) -> float | None:
        achieved = self.bandwidth(side)
        return achieved / self.copy_bandwidth if achieved is not None and self.copy_bandwidth else None

    def figures(self) -> dict[str, Any]:
        """Everything measured, with the derived rates, as the results file keeps it."""
        derived = {
            f"{side}.{name}": value
            for side in ("registry", "raw")
            for name, value in (
                ("tflops", self.tflops(side)),
                ("share_of_matmul_peak", self.share_of_peak(side)),
                ("bandwidth_bytes_per_s", self.bandwidth(side)),
                ("share_of_copy_bandwidth", self.share_of_bandwidth(side)),
            )
        }
        return {**asdict(self), "ratio": self.ratio, **derived}


def schema_for_channels(channels: int) -> ModalitySchema:
    """A modality schema whose CT has ``channels`` channels: phases first, then box-mask channels."""
    if 1 <= channels <= len(PHASES):
        return ModalitySchema("benchmark", phases=PHASES[:channels])
    if channels <= len(PHASES) + len(BOX_LEVELS):
        return ModalitySchema("benchmark", boxes="channels", box_levels=BOX_LEVELS[: channels - len(PHASES)])
    raise ValueError(f"{channels} channels: a schema gives 1 to {len(PHASES) + len(BOX_LEVELS)}")


def run_model_benchmark(config: ModelBenchmarkConfig, device: str | torch.device | None = None) -> ModelBenchmarkResult:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rng = np.random.default_rng(config.seed)
    batch_shape = (config.batch, *config.shape)
    ct = torch.from_numpy(rng.standard_normal(batch_shape, dtype=np.float32)).to(device)
    labels = torch.from_numpy(rng.integers(0, config.classes, config.batch)).to(device)
    schema = schema_for_channels(config.shape[0])
    model_config = ModelConfig(
        vision=config.model,
        fusion=config.fusion,
        vision_kwargs=config.vision_kwargs,
        gradient_checkpointing=config.gradient_checkpointing,
        compile=config.compile,
    )
    inputs = ModelInputs(ct, torch.ones(config.batch, len(schema.phases), dtype=torch.bool, device=device))
    backbone: dict[str, Any] = {}

    def registry_step(compile: bool = config.compile) -> Callable[[], torch.Tensor]:
        encoder = build_encoder(replace(model_config, compile=compile), schema)
        backbone.update(
            encoder=encoder,
            cls=getattr(encoder.vision, "monai_class", type(encoder.vision.backbone)),  # swin3d: MONAI's, raw
            arguments=encoder.vision.backbone_arguments,
            width=encoder.vision.channels[-1],
        )
        model = nn.ModuleDict({"encoder": encoder, "head": nn.Linear(encoder.dim, config.classes)}).to(device)
        groups = param_groups(model, config.lr, config.weight_decay, text_lr_multiplier=2.0)  # the paper's
        return _train_step(model, torch.optim.AdamW(groups, config.lr), lambda: model.head(encoder(inputs).pooled))

    def raw_step(compile: bool = config.compile) -> Callable[[], torch.Tensor]:
        net = backbone["cls"](**backbone["arguments"])
        if compile:
            compile_in_place(net)
        model = nn.ModuleDict({"net": net, "head": nn.Linear(backbone["width"], config.classes)}).to(device)
        x = stack_slices(ct, model_config.vision_kwargs.get("slices", 16)) if config.model == "multichannel2d" else ct
        optimizer = torch.optim.AdamW(model.parameters(), config.lr, weight_decay=config.weight_decay)
        return _train_step(model, optimizer, lambda: model.head(_pooled(net(x))))

    def amp() -> Any:
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.amp == "bf16")

    def train(build: Callable[[], Callable[[], torch.Tensor]]) -> Timing:
        return _time_training(build, lambda logits: F.cross_entropy(logits, labels), amp(), config, device)

    def counted(build: Callable[[bool], Callable[..., torch.Tensor]]) -> tuple[float, float]:
        """One eager step's FLOPs and bytes moved over the batch (compiled kernels hide their operations from the
        counters)."""
        step = build(False)
        for module in backbone["encoder"].modules() if build is registry_step else ():
            if isinstance(module, WindowAttention):  # compiled FlexAttention runs under no dispatch mode: count SDPA's
                module.backend = "sdpa"
        with FlopCounterMode(display=False) as counter, BytesMoved() as moved:
            step(lambda logits: F.cross_entropy(logits, labels), amp())
        del step
        return counter.get_total_flops() / config.batch, moved.bytes / config.batch

    cudnn_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True  # the same for both sides; it is what a GPU trial would run with
    try:
        registry = train(registry_step)
        raw = train(raw_step)
        sides = {"registry": counted(registry_step), "raw": counted(raw_step)}
    finally:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    differences, kernels = {}, {}
    if config.model == "swin3d" and not config.compile:  # the eager kernels are the ones compared and profiled
        differences = swin_differences(backbone["arguments"], ct, amp(), config.seed)
    if device.type == "cuda":
        kernels = kernel_profile(registry_step(), lambda logits: F.cross_entropy(logits, labels), amp(), device)
    peak = matmul_peak(device) if device.type == "cuda" else None
    copy = copy_bandwidth(device) if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    flops, moved = ({side: figures[i] for side, figures in sides.items()} for i in (0, 1))
    return ModelBenchmarkResult(config, name, registry, raw, flops, peak, differences, kernels, moved, copy)


def swin_differences(arguments: dict[str, Any], x: torch.Tensor, amp: Any, seed: int = 0) -> dict[str, float]:
    """gx-ray's Swin against MONAI's with the same weights on ``x`` (the benchmark's batch): the largest difference
    of the five stage outputs and of the parameter gradients (of a loss weighing every output), relative to the
    largest magnitude of MONAI's fp32 tensor, for ours and MONAI's under ``amp`` against each other and against
    MONAI's fp32: MONAI's own low-precision error is the yardstick. The position bias tables are perturbed (their
    init, std 0.02, would hide a misplaced bias)."""
    from monai.networks.nets.swin_unetr import SwinTransformer as MonaiSwin

    from gx_ray.models.swin import SwinTransformer

    torch.manual_seed(seed)
    theirs = MonaiSwin(**arguments).to(x.device).train()
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            if name.endswith("relative_position_bias_table"):
                parameter.add_(0.5 * torch.randn_like(parameter))
    ours = SwinTransformer(**arguments).to(x.device).train()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    weights: list[torch.Tensor] = []

    def run(model: nn.Module, autocast: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with autocast:
            outputs = model(x)
        if not weights:
            weights.extend(torch.randn_like(o, dtype=torch.float32) for o in outputs)
        sum((o.float() * w).sum() for o, w in zip(outputs, weights, strict=True)).backward()
        grads = [p.grad.float() for p in model.parameters()]
        return [o.detach().float() for o in outputs], grads

    reference = run(theirs, torch.autocast(x.device.type, enabled=False))
    monai_amp = run(theirs, amp)
    ours_amp = run(ours, amp)

    def largest(a: list[torch.Tensor], b: list[torch.Tensor], scale: list[torch.Tensor]) -> float:
        return max(
            ((u - v).abs().max() / s.abs().max().clamp_min(1e-30)).item() for u, v, s in zip(a, b, scale, strict=True)
        )

    figures = {}
    for part, index in (("outputs", 0), ("gradients", 1)):
        ref = reference[index]
        figures[f"{part}.ours_vs_monai"] = largest(ours_amp[index], monai_amp[index], ref)
        figures[f"{part}.monai_vs_fp32"] = largest(monai_amp[index], ref, ref)
        figures[f"{part}.ours_vs_fp32"] = largest(ours_amp[index], ref, ref)
    del theirs, ours, reference, monai_amp, ours_amp
    gc.collect()
    if x.device.type == "cuda":
        torch.cuda.empty_cache()
    return figures


def kernel_profile(
    step: Callable[..., torch.Tensor], loss_of: Callable[[torch.Tensor], torch.Tensor], amp: Any, device: torch.device
) -> dict[str, str]:
    """The GPU kernels of one training step after two warm-up steps, costliest first (the top 12, then the rest):
    ``{rank: "share % calls name"}``, with ``total`` the step's kernel time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step(loss_of, amp)
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(loss_of, amp)
        synchronize(device)
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = times.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time
            entry[1] += 1
    del step
    gc.collect()
    torch.cuda.empty_cache()
    total = sum(t for t, _ in times.values()) or 1.0
    ranked = sorted(times.items(), key=lambda item: -item[1][0])
    kernels = {"total": f"{total / 1e3:.1f} ms"}
    for rank, (name, (time_us, calls)) in enumerate(ranked[:12], 1):
        kernels[f"{rank:02d}"] = f"{100 * time_us / total:5.1f} % {calls:5d}x  {name[:110]}"
    rest = sum(t for _, (t, _) in ranked[12:])
    kernels["rest"] = f"{100 * rest / total:5.1f} % {sum(c for _, (_, c) in ranked[12:]):5d}x  other kernels"
    return kernels


def matmul_peak(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of a bf16 ``size``³ matrix product on ``device``: the card's practical matmul ceiling, in this run."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def copy_bandwidth(device: torch.device, gib: int = 2, repeats: int = 10) -> float:
    """Bytes/s a ``gib`` GiB device-to-device copy moves (each byte read once and written once): the card's
    practical memory bandwidth, in this run."""
    source = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    return 2 * source.numel() * repeats / (time.perf_counter() - start)


class BytesMoved(TorchDispatchMode):
    """Memory traffic of the operations run under it, estimated as eager PyTorch moves it: each operation that
    computes (views only re-describe storage) reads every tensor it is given and writes every tensor it returns,
    once. Kernels that keep data in cache, or fused ones, move less; an operation that reads an input twice moves
    more. A stated estimate, not a hardware count: the same rule for both sides of the benchmark."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.bytes += sum(
                t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
            )
        return out


def _pooled(features: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """MONAI's Swin returns its stage outputs (pool the deepest); its ResNets without classifier a pooled vector."""
    if isinstance(features, list):
        return features[-1].flatten(2).mean(2)
    return features


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, logits: Callable[[], torch.Tensor]
) -> Callable[..., torch.Tensor]:
    model.train()

    def step(loss_of: Callable[[torch.Tensor], torch.Tensor], amp: Any) -> torch.Tensor:
        with amp:
            loss = loss_of(logits())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _time_training(
    build: Callable[[], Callable[..., torch.Tensor]],
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    amp: Any,
    config: ModelBenchmarkConfig,
    device: torch.device,
) -> Timing:
    with peak_memory(device) as peak:
        built = time.perf_counter()
        step = build()
        for _ in range(config.warmup):
            step(loss_of, amp)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(config.steps):
            loss = step(loss_of, amp)
        synchronize(device)
        seconds = time.perf_counter() - start
    if not torch.isfinite(loss):
        raise FloatingPointError(f"training loss became {loss.item()}")
    del step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Timing(config.steps * config.batch / seconds, peak["bytes"], seconds, start - built)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def peak_memory(device: torch.device, interval_s: float = 0.005) -> Iterator[dict[str, int]]:
    """Peak allocated GPU memory, or the peak rise of the resident set on the CPU, into ``result["bytes"]``."""
    result = {"bytes": 0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        result["bytes"] = torch.cuda.max_memory_allocated(device)
        return
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        done.set()
        sampler.join()
        peak[0] = max(peak[0], process.memory_info().rss)
        result["bytes"] = peak[0] - baseline


def format_model_result(result: ModelBenchmarkResult) -> str:
    c = result.config
    swin = c.vision_kwargs.get("implementation", "gx")
    attention = f", {swin}'s Swin, raw: MONAI's" if c.model == "swin3d" else ""
    rows = [
        f"model {c.model} (fusion {c.fusion}{attention}), input {'x'.join(map(str, c.shape))}, batch {c.batch}, "
        f"amp {c.amp}{', compiled' if c.compile else ''}, {c.steps} timed steps after {c.warmup} warm-up, "
        f"on {result.device}",
        f"{'':10}{'samples/s':>12}{'peak memory':>14}{'warm-up':>10}{'GFLOP/sample':>14}{'TFLOP/s':>9}"
        f"{'of matmul':>11}",
    ]
    for label in ("registry", "raw"):
        t = getattr(result, label)
        memory, share = t.peak_memory_bytes / 2**30, result.share_of_peak(label)
        rows.append(
            f"{label:10}{t.samples_per_s:12.2f}{memory:11.2f} GiB{t.warmup_seconds:8.1f} s"
            f"{result.flops_per_sample[label] / 1e9:14.1f}{result.tflops(label):9.2f}"
            f"{'—' if share is None else f'{100 * share:.1f} %':>11}"
        )
    rows.append(f"ratio registry/raw: {result.ratio:.3f}")
    if result.matmul_peak_flops:
        rows.append(f"bf16 8192³ matmul on this card, same run: {result.matmul_peak_flops / 1e12:.0f} TFLOP/s")
    for label in ("registry", "raw") if result.bytes_per_sample else ():
        achieved, share = result.bandwidth(label), result.share_of_bandwidth(label)
        rows.append(
            f"memory traffic, {label}: {result.bytes_per_sample[label] / 1e9:.1f} GB a sample (estimated: each "
            f"operation reads its inputs and writes its outputs once), {achieved / 1e9:.0f} GB/s"
            + (
                ""
                if share is None
                else f", {100 * share:.0f} % of a device copy's {result.copy_bandwidth / 1e9:.0f} GB/s"
            )  # noqa: E501
        )
    if result.differences:
        d = result.differences
        rows.append(
            f"largest difference from MONAI ({c.amp}, relative to MONAI's fp32 maximum), stage outputs / parameter "
            f"gradients: ours vs MONAI {d['outputs.ours_vs_monai']:.2e} / {d['gradients.ours_vs_monai']:.2e}; "
            f"against MONAI fp32: ours {d['outputs.ours_vs_fp32']:.2e} / {d['gradients.ours_vs_fp32']:.2e}, "
            f"MONAI's own {d['outputs.monai_vs_fp32']:.2e} / {d['gradients.monai_vs_fp32']:.2e}"
        )
    if result.kernels:
        rows.append(f"registry side, one training step: {result.kernels['total']} of GPU kernels")
        rows.extend(f"  {v}" for k, v in result.kernels.items() if k != "total")
    return "\n".join(rows)
