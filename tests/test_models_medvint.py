"""The MedVInT-style VLM plug-in (``gx_ray.models.medvint``) on a tiny model built offline
(``gx_ray.models.tiny_vlms``): it meets the VLM protocol, each view adds its queries to the visual prefix and the
prefix is never a target, only the query decoder, the projections and the LoRA adapters train, a synthetic checkpoint
with a released MedVInT-TD checkpoint's names (PMC-VQA's ``QA_model``, its LLaMA wrapped by peft) loads onto it and
gives the outputs of the model it was made from, and it trains and answers every VLM task through the trial's module
(retrieval through its pooled states)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gx_ray.modalities import resolve_schema
from gx_ray.modalities.views import ViewsConfig
from gx_ray.models.medvint import LORA_ALPHA, MedVInTVLM
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


def _released(model: MedVInTVLM, rank: int = 2) -> dict[str, torch.Tensor]:
    """``model``'s weights as MedVInT-TD's ``QA_model`` names them in a released checkpoint: ``query_embed``,
    ``decoder``, ``fc_l1``/``fc_l2``, its LLaMA under ``llamacasual.base_model.model.`` (peft) with LoRA on the query
    and value projections (layer 0 in older peft's names, layer 1 in newer peft's ``base_layer``/``default``; the
    base weight less the factors' product, so that merged they are ``model``'s), an ``inv_freq`` buffer as older
    transformers saved it, and a PMC-CLIP ResNet-50 weight (``vision_model.0``). Not in it: ``image_embed`` and the
    CLIP vision encoder (MedVInT-TD has neither)."""
    generator, state = torch.Generator().manual_seed(3), {}
    for name, tensor in model.state_dict().items():
        if name.startswith("qformer_decoder."):
            state[f"decoder.{name.removeprefix('qformer_decoder.')}"] = tensor.clone()
        elif name.startswith("projection."):
            state[name.replace("projection.0.", "fc_l1.").replace("projection.2.", "fc_l2.")] = tensor.clone()
        elif name.startswith("language."):
            released = f"llamacasual.base_model.model.{name.removeprefix('language.')}"
            if not name.endswith(("q_proj.weight", "v_proj.weight")):
                state[released] = tensor.clone()
                continue
            down, up = (torch.randn(shape, generator=generator) for shape in ((rank, tensor.shape[1]),
                                                                             (tensor.shape[0], rank)))  # fmt: skip
            layer, new = released.removesuffix(".weight"), ".layers.1." in name
            state[f"{layer}.base_layer.weight" if new else released] = tensor - LORA_ALPHA / rank * up @ down
            state[f"{layer}.lora_A{'.default' if new else ''}.weight"] = down
            state[f"{layer}.lora_B{'.default' if new else ''}.weight"] = up
    state["query_embed.weight"] = model.qformer_query.detach().clone()
    state["llamacasual.base_model.model.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    state["vision_model.0.weight"] = torch.randn(32, 3, 3, 3, generator=generator)
    return state


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A tiny MedVInT's folder whose ``medvint.json`` names a synthetic released checkpoint (:func:`_released`), and
    the model (eval) whose weights it holds."""
    folder = tiny_medvint(tmp_path_factory.mktemp("medvint_td"))
    torch.manual_seed(1)
    source = MedVInTVLM.from_config(VLMConfig(name=str(folder), lora=False, plugin=PLUGIN), CPU).eval()
    torch.save(_released(source), folder / "medvint-td.bin")
    settings = json.loads((folder / "medvint.json").read_text(encoding="utf-8"))
    (folder / "medvint.json").write_text(json.dumps({**settings, "checkpoint": "medvint-td.bin"}), encoding="utf-8")
    return folder, source


def test_the_medvint_plugin_meets_the_protocol_and_reads_each_view_as_its_own_queries(vlm):
    from gx_ray.models.medvint import MedVInTVLM

    assert vlm_protocol_problems(MedVInTVLM) == [] and retrieval_problem(PLUGIN) is None
    queries = vlm.qformer_query.shape[0]
    for views in (1, 3):
        assert vlm._prefix(_views(2, views)).shape == (2, views * queries, vlm.projection[-1].out_features)
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


def test_a_released_medvint_td_checkpoint_loads_and_gives_the_outputs_of_the_model_it_was_made_from(released):
    """Every mapped weight (the LoRA pairs merged) is the source model's; with ``image_embed`` (not in MedVInT-TD)
    copied over, the loss on a fixed batch is the source's, and still with LoRA added after the checkpoint."""
    folder, source = released
    batch = (_views(2, 2), ["Is there a lesion?", "Which phase?"], ["yes", "venous"])
    for lora in (False, True):
        torch.manual_seed(2)  # other initial weights than the source's
        model = MedVInTVLM.from_config(VLMConfig(name=str(folder), lora=lora, lora_rank=2, plugin=PLUGIN), CPU)
        assert not torch.equal(model.image_embed.weight, source.image_embed.weight)
        model.image_embed.load_state_dict(source.image_embed.state_dict())
        if not lora:
            expected = source.state_dict()
            for name, tensor in model.state_dict().items():
                torch.testing.assert_close(tensor, expected[name], msg=name)
        with torch.no_grad():
            assert float(model.eval().loss(*batch)) == pytest.approx(float(source.loss(*batch)), rel=1e-5)


def test_a_checkpoint_whose_names_or_shapes_do_not_match_is_refused_naming_them(released):
    folder, source = released
    state = torch.load(folder / "medvint-td.bin", weights_only=True)
    with pytest.raises(ValueError, match=r"lacks \['qformer_decoder.extra'\]"):
        source.load_medvint({**state, "decoder.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"projection parameters it lacks \['projection.2.bias'\]"):
        source.load_medvint({k: v for k, v in state.items() if k != "fc_l2.bias"})
    with pytest.raises(ValueError, match=r"at another shape \['qformer_query \(32, 16\), here \(4, 16\)'\]"):
        source.load_medvint({**state, "query_embed.weight": torch.zeros(32, 16)})
    lone = "llamacasual.base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    with pytest.raises(ValueError, match=r"LoRA factors \['A'\] of .*layers.0.self_attn.q_proj lack"):
        source.load_medvint({k: v for k, v in state.items() if k != lone})
