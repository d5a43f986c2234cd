"""The Flamingo-style VLM plug-in (``gx_ray.models.flamingo``) on a tiny model built offline
(``tests/vlm_fixtures.py``): its parameters carry OpenFlamingo's names, a synthetic checkpoint with a released
checkpoint's names loads onto them, the closed gates leave the language model as it was and an open one conditions only
the text after an image, and it trains and answers the three VLM tasks through the trial's module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gx_ray.modalities import resolve_schema
from gx_ray.modalities.views import ViewsConfig
from gx_ray.models.flamingo import FlamingoVLM
from gx_ray.models.vlm import VLMConfig, vlm_class

from .vlm_fixtures import scored, tiny_flamingo, vlm_batch

CPU = torch.device("cpu")
PLUGIN = "gx_ray.models.flamingo:FlamingoVLM"
PERCEIVER = {  # OpenFlamingo's resampler of depth 1 (open_flamingo/src/helpers.py)
    "perceiver.latents", "perceiver.norm.weight", "perceiver.norm.bias",
    *(f"perceiver.layers.0.0.{n}" for n in ("norm_media.weight", "norm_media.bias", "norm_latents.weight",
                                            "norm_latents.bias", "to_q.weight", "to_kv.weight", "to_out.weight")),
    *(f"perceiver.layers.0.1.{n}" for n in ("0.weight", "0.bias", "1.weight", "3.weight")),
}  # fmt: skip
BLOCK = ("attn.norm.weight", "attn.norm.bias", "attn.to_q.weight", "attn.to_kv.weight", "attn.to_out.weight",
         "attn_gate", "ff.0.weight", "ff.0.bias", "ff.1.weight", "ff.3.weight")  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_flamingo(tmp_path_factory.mktemp("flamingo"))


def _views(n: int, views: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [[rng.random((3, 32, 32)).astype(np.float32) for _ in range(views)] for _ in range(n)]


def _released(model: FlamingoVLM, seed: int = 1) -> dict[str, torch.Tensor]:
    """A checkpoint as OpenFlamingo saves one, random values under its names: the resampler's, each gated block
    under both of its names, the language model's decoder layers wrapped (``decoder_layer``) under ``lang_encoder``,
    and open_clip's vision encoder."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        value = torch.randn(tensor.shape, generator=generator)
        if name.startswith("perceiver."):
            state[name] = value
        elif name.startswith("gated_cross_attn_layers."):
            layer, rest = name.split(".", 2)[1:]
            state[f"lang_encoder.{name}"] = value
            state[f"lang_encoder.model.layers.{layer}.gated_cross_attn_layer.{rest}"] = value
        elif name.startswith("language.model.layers."):
            layer, rest = name.removeprefix("language.model.layers.").split(".", 1)
            state[f"lang_encoder.model.layers.{layer}.decoder_layer.{rest}"] = value
        elif name.startswith("language."):
            state[f"lang_encoder.{name.removeprefix('language.')}"] = value
    state["vision_encoder.conv1.weight"] = torch.randn(16, 3, 8, 8, generator=generator)
    return state


def test_the_parameters_carry_openflamingos_names_and_a_released_checkpoint_loads_onto_them(folder):
    model = FlamingoVLM.from_config(VLMConfig(name=str(folder), lora=False, plugin=PLUGIN), CPU)
    names = set(model.state_dict())
    assert {n for n in names if n.startswith("perceiver.")} == PERCEIVER
    assert {n for n in names if n.startswith("gated_cross_attn_layers.")} == {
        f"gated_cross_attn_layers.{i}.{n}" for i in (0, 1) for n in BLOCK
    } | {f"gated_cross_attn_layers.{i}.ff_gate" for i in (0, 1)}
    vision = {n: p.clone() for n, p in model.vision_encoder.state_dict().items()}
    released = _released(model)
    model.load_openflamingo(released)
    loaded = model.state_dict()
    assert torch.equal(loaded["perceiver.latents"], released["perceiver.latents"])
    assert torch.equal(loaded["gated_cross_attn_layers.1.attn.to_kv.weight"],
                       released["lang_encoder.gated_cross_attn_layers.1.attn.to_kv.weight"])  # fmt: skip
    assert torch.equal(loaded["language.model.layers.0.self_attn.q_proj.weight"],
                       released["lang_encoder.model.layers.0.decoder_layer.self_attn.q_proj.weight"])  # fmt: skip
    assert torch.equal(loaded["language.lm_head.weight"], released["lang_encoder.lm_head.weight"])
    assert all(torch.equal(p, vision[n]) for n, p in model.vision_encoder.state_dict().items())
    with pytest.raises(ValueError, match=r"lacks \['perceiver.extra'\]"):
        model.load_openflamingo({**released, "perceiver.extra": torch.zeros(1)})
    without = {k: v for k, v in released.items() if "perceiver.norm" not in k}
    with pytest.raises(ValueError, match="gated-block parameters it lacks \\['perceiver.norm.weight'"):
        model.load_openflamingo(without)


def test_closed_gates_leave_the_language_model_alone_and_an_open_one_conditions_the_text_after_an_image(folder):
    model = vlm_class(PLUGIN).from_config(VLMConfig(name=str(folder), lora=False, plugin=PLUGIN), CPU)
    ids, mask, _ = model._rows(2, ["Which stage?"], ["stage II"])
    ids = torch.cat([ids[:, :1], model.tokenizer(" no", add_special_tokens=False, return_tensors="pt")["input_ids"],
                     ids[:, 1:]], 1)  # text, then the two images, then the question  # fmt: skip
    mask = torch.ones_like(ids)
    latents = model._latents(_views(1, 2))
    with torch.no_grad():
        plain = model.language(input_ids=ids, attention_mask=mask).logits
        closed = model._run(latents, ids, mask).logits
        torch.testing.assert_close(closed, plain)
        for block in model.gated_cross_attn_layers.values():
            block.attn_gate.fill_(1.0)
        opened = model._run(latents, ids, mask).logits
    first_image = int((ids[0] == model.media_id).nonzero()[0])
    torch.testing.assert_close(opened[:, :first_image], plain[:, :first_image])  # before any image: nothing to see
    assert not torch.allclose(opened[:, first_image:], plain[:, first_image:])


def test_the_flamingo_plugin_trains_and_answers_every_vlm_task_through_the_trials_module(folder):
    """Every phase's key slice as an interleaved sequence of four images: a step trains the resampler, the gated
    blocks and the LoRA adapters (nothing of the vision encoder or the base language model), and the answers are
    scored by each task's own metric."""
    from gx_ray.tasks import build_task
    from gx_ray.tasks.vlm import VisionLanguageTask, VisionLanguageTaskModel

    schema = resolve_schema("image_table_bbox")
    recipe = ViewsConfig().recipe(schema)
    config = VLMConfig(name=str(folder), plugin=PLUGIN, lora_rank=2, max_new_tokens=3)
    torch.manual_seed(0)
    vlm = vlm_class(config.plugin).from_config(config, CPU, recipe.images_per_case)
    trained = set(vlm.trainable())
    assert any(n.startswith("perceiver.") for n in trained) and any("lora_" in n for n in trained)
    assert all(n.startswith(("perceiver.", "gated_cross_attn_layers.")) or "lora_" in n for n in trained)
    for task_name, metric_name in (("vqa", "accuracy"), ("report_generation", "rouge_l"),
                                   ("stage_classification", "option_accuracy")):  # fmt: skip
        options = {"max_new_tokens": 3, "max_report_tokens": 8} if task_name == "report_generation" else {}
        task = VisionLanguageTask(build_task(task_name, **options), config.max_new_tokens)
        model = VisionLanguageTaskModel(task, vlm, recipe, schema).train()
        model(vlm_batch())["loss"].backward()
        gates = [p.grad for n, p in vlm.trainable().items() if n.endswith("attn_gate")]
        assert gates and all(g is not None and g.abs().sum() > 0 for g in gates), task_name  # the gates learn
        vlm.zero_grad()
        assert 0 <= scored(model, task)[metric_name] <= 100, task_name
