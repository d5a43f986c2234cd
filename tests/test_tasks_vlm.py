"""Every task for every VLM (#49): retrieval through retrieval's own head, loss and metric on a VLM's pooled image and
report states, and lesion detection as a box written in words, parsed and scored by lesion detection's own metric;
on the paper's tiny transformers models and through the plug-in protocol (the Flamingo-style plug-in)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gx_ray.metrics import detection_metrics, retrieval_metrics
from gx_ray.modalities import resolve_schema
from gx_ray.modalities.boxes import tumour_boxes
from gx_ray.modalities.views import ViewRecipe, ViewsConfig, box_text, ct_images, parse_box_text
from gx_ray.models.vlm import VLMConfig, VLMPluginError, vlm_class
from gx_ray.tasks import build_task
from gx_ray.tasks.lesion_detection import DetectionMetric
from gx_ray.tasks.retrieval import RetrievalMetric
from gx_ray.tasks.vlm import Item, VisionLanguageTask, VisionLanguageTaskModel, detections
from gx_ray.train.config import TrialConfig

from .vlm_fixtures import PAPER_MODELS, tiny_flamingo, trained_losses, vlm_batch

FLAMINGO = "gx_ray.models.flamingo:FlamingoVLM"
MODELS = ("llava_1_5", "blip2_flan_t5", "flamingo")
"""A decoder-only and an encoder-decoder paper model (each with its views stacked as one image), and a plug-in (each
view an image of its interleaved sequence)."""
LR = {"retrieval": {"flamingo": 1e-3}, "lesion_detection": {"flamingo": 1e-2}}
"""Learning rates other than the default: the plug-in trains its resampler and gated blocks whole besides LoRA (its
two cases' resampled latents differ little: larger steps overshoot)."""
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, VLMConfig]:
    built = {
        name: VLMConfig(name=str(PAPER_MODELS[name](tmp_path_factory.mktemp(name))), lora_rank=2, stack_views=True,
                        max_new_tokens=24)
        for name in MODELS[:2]
    }  # fmt: skip
    flamingo = tiny_flamingo(tmp_path_factory.mktemp("flamingo"))
    return {**built, "flamingo": VLMConfig(name=str(flamingo), lora_rank=2, plugin=FLAMINGO, max_new_tokens=12)}


def _model(config: VLMConfig, task_name: str, schema_name: str) -> tuple[VisionLanguageTask, VisionLanguageTaskModel]:
    schema = resolve_schema(schema_name)
    recipe = ViewsConfig().recipe(schema)
    torch.manual_seed(0)
    vlm = vlm_class(config.plugin).from_config(config, CPU, recipe.images_per_case)
    task = VisionLanguageTask(build_task(task_name), config.max_new_tokens)
    return task, VisionLanguageTaskModel(task, vlm, recipe, schema)


def test_a_box_in_words_reads_back_as_the_box_and_is_scored_by_lesion_detections_metric():
    """The answer's form is the box prompt's; the written box read back is the case's one detection, scored by the
    encoder path's metric (AP at 3D IoU): the right box is found, an answer without a box is no detection."""
    box = np.array([2, 8, 8, 5, 16, 16])
    assert box_text(box) == "slices 2-4, rows 8-15, columns 8-15"
    np.testing.assert_array_equal(parse_box_text(f"Answer: {box_text(box).upper()}."), box)
    assert parse_box_text("the lesion is in the antrum") is None
    assert parse_box_text("slices 4-2, rows 8-15, columns 8-15") is None  # inverted: no box
    hu = {"venous": np.zeros((12, 32, 32))}
    _, prompt = ct_images(hu, ViewRecipe(boxes="prompt"), box, box)
    assert box_text(box) in prompt and "12 x 32 x 32 (slices x rows x columns)" in prompt
    items = [Item(0, "", ""), Item(2, "", "")]
    found = detections(items, [f"{box_text(box)}", "I cannot tell"], [0.9, 0.8], 3)
    assert [len(d["boxes"]) for d in found] == [1, 0, 0] and found[0]["scores"].tolist() == [0.9]
    task = VisionLanguageTask(build_task("lesion_detection"))
    metric = task.metric()
    assert isinstance(metric, DetectionMetric)
    batch = vlm_batch()
    metric.update({"detections": found[:2]}, batch)
    assert metric.compute()["ap_50"] == pytest.approx(100.0)  # case a's box found; case b has none to find


@pytest.mark.parametrize("name", MODELS)
def test_retrieval_trains_a_head_on_the_models_pooled_states_scored_as_the_encoder_paths(configs, name):
    """The refusal is gone; InfoNCE on two cases' views and reports falls as the head (and what the model trains)
    learns; the head is in the trial's state; the metric is retrieval's own, recall@k both ways."""
    TrialConfig.from_flat({"model.family": "vlm", "vlm.name": "some/vlm", "task": "retrieval"})
    task, model = _model(configs[name], "retrieval", "image_table_bbox")
    assert {"head.image.weight", "head.text.weight", "head.logit_scale"} <= set(model.state_dict())
    losses = trained_losses(task, model, 6, LR["retrieval"].get(name, 2e-2))
    assert losses[-1] < losses[0] - 0.05, losses
    metric = task.metric()
    assert isinstance(metric, RetrievalMetric)
    with torch.no_grad():
        outputs = model.eval()(vlm_batch())
    metric.update(outputs, vlm_batch())
    similarity = (outputs["image"] @ outputs["text"].T).double().numpy()
    expected = {f"image_to_text_{k}": v for k, v in retrieval_metrics(similarity).items()}
    assert {k: v for k, v in metric.compute().items() if k.startswith("image_to_text")} == pytest.approx(expected)
    assert [r["case_id"] for r in task.predict(outputs, vlm_batch())] == ["a", "b"]


@pytest.mark.parametrize("name", ["llava_1_5", "flamingo"])  # BLIP-2 Flan-T5's generation: tests/test_models_vlm.py
def test_lesion_detection_teaches_the_box_in_words_and_scores_what_is_written(configs, name):
    """The refusal is gone; the written box's cross-entropy falls; in evaluation every case has its detections
    (none for the case without a tumour box), scored by lesion detection's metric exactly as the encoder's are."""
    TrialConfig.from_flat({"model.family": "vlm", "vlm.name": "some/vlm", "task": "lesion_detection"})
    task, model = _model(configs[name], "lesion_detection", "image_only")
    asked = task.items(vlm_batch(), training=True)
    assert [(item.case, item.answer) for item in asked] == [(0, "slices 2-4, rows 8-15, columns 8-15")]
    losses = trained_losses(task, model, 5, LR["lesion_detection"].get(name, 5e-2))
    assert losses[-1] < losses[0] - 0.5, losses
    with torch.no_grad():
        outputs = model.eval()(vlm_batch())
    assert len(outputs["detections"]) == 2 and len(outputs["detections"][1]["boxes"]) == 0
    metric = task.metric()
    metric.update(outputs, vlm_batch())
    boxes, _ = tumour_boxes(vlm_batch()["boxes"], vlm_batch()["box_present"])
    assert metric.compute() == pytest.approx(detection_metrics(outputs["detections"][:1], [{"boxes": boxes[:1]}]))
    assert task.predict(outputs, vlm_batch())[0]["target"] == [2, 8, 8, 5, 16, 16]


def test_a_plugin_without_pooled_states_is_refused_retrieval_naming_the_method():
    """The protocol's one optional method: a plug-in without it (the tests' prefix VLM) is refused retrieval as the
    config is read, and still asked lesion detection (a box in words needs nothing more)."""
    prefix = {"model.family": "vlm", "vlm.name": "some/vlm", "vlm.plugin": "tests.plugins.prefix_vlm:PrefixVLM"}
    with pytest.raises(VLMPluginError, match=r"has no method pooled\(images, texts\).*task retrieval"):
        TrialConfig.from_flat({**prefix, "task": "retrieval"})
    TrialConfig.from_flat({**prefix, "task": "lesion_detection"})


def test_the_reports_rescoring_of_written_answers_is_the_trials_own_metric():
    """A VLM's answers are judged by the cascade ("Yes." is "yes"; "The answer is T3" is T3): each VQA prediction
    record carries that verdict, so the report's per-patient scorer (which its intervals and tests resample) gives the
    accuracy the trial logged, on 200 random batches, where matching the written text exactly gave 0 for 0.2."""
    from gx_ray.analysis.cases import case_scorer

    rng = np.random.default_rng(0)
    task = VisionLanguageTask(build_task("vqa"))
    answers = {"yes": ["yes", "Yes.", "no", "It is yes"], "no": ["no", "No", "yes"], "T3": ["T3", "t3.", "T2", "x"]}
    for _ in range(200):
        cases = [f"GXD{c:05d}" for c in range(int(rng.integers(1, 6)))]
        items, generated = [], []
        for case in range(len(cases)):
            for _ in range(int(rng.integers(1, 4))):
                target = str(rng.choice(list(answers)))
                category = "staging" if target == "T3" else "yes_no"
                items.append(Item(case, "?", target, f"Is it {target}?", category))
                generated.append(str(rng.choice(answers[target])))
        outputs, batch = {"items": items, "generated": generated}, {"case_id": cases}
        metric = task.metric()
        metric.update(outputs, batch)
        logged = metric.compute()["accuracy"]
        scorer = case_scorer("vqa", task.predict(outputs, batch), "accuracy")
        assert scorer.score(np.arange(len(scorer.case_ids))) == pytest.approx(logged)
