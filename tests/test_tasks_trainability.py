"""Every task can learn from the fewest and from all of the paper's inputs: a few AdamW steps on four demo cases make
its loss fall.

Each task under image only and under image + table + boxes (the two partial schemas build their inputs from the same
parts: the last one runs every part of them), each with the registry's encoder in a small configuration (a 3D ResNet of
MONAI's class with one block per stage and a stride-4 stem, a small random BERT, width 64) and the task's own
head, trained on one fixed batch as the training loop would train it (``TaskModel``, ``param_groups``). A model
that cannot overfit four cases has a broken gradient path somewhere between the inputs and the loss.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gx_ray.data.shards import read_manifest
from gx_ray.data.stream import split_rows
from gx_ray.modalities import resolve_schema
from gx_ray.models import ModelConfig, build_encoder, param_groups
from gx_ray.schema import TASKS
from gx_ray.tasks import TaskModel, build_task
from tests.common import first_shard_batch

SMALL_MODEL = ModelConfig(
    vision="resnet18_3d",
    text="bert_tiny",
    hidden=64,
    vision_kwargs={"conv1_t_stride": 4, "layers": [1, 1, 1, 1]},
)
STEPS_AND_RATES = {
    "vqa": (8, 1e-3),
    "report_generation": (8, 3e-3),
    "retrieval": (14, 3e-4),  # its loss rises for a step or two before it falls
    "stage_classification": (6, 3e-4),
    "lesion_detection": (8, 1e-3),
    "lesion_qa": (8, 1e-3),
    "endoscopy": (8, 1e-3),
}
"""Optimiser steps and base learning rate per task (the text encoder gets twice the rate, as in the paper)."""
TASK_OPTIONS = {
    "report_generation": {"max_report_tokens": 32},  # teacher forcing on the reports' first 32 tokens
    "lesion_detection": {"feature_level": 0, "head_channels": 16},  # the stride-8 map of the small ResNet
    "lesion_qa": {"view_depth": 10, "view_kwargs": {"block_inplanes": [8, 16, 32, 64]}},
    "endoscopy": {"view_depth": 10, "view_kwargs": {"block_inplanes": [8, 16, 32, 64]}},
}
DETECTION_BOX_LEVELS = ["lymph_nodes", "stomach"]
"""Box cues a detection schema may give: the tumour box is the target (leakage rule box_cues_in_detection)."""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The 2-core CI box shares its cores with the session's Ray workers: two OpenMP threads then spin against
    # each other and a step took 5-10 times longer than with one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def train_rows(demo_prepared) -> list[dict]:
    return split_rows(demo_prepared.shard_dir, "train")


@pytest.fixture(scope="module")
def manifest(demo_prepared) -> dict:
    return {**read_manifest(demo_prepared.shard_dir), "shards": str(demo_prepared.shard_dir)}


@pytest.fixture(scope="module")
def four_cases(demo_prepared) -> dict:
    batch = first_shard_batch(demo_prepared.shard_dir)
    assert len(batch["case_id"]) == 4
    return batch


def schema_for(task: str, preset: str):
    schema = resolve_schema(preset)
    if task == "lesion_detection" and schema.boxes != "off":
        return resolve_schema({**schema.describe(), "box_levels": DETECTION_BOX_LEVELS})
    return schema


def train(task_name: str, preset: str, batch: dict, train_rows: list[dict], manifest: dict) -> list[float]:
    torch.manual_seed(0)
    task = build_task(task_name, **TASK_OPTIONS.get(task_name, {}))
    task.prepare(train_rows)
    # lesion QA's questions, the endoscopy tasks' annotations; nothing for the others
    task.attach_splits({"train": train_rows}, manifest, manifest["shards"])
    schema = schema_for(task_name, preset)
    model = TaskModel(task, build_encoder(SMALL_MODEL, schema), schema).train()
    steps, rate = STEPS_AND_RATES[task_name]
    optimiser = torch.optim.AdamW(param_groups(model, rate, weight_decay=0.01, text_lr_multiplier=2.0))
    losses = []
    for _ in range(steps):
        loss = task.loss(model(batch), batch)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("preset", ["image_only", "image_table_bbox"])
@pytest.mark.parametrize("task_name", TASKS)
def test_loss_falls_on_a_tiny_set(task_name, preset, four_cases, train_rows, manifest):
    batch = four_cases
    if task_name == "vqa":  # three questions per case: 12 examples, the cost of three batches of four
        batch = {**four_cases, "vqa": [items[:3] for items in four_cases["vqa"]]}
    losses = train(task_name, preset, batch, train_rows, manifest)
    assert all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < 0.8 * losses[0], f"{task_name} under {preset} did not learn: {losses}"
