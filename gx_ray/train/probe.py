"""Measured training steps: the GPU memory a trial's step takes, the micro-batch that fits, how many trials share a
GPU, and which parameters a model leaves without a gradient (DDP must be told); :func:`probe_trial` measures a whole
trial's step before the sweep places its trials.

Nothing here guesses memory from parameter counts: a real step (forward, backward, AdamW) of the trial's own model
on rows of its own training split is measured on the device it will train on.
"""

from __future__ import annotations

import copy
import math
import resource
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from gx_ray.data.shards import TensorLayout
from gx_ray.data.stream import first_rows, on_device, slice_batch
from gx_ray.models.registry import compile_in_place
from gx_ray.schema import AUTO
from gx_ray.tasks import TaskModel
from gx_ray.train.build import autocast, build_trial, loss_function
from gx_ray.train.config import TrialConfig

CONTEXT_BYTES = 768 * 2**20
"""What a CUDA process holds outside PyTorch's allocator (context, cuBLAS/cuDNN handles and workspaces), added to
each packed trial's measured peak."""
MARGIN = 0.1
"""Share of a card kept free when packing trials (allocator fragmentation, longer texts than the probe's)."""
MAX_TRIALS_PER_GPU = 8
"""Small models pack up to this many to a card, as the node's CPUs allow. More processes time-share a card without
running side by side: the demo's 100 trials 16 to an H200 (16 cores) finished 20 in 4.2 min, where the CPUs alone
finish 100 in 8 (docs/benchmarks.md)."""


def adamw(params: Any, lr: float = 1e-3) -> torch.optim.AdamW:
    """The training step's optimiser, the same in the loop, the memory probe and the benchmarks' raw step: AdamW
    fused into one kernel for all parameters (on one CPU core the demo VQA model's step took 8 ms against 58 per
    tensor)."""
    return torch.optim.AdamW(params, lr, fused=True)


def accumulate(
    model: nn.Module,
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    micro_batches: Sequence[Any],
    accumulation: int,
    no_sync: Callable[[], AbstractContextManager] | None = None,
) -> torch.Tensor:
    """Forward and backward over one optimiser step's micro-batches (gradients of the mean loss over equal-size
    micro-batches); ``no_sync`` (DDP's) skips the all-reduce on all but the last. Returns the summed unscaled loss
    as a device tensor: reading it would stall the GPU, so the caller decides when."""
    total = None
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with no_sync() if no_sync is not None and not last else nullcontext():
            loss = loss_of(model, batch)
            (loss / accumulation).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def unused_parameters(model: nn.Module) -> list[str]:
    """Trainable parameters that the last backward left without a gradient (DDP needs ``find_unused_parameters``
    for them, which costs a graph traversal every step, so it is asked for only when this is not empty)."""
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def enable_checkpointing(model: nn.Module) -> bool:
    """Switch on gradient checkpointing in every block that offers it (MONAI's Swin blocks read ``use_checkpoint``
    at each forward): activations are recomputed in the backward instead of kept. False when no block offers it."""
    blocks = [m for m in model.modules() if hasattr(m, "use_checkpoint")]
    for block in blocks:
        block.use_checkpoint = True
    return bool(blocks)


def checkpointing(model: nn.Module) -> bool:
    return any(getattr(m, "use_checkpoint", False) for m in model.modules())


def step_peak_bytes(
    model: nn.Module, loss_of: Callable[[nn.Module, Any], torch.Tensor], batch: Any, device: torch.device
) -> int | None:
    """Peak GPU memory of one training step (forward, backward, AdamW with its state) on a copy of the model, so the
    model itself is untouched; None when the step runs out of memory. A compiled part is compiled in the copy too (a
    compiled 3D Swin step held 22 GiB against 32 eager on H100), which also fills the node's compilation cache for the
    trials that follow."""
    trial = compiled_copy(model)
    optimiser = adamw(trial.parameters())

    def step() -> None:
        accumulate(trial, loss_of, [batch], 1)
        optimiser.step()

    try:
        return reserved_peak(step, device)
    finally:
        trial = optimiser = None  # the copy's memory goes back before the next measurement
        torch.cuda.empty_cache()


def reserved_peak(run: Callable[[], Any], device: torch.device) -> int | None:
    """What the caching allocator held at the peak of ``run()`` on ``device``, from an emptied cache; None when it
    runs out of memory. Held, not only what tensors used: packed trials fit by the former (seen on H200: 32 GiB
    allocated, 42-54 GiB held by each of three packed 3D Swin trials, which then ran out of memory)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_reserved(device)
    except torch.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()


def compiled_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with the same parts compiled (``copy.deepcopy`` drops ``nn.Module.compile()``)."""
    from gx_ray.compat import is_compiled  # light: compat imports Tune's classes only when they are asked for

    compiled = {name for name, m in model.named_modules() if is_compiled(m)}
    trial = copy.deepcopy(model)
    for name, module in trial.named_modules():
        if name in compiled:
            compile_in_place(module)
    return trial


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_micro_batch(per_rank: int, peak_of: Callable[[int], int | None], budget_bytes: float) -> tuple[int, int]:
    """The largest divisor of ``per_rank`` whose measured step peak fits ``budget_bytes``, and that peak. Memory grows
    about linearly, so two small measurements predict the rest and only those predicted to fit are measured."""
    candidates = divisors(per_rank)
    measured: dict[int, int | None] = {}

    def fits(m: int) -> bool:
        if m not in measured:
            measured[m] = peak_of(m)
        return measured[m] is not None and measured[m] <= budget_bytes

    if not fits(candidates[0]):
        raise MemoryError(
            f"a training step at micro-batch {candidates[0]} needs {_gib(measured[candidates[0]])}, more than the "
            f"{_gib(budget_bytes)} this trial may use: give it more of a GPU (resources.gpus_per_worker) or a "
            "smaller input (preprocessing shape) or gradient checkpointing (model.gradient_checkpointing)"
        )
    if len(candidates) > 1:
        fits(candidates[1])
    small = [m for m in candidates[:2] if measured.get(m) is not None]
    slope = (measured[small[1]] - measured[small[0]]) / (small[1] - small[0]) if len(small) == 2 else math.inf
    base = measured[small[0]] - slope * small[0] if math.isfinite(slope) else 0.0
    for m in reversed(candidates):
        predicted_to_fit = m in measured or not math.isfinite(slope) or base + slope * m <= budget_bytes
        if predicted_to_fit and fits(m):
            return m, int(measured[m])
    return candidates[0], int(measured[candidates[0]])


def gpu_share(
    need_bytes: float, card_bytes: float, margin: float = MARGIN, max_trials: int = MAX_TRIALS_PER_GPU
) -> float:
    """The fraction of a GPU to give each trial (``num_gpus``) so that as many trials as fit share it: 1/k for the
    largest k (at most ``max_trials``) whose k x ``need_bytes`` fit the card less the margin; 1 if even one does not
    (a trial then gets the card to itself and its own micro-batch choice)."""
    if need_bytes <= 0 or card_bytes <= 0:
        raise ValueError(f"need {need_bytes} and card {card_bytes} bytes must be positive")
    trials = int(card_bytes * (1 - margin) // need_bytes)
    trials = max(1, min(max_trials, trials))
    return math.floor(10_000 / trials) / 10_000  # Ray's resource precision: k shares never exceed one GPU


def trials_per_gpu(share: float) -> int:
    """How many trials of this share Ray places on one GPU."""
    return int(1 / share + 1e-6) if share <= 1 else 0  # not 1 // share: 1 // 0.2 is 4.0 in floating point


def _gib(value: float | None) -> str:
    return "more memory than the card has" if value is None else f"{value / 2**30:.1f} GiB"


def micro_batch_for(
    config: TrialConfig, model: TaskModel, task: Any, layout: TensorLayout, device: torch.device, world_size: int
) -> tuple[int, int | None]:
    """The trial's micro-batch and its measured step peak (bytes; None where not measured). ``auto``: the whole
    per-rank batch on the CPU; on a GPU the largest divisor of it whose step fits the trial's share of the card
    (a fixed ``gpus_per_worker`` fraction, else the whole card). Where not even one sample fits, gradient
    checkpointing is switched on in the model (blocks that offer it) and the choice made again."""
    per_rank = config.data.per_rank_batch(world_size)
    if config.data.micro_batch != AUTO:
        return int(config.data.micro_batch), None
    if device.type != "cuda":
        return per_rank, None
    rows = first_rows(config.data.shards, "train", per_rank, layout)
    loss_of = loss_function(task, config, device)

    def peak_of(micro: int) -> int | None:
        return step_peak_bytes(model, loss_of, on_device(slice_batch(rows, micro), device), device)

    gpus = config.resources.gpus_per_worker
    share = float(gpus) if gpus != AUTO and 0 < float(gpus) < 1 else 1.0
    budget = torch.cuda.get_device_properties(device).total_memory * share * (1 - MARGIN) - CONTEXT_BYTES
    try:
        return choose_micro_batch(per_rank, peak_of, budget)
    except MemoryError:
        if not enable_checkpointing(model):
            raise
        return choose_micro_batch(per_rank, peak_of, budget)


def probe_trial(config: TrialConfig) -> dict[str, Any]:
    """One measured training step and one evaluation forward of a trial's model on a whole GPU, before the sweep
    places its trials: the micro-batch it will use (``auto``: the largest that fits the card) and the peak memory of
    the step at it or of the evaluation at ``data.eval_batch_size``, whichever is higher."""
    device = torch.device("cuda")
    task, model, layout = build_trial(config, device)
    micro, peak = micro_batch_for(config, model, task, layout, device, config.resources.workers)
    if peak is None:
        rows = first_rows(config.data.shards, "train", micro, layout)
        peak = step_peak_bytes(model, loss_function(task, config, device), on_device(rows, device), device)
    eval_size = config.data.eval_batch_size or micro
    batch = on_device(first_rows(config.data.shards, "val", eval_size, layout), device)

    def forward() -> None:
        model.eval()
        with torch.no_grad(), autocast(config, device):
            model(batch)
        model.train()

    # an evaluation batch can need more than the training step: a compiled 3D Swin at evaluation batch 32 allocated
    # one 21 GiB buffer, and trials packed by their training step alone ran out of memory in validation (4 x H200)
    eval_peak = reserved_peak(forward, device)
    properties = torch.cuda.get_device_properties(device)
    if eval_peak is None:
        raise MemoryError(
            f"{config.task} x {config.schema}: an evaluation batch of {eval_size} does not fit a whole "
            f"{properties.name}: give data.eval_batch_size a smaller value"
        )
    return {
        "micro_batch": micro,
        "peak_bytes": max(peak, eval_peak),  # what the trial needs at its peak, training or evaluating
        "train_peak_bytes": peak,
        "eval_peak_bytes": eval_peak,
        "eval_batch": eval_size,
        "card_bytes": properties.total_memory,
        "gpu": properties.name,
        "gradient_checkpointing": checkpointing(model),
        # the probe process's peak RSS (at least this setting's: the process may have probed others before), which
        # the trial reserves as Ray's ``memory`` so that a node takes no more trials than its memory holds
        "host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
