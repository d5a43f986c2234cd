"""LoRA targets chosen by the model's language-model family (LLaMA, Mistral, OPT, T5, BERT, and inside a
vision-language model its language model's), on tiny random models built from transformers' configs; named targets
override the family's, and a family without known targets is refused naming the keys to set."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gx_ray.models.lora import LoraSettings, apply_lora, family_targets
from gx_ray.models.vlm import VISION_MODULES, VLMConfig

TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "vocab_size": 64}  # fmt: skip


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2))


def _mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**TINY, num_key_value_heads=1))


def _opt() -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=64,
                  word_embed_proj_dim=16)
    )  # fmt: skip


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, vocab_size=64, feed_forward_proj="gated-gelu")
    )


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(**TINY))


def _llava_mistral() -> nn.Module:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, MistralConfig

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8)  # fmt: skip
    return LlavaForConditionalGeneration(
        LlavaConfig(vision_config=vision, text_config=MistralConfig(**TINY, num_key_value_heads=1))
    )


# model, the suffixes LoRA adapts there, how many linear layers carry each
FAMILIES = {
    "llama": (_llama, ("q_proj", "v_proj")),
    "mistral": (_mistral, ("q_proj", "v_proj")),
    "opt": (_opt, ("q_proj", "v_proj")),
    "t5": (_t5, ("q", "v")),
    "bert": (_bert, ("query", "value")),
    "llava+mistral": (_llava_mistral, ("q_proj", "v_proj")),
}


def _adapted(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if hasattr(module, "lora_A")]


def _linear(model: nn.Module, suffixes: tuple[str, ...]) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in suffixes]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_adapts_the_query_and_value_projections_of_each_family_by_their_own_names(family):
    build, suffixes = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    assert family_targets(model) == suffixes
    expected = _linear(model, suffixes)
    expected = [n for n in expected if "vision" not in n]  # a VLM's vision tower keeps none by default
    adapted = apply_lora(model, LoraSettings(rank=2), exclude=VISION_MODULES if "llava" in family else None)
    names = [n.removeprefix("base_model.model.") for n in _adapted(adapted)]
    # every query and value projection of the language model, and nothing else (not OPT's out_proj, T5's o, k)
    assert sorted(names) == sorted(expected) and len(names) >= 4, (family, names)
    if family == "t5":  # both the self-attention and the encoder-decoder attention of the decoder
        assert any("EncDecAttention.q" in n for n in names) and any("SelfAttention.v" in n for n in names)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_named_targets_override_the_familys_and_auto_means_the_familys():
    model = apply_lora(_opt(), LoraSettings(rank=2, target_modules=("out_proj", "fc1")))
    names = _adapted(model)
    assert names and all(n.endswith(("out_proj", "fc1")) for n in names)
    assert VLMConfig(lora_targets="auto").lora_settings().target_modules == ()
    assert VLMConfig(lora_targets=["auto"]).lora_targets == ()
    assert VLMConfig(lora_targets="q, v").lora_settings().target_modules == ("q", "v")


def test_a_family_without_known_targets_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"no default LoRA targets for language model family.*vlm\.lora_targets"):
        apply_lora(nn.Sequential(nn.Linear(4, 4)), LoraSettings(rank=2))
