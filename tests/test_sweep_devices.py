"""Where the main command's trials run: on the demo cohort, the GPUs a machine has (its ``demo_gpu`` preset), unless
told otherwise; a machine without GPUs runs exactly as before."""

from __future__ import annotations

from gx_ray.sweep.driver import SweepOptions, demo_presets
from gx_ray.sweep.spaces import load_space


def test_a_machine_without_gpus_runs_the_demo_on_its_cpus_as_before():
    assert demo_presets(SweepOptions("modality_ablation"), gpus=0) == ("demo",)
    assert demo_presets(SweepOptions("modality_ablation", presets=("smoke",)), gpus=0) == ("demo", "smoke")
    space = load_space("modality_ablation", demo_presets(SweepOptions("modality_ablation"), gpus=0))
    assert space.gpus_per_worker == 0 and space.cpus_per_worker == 1
    assert space.grid["task"][0] == "vqa"  # the space's own order


def test_a_machine_with_gpus_packs_the_demo_on_them_unless_told_otherwise():
    options = SweepOptions("modality_ablation", presets=("smoke",))
    presets = demo_presets(options, gpus=1)
    assert presets == ("demo", "demo_gpu", "smoke")  # the user's presets last: smoke's epochs win
    space = load_space("modality_ablation", presets)
    assert space.gpus_per_worker == "auto" and space.trial_count() == 20
    detection = space.resolve({"task": "lesion_detection", "schema": "image_bbox", "seed": 0})
    assert detection["resources.gpu_alone"] is False and detection["resources.use_gpu"] is True
    assert detection["task_options.feature_level"] == 0  # the demo's own detection settings kept
    assert space.grid["task"][0] == "report_generation"  # the longest trials first
    # --cpu, a cohort of one's own, or a preset that says where trials run: the demo_gpu preset stays out
    assert demo_presets(SweepOptions("modality_ablation", cpu=True), gpus=1) == ("demo",)
    assert demo_presets(SweepOptions("modality_ablation", data="prepared"), gpus=1) == ()
    assert demo_presets(SweepOptions("modality_ablation", presets=("gpu",)), gpus=1) == ("demo", "gpu")
    # a space without a demo_gpu preset runs its demo preset alone
    assert "demo_gpu" not in demo_presets(SweepOptions("lr_sweep"), gpus=2)
