"""LLaVA-Med v1.5 with the paper's 3D Swin in place of its vision encoder (``gx_ray.models.swin_vlm``), on a tiny model
built offline (``gx_ray.models.tiny_vlms``): a case's views stacked back into its volume, the Swin's stage tokens as
the prefix, what trains under ``vlm.train_vision``, SwinUNETR-format weights read and a partial checkpoint refused,
views that are not whole phases refused naming the keys, and every VLM task through the trial's module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gx_ray.modalities import resolve_schema
from gx_ray.modalities.views import ViewsConfig
from gx_ray.models.swin_vlm import Swin3dVLM
from gx_ray.models.tiny_vlms import tiny_llava_med_3d
from gx_ray.models.vlm import VLMConfig, retrieval_problem, vlm_class, vlm_protocol_problems

from .vlm_fixtures import scored, trained_losses

CPU = torch.device("cpu")
PLUGIN = "gx_ray.models.swin_vlm:Swin3dVLM"
LR = {"vqa": 1e-2, "stage_classification": 1e-2, "retrieval": 1e-3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llava_med_3d(tmp_path_factory.mktemp("llava_med_3d"))


def _model(folder, views: int = 8, train_vision: bool = True) -> Swin3dVLM:
    torch.manual_seed(0)
    config = VLMConfig(name=str(folder), plugin=PLUGIN, lora_rank=2, train_vision=train_vision)
    return vlm_class(PLUGIN).from_config(config, CPU, views)


def _views(n: int, views: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.random((3, 24, 24)).astype(np.float32) for _ in range(views)] for _ in range(n)]


def test_the_views_become_one_volume_whose_swin_tokens_are_the_prefix(folder):
    model = _model(folder)
    assert vlm_protocol_problems(Swin3dVLM) == [] and retrieval_problem(PLUGIN) is None
    # 32³ through patch 2 and three merges: the second-deepest stage is 2 x 2 x 2 tokens, at the language's width
    assert model._prefix(_views(2, 8)).shape == (2, 8, model.language.config.hidden_size)
    # the volume, not the views one by one: changing one slice of one phase changes every token of the prefix
    views = _views(1, 8)
    changed = [[v.copy() for v in views[0]]]
    changed[0][5][:] = 1.0
    with torch.no_grad():
        before, after = model._prefix(views), model._prefix(changed)
    assert not torch.allclose(before, after)
    with pytest.raises(ValueError, match="views.phase_layout: images"):
        _model(folder, views=6)  # not four phases of one slab each


def test_train_vision_opens_the_swin_and_swinunetr_weights_load_onto_it(folder):
    frozen, trained = _model(folder, train_vision=False), _model(folder)
    assert not any(n.startswith("vision.") for n in frozen.trainable())
    assert any(n.startswith("vision.") for n in trained.trainable())
    assert all(n.startswith(("vision.", "projector.")) or "lora_" in n for n in trained.trainable())
    released = {f"swinViT.{k}": torch.randn_like(v) if v.is_floating_point() else v.clone()
                for k, v in trained.vision.backbone.state_dict().items()}  # fmt: skip
    released["decoder1.conv.weight"] = torch.zeros(3)  # SwinUNETR's decoder: not the Swin's
    frozen.load_swin(released)
    for key, value in frozen.vision.backbone.state_dict().items():
        assert torch.equal(value, released[f"swinViT.{key}"]), key
    partial = dict(list(released.items())[:3])
    with pytest.raises(ValueError, match="parameters it lacks"):
        frozen.load_swin(partial)


def test_the_3d_swin_llava_med_trains_and_answers_every_vlm_task_through_the_trials_module(folder):
    """Every phase's two middle slices stacked back into a slab: the Swin, the projector and the LoRA adapters train
    (the base language model does not), and each task's own metric scores the answers."""
    from gx_ray.tasks import build_task
    from gx_ray.tasks.vlm import VisionLanguageTask, VisionLanguageTaskModel

    schema = resolve_schema("image_table_bbox")
    recipe = ViewsConfig(slices=2).recipe(schema)
    vlm = _model(folder, views=recipe.images_per_case)
    frozen = {n: p.detach().clone() for n, p in vlm.named_parameters() if not p.requires_grad}
    for task_name, metric_name in (("vqa", "accuracy"), ("stage_classification", "option_accuracy"),
                                   ("retrieval", "image_to_text_recall_at_1")):  # fmt: skip
        task = VisionLanguageTask(build_task(task_name), 3)
        model = VisionLanguageTaskModel(task, vlm, recipe, schema).train()
        losses = trained_losses(task, model, 4, LR[task_name])
        assert losses[-1] < losses[0], (task_name, losses)
        assert 0 <= scored(model, task)[metric_name] <= 100, task_name
    assert all(torch.equal(p, frozen[n]) for n, p in vlm.named_parameters() if n in frozen)
