"""VLM benchmark: LoRA training samples/s and peak memory of :class:`~gx_ray.models.vlm.VisionLanguageModel` on CT
views, against the raw transformers training step of the very same model in the same run.

No VLM weights reach the GPU machine (it has no network), so the model is built from a realistic config with random
weights (rates do not depend on weights): ``2b`` is a LLaVA-class model of Qwen2-VL-2B's size, a SigLIP-so400m vision
tower (384 px, patch 14: 729 image tokens) and a Qwen2-1.5B language model, about 2.0 B parameters; ``tiny`` is a
one-layer model of the same classes for a CPU check. Its tokenizer is the offline MiniLM one with the image token
added and the chat template hand-written (as the test fixtures'): neither is the real model's, and neither changes
the model's step.

Both sides train the LoRA adapters (rank 16 on the language model's q/v projections, the base frozen) with AdamW on
one fixed batch of MCQ questions on one CT view each (the default :class:`~gx_ray.modalities.views.ViewRecipe`: the
venous phase's key slice through the lesion): gx-ray's side is what a trial's step does, ``VisionLanguageModel.loss``
from images and texts (the processor, the chat template and the answer-only labels every step); the raw side calls
the model on the same batch's tensors, built once and already on the device. Warm-up steps are not timed; the
device is synchronised before every clock read.

``packing`` (``vlm.packing``) packs the taught batch into one row without padding on both sides, and times the raw
step on the padded batch as well (``raw_padded``): packed against padded within one run. ``varied`` gives the samples
questions of different lengths (a padded batch of equal questions has no padding to remove); the result tells the
tokens a sample and the share of a padded batch that is padding.

``--size llava_1_5|llava_med|blip2_opt|blip2_flan_t5``: the Gastric-X paper's transformers models at their released
sizes (:data:`benchmarks.vlm_memory.REAL`), random weights, each with its tiny namesake's processor, tokenizer and
prompt format (:mod:`gx_ray.models.tiny_vlms`) at the real image size and image-token count: the LoRA targets are
the model's family's (the trial's), so gx-ray's step is the trial's for that model.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.model import peak_memory, synchronize
from benchmarks.vlm_memory import REAL
from gx_ray.metrics.cascade import question_prompt
from gx_ray.modalities.views import ViewRecipe, ct_images
from gx_ray.models.vlm import VLM_LORA, VisionLanguageModel, VLMConfig

LLAVA_TEMPLATE_HAND_WRITTEN = (
    "{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %} {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A chat template of ``role: content`` lines, HAND-WRITTEN (LLaVA's own is not available offline)."""
SIZES = {
    # SigLIP-so400m-patch14-384's vision config and Qwen2-1.5B's text config: Qwen2-VL-2B's size class
    "2b": {
        "vision": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                   "image_size": 384, "patch_size": 14},
        "text": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                 "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
                 "rope_theta": 1e6, "tie_word_embeddings": True},
    },
    "tiny": {
        "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "image_size": 56, "patch_size": 14},
        "text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "vocab_size": 30600, "max_position_embeddings": 2048},
    },
}  # fmt: skip


@dataclass(frozen=True)
class VlmBenchmarkConfig:
    size: str = "2b"
    batch: int = 8
    steps: int = 10
    warmup: int = 3
    rank: int = 16
    gradient_checkpointing: bool = False
    packing: bool = False
    """``vlm.packing``: the taught batch as one row without padding (both sides train on the packed tensors)."""
    varied: bool = False
    """Questions of different lengths (sample ``i`` has ``i`` lab findings before its question), so that a padded
    batch has padding to pack away; default: every sample the same question."""
    device: str | None = None
    """Default: cuda when available (bf16 weights), else cpu (fp32)."""

    def __post_init__(self) -> None:
        if self.size not in SIZES and self.size not in REAL:
            raise ValueError(f"unknown VLM size {self.size!r}; valid: {', '.join([*SIZES, *REAL])}")


def offline_vlm_tokenizer(image_token: str) -> Any:
    """The offline MiniLM (BERT) tokenizer with a VLM's image token added: no real VLM's tokenizer is here."""
    from gx_ray.models.text import offline_tokenizer

    base = offline_tokenizer()
    tokenizer = base.__class__.from_pretrained(base.name_or_path)
    tokenizer.add_special_tokens({"additional_special_tokens": [image_token]})
    return tokenizer


def build_llava(folder: Path, size: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Path:
    """A random-weight LLaVA (SigLIP vision tower, Qwen2 language model) of ``size`` with its processor, saved."""
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tokenizer = offline_vlm_tokenizer("<image>")
    shape = SIZES[size]
    side = shape["vision"]["image_size"]
    processor = LlavaProcessor(
        image_processor=SiglipImageProcessor(size={"height": side, "width": side}),
        tokenizer=tokenizer,
        patch_size=shape["vision"]["patch_size"],
        vision_feature_select_strategy="full",
        chat_template=LLAVA_TEMPLATE_HAND_WRITTEN,
        image_token="<image>",
        num_additional_image_tokens=0,
    )
    config = LlavaConfig(
        vision_config=SiglipVisionConfig(**shape["vision"]),
        text_config=Qwen2Config(**shape["text"], pad_token_id=tokenizer.pad_token_id),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init of 2 B parameters: seconds on a GPU, a minute on CPU
        model = LlavaForConditionalGeneration(config).to(dtype)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    del model
    gc.collect()
    return folder


def build_paper_model(
    folder: Path, name: str, dtype: torch.dtype, device: torch.device | str = "cpu", tiny: bool = False
) -> Path:
    """The paper's model ``name`` at its released size with random weights (:func:`benchmarks.vlm_memory.build`;
    ``tiny``: one layer, as its ``--tiny``), saved with its tiny namesake's processor set to the model's image size and
    image-token count."""
    from transformers import AutoProcessor

    from benchmarks.vlm_memory import build
    from gx_ray.models import tiny_vlms

    namesake = {"llava_1_5": "llava-1.5", "llava_med": "llava-med", "blip2_opt": "blip2-opt",
                "blip2_flan_t5": "blip2-flan-t5"}[name]  # fmt: skip
    processor = AutoProcessor.from_pretrained(tiny_vlms.local_weights(tiny_vlms.PREFIX + namesake))
    model, image_tokens = build(name, tiny, torch.device(device))
    side = model.config.vision_config.image_size
    images = processor.image_processor
    if name.startswith("llava"):
        processor.patch_size = model.config.vision_config.patch_size
        images.size, images.crop_size = {"shortest_edge": side}, {"height": side, "width": side}
    else:
        processor.num_query_tokens, images.size = image_tokens, {"height": side, "width": side}
    tokenizer = processor.tokenizer
    model.config.image_token_index = model.config.image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if (value := getattr(tokenizer, key)) is not None:
            setattr(model.config.get_text_config(), key, value)
    model.to(dtype).save_pretrained(folder)
    processor.save_pretrained(folder)
    del model
    gc.collect()
    return folder


LAB_FINDING = "CEA 12.4 ng/mL, 2.5x above upper limit."
"""An abnormal lab finding as ``schema.table: text`` puts it before a question (``varied`` batches)."""


def benchmark_batch(
    batch: int, seed: int = 0, varied: bool = False
) -> tuple[list[list[np.ndarray]], list[str], list[str]]:
    """``batch`` cases' default CT views (one venous key slice through the lesion of a synthetic 64 x 128 x 128 HU
    volume) with an MCQ question each and its answer letter; ``varied``: case ``i``'s question after ``i`` lab
    findings."""
    rng = np.random.default_rng(seed)
    images, questions, answers = [], [], []
    options = ["gastric body", "gastric antrum", "cardia", "fundus"]
    for i in range(batch):
        hu = {"venous": rng.normal(40, 60, (64, 128, 128)).astype(np.float32)}
        box = [20, 40, 40, 28, 60, 64]
        views, _ = ct_images(hu, ViewRecipe(), tumour_box=box)
        images.append(list(views))
        question = question_prompt("mcq", "Where is the lesion?", options)
        questions.append(" ".join([LAB_FINDING] * i + [question]) if varied else question)
        answers.append("ABCD"[i % 4])
    return images, questions, answers


def run_vlm_benchmark(config: VlmBenchmarkConfig = VlmBenchmarkConfig()) -> dict[str, Any]:
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as VisionLanguageModel.from_config picks
    with tempfile.TemporaryDirectory(prefix="gx-vlm-") as folder:
        started = time.perf_counter()
        builder = build_paper_model if config.size in REAL else build_llava
        builder(Path(folder), config.size, dtype, device)
        built = time.perf_counter() - started
        vlm = VisionLanguageModel.from_config(  # as a trial builds it
            VLMConfig(
                name=folder, lora_rank=config.rank, lora_alpha=2 * config.rank, lora_dropout=VLM_LORA.dropout,
                gradient_checkpointing=config.gradient_checkpointing, packing=config.packing,
            ),
            device,
        )  # fmt: skip
    vlm.train()
    parameters = sum(p.numel() for p in vlm.model.parameters())
    trainable = list(vlm.trainable().values())
    optimiser = torch.optim.AdamW(trainable, lr=1e-4)
    images, questions, answers = benchmark_batch(config.batch, varied=config.varied)
    inputs, labels = vlm._taught(images, questions, answers)  # the raw side's tensors, built once (packed or padded)
    padded, padded_labels = vlm._with_answers(vlm._prompt_inputs(images, questions, "right"), answers)

    def step(loss_of) -> None:
        loss_of().backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)

    sides = {
        "gx_ray": lambda: vlm.loss(images, questions, answers),
        "raw": lambda: vlm.model(**inputs, labels=labels).loss,
    }
    if config.packing:  # the raw step on the padded batch too: packed against padded within one run
        sides["raw_padded"] = lambda: vlm.model(**padded, labels=padded_labels).loss
    result: dict[str, Any] = {"config": asdict(config), "device": _device_name(device), "dtype": str(dtype)}
    result.update(parameters=parameters, trainable=sum(p.numel() for p in trainable), build_seconds=built)
    tokens = int(padded["attention_mask"].sum())
    result["tokens_per_sample"] = tokens / config.batch
    result["padding_share"] = 1 - tokens / padded["input_ids"].numel()  # of a padded batch, packed or not
    result["row_tokens"] = inputs["input_ids"].numel()  # what the model is given: the packed row has no padding
    for name, loss_of in sides.items():
        with peak_memory(device) as peak:
            for _ in range(config.warmup):
                step(loss_of)
            synchronize(device)
            start = time.perf_counter()
            for _ in range(config.steps):
                step(loss_of)
            synchronize(device)
            seconds = time.perf_counter() - start
        result[name] = {"samples_per_s": config.steps * config.batch / seconds, "peak_gib": peak["bytes"] / 2**30}
    result["ratio"] = result["gx_ray"]["samples_per_s"] / result["raw"]["samples_per_s"]
    if config.packing:
        result["packed_over_padded"] = result["raw"]["samples_per_s"] / result["raw_padded"]["samples_per_s"]
    return result


def format_vlm_result(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"VLM {c['size']} ({'LLaVA: SigLIP + Qwen2, ' if c['size'] in SIZES else ''}"
        f"{result['parameters'] / 1e6:,.1f} M parameters, LoRA rank "
        f"{c['rank']}: {result['trainable'] / 1e6:.2f} M trainable) on {result['device']}, {result['dtype']}, "
        f"batch {c['batch']}, {result['tokens_per_sample']:.1f} tokens a sample",
        f"  {'packed: one row' if c.get('packing') else 'padded'}, {result['row_tokens']} tokens given "
        f"(padding would be {100 * result['padding_share']:.1f} % of a padded batch)",
    ]
    for name in ("gx_ray", "raw", "raw_padded"):
        if side := result.get(name):
            lines.append(f"  {name:10s} {side['samples_per_s']:8.2f} samples/s   peak {side['peak_gib']:.1f} GiB")
    lines.append(f"  ratio gx_ray / raw: {result['ratio']:.3f}")
    if "packed_over_padded" in result:
        lines.append(f"  ratio raw packed / raw padded: {result['packed_over_padded']:.3f}")
    return "\n".join(lines)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
