"""Tiny randomly initialised vision-language models of two families, built offline from their configs, with
processors: CI has no VLM weights and no real processor or tokenizer files.

Both use the offline MiniLM (BERT) tokenizer with the family's image token added, so their vocabularies are not the
real models'. The LLaVA fixture's chat template is HAND-WRITTEN (``role: content`` lines), not LLaVA's own: the real
template files are not available offline, so LLaVA's template itself is untested here. PaliGemma has no chat
template (its processor prefixes the image tokens itself), which is the real model's behaviour.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.vlm import LLAVA_TEMPLATE_HAND_WRITTEN, offline_vlm_tokenizer

SIZE = 32
INIT = 1.0
"""The language models' weight scale: at the usual 0.02 a random 30k-way output layer, frozen under LoRA, caps every
logit below ~0.7, so no adapter could fit even four answers (the loss stalls at ln 30k - 0.7)."""


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
