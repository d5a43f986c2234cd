"""Measured training steps (:mod:`gx_ray.train.probe`) and the GPU packing built on them (``auto_share`` of
:mod:`gx_ray.sweep.gpu_plan`), checked where no GPU is: packing arithmetic, the micro-batch choice, micro-batches
accumulated to the effective batch (the same gradients as one big batch), the parameters a step leaves without a
gradient, and gradient checkpointing switched on after the fact."""

from __future__ import annotations

import random

import pytest
import torch

from gx_ray.data.stream import first_rows
from gx_ray.train import probe
from gx_ray.train.build import build_trial, loss_function
from gx_ray.train.config import TrialConfig

GIB = 2**30


# --- packing ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "need_gib, card_gib, trials",
    [(35, 80, 2), (34, 141, 3), (10, 80, 7), (1, 80, 8), (79, 80, 1), (100, 80, 1), (24, 80, 3), (8, 80, 8)],
)
def test_gpu_share_packs_as_many_trials_as_fit_with_the_margin(need_gib, card_gib, trials):
    share = probe.gpu_share(need_gib * GIB, card_gib * GIB)
    assert probe.trials_per_gpu(share) == trials
    assert trials * share <= 1.0  # Ray never places more than a GPU's worth
    # the packed trials' memory fits the card less the margin (a trial alone gets the card whatever it needs)
    assert trials == 1 or trials * need_gib <= card_gib * (1 - probe.MARGIN)


def test_gpu_share_on_random_cases_never_overcommits_and_never_wastes_a_slot():
    rng = random.Random(0)
    for _ in range(500):
        card, need = rng.uniform(16, 141) * GIB, rng.uniform(0.1, 150) * GIB
        trials = probe.trials_per_gpu(probe.gpu_share(need, card))
        assert 1 <= trials <= probe.MAX_TRIALS_PER_GPU
        usable = card * (1 - probe.MARGIN)
        assert trials == 1 or trials * need <= usable
        assert trials == probe.MAX_TRIALS_PER_GPU or (trials + 1) * need > usable


def test_auto_packs_every_task_but_the_one_that_waits_on_the_gpu_each_step():
    from gx_ray.schema import PAPER_TASKS
    from gx_ray.sweep.gpu_plan import auto_share

    measured = {"peak_bytes": 20 * GIB, "card_bytes": 141 * GIB}
    shares = {task: auto_share(task, measured) for task in PAPER_TASKS}
    assert shares.pop("lesion_detection") == 1.0  # a whole card: packed, it trained at a ninth of its rate
    assert all(probe.trials_per_gpu(share) >= 2 for share in shares.values()), shares
    # no more than the sweep needs: as many trials as cards get a card each (Ray fills one card before the next)
    assert auto_share("vqa", measured, trials_per_card=1) == 1.0
    assert probe.trials_per_gpu(auto_share("vqa", measured, trials_per_card=2)) == 2
    assert auto_share("vqa", measured, trials_per_card=100) == auto_share("vqa", measured)  # memory bounds it
    big = {"peak_bytes": 60 * GIB, "card_bytes": 141 * GIB}  # two fit: a sweep of 3 trials a card still gets two
    assert probe.trials_per_gpu(auto_share("vqa", big, trials_per_card=3)) == 2


def test_a_card_holds_no_more_trials_than_the_sweep_has_for_it_or_the_cpus_beside_it_run():
    from gx_ray.sweep.gpu_plan import trials_per_card

    node = {"CPU": 16.0, "GPU": 1.0}
    assert trials_per_card(100, 1, node) == 16  # the CPUs bound it: 16 trials at once, one core each
    assert trials_per_card(100, 4, node) == 4
    assert trials_per_card(3, 1, node) == 3  # the sweep bounds it
    assert trials_per_card(60, 4, {"CPU": 128.0, "GPU": 8.0}) == 4  # 32 trial slots over 8 cards
    assert trials_per_card(60, 1, {"CPU": 128.0, "GPU": 8.0}) == 8  # 60 trials over 8 cards, rounded up
    assert trials_per_card(10, 8, {"CPU": 4.0, "GPU": 1.0}) == 1  # never none


def test_gpu_share_refuses_nonsense():
    with pytest.raises(ValueError):
        probe.gpu_share(0, 80 * GIB)


# --- micro-batches ----------------------------------------------------------------------------------------


def test_micro_batch_choice_is_the_largest_divisor_that_fits_in_few_measurements():
    rng = random.Random(1)
    for _ in range(300):
        per_rank = rng.choice([1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64])
        base, slope = rng.uniform(0.5, 4) * GIB, rng.uniform(0.2, 6) * GIB
        budget = rng.uniform(base + slope, base + slope * per_rank * 1.5)
        calls = []

        def peak_of(m: int, base=base, slope=slope, budget=budget, calls=calls) -> int | None:
            calls.append(m)
            peak = base + slope * m
            return None if peak > 1.3 * budget else int(peak)  # far over the budget: out of memory

        micro, peak = probe.choose_micro_batch(per_rank, peak_of, budget)
        fitting = [d for d in probe.divisors(per_rank) if base + slope * d <= budget]
        assert micro == max(fitting) and peak <= budget and per_rank % micro == 0
        assert len(calls) <= 4  # two small steps predict the rest


def test_micro_batch_choice_says_when_not_even_one_sample_fits():
    with pytest.raises(MemoryError, match="gradient checkpointing"):
        probe.choose_micro_batch(8, lambda m: None, 10 * GIB)


def tiny_config(shards, schema: str, **keys) -> TrialConfig:
    """Stage classification with a CPU-sized model on the tiny cohort."""
    return TrialConfig.from_flat(
        {
            "task": "stage_classification",
            "schema": schema,
            "model.vision": "resnet10_3d",
            "model.vision_kwargs": {"block_inplanes": [4, 8, 8, 8]},
            "model.text": "bert_tiny",
            "model.hidden": 16,
            "data.shards": str(shards),
            **keys,
        }
    )


def test_micro_batches_accumulated_give_the_gradients_of_one_big_batch(demo_prepared):
    """Four micro-batches of 1 with accumulation 4 give the gradients of one batch of 4: the loss of each is a mean
    over equal micro-batches (stage classification), normalisation layers in eval mode (batch statistics differ by
    definition) and no dropout."""
    config = tiny_config(demo_prepared.shard_dir, schema="image_table", **{"data.effective_batch": 4, "amp": "off"})
    torch.manual_seed(0)
    device = torch.device("cpu")
    task, model, layout = build_trial(config, device)
    model.eval()
    batch = first_rows(demo_prepared.shard_dir, "train", 4, layout)  # (8 rows: twice the backward seconds)
    loss_of = loss_function(task, config, device)

    def gradients(micro_batches: list[dict], accumulation: int) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        probe.accumulate(model, loss_of, micro_batches, accumulation)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole = gradients([batch], 1)
    parts = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(4)]
    accumulated = gradients(parts, 4)
    assert whole.keys() == accumulated.keys() and len(whole) > 10
    for name, grad in whole.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # and the test can fail: without dividing by the accumulation the gradients are 4 times too large
    model.zero_grad(set_to_none=True)
    probe.accumulate(model, loss_of, parts, 1)
    name = next(iter(whole))
    assert not torch.allclose(dict(model.named_parameters())[name].grad, whole[name], rtol=1e-2)


def test_a_measured_backward_names_the_unused_parameters(demo_prepared):
    config = tiny_config(demo_prepared.shard_dir, schema="image_only", **{"data.effective_batch": 2})
    device = torch.device("cpu")
    task, model, layout = build_trial(config, device)
    batch = first_rows(demo_prepared.shard_dir, "train", 2, layout)
    probe.accumulate(model, loss_function(task, config, device), [batch], 1)
    unused = probe.unused_parameters(model)
    # image only: the text encoder (always built, for tasks that send a query) gets no gradient; the vision does
    assert any(name.startswith("encoder.text.") for name in unused)
    assert not any(name.startswith(("encoder.vision.", "head.")) for name in unused)


# --- gradient checkpointing -------------------------------------------------------------------------------


def test_checkpointing_switched_on_after_the_fact_keeps_the_gradients():
    """What the micro-batch choice falls back to when not one sample fits: the same model, activations recomputed."""
    from gx_ray.modalities import resolve_schema
    from gx_ray.modalities.inputs import ModelInputs
    from gx_ray.models.registry import ModelConfig, build_encoder

    torch.manual_seed(0)
    encoder = build_encoder(
        ModelConfig(vision="swin3d", hidden=16, vision_kwargs={"feature_size": 12, "window_size": 4}),
        resolve_schema("image_only"),
    )
    inputs = ModelInputs(torch.randn(2, 4, 32, 32, 32), torch.ones(2, 4, dtype=torch.bool))

    def gradients() -> dict[str, torch.Tensor]:
        encoder.zero_grad(set_to_none=True)
        encoder(inputs).pooled.square().sum().backward()
        return {n: p.grad.clone() for n, p in encoder.named_parameters() if p.grad is not None}

    plain = gradients()
    assert not probe.checkpointing(encoder)
    assert probe.enable_checkpointing(encoder) and probe.checkpointing(encoder)
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    resnet = build_encoder(ModelConfig(vision="resnet10_3d", hidden=16), resolve_schema("image_only"))
    assert not probe.enable_checkpointing(resnet)  # nothing to switch on: the caller reports the memory error
