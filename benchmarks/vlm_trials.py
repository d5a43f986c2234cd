"""`python jobs/benchmark.py vlm --trials TASKS`: whole VLM trials through the sweep, beside the LoRA step's rate.

The step benchmark (:mod:`benchmarks.vlm`) times one LoRA step, gx-ray's against raw transformers'. This
runs the ``vlm_lora`` space's ``bench`` preset (the same view, LoRA and micro-batch) through the sweep itself on a
model of the same size, one trial per task, and reads each trial back from MLflow: its training rate per epoch, the
time it spends evaluating by generation, and its process's peak GPU memory. A VQA sample is a case with all its
questions, so VQA's rate counts cases, not questions.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from mlflow.tracking import MlflowClient

from benchmarks.cluster import run_epochs
from benchmarks.vlm import build_llava
from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.sweep.spaces import space_path
from gx_ray.tracking import child_runs


def run_vlm_trials(
    size: str,
    tasks: tuple[str, ...],
    output: Path,
    gradient_checkpointing: bool = True,
    data: Path | str | None = None,
    demo_cases: int = 160,
    fixed: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One trial per task of the ``bench`` preset on a random-weight LLaVA of ``size``; ``fixed`` overrides its keys
    (a shorter schedule in tests)."""
    cuda = torch.cuda.is_available()
    document = yaml.safe_load(space_path("vlm_lora").read_text(encoding="utf-8"))
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gx-vlm-trials-") as folder:
        build_llava(Path(folder), size, torch.bfloat16 if cuda else torch.float32, "cuda" if cuda else "cpu")
        bench = document["presets"]["bench"]
        bench["fixed"].update(
            {"vlm.name": folder, "vlm.gradient_checkpointing": gradient_checkpointing, **(fixed or {})}
        )
        bench["grid"] = {"task": list(tasks)}
        space = output / "vlm_lora_bench.yaml"
        space.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
        options = SweepOptions(
            space=str(space), output=output / "sweeps", data=data, demo_cases=demo_cases, demo_dir=output / "demo",
            presets=("gpu", "bench") if cuda else ("bench",),
        )  # fmt: skip
        result = run_sweep(options)
    client = MlflowClient(result.store_uri)
    rows = []
    for run in child_runs(client, result.parent_run_id):
        metrics = run.data.metrics
        rows.append(
            {
                "task": run.data.tags["task"],
                "status": run.info.status,
                "model": run.data.params["vlm.name"],
                "samples_per_s": [epoch["train_samples_per_second"] for epoch in run_epochs(client, run)],
                "eval_seconds": metrics.get("eval_seconds"),
                "trial_seconds": metrics.get("trial_seconds"),
                "process_peak_gib": metrics.get("gpu_process_memory_peak_gib"),
            }
        )  # fmt: skip
    return sorted(rows, key=lambda row: row["task"])


def format_vlm_trials(rows: list[dict[str, Any]], step: dict[str, Any]) -> str:
    """Each trial's epochs beside the step benchmark's gx-ray and raw rates (``step``: its result)."""
    gx, raw = step["gx_ray"]["samples_per_s"], step["raw"]["samples_per_s"]
    lines = [f"whole trials through the sweep (the step above: gx-ray {gx:.2f}, raw {raw:.2f} samples/s)"]
    for row in rows:
        rates = row["samples_per_s"]
        last = rates[-1] if rates else float("nan")
        peak = f"{row['process_peak_gib']:.1f} GiB" if row["process_peak_gib"] is not None else "-"
        unit = "cases/s (all their questions)" if row["task"] == "vqa" else "samples/s"
        lines.append(
            f"  {row['task']:22s} {row['status']:9s} epochs {', '.join(f'{r:.2f}' for r in rates)} {unit}; "
            f"last / step {last / gx:.2f}, / raw {last / raw:.2f}; evaluation {row['eval_seconds'] or 0:.1f} s; "
            f"trial {row['trial_seconds'] or 0:.1f} s; process peak {peak}"
        )
    return "\n".join(lines)
