"""Tiny randomly initialised vision-language models, built offline from their configs, with processors: CI has no
VLM weights and no real processor or tokenizer files. :data:`FAMILIES`: LLaVA and PaliGemma; :data:`PAPER_MODELS`:
the Gastric-X paper's models whose architectures transformers has, built by ``gx_ray.models.tiny_vlms`` (tokenizers
trained by ``tokenizers``, their prompt formats hand-written).

Both use the offline MiniLM (BERT) tokenizer with the family's image token added, so their vocabularies are not the
real models'. The LLaVA fixture's chat template is HAND-WRITTEN (``role: content`` lines), not LLaVA's own: the real
template files are not available offline, so LLaVA's template itself is untested here. PaliGemma has no chat
template (its processor prefixes the image tokens itself), which is the real model's behaviour.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from benchmarks.vlm import LLAVA_TEMPLATE_HAND_WRITTEN, offline_vlm_tokenizer
from gx_ray.models.tiny_vlms import (  # noqa: F401 - the paper's tiny models, for the tests that import them here
    INIT,
    SIZE,
    tiny_blip2_flan_t5,
    tiny_blip2_opt,
    tiny_flamingo,
    tiny_llava_15,
    tiny_llava_med,
    trained_tokenizer,
)
from gx_ray.schema import BOX_LEVELS, PHASES


def tiny_llava(folder: Path) -> Path:
    """LLaVA: a CLIP vision tower and a Llama language model, one layer each, width 32."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    torch.manual_seed(0)
    tokenizer = offline_vlm_tokenizer("<image>")
    images = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE_HAND_WRITTEN, image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=SIZE,
            patch_size=8,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
            initializer_range=INIT,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )  # fmt: skip
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def tiny_paligemma(folder: Path) -> Path:
    """PaliGemma: a SigLIP vision tower and a Gemma language model, one layer each, width 32."""
    import torch
    from transformers import (
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessor,
    )

    torch.manual_seed(0)
    tokenizer = offline_vlm_tokenizer("<image>")
    tokenizer.bos_token, tokenizer.eos_token = "[CLS]", "[SEP]"
    images = SiglipImageProcessor(size={"height": SIZE, "width": SIZE})
    images.image_seq_length = (SIZE // 8) ** 2
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)
    config = PaliGemmaConfig(
        vision_config={
            "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "image_size": SIZE, "patch_size": 8, "projection_dim": 32,
        },
        text_config={
            "model_type": "gemma", "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "max_position_embeddings": 512, "pad_token_id": tokenizer.pad_token_id, "initializer_range": INIT,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), projection_dim=32,
    )  # fmt: skip
    PaliGemmaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


FAMILIES = {"llava": tiny_llava, "paligemma": tiny_paligemma}


PAPER_MODELS = {
    "llava_1_5": tiny_llava_15,
    "llava_med": tiny_llava_med,
    "blip2_opt": tiny_blip2_opt,
    "blip2_flan_t5": tiny_blip2_flan_t5,
}
"""The paper's models whose architectures transformers has, as tiny random models (``gx_ray.models.tiny_vlms``)."""


def vlm_batch() -> dict:
    """Two cases on a 12 x 32 x 32 grid: the first with a tumour box, an abnormal CEA and no delayed phase; the
    second without a tumour box; each with a VQA question, a report and a stage (the VLM tasks' columns)."""
    rng = np.random.default_rng(0)
    ct = torch.from_numpy(rng.normal(size=(2, len(PHASES), 12, 32, 32)).astype(np.float16))
    boxes = np.zeros((2, len(PHASES), len(BOX_LEVELS), 6), np.int32)
    present = np.zeros((2, len(PHASES), len(BOX_LEVELS)), bool)
    boxes[:, :, BOX_LEVELS.index("tumour")] = [2, 8, 8, 5, 16, 16]
    boxes[:, :, BOX_LEVELS.index("stomach")] = [4, 2, 2, 11, 30, 30]
    present[0] = True
    present[1, :, BOX_LEVELS.index("stomach")] = True
    mean = np.full((2, len(PHASES)), 40.0, np.float32)
    mean[0, PHASES.index("delayed")] = np.nan
    return {
        "case_id": ["a", "b"],
        "ct": ct,
        "ct_hu_mean": torch.from_numpy(mean),
        "ct_hu_std": torch.full((2, len(PHASES)), 100.0),
        "boxes": torch.from_numpy(boxes),
        "box_present": torch.from_numpy(present.reshape(2, -1)),
        "lab_abnormal": [["CEA 12.4 ng/mL, 2.5x above upper limit"], []],
        "vqa": [[{"question": "Is there a lesion?", "answer": "yes", "category": "yes_no"}],
                [{"question": "Where is the lesion?", "answer": "lower third", "category": "localization"}]],
        "ct_report": ["Gastric wall thickening in the antrum.", "No distant metastasis."],
        "stage_label": torch.tensor([2, 0]),
    }  # fmt: skip


def trained_losses(task, model: torch.nn.Module, steps: int, lr: float) -> list[float]:
    """``task``'s loss on :func:`vlm_batch` at each of ``steps`` AdamW steps of ``model``'s trainable parameters."""
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = task.loss(model.train()(vlm_batch()), vlm_batch())
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
        losses.append(loss.item())
    return losses


def scored(model: torch.nn.Module, task) -> dict:
    """``task``'s metric of ``model`` in evaluation mode on :func:`vlm_batch`."""
    metric = task.metric()
    with torch.no_grad():
        outputs = model.eval()(vlm_batch())
    metric.update(outputs, vlm_batch())
    return metric.compute()
