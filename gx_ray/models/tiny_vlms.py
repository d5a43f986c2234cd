"""Tiny random models of the Gastric-X paper's vision-language models, built offline from their architectures'
config classes at toy sizes (width 32, one or two layers), with tokenizers trained by ``tokenizers`` on a few
sentences and the models' prompt formats hand-written: what a smoke run, a test or a new machine without weights
runs in place of LLaVA-1.5, LLaVA-Med v1.5, BLIP-2, Med-Flamingo and MedVInT. Their numbers mean nothing; their
code paths (load, LoRA, the 3D-to-2D views, a training step, generation, scoring) are the real models'.

``vlm.name: tiny:<model>`` (:data:`TINY_VLMS`) names one: :func:`local_weights` builds it once under
``$XDG_CACHE_HOME/gx-ray/tiny-vlms/`` (``~/.cache`` by default; a build is deterministic, so every node builds the
same model) and gives the folder that the loaders read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SIZE = 32
"""The image side the tiny processors resize to."""
INIT = 1.0
"""The language models' weight scale: at the usual 0.02 a random 30k-way output layer, frozen under LoRA, caps every
logit below ~0.7, so no adapter could fit even four answers (the loss stalls at ln 30k - 0.7)."""
PREFIX = "tiny:"

CORPUS = (
    "Which gastric site holds the lesion? Options: A. cardia B. body C. antrum D. pylorus. Answer with the option's "
    "letter from the given choices directly. Answer the question using a single word or phrase. What is the overall "
    "AJCC stage group of this gastric cancer? stage I stage II stage III stage IV yes no lower third upper third "
    "You are a helpful assistant. Please generate a report for the given images, including both findings and "
    "impressions. Return the report in the following format: Findings: Impression: Gastric wall thickening in the "
    "antrum with perigastric lymph nodes. No distant metastasis. CEA 12.4 ng/mL, 2.5x above upper limit. No abnormal "
    "laboratory findings. The tumour box: slices 2-4, rows 8-15, columns 8-15. USER: ASSISTANT: [INST] [/INST]"
)
"""What the tiny tokenizers are trained on: the words the tests' prompts, answers and reports use (byte-level, so
any other text still tokenizes)."""
LLAVA_15_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<image>\n{% endif %}{% endfor %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
"""LLaVA-1.5's conversation format (``USER: <image>\\n{question} ASSISTANT:``), hand-written after llava-hf's."""
MISTRAL_TEMPLATE = (
    "{% for m in messages %}[INST] {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}"
    "{% endfor %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    " [/INST]{% endfor %}"
)
"""LLaVA-Med v1.5's Mistral instruction format (``[INST] <image>\\n{question} [/INST]``), hand-written."""


def trained_tokenizer(seq2seq: bool = False, vocab_size: int = 400):
    """A byte-level BPE tokenizer trained by ``tokenizers`` on :data:`CORPUS`, with ``<pad>``, ``<s>``, ``</s>``,
    ``<unk>`` and ``<image>``: a decoder's (``<s>`` before each text) or, ``seq2seq``, T5's (``</s>`` after it,
    ``<pad>`` first: T5 starts decoding from id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>", "<s>", "<image>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    single = "$A </s>" if seq2seq else "<s> $A"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B", special_tokens=[(t, ids[t]) for t in ("<s>", "</s>")]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        bos_token=None if seq2seq else "<s>", additional_special_tokens=["<image>"],
    )  # fmt: skip


def _llava_family(folder: Path, text_config, template: str) -> Path:
    """LLaVA (a CLIP vision tower, ``text_config``'s language model) with :func:`trained_tokenizer`."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    torch.manual_seed(0)
    tokenizer = trained_tokenizer()
    images = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
        chat_template=template, image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=SIZE,
            patch_size=8,
        ),
        text_config=text_config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=INIT,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )  # fmt: skip
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def tiny_llava_15(folder: Path) -> Path:
    """LLaVA-1.5: CLIP and LLaMA (LlavaForConditionalGeneration), in LLaVA-1.5's conversation format."""
    from transformers import LlamaConfig

    return _llava_family(folder, LlamaConfig, LLAVA_15_TEMPLATE)


def tiny_llava_med(folder: Path) -> Path:
    """LLaVA-Med v1.5: CLIP and Mistral (the transformers port of llava-med-v1.5-mistral-7b), in Mistral's format."""
    from transformers import MistralConfig

    return _llava_family(folder, MistralConfig, MISTRAL_TEMPLATE)


def _blip2(folder: Path, seq2seq: bool) -> Path:
    """BLIP-2: its ViT, a Q-Former of 4 query tokens, and OPT or (``seq2seq``) Flan-T5, with its processor."""
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        BlipImageProcessor,
        OPTConfig,
        T5Config,
    )

    torch.manual_seed(0)
    tokenizer = trained_tokenizer(seq2seq)
    processor = Blip2Processor(BlipImageProcessor(size={"height": SIZE, "width": SIZE}), tokenizer, num_query_tokens=4)
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if seq2seq:
        text = T5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
            feed_forward_proj="gated-gelu", decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
            initializer_factor=INIT, **special,
        )  # fmt: skip
    else:
        text = OPTConfig(
            vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
            word_embed_proj_dim=32, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
            init_std=INIT, **special,
        )  # fmt: skip
    config = Blip2Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": SIZE, "patch_size": 8},
        qformer_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "encoder_hidden_size": 32, "vocab_size": 64},
        text_config=text.to_dict(), num_query_tokens=4,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
    )  # fmt: skip
    Blip2ForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def tiny_blip2_opt(folder: Path) -> Path:
    return _blip2(folder, seq2seq=False)


def tiny_blip2_flan_t5(folder: Path) -> Path:
    return _blip2(folder, seq2seq=True)


def _clip_vision(folder: Path) -> None:
    """A one-layer CLIP vision model of width 16 and its image processor, saved in ``folder``."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=SIZE, patch_size=8)  # fmt: skip
    CLIPVisionModel(vision).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}).save_pretrained(folder)


def _causal_lm(folder: Path, config_class: Any, model_class: Any, layers: int) -> None:
    """A causal language model of width 32 (``config_class``/``model_class``: LLaMA's or Mistral's) with
    :func:`trained_tokenizer`, saved in ``folder``."""
    tokenizer = trained_tokenizer()
    language = config_class(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=INIT,
    )  # fmt: skip
    model_class(language).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _vision_and_llama(folder: Path) -> None:
    """A plug-in's two parts: :func:`_clip_vision` in ``vision/``, a two-layer LLaMA in ``language/``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    _clip_vision(folder / "vision")
    _causal_lm(folder / "language", LlamaConfig, LlamaForCausalLM, layers=2)


def tiny_flamingo(folder: Path, checkpoint: str = "") -> Path:
    """A Flamingo-style model's folder (``gx_ray.models.flamingo``): :func:`_vision_and_llama`, and ``flamingo.json``
    (a gated block before each layer, four latents)."""
    _vision_and_llama(folder)
    settings = {"vision": "vision", "language": "language", "every": 1, "latents": 4, "depth": 1, "heads": 2,
                "head_dim": 8, "checkpoint": checkpoint}  # fmt: skip
    (folder / "flamingo.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


def tiny_medvint(folder: Path) -> Path:
    """A MedVInT-style model's folder (``gx_ray.models.medvint``): :func:`_vision_and_llama`, and ``medvint.json``
    (four queries, a one-layer query decoder of width 16)."""
    _vision_and_llama(folder)
    settings = {"vision": "vision", "language": "language", "queries": 4, "width": 16, "layers": 1, "heads": 2,
                "feedforward": 32}  # fmt: skip
    (folder / "medvint.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


def tiny_llava_med_3d(folder: Path) -> Path:
    """LLaVA-Med v1.5 as the paper adapts it (``gx_ray.models.swin_vlm``): a one-layer Mistral with
    :func:`trained_tokenizer`, and ``swin_vlm.json`` (a 3D Swin of width 12, one block a stage, on 32³ volumes of four
    phases; its second-deepest stage's eight tokens the prefix)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    _causal_lm(folder / "language", MistralConfig, MistralForCausalLM, layers=1)
    swin = {"feature_size": 12, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 2, 4], "window_size": 4}
    settings = {"language": "language", "phases": 4, "depth": 32, "size": 32, "stage": -2, "swin": swin}
    (folder / "swin_vlm.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


TINY_VLMS: dict[str, Callable[[Path], Path]] = {
    "llava-1.5": tiny_llava_15,
    "llava-med": tiny_llava_med,
    "blip2-opt": tiny_blip2_opt,
    "blip2-flan-t5": tiny_blip2_flan_t5,
    "med-flamingo": tiny_flamingo,
    "medvint": tiny_medvint,
    "llava-med-3d": tiny_llava_med_3d,
}
"""``tiny:<model>`` → its builder. ``med-flamingo``, ``medvint`` and ``llava-med-3d`` are folders for their plug-ins
(``vlm.plugin: gx_ray.models.flamingo:FlamingoVLM``, ``gx_ray.models.medvint:MedVInTVLM``,
``gx_ray.models.swin_vlm:Swin3dVLM``); the others load through transformers' Auto classes."""


BUILD_VERSION = 2
"""Bump when a builder changes what it writes: cached models of another version are never read."""


def tiny_root() -> Path:
    """Where the tiny models are kept: by this module's build version and transformers' (whose files they are)."""
    import transformers

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "gx-ray" / "tiny-vlms" / f"v{BUILD_VERSION}-transformers-{transformers.__version__}"


def local_weights(name: str) -> str:
    """``name`` itself, unless it is ``tiny:<model>``: then the folder of that tiny model, built on first use
    (into a temporary folder renamed into place, so that two processes building it at once both end with one)."""
    if not name.startswith(PREFIX):
        return name
    model = name.removeprefix(PREFIX)
    if model not in TINY_VLMS:
        raise ValueError(f"{name}: no such tiny model; known: {', '.join(PREFIX + m for m in TINY_VLMS)}")
    folder = tiny_root() / model
    if not folder.is_dir():
        from gx_ray.models.text import quiet_loading

        quiet_loading()  # no "Writing model shards" bar per part
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{model}-", dir=folder.parent))
        TINY_VLMS[model](partial)
        try:
            partial.rename(folder)
        except OSError:  # another process put its build there first: the same model
            shutil.rmtree(partial, ignore_errors=True)
    return str(folder)
