"""A trial's parts, built from its config: the task (fitted on the training rows), the model on its device, and the
loss under the trial's autocast. The training loop and the memory probe build the very same parts."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from gx_ray.data.shards import TensorLayout, read_manifest
from gx_ray.data.stream import split_rows
from gx_ray.models.registry import build_encoder
from gx_ray.models.text import choose_attention_backends
from gx_ray.tasks import Task, TaskModel, build_task
from gx_ray.train.config import TrialConfig


def autocast(config: TrialConfig, device: torch.device) -> AbstractContextManager:
    """bf16 autocast where the config asks for it (``amp: auto``: on a GPU), else nothing."""
    use_bf16 = config.amp == "bf16" or (config.amp == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


def build_trial(
    config: TrialConfig, device: torch.device, train_rows: list[dict] | None = None
) -> tuple[Any, TaskModel, TensorLayout]:
    """The trial's task (fitted on the training split: ``train_rows``, read here when not given) and model."""
    manifest = read_manifest(config.data.shards)
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    task = build_task(config.task, **config.task_options)
    data = config.data
    train_rows = (
        split_rows(data.shards, "train", data.folds_file, data.fold, data.refit) if train_rows is None else train_rows
    )
    task.prepare(train_rows)  # training split only
    if type(task).attach_splits is not Task.attach_splits:  # only a task that asks reads the other splits
        splits = {"train": train_rows, **{s: split_rows(config.data.shards, s) for s in ("val", "test")}}
        task.attach_splits(splits, manifest, str(config.data.shards))
    if device.type == "cuda":
        choose_attention_backends()
    if config.model.family == "vlm":
        return (*build_vlm_trial(config, task, device), layout)
    model = TaskModel(task, build_encoder(config.model, config.schema), config.schema).to(device)
    return task, model, layout


def build_vlm_trial(config: TrialConfig, task: Task, device: torch.device) -> tuple[Any, torch.nn.Module]:
    """``model.family: vlm``: the task asked of a vision-language model in words (:mod:`gx_ray.tasks.vlm`); the loop
    trains, evaluates, logs and checkpoints it as any task model."""
    from gx_ray.models.vlm import vlm_class  # transformers and peft load only for a VLM trial
    from gx_ray.tasks.vlm import VisionLanguageTask, VisionLanguageTaskModel

    asked = VisionLanguageTask(task, config.vlm.max_new_tokens)
    recipe = config.views.recipe(config.schema)
    vlm = vlm_class(config.vlm.plugin).from_config(config.vlm, device, recipe.images_per_case)
    return asked, VisionLanguageTaskModel(asked, vlm, recipe, config.schema)


def loss_function(task: Any, config: TrialConfig, device: torch.device) -> Callable[[torch.nn.Module, dict], Any]:
    def loss_of(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        with autocast(config, device):
            return task.loss(model(batch), batch)

    return loss_of
