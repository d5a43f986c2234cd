"""Models: every vision x fusion under every paper schema gives a well-formed Encoded; the paper-sized encoders
are wired consistently; the offline text encoders load (MiniLM with its real weights); LoRA trains only adapters;
parameter groups follow the paper's recipe; bad names fail with the valid choices; gradients reach every branch
and a few steps fit a batch; the model benchmark reports rates.

Everything but the paper-size checks runs tiny (narrow ResNets, narrow small-window Swin, one thread) so the
file stays fast on a 2-core CI box."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.model import ModelBenchmarkConfig, format_model_result, run_model_benchmark
from gx_ray.modalities import PRESETS, ModalitySchema, ModelInputs, input_channels, table_width
from gx_ray.models import (
    FUSIONS,
    TEXT_ENCODERS,
    VISION_ENCODERS,
    LoraSettings,
    ModelConfig,
    build_encoder,
    param_groups,
)
from gx_ray.models import vision as vision_module
from gx_ray.models.text import build_text_encoder, masked_mean
from gx_ray.models.vision import build_endoscopy_encoder, build_vision_encoder

HIDDEN = 32
SMALL_VISION = {"swin3d": {"feature_size": 12, "window_size": 4}, "multichannel2d": {"slices": 8}}
"""Narrower than the defaults where the architecture allows it, so the CPU suite stays fast (Swin's window 4 still
shifts on the 16^3 and 8^3 stages of a 32^3 volume)."""
PAPER_RESNET_WIDTHS = list(vision_module.RESNET_WIDTHS)
TINY_RESNET_WIDTHS = [4, 8, 16, 32]
CONTEXT = ["CEA 12.4 ng/mL, 2.5x above upper limit", "Hemoglobin 92 g/L, 1.4x below lower limit"]
QUESTIONS = ["Is there a gastric tumour?", "Which phase shows the lesion best?"]


def random_schema_inputs(schema: ModalitySchema, rng: np.random.Generator, size=(32, 32, 32)) -> ModelInputs:
    """A batch of two with every input the schema asks for; the second sample lacks its first phase."""
    ct = torch.from_numpy(rng.standard_normal((2, input_channels(schema), *size), dtype=np.float32))
    phase_mask = torch.ones(2, len(schema.phases), dtype=torch.bool)
    phase_mask[1, 0] = False
    ct[1, 0] = 0
    table = None
    if schema.table == "numeric":
        table = torch.from_numpy(rng.standard_normal((2, table_width(schema)), dtype=np.float32))
        table[0, 0] = float("nan")  # a missing value that slipped through must not poison the features
    return ModelInputs(
        ct=ct,
        phase_mask=phase_mask,
        endoscopy=torch.from_numpy(rng.standard_normal((2, 3, 32, 32), dtype=np.float32)) if schema.endoscopy else None,
        text=CONTEXT if schema.has_text else None,
        table=table,
    )


def config(vision: str = "resnet18_3d", fusion: str = "concat", **kwargs) -> ModelConfig:
    small = SMALL_VISION.get(vision, {})
    return ModelConfig(vision=vision, fusion=fusion, hidden=HIDDEN, vision_kwargs=small, **kwargs)


ALL_INPUTS = ModalitySchema(
    "all_inputs", endoscopy=True, table="numeric", boxes="channels", box_levels=("stomach",), reports=("ct_report",)
)
"""Every branch of the encoder on: CT with a box channel, endoscopy, numeric table, a report as context."""


@pytest.fixture(scope="module", autouse=True)
def tiny_and_single_threaded():
    """Every ResNet (3D, multichannel 2D, endoscopy) at widths 4-32, and one intra-op thread.

    The widths are patched at the module constant so that every ResNet shrinks in one place, the endoscopy encoder
    included (``ModelConfig`` passes it no kwargs). One thread because these ops are tiny: on a busy 2-core box,
    two OpenMP threads made each forward ~30x slower, not faster.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vision_module, "RESNET_WIDTHS", TINY_RESNET_WIDTHS)
        yield
    torch.set_num_threads(threads)


# --- shapes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("vision", list(VISION_ENCODERS))
def test_every_vision_and_fusion_encodes_every_paper_schema(vision, fusion):
    rng = np.random.default_rng(0)
    for preset, schema in PRESETS.items():
        encoder = build_encoder(config(vision, fusion), schema).eval()
        inputs = random_schema_inputs(schema, rng)
        with torch.no_grad():
            out = encoder(inputs, query=QUESTIONS)
            plain = encoder(inputs) if not schema.has_text else None
        image_tokens = out.feature_maps[-1].shape[2:].numel()
        context = encoder.text(CONTEXT)[1].shape[1] if schema.has_text else 0
        query = encoder.text(QUESTIONS)[1].shape[1]
        assert encoder.dim == HIDDEN
        assert out.pooled.shape == out.image.shape == (2, HIDDEN), preset
        assert out.tokens.shape == (2, image_tokens + context + query, HIDDEN), preset
        assert out.token_mask.shape == out.tokens.shape[:2] and out.token_mask[:, :image_tokens].all()
        assert [m.shape[1] for m in out.feature_maps] == encoder.vision.channels
        assert all(m.ndim == 5 and m.shape[0] == 2 for m in out.feature_maps)
        for t in (out.pooled, out.tokens, out.image, *out.feature_maps):
            assert torch.isfinite(t).all(), (vision, fusion, preset)
        if plain is not None:
            # Without text the text encoder is skipped; a query is fused (it moves the pooled features) while
            # the image side stays the image side.
            assert plain.tokens.shape[1] == image_tokens and plain.token_mask.all()
            assert not torch.allclose(plain.pooled, out.pooled)
            torch.testing.assert_close(plain.image, out.image)


def test_swin_default_matches_the_paper_encoder():
    encoder = build_encoder(ModelConfig(vision="swin3d", hidden=HIDDEN), PRESETS["image_only"])
    assert encoder.vision.channels == [48, 96, 192, 384, 768]
    arguments = encoder.vision.backbone_arguments
    assert arguments["window_size"] == (7, 7, 7) and arguments["patch_size"] == (2, 2, 2)
    assert arguments["depths"] == (2, 2, 2, 2) and arguments["num_heads"] == (3, 6, 12, 24)
    assert not arguments["use_checkpoint"]
    checkpointed = build_encoder(config("swin3d", gradient_checkpointing=True), PRESETS["image_only"])
    assert checkpointed.vision.backbone_arguments["use_checkpoint"]
    with pytest.raises(ValueError, match="swin3d only"):
        build_encoder(config("resnet18_3d", gradient_checkpointing=True), PRESETS["image_only"])


PAPER_CHANNELS = {
    "resnet18_3d": [64, 128, 256, 512],
    "resnet50_3d": [256, 512, 1024, 2048],
    "multichannel2d": [64, 128, 256, 512],
}


@pytest.mark.parametrize("vision", list(PAPER_CHANNELS))
def test_resnets_at_the_paper_widths_report_the_channels_they_produce(vision, monkeypatch):
    # The rest of the file runs narrow ResNets; here the paper's own widths, on a small volume.
    monkeypatch.setattr(vision_module, "RESNET_WIDTHS", PAPER_RESNET_WIDTHS)
    encoder = build_vision_encoder(vision, 2).eval()
    with torch.no_grad():
        maps = encoder(torch.zeros(1, 2, 16, 16, 16))
    assert encoder.channels == [m.shape[1] for m in maps] == PAPER_CHANNELS[vision]


def test_endoscopy_encoder_at_the_paper_width_gives_one_512_vector(monkeypatch):
    monkeypatch.setattr(vision_module, "RESNET_WIDTHS", PAPER_RESNET_WIDTHS)
    endoscopy = build_endoscopy_encoder("resnet18_2d").eval()
    with torch.no_grad():
        assert endoscopy(torch.zeros(1, 3, 32, 32)).shape == (1, endoscopy.dim) == (1, 512)


def test_endoscopy_and_table_add_one_token_each():
    rng = np.random.default_rng(1)
    plain = build_encoder(config(), PRESETS["image_only"]).eval()
    full = build_encoder(config(), ModalitySchema("cues", endoscopy=True, table="numeric")).eval()
    with torch.no_grad():
        a = plain(random_schema_inputs(plain.schema, rng))
        b = full(random_schema_inputs(full.schema, rng))
    assert b.tokens.shape[1] == a.tokens.shape[1] + 2
    assert torch.isfinite(b.pooled).all() and torch.isfinite(b.image).all()


def test_inputs_that_do_not_match_the_schema_are_refused():
    encoder = build_encoder(config(), ALL_INPUTS)
    good = random_schema_inputs(ALL_INPUTS, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\(B, 5, D, H, W\)"):
        encoder(ModelInputs(good.ct[:, :4], good.phase_mask, good.endoscopy, good.text, good.table))
    with pytest.raises(ValueError, match="endoscopy"):
        encoder(ModelInputs(good.ct, good.phase_mask, None, good.text, good.table))


# --- text ----------------------------------------------------------------------------------------------


def test_bert_tiny_is_small_random_and_uses_the_offline_tokenizer():
    encoder = build_text_encoder("bert_tiny")
    config_ = encoder.model.config
    assert (config_.hidden_size, config_.num_hidden_layers, config_.num_attention_heads) == (128, 2, 2)
    assert encoder.tokenizer.vocab_size == config_.vocab_size == 30522
    assert build_text_encoder("bert_tiny", max_length=8)(["word " * 50])[0].shape == (1, 8, 128)


def test_minilm_loads_its_real_weights_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    encoder = build_text_encoder("minilm").eval()
    sentences = [
        "A tumour is seen in the gastric antrum.",
        "A tumour is seen in the gastric antrum.",
        "There is a mass in the antrum of the stomach.",
        "The weather was sunny at the football match.",
    ]
    with torch.no_grad():
        embedding = F.normalize(masked_mean(*encoder(sentences)), dim=1)
    assert embedding.shape == (4, 384)
    torch.testing.assert_close(embedding[0], embedding[1])
    similarity = embedding @ embedding.T
    # Pretrained weights put a paraphrase nearer than an unrelated sentence; random weights would not.
    assert similarity[0, 2] > similarity[0, 3] + 0.3


def test_encode_text_uses_the_shared_text_encoder():
    encoder = build_encoder(config(), PRESETS["image_only"]).eval()
    with torch.no_grad():
        vectors = encoder.encode_text(["gastric wall thickening", "gastric wall thickening", "normal stomach"])
    assert vectors.shape == (3, HIDDEN)
    torch.testing.assert_close(vectors[0], vectors[1])
    assert not torch.allclose(vectors[0], vectors[2])
    assert encoder.tokenizer is encoder.text.tokenizer


# --- LoRA and parameter groups -------------------------------------------------------------------------


@pytest.mark.parametrize("targets", [("query", "value"), ("query", "key", "value", "dense")])
def test_lora_trains_only_adapters_of_the_expected_size(targets):
    settings = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules=targets)
    reference = build_text_encoder("bert_tiny").model
    expected = sum(
        settings.rank * (module.in_features + module.out_features)
        for name, module in reference.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )
    encoder = build_encoder(config(lora=settings), PRESETS["image_table"])
    trainable = {n: p for n, p in encoder.text.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == expected
    # Only the text encoder is frozen: the vision side and the projection of text tokens still train.
    assert all(p.requires_grad for p in encoder.vision.parameters())
    assert all(p.requires_grad for p in encoder.text_projection.parameters())


def test_lora_settings_come_from_plain_data():
    cfg = ModelConfig.from_dict({"lora": {"rank": 2, "target_modules": ["query"]}, "hidden": HIDDEN})
    assert cfg.lora == LoraSettings(rank=2, target_modules=("query",))
    with pytest.raises(ValueError, match="valid: rank, alpha"):
        LoraSettings.from_dict({"ranks": 2})


@pytest.mark.parametrize("lora", [None, LoraSettings(rank=2)])
def test_param_groups_give_the_text_side_its_multiplier_and_spare_biases_and_norms(lora):
    encoder = build_encoder(config("swin3d", lora=lora), PRESETS["image_table"])
    model = nn.ModuleDict({"encoder": encoder, "head": nn.Linear(HIDDEN, 4)})
    groups = param_groups(model, base_lr=1e-4, weight_decay=0.01, text_lr_multiplier=2.0)

    grouped = [id(p) for g in groups for p in g["params"]]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(grouped) == sorted(trainable)  # every trainable parameter exactly once, no frozen one
    text = {id(p) for p in encoder.text.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in groups:
        ids = {id(p) for p in group["params"]}
        on_text = group["name"].startswith("text")
        assert ids <= text if on_text else not ids & text
        assert group["lr"] == pytest.approx(2e-4 if on_text else 1e-4)
        no_decay = group["name"].endswith("no_decay")
        assert group["weight_decay"] == (0.0 if no_decay else 0.01)
        for p in group["params"]:
            is_bias_or_norm = p.ndim == 1 or "bias" in names[id(p)].rsplit(".", 1)[-1]
            assert is_bias_or_norm == no_decay, names[id(p)]
    norm_types = (nn.LayerNorm, nn.BatchNorm3d)
    norms = [m.weight for m in model.modules() if isinstance(m, norm_types) and m.weight.requires_grad]
    no_decay_ids = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert norms and all(id(w) in no_decay_ids for w in norms)
    torch.optim.AdamW(groups)  # the groups are what the optimiser takes


# --- bad names -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "valid"), [("vision", VISION_ENCODERS), ("fusion", FUSIONS), ("endoscopy", ["resnet18_2d"])]
)
def test_unknown_model_names_list_the_valid_choices(key, valid):
    with pytest.raises(ValueError, match=f"unknown {key}") as error:
        ModelConfig(**{key: "no_such_model"})
    assert all(name in str(error.value) for name in valid)


def test_unknown_text_name_and_missing_text_folder_list_the_valid_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown text encoder 'no_such_model'") as error:
        ModelConfig(text="no_such_model")
    assert all(name in str(error.value) for name in TEXT_ENCODERS) and "hf-hub:" in str(error.value)
    missing = tmp_path / "my_text_model"
    cfg = ModelConfig(text=str(missing))  # a path is only looked for when the model is built (on the worker)
    with pytest.raises(ValueError, match="does not exist") as error:
        build_encoder(cfg, PRESETS["image_only"])
    assert str(missing) in str(error.value) and all(name in str(error.value) for name in TEXT_ENCODERS)
    with pytest.raises(ValueError, match="valid: vision, text"):
        ModelConfig.from_dict({"visoin": "swin3d"})


def test_a_local_text_folder_loads(tmp_path):
    source = build_text_encoder("bert_tiny")
    source.model.save_pretrained(tmp_path)
    source.tokenizer.save_pretrained(tmp_path)
    loaded = build_text_encoder(str(tmp_path)).eval()
    source.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(CONTEXT)[0], source(CONTEXT)[0])


# --- training ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_gradients_reach_every_branch_and_a_few_steps_fit_a_batch(fusion):
    torch.manual_seed(0)
    encoder = build_encoder(config("resnet18_3d", fusion, text_kwargs={"num_hidden_layers": 1}), ALL_INPUTS)
    head = nn.Linear(HIDDEN, 3)
    inputs = random_schema_inputs(ALL_INPUTS, np.random.default_rng(3), size=(16, 16, 16))
    labels = torch.tensor([0, 2])
    image_target = torch.from_numpy(np.random.default_rng(4).standard_normal((2, HIDDEN), dtype=np.float32))
    model = nn.ModuleDict({"encoder": encoder, "head": head})
    optimizer = torch.optim.AdamW(param_groups(model, 3e-3, 0.01, 2.0))

    losses = []
    for step in range(6):
        out = encoder(inputs, query=QUESTIONS)
        # CE on the fused features (classification), MSE on the image side (what retrieval aligns).
        loss = F.cross_entropy(head(out.pooled), labels) + F.mse_loss(out.image, image_target)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            # Every module that owns parameters got a non-zero gradient: each branch is wired into the loss.
            dead = [
                name
                for name, module in encoder.named_modules()
                if list(module.parameters(recurse=False))
                and all(p.grad is None or not p.grad.any() for p in module.parameters(recurse=False))
            ]
            assert not dead, dead
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_compiled_encoder_computes_what_the_eager_one_does_and_keeps_its_checkpoint_keys():
    from gx_ray.train.probe import compiled_copy

    torch.manual_seed(0)
    eager = build_encoder(config("resnet18_3d", text_kwargs={"num_hidden_layers": 1}), PRESETS["image_only"])
    compiled = build_encoder(config("resnet18_3d", text_kwargs={"num_hidden_layers": 1}, compile=True), eager.schema)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints load into either
    compiled.load_state_dict(eager.state_dict())
    inputs = random_schema_inputs(eager.schema, np.random.default_rng(5), size=(16, 16, 16))
    expected, got = eager(inputs).pooled, compiled(inputs).pooled
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    got.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(eager.vision.named_parameters(), compiled.vision.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
    # the GPU probe measures a copy; a plain deep copy would run (and measure) the eager step
    assert compiled.vision._compiled_call_impl is not None and eager.vision._compiled_call_impl is None
    copy = compiled_copy(compiled)
    assert copy.vision._compiled_call_impl is not None and copy.vision is not compiled.vision
    assert compiled_copy(eager).vision._compiled_call_impl is None


# --- benchmark -----------------------------------------------------------------------------------------


def test_model_benchmark_reports_rates_memory_and_the_ratio():
    cfg = ModelBenchmarkConfig(model="multichannel2d", shape=(2, 8, 32, 32), batch=2, steps=2, warmup=1, amp="off")
    result = run_model_benchmark(cfg, "cpu")
    assert result.registry.samples_per_s > 0 and result.raw.samples_per_s > 0
    assert result.ratio == pytest.approx(result.registry.samples_per_s / result.raw.samples_per_s)
    assert result.registry.peak_memory_bytes >= 0 and result.raw.peak_memory_bytes >= 0
    assert "ratio registry/raw" in format_model_result(result)
    with pytest.raises(ValueError, match="valid: swin3d"):
        ModelBenchmarkConfig(model="vit")


def test_concat_fusion_pools_the_query_apart_from_the_context():
    """A VQA question must not drown in the lab-table text before it: the query has its own pooled slot, so a
    longer context leaves the query's contribution as it was."""
    from gx_ray.models.fusion import ConcatFusion

    torch.manual_seed(0)
    fusion = ConcatFusion(8, [4]).eval()
    maps = [torch.randn(2, 4, 2, 2, 2)]
    text = torch.randn(2, 7, 8)
    mask = torch.ones(2, 7, dtype=torch.bool)
    query_mask = torch.zeros(2, 7, dtype=torch.bool)
    query_mask[:, 5:] = True  # five context tokens, then a two-token query
    pooled = fusion(maps, text, mask, query_mask=query_mask).pooled
    visual = fusion.project(maps[0].flatten(2).transpose(1, 2)).mean(1)
    context, query = text[:, :5].mean(1), text[:, 5:].mean(1)
    expected = fusion.norm(fusion.mlp(torch.cat([visual, context, query], dim=1)))
    torch.testing.assert_close(pooled, expected)
    # without a query mask every text token is context
    alone = fusion(maps, text, mask).pooled
    torch.testing.assert_close(alone, fusion.norm(fusion.mlp(torch.cat([visual, text.mean(1), 0 * query], dim=1))))


def test_the_encoder_marks_the_query_tokens_for_the_fusion():
    schema = ModalitySchema("t", table="text")
    encoder = build_encoder(ModelConfig(vision="resnet10_3d", text="bert_tiny", fusion="concat", hidden=8), schema)
    seen = {}
    original = encoder.fusion.forward

    def spy(maps, text, text_mask, **kwargs):
        seen.update(text_mask=text_mask, query_mask=kwargs["query_mask"])
        return original(maps, text, text_mask, **kwargs)

    encoder.fusion.forward = spy
    inputs = random_schema_inputs(schema, np.random.default_rng(0))
    questions = QUESTIONS
    encoder(inputs, query=questions)
    query_lengths = [len(encoder.tokenizer(q)["input_ids"]) for q in questions]
    query_mask, text_mask = seen["query_mask"], seen["text_mask"]
    assert query_mask.shape == text_mask.shape
    assert (query_mask & text_mask).sum(1).tolist() == query_lengths  # exactly the query's real tokens
    assert not query_mask[:, : text_mask.shape[1] - query_mask.sum(1).max()].any()  # context first, then the query


def test_swin3d_evaluates_through_fused_attention_with_the_same_outputs():
    """Where no gradient is taken, 3D Swin's window attention runs fused (PyTorch's scaled_dot_product_attention,
    shifted-window masks included): the same maps as MONAI's explicit softmax."""
    from gx_ray.models.vision import Swin3d

    torch.manual_seed(0)
    fused = Swin3d(2, implementation="monai", **SMALL_VISION["swin3d"]).eval()
    explicit = Swin3d(2, attention="explicit", use_flash_attention=False, **SMALL_VISION["swin3d"]).eval()
    explicit.load_state_dict(fused.state_dict())
    attentions = [m for m in fused.modules() if hasattr(m, "use_flash_attention")]
    assert attentions and all(type(m).__name__ == "FusedWindowAttention" for m in attentions)
    ct = torch.randn(2, 2, 32, 32, 32)
    with torch.no_grad():
        for a, b in zip(fused(ct), explicit(ct), strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", range(6))
def test_swin3d_trains_through_fused_attention_with_the_same_gradients(case):
    """In training too, 3D Swin's fused window attention (a shifted block's windows folded into heads, its bias
    broadcast over the images) gives MONAI's explicit outputs and the same gradient for every parameter, the
    relative position bias tables included: random batches, windows (4 exactly tiling, 5 and 7 padded), odd shapes
    and dropout off, in float64 so that only a wrong formula could differ."""
    from gx_ray.models.vision import Swin3d

    rng = np.random.default_rng(case)
    window = int(rng.choice([4, 5, 7]))
    shape = tuple(int(rng.choice([32, 64])) for _ in range(3)) if case % 2 else (32, 32, 32)
    batch = int(rng.integers(1, 4))
    torch.manual_seed(case)
    arguments = {"feature_size": 6, "window_size": window, "depths": (2, 2, 1, 1), "num_heads": (1, 2, 2, 2)}
    fused = Swin3d(2, implementation="monai", **arguments).double().train()
    explicit = Swin3d(2, attention="explicit", **arguments).double().train()
    for parameter in fused.parameters():  # a bias table at its init (std 0.02) would hide a misplaced bias
        parameter.data += 0.3 * torch.randn_like(parameter)
    explicit.load_state_dict(fused.state_dict())
    ct = torch.randn(batch, 2, *shape, dtype=torch.float64)
    weights = [torch.randn_like(m) for m in explicit(ct)]  # a loss that reaches every map differently
    for model in (fused, explicit):
        sum((m * w).sum() for m, w in zip(model(ct), weights, strict=True)).backward()
    for (name, a), b in zip(fused.named_parameters(), explicit.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-9, rtol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert any("relative_position_bias_table" in name for name, _ in fused.named_parameters())


def test_swin3d_attention_choice_is_checked_and_a_fused_model_pickles():
    import pickle

    from gx_ray.models.vision import Swin3d

    with pytest.raises(ValueError, match="valid: fused, explicit"):
        Swin3d(2, attention="flash", **SMALL_VISION["swin3d"])
    model = Swin3d(2, implementation="monai", **SMALL_VISION["swin3d"])
    copy = pickle.loads(pickle.dumps(model))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), copy.state_dict().values(), strict=True))
    assert sum(type(m).__name__ == "FusedWindowAttention" for m in copy.modules()) == 8
