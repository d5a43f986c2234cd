"""gx-ray's 3D Swin transformer against MONAI's: the same state dict both ways, and with MONAI's weights the same
stage outputs and parameter gradients (fp32, random configurations: padded and unpadded stages, windows that shrink to
the stage, batches above one), also compiled and with gradient checkpointing; its window partition and shift mask
against MONAI's; no fp32 matrix product under bf16 autocast; the registry builds it by default.

Everything is tiny (embed dims 6-12, inputs up to 40 voxels a side) and single-threaded, so the file runs in seconds.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from monai.networks.nets import swin_unetr
from torch.utils._python_dispatch import TorchDispatchMode

from gx_ray.models import swin
from gx_ray.models.vision import Swin3d

TOLERANCE = 1e-4
"""Largest difference allowed, relative to the largest magnitude of MONAI's tensor."""


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_config(rng: np.random.Generator) -> dict:
    """MONAI ``SwinTransformer`` arguments: tiny widths, windows 2-7 (anisotropic at times), rarely used options."""
    heads = tuple(int(h) for h in rng.choice([1, 2, 3], 4))
    width = int(np.lcm.reduce(heads)) * int(rng.integers(1, 3)) * 2
    window = int(rng.integers(2, 8))
    return {
        "in_chans": int(rng.integers(1, 4)),
        "embed_dim": width,
        "window_size": (window, window, window) if rng.random() < 0.7 else tuple(int(w) for w in rng.integers(2, 6, 3)),
        "patch_size": (2, 2, 2) if rng.random() < 0.8 else (1, 2, 2),
        "depths": tuple(int(d) for d in rng.integers(1, 3, 4)),
        "num_heads": heads,
        "spatial_dims": 3,
        "qkv_bias": bool(rng.random() < 0.8),
        "mlp_ratio": float(rng.choice([2.0, 4.0])),
        "downsample": str(rng.choice(["merging", "mergingv2"])),
        "use_v2": bool(rng.random() < 0.2),
        "patch_norm": bool(rng.random() < 0.2),
    }


def random_shape(rng: np.random.Generator, v2: bool) -> tuple[int, ...]:
    """Stage sizes that tile the window, need padding, or are smaller than the window (which then shrinks). MONAI's
    v2 instance norms need more than one voxel at stage 4 in training."""
    return tuple(int(s) for s in rng.choice([20, 27, 32, 40] if v2 else [8, 12, 16, 20, 27, 32, 40], 3))


def pair(config: dict, seed: int, **ours: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """MONAI's network with perturbed weights (a bias table at its init, std 0.02, would hide a misplaced bias), and
    ours with MONAI's state dict loaded strictly."""
    torch.manual_seed(seed)
    monai = swin_unetr.SwinTransformer(**config)
    for parameter in monai.parameters():
        parameter.data += 0.3 * torch.randn_like(parameter)
    gx = swin.SwinTransformer(**config, **ours)
    gx.load_state_dict(monai.state_dict(), strict=True)
    return monai, gx


def assert_relative(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = theirs.abs().max().clamp_min(1e-12)
    error = ((ours.float() - theirs.float()).abs().max() / scale).item()
    assert error <= TOLERANCE, f"{what}: relative difference {error:.2e}"


def assert_same_training_step(monai: torch.nn.Module, gx: torch.nn.Module, x: torch.Tensor, label: str) -> None:
    """Every stage output and every parameter gradient of a loss that weighs each output differently."""
    theirs = monai(x)
    ours = gx(x)
    assert len(ours) == len(theirs) == 5
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.shape == b.shape, f"{label} stage {i}: {a.shape} vs {b.shape}"
        assert_relative(a, b, f"{label} stage {i}")
    weights = [torch.randn_like(t) for t in theirs]
    for outputs in (theirs, ours):
        sum((o * w).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    for (name, a), b in zip(gx.named_parameters(), monai.parameters(), strict=True):
        assert a.grad is not None, f"{label} {name}: no gradient"
        assert_relative(a.grad, b.grad, f"{label} gradient of {name}")


@pytest.mark.parametrize("seed", range(4))
def test_state_dicts_load_both_ways_with_the_same_keys_and_shapes(seed):
    config = random_config(np.random.default_rng(seed))
    monai, gx = swin_unetr.SwinTransformer(**config), swin.SwinTransformer(**config)
    assert {k: v.shape for k, v in gx.state_dict().items()} == {k: v.shape for k, v in monai.state_dict().items()}
    # the same registration order: optimiser states and parameter groups line up too
    assert [n for n, _ in gx.named_parameters()] == [n for n, _ in monai.named_parameters()]
    monai.load_state_dict(gx.state_dict(), strict=True)
    gx.load_state_dict(monai.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(gx.state_dict().values(), monai.state_dict().values(), strict=True))


@pytest.mark.parametrize("seed", range(8))
def test_outputs_and_gradients_equal_monai(seed):
    rng = np.random.default_rng(100 + seed)
    config = random_config(rng)
    monai, gx = pair(config, seed)
    x = torch.randn(int(rng.integers(1, 4)), config["in_chans"], *random_shape(rng, config["use_v2"]))
    assert_same_training_step(monai.train(), gx.train(), x, f"{config} on {tuple(x.shape)}")


@pytest.mark.parametrize("window", [3, 5, 7])
def test_windows_shrink_to_small_stages_as_monai_does(window):
    """Stages no larger than the window along some axes (the window shrinks there and stops shifting) and larger
    along others (padded, shifted): MONAI's index slicing and per-axis shift rules."""
    config = {**random_config(np.random.default_rng(window)), "window_size": (window,) * 3, "use_v2": False}
    monai, gx = pair(config, window)
    x = torch.randn(2, config["in_chans"], 6, 2 * window + 4, 40)
    assert_same_training_step(monai, gx, x, f"window {window}")


def test_compiled_and_checkpointed_equal_monai():
    """Compiled (the graph path: pad, roll and permute ops, the shift mask built in the graph, one graph without
    breaks) and with gradient checkpointing: MONAI's outputs and gradients. The compiler's ``eager`` backend keeps
    this fast on a CPU; the graph it runs is the one inductor would compile."""
    config = {**random_config(np.random.default_rng(7)), "window_size": (4, 4, 4), "use_v2": False}
    x = torch.randn(2, config["in_chans"], 20, 36, 28)
    monai, gx = pair(config, 7)
    torch._dynamo.reset()
    compiled = torch.compile(gx, backend="eager", fullgraph=True)
    assert_same_training_step(monai, compiled, x, "compiled")
    monai, gx = pair(config, 7, use_checkpoint=True)
    assert_same_training_step(monai, gx, x, "checkpointed")


def test_split_and_flex_attention_equal_monai(monkeypatch):
    """The two other attention paths: ``split`` (the bias a constant in the attention call, its gradient computed
    apart), also compiled and checkpointed, and ``flex`` (the shift as a block mask, the bias as a score
    modification) through FlexAttention's reference implementation, whose backward torch refuses on a CPU only
    because its fused kernel is GPU-only (the check is lifted here; the arithmetic is device-independent)."""
    from torch.nn.attention import flex_attention

    config = {**random_config(np.random.default_rng(11)), "window_size": (4, 4, 4), "depths": (2, 2, 1, 1)}
    config["use_v2"] = False
    x = torch.randn(2, config["in_chans"], 20, 36, 28)  # padded stages, shifted windows
    for backend in ("split", "flex"):
        monai, gx = pair(config, 11, attention_backend=backend)
        assert all(block.attn.path(x) == backend for block in gx.layers1[0].blocks)
        if backend == "flex":
            monkeypatch.setattr(flex_attention, "_validate_device", lambda *args: None)
        assert_same_training_step(monai, gx, x, backend)
    torch._dynamo.reset()
    monai, gx = pair(config, 11, attention_backend="split", use_checkpoint=True)
    assert_same_training_step(monai, torch.compile(gx, backend="eager", fullgraph=True), x, "split, compiled")


def test_attention_backends():
    """``auto`` is the one-call SDPA path everywhere (the fastest measured on an H200); attention dropout in
    training falls back to it; an unknown backend is refused."""
    config = {**random_config(np.random.default_rng(1)), "use_v2": False}
    x = torch.randn(1, 8, 4, 4, 4)
    attention = swin.SwinTransformer(**config).layers1[0].blocks[0].attn
    assert attention.path(x) == "sdpa"
    dropped = swin.SwinTransformer(**config, attn_drop_rate=0.1, attention_backend="flex").layers1[0].blocks[0].attn
    assert dropped.train().path(x) == "sdpa" and dropped.eval().path(x) == "flex"
    with pytest.raises(ValueError, match="valid: auto"):
        swin.SwinTransformer(**config, attention_backend="xformers")


def windows_cases(count: int) -> list[swin.Windows]:
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(count):
        size = tuple(int(s) for s in rng.integers(1, 12, 3))
        window = tuple(int(w) for w in rng.integers(1, 6, 3))
        window, shift = swin.get_window_size(size, window, tuple(w // 2 for w in window))
        cases.append(swin.Windows(size, window, shift if rng.random() < 0.7 else (0, 0, 0)))
    return cases


@pytest.mark.parametrize("windows", windows_cases(40), ids=str)
def test_one_gather_partitions_as_pad_roll_partition(windows):
    """The eager path's gathers (pad, roll and partition; and back) move the same values, forward and backward, as
    the plain ops the compiled path and MONAI use."""
    x = torch.randn(2, *windows.size, 3, dtype=torch.float64, requires_grad=True)
    plain = swin.partition_plain(x, windows)
    gathered = swin.partition(x, windows)
    assert torch.equal(gathered, plain)
    g = torch.randn_like(plain)
    (a,) = torch.autograd.grad(swin.partition_plain(x, windows), x, g)
    (b,) = torch.autograd.grad(swin.partition(x, windows), x, g)
    assert torch.equal(a, b)
    y = torch.randn(2, windows.count, windows.tokens, 3, dtype=torch.float64, requires_grad=True)
    assert torch.equal(swin.reverse(y, windows), swin.reverse_plain(y, windows))
    h = torch.randn(2, *windows.size, 3, dtype=torch.float64)
    (a,) = torch.autograd.grad(swin.reverse_plain(y, windows), y, h)
    (b,) = torch.autograd.grad(swin.reverse(y, windows), y, h)
    assert torch.equal(a, b)
    assert torch.equal(swin.reverse(swin.partition(x, windows), windows), x)


@pytest.mark.parametrize("windows", [w for w in windows_cases(60) if w.shifted][:25], ids=str)
def test_shift_mask_is_monais(windows):
    theirs = swin_unetr.compute_mask(list(windows.padded), windows.window, windows.shift, "cpu")
    ours = swin.build_shift_mask(windows, torch.device("cpu"), torch.float32)
    n = windows.tokens
    assert ours.shape == (windows.count, 1, n, swin.aligned(n))
    assert torch.equal(ours[:, 0, :, :n], theirs)
    assert not ours[..., n:].any()


class DtypeRecorder(TorchDispatchMode):
    """Records the floating input dtypes of every matrix product and attention kernel dispatched, and the largest
    fp32 tensor any op returns."""

    PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")
    ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")

    def __init__(self):
        super().__init__()
        self.products: list[tuple[str, set[torch.dtype]]] = []
        self.largest_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.PRODUCTS or name.startswith(self.ATTENTION):
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
            self.products.append((name, dtypes))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest_fp32 = max(self.largest_fp32, t.numel())
        return out


def record_step(model: torch.nn.Module, x: torch.Tensor) -> tuple[DtypeRecorder, list[torch.Tensor]]:
    """One forward and backward under bf16 autocast. The CPU runs attention through PyTorch's math path, which
    upcasts bf16 to fp32 unless allowed not to (CUDA's fused kernels take bf16 as it comes): allowed here, so that
    what is recorded is what the model feeds it."""
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), DtypeRecorder() as record:
            outputs = model(x)
            sum(o.float().sum() for o in outputs).backward()
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    return record, outputs


def test_no_fp32_round_trips_under_bf16_autocast():
    """Under bf16 autocast every matrix product and attention call, forward and backward, runs in bf16, and no fp32
    tensor is larger than a stage output (fp32, as MONAI's) or a parameter. MONAI adds its fp32 bias to the scores,
    which upcasts them: an fp32 tensor of windows x heads x n x n. The outputs keep MONAI's dtypes and values within
    bf16's precision."""
    config = {**random_config(np.random.default_rng(3)), "window_size": (4, 4, 4), "use_v2": False}
    monai, gx = pair(config, 3)
    x = torch.randn(2, config["in_chans"], 20, 32, 28)
    ours_record, ours = record_step(gx, x)
    theirs_record, theirs = record_step(monai, x)
    # fp32 is expected as large as a stage output or a parameter (its gradient), and no larger
    expected = max(max(o.numel() for o in theirs), max(p.numel() for p in gx.parameters()))
    assert {name for name, _ in ours_record.products} >= {"mm", "addmm"}
    assert all(dtypes == {torch.bfloat16} for _, dtypes in ours_record.products), ours_record.products
    assert ours_record.largest_fp32 <= expected < theirs_record.largest_fp32
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype
        assert ((a - b).abs().max() / b.abs().max()).item() < 0.1


def test_registry_builds_gx_by_default_and_monai_on_request():
    small = {"feature_size": 6, "window_size": 4, "depths": (2, 1, 1, 1), "num_heads": (1, 2, 2, 2)}
    default = Swin3d(2, **small)
    assert isinstance(default.backbone, swin.SwinTransformer) and default.implementation == "gx"
    assert default.monai_class is swin_unetr.SwinTransformer
    monai = Swin3d(2, implementation="monai", **small)
    explicit = Swin3d(2, attention="explicit", **small)  # MONAI's own attention: MONAI's class, as before
    assert type(monai.backbone) is type(explicit.backbone) is swin_unetr.SwinTransformer
    # a checkpoint of either loads into the other; the default pickles
    monai.load_state_dict(default.state_dict(), strict=True)
    default.load_state_dict(pickle.loads(pickle.dumps(default)).state_dict(), strict=True)
    ct = torch.randn(1, 2, 32, 32, 32)
    with torch.no_grad():
        for a, b in zip(default.eval()(ct), monai.eval()(ct), strict=True):
            assert_relative(a, b, "registry")
    with pytest.raises(ValueError, match="valid: gx, monai"):
        Swin3d(2, implementation="timm", **small)
    with pytest.raises(ValueError, match="implementation 'monai'"):
        Swin3d(2, implementation="gx", attention="explicit", **small)
    with pytest.raises(ValueError, match="Hyena"):
        Swin3d(2, use_hyena=True, **small)
    with pytest.raises(ValueError, match="3D only"):
        swin.SwinTransformer(
            in_chans=2, embed_dim=6, window_size=(4, 4), patch_size=(2, 2), depths=(1,) * 4, num_heads=(1,) * 4,
            spatial_dims=2,
        )  # fmt: skip
    with pytest.raises(TypeError, match="unexpected arguments"):
        Swin3d(2, windw_size=4, **small)
