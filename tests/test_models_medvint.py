"""The MedVInT-style VLM plug-in (``gx_ray.models.medvint``) on a tiny model built offline
(``gx_ray.models.tiny_vlms``): it meets the VLM protocol, each view adds its queries to the visual prefix and the
prefix is never a target, only the query decoder, the projections and the LoRA adapters train, and it trains and
answers every VLM task through the trial's module (retrieval through its pooled states)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gx_ray.modalities import resolve_schema
from gx_ray.modalities.views import ViewsConfig
from gx_ray.models.tiny_vlms import tiny_medvint
from gx_ray.models.vlm import VLMConfig, retrieval_problem, vlm_class, vlm_protocol_problems

from .vlm_fixtures import scored, trained_losses

CPU = torch.device("cpu")
PLUGIN = "gx_ray.models.medvint:MedVInTVLM"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    config = VLMConfig(name=str(tiny_medvint(tmp_path_factory.mktemp("medvint"))), plugin=PLUGIN, lora_rank=2)
    torch.manual_seed(0)
    return vlm_class(PLUGIN).from_config(config, CPU, 4)


def _views(n: int, views: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [[rng.random((3, 32, 32)).astype(np.float32) for _ in range(views)] for _ in range(n)]


def test_the_medvint_plugin_meets_the_protocol_and_reads_each_view_as_its_own_queries(vlm):
    from gx_ray.models.medvint import MedVInTVLM

    assert vlm_protocol_problems(MedVInTVLM) == [] and retrieval_problem(PLUGIN) is None
    queries = vlm.qformer_query.shape[0]
    for views in (1, 3):
        assert vlm._prefix(_views(2, views)).shape == (2, views * queries, vlm.projection.out_features)
    trained = set(vlm.trainable())
    assert any("lora_" in n for n in trained) and any(n.startswith("qformer_decoder.") for n in trained)
    assert all(n.startswith(("qformer_", "image_embed.", "projection.")) or "lora_" in n for n in trained)
    # the answer alone is taught: the same question with another answer changes the loss, another prefix too
    images = _views(1, 2)
    flipped = [[1 - view for view in images[0]]]
    with torch.no_grad():
        yes, no = (float(vlm.loss(images, ["Is there a lesion?"], [a])) for a in ("yes", "no"))
        other = float(vlm.loss(flipped, ["Is there a lesion?"], ["yes"]))
    assert yes != no and yes != other


def test_the_medvint_plugin_trains_and_answers_every_vlm_task_through_the_trials_module(vlm):
    """Every phase's key slice, each its own queries in the prefix: a step trains the query decoder and the LoRA
    adapters (nothing of the vision encoder or the base language model); the answers are scored by each task's own
    metric; retrieval's head reads its pooled prefix and report states."""
    from gx_ray.tasks import build_task
    from gx_ray.tasks.vlm import VisionLanguageTask, VisionLanguageTaskModel

    schema = resolve_schema("image_table_bbox")
    recipe = ViewsConfig().recipe(schema)
    frozen = {n: p.detach().clone() for n, p in vlm.named_parameters() if not p.requires_grad}
    for task_name, metric_name in (("vqa", "accuracy"), ("report_generation", "rouge_l"),
                                   ("stage_classification", "option_accuracy"),
                                   ("retrieval", "image_to_text_recall_at_1")):  # fmt: skip
        options = {"max_new_tokens": 3, "max_report_tokens": 8} if task_name == "report_generation" else {}
        task = VisionLanguageTask(build_task(task_name, **options), 3)
        model = VisionLanguageTaskModel(task, vlm, recipe, schema).train()
        losses = trained_losses(task, model, 4, 1e-3 if task_name == "retrieval" else 1e-2)
        assert losses[-1] < losses[0], (task_name, losses)
        assert 0 <= scored(model, task)[metric_name] <= 100, task_name
    assert all(torch.equal(p, frozen[n]) for n, p in vlm.named_parameters() if n in frozen)
