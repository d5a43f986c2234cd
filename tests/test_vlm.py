"""Vision-language models with LoRA, on tiny randomly initialised models of two families (LLaVA, PaliGemma) built
offline from their configs (``tests/vlm_fixtures.py``): only the adapters train, the loss falls on a tiny overfit set,
and generated answers go through the scoring cascade to metrics."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from gx_ray.metrics.cascade import cascade_metrics, score_answer
from gx_ray.modalities.views import ViewRecipe, ct_images
from gx_ray.models.vlm import VLM_LORA, VisionLanguageModel

from .vlm_fixtures import FAMILIES

QUESTION = "Which gastric site holds the lesion? Options: A. cardia B. body C. antrum D. pylorus."


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_vlm(request, tmp_path_factory):
    return request.param, str(FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


def _images(n: int) -> list[list[np.ndarray]]:
    """CT views as a VLM is given them: the lesion's key slice through a view recipe, one image per case."""
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(n):
        hu = {"venous": rng.uniform(-200, 300, (12, 32, 32)).astype(np.float32)}
        images, _ = ct_images(hu, ViewRecipe(), [4, 8, 8, 8, 16, 16])
        cases.append(list(images))
    return cases


def test_only_the_lora_adapters_train_and_the_loss_falls_on_a_tiny_overfit_set(tiny_vlm):
    family, folder = tiny_vlm
    torch.manual_seed(0)
    every_projection = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = VisionLanguageModel(
        folder, replace(VLM_LORA, rank=4, alpha=8, dropout=0.0, target_modules=every_projection)
    )
    trainable = model.trainable()
    assert trainable and all("lora_" in name for name in trainable), family
    assert not any("vision" in name for name in trainable)  # the vision tower keeps its weights
    frozen = {n: p.detach().clone() for n, p in model.model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    images, answers = _images(4), ["A", "B", "C", "D"]
    optimiser = torch.optim.AdamW(trainable.values(), lr=3e-2)
    losses = []
    for _ in range(30):
        loss = model.loss(images, [QUESTION] * 4, answers)
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
        losses.append(loss.item())
    # the adapters alone move a random model's 30k-way output slowly: a clear, steady fall is what is asked
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3 and losses[-1] < losses[0], (family, losses)
    assert any(not torch.equal(before[n], p) for n, p in model.trainable().items())
    assert all(torch.equal(frozen[n], p) for n, p in model.model.named_parameters() if n in frozen)


def test_generated_answers_go_through_the_cascade_to_metrics(tiny_vlm):
    family, folder = tiny_vlm
    model = VisionLanguageModel(folder, replace(VLM_LORA, rank=4))
    answers = model.generate(_images(3), [QUESTION] * 3, max_new_tokens=4)
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    options = ["cardia", "body", "antrum", "pylorus"]
    scored = [score_answer("mcq", answer, "C", options=options) for answer in answers]
    metrics = cascade_metrics(scored)
    assert 0 <= metrics["accuracy"] <= 100 and 0 <= metrics["parse_failure_rate"] <= 100
    # a random model names no option: what it says counts as a parse failure, never as a right answer
    assert metrics["accuracy"] + metrics["parse_failure_rate"] <= 100


def test_the_vision_tower_and_the_language_model_open_when_asked(tiny_vlm):
    family, folder = tiny_vlm
    model = VisionLanguageModel(folder, lora=None, train_vision=True)
    names = list(model.trainable())
    assert names and all("vision" in n for n in names)
    language = VisionLanguageModel(folder, replace(VLM_LORA, rank=2), train_language=True).trainable()
    assert any("lora_" in n for n in language) and any("lora_" not in n and "vision" not in n for n in language)


def test_option_log_likelihoods_agree_with_the_loss_whatever_the_batch_and_give_an_auc(tiny_vlm):
    """Stage classification through a VLM: each option's log-likelihood as the answer; a batch scores as its cases
    do one by one (padding changes nothing), each score is minus the answer's summed cross-entropy, and the softmax over
    the options gives probabilities an AUC can be computed from."""
    from gx_ray.metrics.classification import classification_metrics

    family, folder = tiny_vlm
    model = VisionLanguageModel(folder, replace(VLM_LORA, rank=2)).eval()
    stages = ["stage I", "stage II", "stage III", "stage IV"]
    images = _images(4)
    questions = [f"What is the stage? {'(contrast-enhanced)' * i}" for i in range(4)]  # prompts of four lengths
    scores = model.option_scores(images, questions, [stages] * 4)
    assert scores.shape == (4, 4) and torch.isfinite(scores).all() and (scores < 0).all()
    for i in range(4):
        alone = model.option_scores(images[i : i + 1], questions[i : i + 1], [stages])
        torch.testing.assert_close(alone[0], scores[i], atol=1e-4, rtol=1e-4)
        _, labels = model._taught(images[i : i + 1], questions[i : i + 1], [stages[2]])
        with torch.no_grad():
            loss = model.loss(images[i : i + 1], questions[i : i + 1], [stages[2]])
        taught = int((labels[:, 1:] != -100).sum())
        assert scores[i, 2].item() == pytest.approx(-loss.item() * taught, rel=1e-4)
    probabilities = scores.softmax(1).numpy()
    metrics = classification_metrics(probabilities, np.array([0, 1, 2, 3]))
    assert 0 <= metrics["auc"] <= 100


def test_gradient_checkpointing_still_trains_the_adapters_of_a_frozen_model(tiny_vlm):
    """With every base weight frozen, checkpointed blocks get inputs that carry no grad: the adapters must still get
    gradients, the same as without checkpointing (the recomputed forward is the same forward)."""
    family, folder = tiny_vlm
    gradients = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = VisionLanguageModel(
            folder, replace(VLM_LORA, rank=2, dropout=0.0), gradient_checkpointing=checkpointing
        ).train()
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.model.modules()) == checkpointing
        model.loss(_images(2), [QUESTION] * 2, ["A", "B"]).backward()
        gradients.append({n: p.grad for n, p in model.trainable().items()})
    # every adapter gets a gradient (lora_A's is zero at the start: lora_B starts at zero; lora_B's is not)
    assert gradients[1] and all(g is not None for g in gradients[1].values()), family
    assert all(g.abs().sum() > 0 for n, g in gradients[1].items() if "lora_B" in n), family
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, atol=1e-5, rtol=1e-4)


def test_a_batch_of_prompts_of_unequal_length_is_answered_as_each_prompt_alone(tiny_vlm):
    """Generation pads on the left: each answer starts where its own prompt ends (right padding would have the
    shorter prompts continue from padding)."""
    family, folder = tiny_vlm
    model = VisionLanguageModel(folder, replace(VLM_LORA, rank=2)).eval()
    images = _images(3)
    questions = [f"What is the stage? {'(contrast-enhanced) ' * 3 * i}" for i in range(3)]
    together = model.generate(images, questions, max_new_tokens=4)
    alone = [model.generate(images[i : i + 1], questions[i : i + 1], max_new_tokens=4)[0] for i in range(3)]
    assert together == alone, family
