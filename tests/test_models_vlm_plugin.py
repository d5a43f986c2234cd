"""Vision-language models whose code is not in transformers: a ``vlm.plugin`` resolved from a ``module:Class``
reference or an entry point of the group ``gx_ray.models.vlm`` (the loader tasks use), checked against the VLM protocol
with one error naming everything missing, and run through the trial's module on the three VLM tasks
(tests/plugins/prefix_vlm.py)."""

from __future__ import annotations

import pytest
import torch

from gx_ray.modalities import resolve_schema
from gx_ray.modalities.views import ViewsConfig
from gx_ray.models.vlm import VisionLanguageModel, VLMConfig, VLMPluginError, vlm_class, vlm_protocol_problems
from gx_ray.train.config import TrialConfig
from tests.plugins.prefix_vlm import PrefixVLM

from .vlm_fixtures import scored, vlm_batch

REFERENCE = "tests.plugins.prefix_vlm:PrefixVLM"


class NoTokenizer(torch.nn.Module):
    def from_config(self, config, device):  # not a classmethod, and without views
        return self

    def loss(self, images, questions, answers):
        return torch.zeros(())


def test_a_vlm_plugin_resolves_from_its_reference_or_entry_point_and_transformers_is_the_default(tmp_path, monkeypatch):
    assert vlm_class("") is VisionLanguageModel and vlm_protocol_problems(VisionLanguageModel) == []
    assert vlm_class(REFERENCE) is PrefixVLM
    info = tmp_path / "gx_vlm_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gx-vlm-example\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[gx_ray.models.vlm]\nprefix = {REFERENCE}\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert vlm_class("prefix") is PrefixVLM
    with pytest.raises(VLMPluginError, match="vlm.plugin 'flamingo' is neither 'module:Class' nor the name of an "
                                             "entry point of group 'gx_ray.models.vlm'"):  # fmt: skip
        vlm_class("flamingo")
    flat = {"model.family": "vlm", "vlm.name": "weights/here", "task": "vqa", "vlm.plugin": REFERENCE}
    assert TrialConfig.from_flat(flat).to_flat()["vlm.plugin"] == REFERENCE


def test_a_class_that_lacks_the_protocol_is_refused_with_one_error_naming_all_it_lacks():
    with pytest.raises(VLMPluginError) as info:
        vlm_class(f"{__name__}:NoTokenizer")
    said = str(info.value)
    assert said.startswith(f"vlm.plugin '{__name__}:NoTokenizer' does not implement the gx_ray VLM protocol")
    for lack in ("classmethod from_config(config, device, views)", "property tokenizer",
                 "missing methods generate, option_scores, trainable"):  # fmt: skip
        assert lack in said, said
    assert vlm_protocol_problems(int) == ["int is not a subclass of torch.nn.Module"]
    with pytest.raises(VLMPluginError, match="module 'no_such_module' does not import"):
        vlm_class("no_such_module:Model")
    with pytest.raises(ValueError, match="vlm.plugin 'tests.plugins.prefix_vlm:Nothing'.* has no 'Nothing'"):
        TrialConfig.from_flat({"model.family": "vlm", "vlm.name": "x", "task": "vqa",
                               "vlm.plugin": "tests.plugins.prefix_vlm:Nothing"})  # fmt: skip


def test_a_plugin_vlm_trains_and_answers_every_vlm_task_through_the_trials_module():
    """As a trial builds it (:func:`gx_ray.train.build.build_vlm_trial`): the plug-in's class from the config, its
    views from the recipe; a training step moves only what the plug-in trains, the state kept is exactly that, and
    the answers are scored by each task's own metric."""
    from gx_ray.tasks import build_task
    from gx_ray.tasks.vlm import VisionLanguageTask, VisionLanguageTaskModel

    schema = resolve_schema("image_table_bbox")
    recipe = ViewsConfig().recipe(schema)
    config = VLMConfig(name="random", plugin=REFERENCE, max_new_tokens=3)
    vlm = vlm_class(config.plugin).from_config(config, torch.device("cpu"), recipe.images_per_case)
    for task_name, metric_name in (("vqa", "accuracy"), ("report_generation", "rouge_l"),
                                   ("stage_classification", "option_accuracy")):  # fmt: skip
        options = {"max_new_tokens": 4, "max_report_tokens": 8} if task_name == "report_generation" else {}
        task = VisionLanguageTask(build_task(task_name, **options), config.max_new_tokens)
        model = VisionLanguageTaskModel(task, vlm, recipe, schema).train()
        assert set(model.state_dict()) == {"vlm.projector.weight", "vlm.projector.bias"}
        model(vlm_batch())["loss"].backward()
        assert vlm.projector.weight.grad.abs().sum() > 0, task_name
        vlm.zero_grad()
        assert 0 <= scored(model, task)[metric_name] <= 100, task_name
