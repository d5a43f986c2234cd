"""`python jobs/benchmark.py attention`: what attention's first meeting with each new shape costs a GPU trial.

A trial's text paths meet many attention shapes once: the text encoder one per (bucket length, batch size), training
and evaluation apart; report generation one per decoded length (1 … ``max_new_tokens`` keys against one query). A
backend that builds a plan per shape (cuDNN's) pays each of them on first sight; one that does not (FlashAttention,
memory-efficient) pays nothing. Each variant runs in a fresh process (plans are per process) and times, on one GPU
in bf16 (on a machine without one, the CPU, to try the code):

* ``text``: MiniLM forward + backward at the loop's bucket lengths for a full and a partial training batch, then
  forward at evaluation's batch: the first pass (cold) and the same pass again (warm);
* ``generate``: the report decoder writing ``max_new_tokens`` tokens for an evaluation batch, cold and warm.

Cold minus warm is the one-off cost a trial process pays: the figure to compare between variants.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from typing import Any

from gx_ray.models.text import TEXT_BUCKETS

VARIANTS = {
    "default": "torch's own choice of SDPA backend",
    "no_cudnn": "cuDNN attention off (FlashAttention / memory-efficient / math)",
}


@dataclass(frozen=True)
class AttentionBenchmarkConfig:
    variants: tuple[str, ...] = tuple(VARIANTS)
    train_batch: int = 8
    eval_batch: int = 32
    lengths: tuple[int, ...] = tuple(b for b in TEXT_BUCKETS if b <= 256)
    """The loop's bucket lengths up to the reports' default 256 tokens."""
    max_new_tokens: int = 256
    memory_tokens: int = 64
    memory_dim: int = 256


def measure(variant: str, config: AttentionBenchmarkConfig) -> dict[str, Any]:
    """Cold and warm seconds of the text and generation passes, in this process, under ``variant``."""
    import torch

    from gx_ray.models.text import build_text_encoder, choose_attention_backends
    from gx_ray.tasks.report_generation import build_decoder

    if variant not in VARIANTS:
        raise ValueError(f"unknown attention variant {variant!r}; valid: {', '.join(VARIANTS)}")
    choose_attention_backends(variant != "no_cudnn")  # the switch a trial's build_trial throws
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU only to try the code
    torch.manual_seed(0)
    encoder = build_text_encoder("minilm").to(device)
    decoder = build_decoder(encoder.tokenizer, config.memory_dim).to(device).eval()
    ids = torch.randint(1000, 2000, (config.eval_batch, max(config.lengths)), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def encode(batch: int, length: int) -> torch.Tensor:
        mask = torch.ones(batch, length, dtype=torch.long, device=device)
        mask[0, length // 2 :] = 0  # padding, as real batches have: the attention mask is not empty
        with torch.autocast(device.type, torch.bfloat16):
            return encoder.model(input_ids=ids[:batch, :length], attention_mask=mask).last_hidden_state

    def text_pass() -> None:
        encoder.train()
        for length in config.lengths:
            for batch in (config.train_batch, config.train_batch - 3):  # a full batch and an epoch's last
                encode(batch, length).float().mean().backward()
        encoder.eval()
        with torch.no_grad():
            for length in config.lengths:
                encode(config.eval_batch, length)

    steps = []
    decoder.decoder.bert.embeddings.register_forward_hook(lambda *_: steps.append(1))
    memory = torch.randn(config.eval_batch, config.memory_tokens, config.memory_dim, device=device)
    memory_mask = torch.ones(config.eval_batch, config.memory_tokens, dtype=torch.bool, device=device)

    def generate_pass() -> None:
        steps.clear()
        with torch.autocast(device.type, torch.bfloat16):
            decoder.generate(memory, memory_mask, 1, config.max_new_tokens)

    def timed(work) -> float:
        sync()
        start = time.perf_counter()
        work()
        sync()
        return time.perf_counter() - start

    torch.ones(1, device=device).sum().item()  # the CUDA context, before anything is timed
    result = {"variant": variant, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}
    for name, work in (("text", text_pass), ("generate", generate_pass)):
        result[f"{name}_cold_s"] = timed(work)
        result[f"{name}_warm_s"] = timed(work)
    result["generated_tokens"] = len(steps)
    return result


def run_attention_benchmark(config: AttentionBenchmarkConfig = AttentionBenchmarkConfig()) -> list[dict[str, Any]]:
    """Each variant in its own fresh process, in turn (one GPU)."""
    context = multiprocessing.get_context("spawn")
    results = []
    for variant in config.variants:
        with context.Pool(1) as pool:
            results.append(pool.apply(measure, (variant, config)))
    return results


def format_attention_result(results: list[dict[str, Any]], config: AttentionBenchmarkConfig) -> str:
    lines = [
        f"attention's first sight of each shape on {results[0]['gpu'] if results else '?'} (bf16): MiniLM at lengths "
        f"{','.join(map(str, config.lengths))}, batches {config.train_batch}/{config.train_batch - 3} training and "
        f"{config.eval_batch} evaluation; the report decoder writing {config.max_new_tokens} tokens for "
        f"{config.eval_batch}",
        f"{'variant':<10}{'text cold s':>12}{'warm s':>8}{'one-off s':>10}{'generate cold s':>16}{'warm s':>8}"
        f"{'one-off s':>10}{'tokens':>8}",
    ]
    for r in results:
        lines.append(
            f"{r['variant']:<10}{r['text_cold_s']:>12.2f}{r['text_warm_s']:>8.2f}"
            f"{r['text_cold_s'] - r['text_warm_s']:>10.2f}{r['generate_cold_s']:>16.2f}{r['generate_warm_s']:>8.2f}"
            f"{r['generate_cold_s'] - r['generate_warm_s']:>10.2f}{r['generated_tokens']:>8}"
        )
    return "\n".join(lines)
