"""The benchmark commands on CPU at tiny sizes: they run from the command line, and each compares like with like (the
VLM benchmark's two sides compute the same loss on the same batch, so their rate ratio is the platform's cost only)."""

from __future__ import annotations

import math

import torch

from gx_ray.models.vlm import VisionLanguageModel
from gx_ray.models.vlm_benchmark import VlmBenchmarkConfig, benchmark_batch, build_llava, run_vlm_benchmark
from jobs.benchmark import main


def test_the_model_benchmark_command_runs(capsys):
    assert main(["model", "--model", "swin3d", "--shape", "1,32,32,32", "--batch", "2", "--steps", "1",
                 "--warmup", "1", "--device", "cpu"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "ratio registry/raw" in out


def test_the_vlm_benchmark_sides_compute_the_same_loss_and_train_only_lora(tmp_path):
    folder = build_llava(tmp_path / "llava", "tiny", torch.float32)
    vlm = VisionLanguageModel(str(folder))
    images, questions, answers = benchmark_batch(3)
    inputs, labels = vlm._taught(images, questions, answers)
    vlm.eval()  # no dropout: both sides must give the very same number
    ours = vlm.loss(images, questions, answers)
    raw = vlm.model(**inputs, labels=labels).loss
    torch.testing.assert_close(ours, raw)
    taught = (labels != -100).sum(1)
    assert taught.min() >= 2  # the answer letter and the end of text, nothing of the prompt or the image
    assert taught.max() <= 4

    result = run_vlm_benchmark(VlmBenchmarkConfig(size="tiny", batch=2, steps=1, warmup=1, device="cpu"))
    assert 0 < result["trainable"] < result["parameters"] / 10
    for side in ("gx_ray", "raw"):
        assert result[side]["samples_per_s"] > 0
    assert math.isclose(result["ratio"], result["gx_ray"]["samples_per_s"] / result["raw"]["samples_per_s"])
    assert result["tokens_per_sample"] > (56 // 14) ** 2  # the image's tokens and the question's
