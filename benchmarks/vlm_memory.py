"""Peak GPU memory and time of a LoRA training step of the Gastric-X paper's transformers VLMs at their real sizes,
at batch 1 and at the paper's batch 32: ``python -m benchmarks.vlm_memory [--tiny] [--models NAME ...]``.

No weights reach the GPU machine, so each model is built with random weights from its released configuration
(:data:`REAL`: LLaVA-1.5-7B, LLaVA-Med v1.5 on Mistral-7B, BLIP-2 with OPT-2.7B and with Flan-T5-XL), in bf16 on the
device; memory and speed do not depend on the weights. The step is a trial's: LoRA rank 16 on the language model's
family targets (:func:`gx_ray.models.lora.family_targets`), the base frozen, gradient checkpointing on (as the
``vlm_lora`` space sets it), AdamW, one image a question (one view, or the views stacked) and a prompt of
:data:`PROMPT_TOKENS` text tokens with a 4-token answer, the image tokens in the sequence as each model places them.
The processors are left out (they run on the CPU and cost no GPU memory). ``--tiny`` runs one-layer versions on the
CPU, to check the script.

``--estimate`` needs no GPU: the same step's peak, ESTIMATED. The parameters are counted exactly (the model built on
the meta device, LoRA applied); the rest is arithmetic, in bytes (B batch, T tokens, H width, I the MLP's, L layers,
V vocabulary): the bf16 weights; LoRA's trainable parameters in float32 with their gradients and AdamW's two moments
(16 a parameter: peft keeps adapters in float32); the checkpointed input of every language-model layer (L·B·T·H·2);
and the larger of the logits (B·T·V·10: bf16, the loss's float32 copy and its float32 gradient) and one layer
recomputed with its gradients (B·T·(6H + 3I)·4). The frozen vision tower keeps nothing for the backward pass. CUDA's
context and the allocator's fragmentation are not counted; a measured figure replaces an estimate where a GPU ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

from benchmarks.model import peak_memory, synchronize
from gx_ray.models.lora import LoraSettings, apply_lora

PROMPT_TOKENS = 64
ANSWER_TOKENS = 4
CLIP_336 = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
            "image_size": 336, "patch_size": 14, "projection_dim": 768}  # fmt: skip
EVA_G = {"hidden_size": 1408, "intermediate_size": 6144, "num_hidden_layers": 39, "num_attention_heads": 16,
         "image_size": 224, "patch_size": 14}  # fmt: skip
QFORMER = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
           "encoder_hidden_size": 1408}  # fmt: skip
REAL: dict[str, dict[str, Any]] = {
    "llava_1_5": {"vision": CLIP_336, "text": ("llama", {"vocab_size": 32064, "hidden_size": 4096,
                  "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32})},
    "llava_med": {"vision": CLIP_336, "text": ("mistral", {"vocab_size": 32064, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8})},
    "blip2_opt": {"vision": EVA_G, "qformer": QFORMER, "text": ("opt", {"vocab_size": 50304, "hidden_size": 2560,
                  "ffn_dim": 10240, "num_hidden_layers": 32, "num_attention_heads": 32, "word_embed_proj_dim": 2560})},
    "blip2_flan_t5": {"vision": EVA_G, "qformer": QFORMER, "text": ("t5", {"vocab_size": 32128, "d_model": 2048,
                      "d_kv": 64, "d_ff": 5120, "num_layers": 24, "num_heads": 32, "feed_forward_proj": "gated-gelu",
                      "tie_word_embeddings": False, "decoder_start_token_id": 0, "pad_token_id": 0})},
}  # fmt: skip
"""The released models' configurations (their config.json's sizes)."""
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def _tiny(sizes: dict[str, Any]) -> dict[str, Any]:
    """One layer, width 32, of a config's sizes (``--tiny``): its kind kept, its vocabulary cut."""
    small = {k: v for k, v in sizes.items() if k != "projection_dim"}
    widths = {"hidden_size": 32, "intermediate_size": 64, "ffn_dim": 64, "d_model": 32, "d_ff": 64, "d_kv": 16,
              "word_embed_proj_dim": 32, "encoder_hidden_size": 32, "vocab_size": 512, "image_size": 56}  # fmt: skip
    layers = {"num_hidden_layers": 1, "num_layers": 1, "num_attention_heads": 2, "num_heads": 2,
              "num_key_value_heads": 1}  # fmt: skip
    return {k: widths.get(k, layers.get(k, v)) for k, v in small.items()}


def build(name: str, tiny: bool, device: torch.device) -> tuple[torch.nn.Module, int]:
    """The model ``name`` with random weights in bf16 (float32 with ``tiny``) on ``device``, and the image tokens a
    question's sequence holds."""
    import transformers as tf

    spec = REAL[name]
    size = _tiny if tiny else dict
    kind, text = spec["text"]
    text_config = tf.AutoConfig.for_model(kind, **size(text))
    vision = size(spec["vision"])
    dtype = torch.float32 if tiny else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init straight into the step's dtype: 7 B parameters at once
    try:
        with torch.device(device):
            if name.startswith("llava"):
                image_id = text_config.vocab_size - 1
                config = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**vision), text_config=text_config,
                                        image_token_index=image_id, vision_feature_layer=-2)  # fmt: skip
                model = tf.LlavaForConditionalGeneration(config)
                image_tokens = (vision["image_size"] // vision["patch_size"]) ** 2
            else:
                config = tf.Blip2Config(vision_config=vision, qformer_config=size(spec["qformer"]),
                                        text_config=text_config.to_dict(), num_query_tokens=32,
                                        image_token_index=text_config.vocab_size - 1)  # fmt: skip
                model, image_tokens = tf.Blip2ForConditionalGeneration(config), 32
    finally:
        torch.set_default_dtype(previous)
    return model, image_tokens


def batch_inputs(model: torch.nn.Module, image_tokens: int, batch: int, device: torch.device) -> dict[str, Any]:
    """A batch of ``batch`` questions: image tokens then prompt tokens (decoder-only: then the answer, the labels
    on it alone), random pixels at the vision tower's size."""
    config = model.config
    text = config.get_text_config()
    vocab, image_id = text.vocab_size, config.image_token_index
    side = config.vision_config.image_size
    prompt = torch.randint(5, vocab - 2, (batch, PROMPT_TOKENS), device=device)
    answer = torch.randint(5, vocab - 2, (batch, ANSWER_TOKENS), device=device)
    images = torch.full((batch, image_tokens), image_id, device=device)
    pixels = torch.randn(batch, 3, side, side, device=device, dtype=next(model.parameters()).dtype)
    if text.is_encoder_decoder:
        ids = torch.cat([images, prompt], 1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels, "labels": answer}
    ids = torch.cat([images, prompt, answer], 1)
    labels = torch.cat([torch.full_like(images, -100), torch.full_like(prompt, -100), answer], 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels, "labels": labels}


def measure(name: str, batches: tuple[int, ...], tiny: bool, steps: int = 3) -> dict[str, Any]:
    """Parameters, trainable parameters, and per batch size the peak memory (GiB) and seconds a step."""
    device = torch.device("cpu" if tiny else "cuda")
    model, image_tokens = build(name, tiny, device)
    model.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = apply_lora(model, LoraSettings(rank=16, alpha=32, dropout=0.05), exclude=r".*vision.*")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(trainable, lr=5e-5, weight_decay=0.01)
    result: dict[str, Any] = {"model": name, "parameters": sum(p.numel() for p in model.parameters()),
                              "trainable": sum(p.numel() for p in trainable), "image_tokens": image_tokens}  # fmt: skip
    for batch in batches:
        inputs = batch_inputs(model, image_tokens, batch, device)
        try:
            with peak_memory(device) as peak:
                seconds = []
                for _ in range(steps):
                    synchronize(device)
                    start = time.perf_counter()
                    model(**inputs, use_cache=False).loss.backward()
                    optimiser.step()
                    optimiser.zero_grad(set_to_none=True)
                    synchronize(device)
                    seconds.append(time.perf_counter() - start)
            result[f"batch_{batch}"] = {"peak_gib": round(peak["bytes"] / 2**30, 2),
                                        "step_s": round(min(seconds[1:] or seconds), 3)}  # fmt: skip
        except torch.OutOfMemoryError:
            result[f"batch_{batch}"] = {"peak_gib": "out of memory", "step_s": None}
        del inputs
        gc.collect()
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    del model, optimiser
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def estimate(name: str, batches: tuple[int, ...]) -> dict[str, Any]:
    """The step's peak memory at each batch size, estimated (the module's docstring gives the arithmetic)."""
    model, image_tokens = build(name, False, torch.device("meta"))
    model.requires_grad_(False)
    model = apply_lora(model, LoraSettings(rank=16, alpha=32, dropout=0.05), exclude=r".*vision.*")
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = model.config.get_text_config()
    width, layers = _size(text, "hidden_size", "d_model"), _size(text, "num_hidden_layers", "num_layers")
    mlp = _size(text, "intermediate_size", "ffn_dim", "d_ff")
    prompt = image_tokens + PROMPT_TOKENS
    # T5: the prompt is encoded (its layers checkpointed), the answer decoded (its logits only the answer's)
    tokens, logit_rows = (prompt, ANSWER_TOKENS) if text.is_encoder_decoder else (prompt + ANSWER_TOKENS,) * 2
    fixed = (parameters - trainable) * 2 + trainable * 16
    result: dict[str, Any] = {"model": name, "parameters": parameters, "trainable": trainable, "estimate": True}
    for batch in batches:
        saved = layers * batch * tokens * width * 2
        working = max(batch * logit_rows * text.vocab_size * 10, batch * tokens * (6 * width + 3 * mlp) * 4)
        result[f"batch_{batch}"] = {"peak_gib": round((fixed + saved + working) / 2**30, 1)}
    return result


def _size(config: Any, *names: str) -> int:
    """The first of ``names`` that ``config`` has (the families name their sizes differently)."""
    return next(int(getattr(config, n)) for n in names if getattr(config, n, None) is not None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(REAL), choices=list(REAL))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--tiny", action="store_true", help="one-layer models on the CPU (a check of the script)")
    parser.add_argument("--estimate", action="store_true", help="no GPU: the peak estimated from the sizes")
    args = parser.parse_args(argv)
    for name in args.models:
        batches = tuple(args.batches)
        figures = estimate(name, batches) if args.estimate else measure(name, batches, args.tiny)
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
