"""The Gastric-X paper's vision-language models whose architectures transformers has (LLaVA-1.5, LLaVA-Med v1.5,
BLIP-2 with OPT and with Flan-T5), as tiny random models built offline (``tests/vlm_fixtures.py``): loaded, LoRA on
their language model's own query and value projections, the paper's multi-channel adaptation (every phase's slices as
one image), a training step, generation and scoring on the three tasks a VLM answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gx_ray.modalities import resolve_schema
from gx_ray.modalities.views import ViewsConfig
from gx_ray.models.vlm import VisionLanguageModel, VLMConfig

from .vlm_fixtures import PAPER_MODELS, vlm_batch

STACKED = {"llava_1_5": True, "blip2_opt": True, "blip2_flan_t5": True, "llava_med": False}
"""The paper's adaptation per model where it is built: slices of all phases as one multi-channel image for LLaVA-1.5
and BLIP-2; LLaVA-Med's (a 3D Swin vision tower) is not, so it reads each view as its own image."""
TARGETS = {"llava_1_5": ("q_proj", "v_proj"), "llava_med": ("q_proj", "v_proj"), "blip2_opt": ("q_proj", "v_proj"),
           "blip2_flan_t5": ("q", "v")}  # fmt: skip
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {name: str(build(tmp_path_factory.mktemp(name))) for name, build in PAPER_MODELS.items()}


def _images(n: int, views: int = 1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [[rng.random((3, 32, 32)).astype(np.float32) for _ in range(views)] for _ in range(n)]


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
def test_each_paper_model_trains_its_language_models_own_projections_and_answers(folders, name):
    """LoRA lands on the family's q/v (T5's ``q``/``v``, in its encoder and decoder), nowhere in the vision tower or
    BLIP-2's Q-Former; a few steps lower the loss of two answers; each answer's option score is minus its summed
    cross-entropy (the labels aligned right for a decoder-only and an encoder-decoder model alike); generation
    returns the answer alone."""
    torch.manual_seed(0)
    model = VisionLanguageModel.from_config(VLMConfig(name=folders[name], lora_rank=4, lora_dropout=0.0), CPU)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in model.trainable()}
    assert adapted == set(TARGETS[name]) and all("lora_" in n for n in model.trainable())
    assert not any(part in n for n in model.trainable() for part in ("vision", "qformer"))
    images, questions, answers = _images(2), ["Is there a lesion?", "Which stage?"], ["yes", "stage II"]
    optimiser = torch.optim.AdamW(model.trainable().values(), lr=5e-2)
    losses = []
    for _ in range(6):
        loss = model.loss(images, questions, answers)
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    model.eval()
    scores = model.option_scores(images[:1], questions[:1], [["yes", "no"]])
    _, labels = model._taught(images[:1], questions[:1], ["yes"])
    taught = int((labels != -100).sum()) - (0 if model.seq2seq else int(labels[0, 0] != -100))
    with torch.no_grad():
        loss = model.loss(images[:1], questions[:1], ["yes"]).item()
    assert scores[0, 0].item() == pytest.approx(-loss * taught, rel=1e-4)
    generated = model.generate(images, questions, max_new_tokens=3)
    assert len(generated) == 2 and all(isinstance(g, str) for g in generated)
    assert not any("Question" in g or "USER" in g or "[INST]" in g for g in generated)  # no prompt echoed


@pytest.mark.parametrize("name", ["llava_1_5", "blip2_flan_t5"])
def test_stacked_views_embed_copies_of_a_view_as_that_view_and_train_the_widened_embedding(folders, name):
    """The paper's LLaVA-1.5/BLIP-2 adaptation: a question's four views as one 12-channel image. Four copies of one
    view score exactly as the view alone did through the pretrained RGB embedding; the widened embedding trains."""
    single = VisionLanguageModel.from_config(VLMConfig(name=folders[name], lora_rank=2), CPU).eval()
    stacked = VisionLanguageModel.from_config(VLMConfig(name=folders[name], lora_rank=2, stack_views=True), CPU, 4)
    widened = [p for n, p in stacked.trainable().items() if "patch_embedding.weight" in n]
    assert len(widened) == 1 and widened[0].shape[1] == 12
    images, questions = _images(2), ["Is there a lesion?", "Which stage?"]
    alone = single.option_scores(images, questions, [["yes", "no"]] * 2)
    copies = stacked.eval().option_scores([case * 4 for case in images], questions, [["yes", "no"]] * 2)
    torch.testing.assert_close(copies, alone, rtol=1e-4, atol=1e-4)
    stacked.train().loss(_images(2, views=4), questions, ["yes", "no"]).backward()
    assert widened[0].grad is not None and widened[0].grad.abs().sum() > 0
    with pytest.raises(ValueError, match="reads 4 views a question, the batch gives \\[3\\]"):
        stacked.loss(_images(2, views=3), questions, ["yes", "no"])


def test_a_recipe_tells_how_many_views_a_case_becomes():
    """What the widened embedding is built for before any batch: the count :func:`case_views` then makes."""
    from gx_ray.tasks.vlm import case_views

    schema = resolve_schema("image_table_bbox")
    three = resolve_schema({**schema.describe(), "phases": ["arterial", "venous", "delayed"]})
    for views, on in ((ViewsConfig(), schema), (ViewsConfig(slices=3), schema), (ViewsConfig(slices=3, mode="mip"),
                      schema), (ViewsConfig(slices=3, phase_layout="channels"), three)):  # fmt: skip
        recipe = views.recipe(on)
        images, _ = case_views(vlm_batch(), recipe, on)
        assert [len(case) for case in images] == [recipe.images_per_case] * 2, views
    assert ViewsConfig(slices=3).recipe(schema).images_per_case == 12


def test_blip2_given_several_views_without_stacking_is_refused_naming_the_keys(folders):
    with pytest.raises(ValueError, match="reads one image per question.*vlm.stack_views: true"):
        VisionLanguageModel.from_config(VLMConfig(name=folders["blip2_opt"]), CPU, 12)


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
def test_each_paper_model_runs_vqa_reports_and_stage_classification_through_the_task_model(folders, name):
    """The trial's module on a batch of two cases, every phase's key slice (stacked as one 12-channel image where
    the paper stacks): a training step's loss and gradient, then the answers scored by each task's own metric."""
    from gx_ray.tasks import build_task
    from gx_ray.tasks.vlm import VisionLanguageTask, VisionLanguageTaskModel

    schema = resolve_schema("image_table_bbox")
    recipe = ViewsConfig().recipe(schema)
    config = VLMConfig(name=folders[name], lora_rank=2, stack_views=STACKED[name], max_new_tokens=3)
    vlm = VisionLanguageModel.from_config(config, CPU, recipe.images_per_case)
    for task_name, metric_name in (("vqa", "accuracy"), ("report_generation", "rouge_l"),
                                   ("stage_classification", "option_accuracy")):  # fmt: skip
        options = {"max_new_tokens": 4, "max_report_tokens": 8} if task_name == "report_generation" else {}
        task = VisionLanguageTask(build_task(task_name, **options), config.max_new_tokens)
        model = VisionLanguageTaskModel(task, vlm, recipe, schema).train()
        model(vlm_batch())["loss"].backward()
        assert all(p.grad is not None for p in vlm.trainable().values()), (name, task_name)
        vlm.model.zero_grad()
        metric = task.metric()
        with torch.no_grad():
            outputs = model.eval()(vlm_batch())
        metric.update(outputs, vlm_batch())
        result = metric.compute()
        assert 0 <= result[metric_name] <= 100, (name, task_name, result)
        assert len(task.predict(outputs, vlm_batch())) == 2
