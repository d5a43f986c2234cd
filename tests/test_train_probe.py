"""What lets trials scale on GPUs, checked where no GPU is: packing arithmetic, the micro-batch choice, micro-batches
accumulated to the effective batch (the same gradients as one big batch), per-rank data parts, the batch keys, and a
two-worker DDP trial on CPU."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.data import stream as data_stream
from gx_ray.data.shards import TensorLayout, rank_pieces, read_manifest, row_groups
from gx_ray.data.stream import first_rows
from gx_ray.sweep.driver import EXPERIMENT, SweepOptions, run_sweep
from gx_ray.tracking import PARENT_TAG
from gx_ray.tracking.server import LocalMlflowServer
from gx_ray.train import loop, probe
from gx_ray.train.build import build_trial, loss_function
from gx_ray.train.config import TrialConfig
from gx_ray.train.loop import optimiser_steps

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


def test_gpu_share_refuses_nonsense():
    with pytest.raises(ValueError):
        probe.gpu_share(0, 80 * GIB)


def _context(tmp_path: Path, fixed: dict, grid: dict, **kwargs):
    """A sweep's context over a space of ``fixed`` and ``grid`` keys, as the driver builds it."""
    import yaml

    from gx_ray.sweep.spaces import load_space
    from gx_ray.sweep.trial import SweepContext

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"fixed": fixed, "grid": grid}), encoding="utf-8")
    return SweepContext("sweep", load_space(str(path)), "/cohort", str(tmp_path / "ray"), **kwargs)


def test_a_trial_is_reserved_and_logs_its_fixed_or_measured_gpu_share(tmp_path):
    """The share Ray reserves is the one the trial logs and keeps its memory to: the plan's for ``auto``, the space's
    own for a fixed fraction (a fixed share logged as a whole card made the cluster benchmark project 3/2 x the
    GPU-hours of a slice packed two to a card)."""
    from gx_ray.sweep.trial import gpu_plan_key

    fixed = {"task": "vqa", "resources.cpus_per_worker": 4}
    measured = _context(tmp_path, {**fixed, "resources.gpus_per_worker": "auto"}, {"schema": ["image_only"]})
    key = gpu_plan_key(measured.setting({"schema": "image_only"}).config)
    for gpus, share in ((0.25, 0.25), (1, 1.0), (0, 0.0), ("auto", 0.3333)):
        space = {**fixed, "resources.gpus_per_worker": gpus}
        context = _context(
            tmp_path, space, {"schema": ["image_only", "image_table"]}, gpu_plan={key: {"share": 0.3333}}
        )
        assert context.setting({"schema": "image_only"}).gpu_share == share
        assert context.resources({"schema": "image_only"}) == {"cpu": 4, "gpu": share}
    # a setting the plan never saw gets a whole GPU
    assert context.setting({"schema": "image_table"}).gpu_share == 1.0


def test_a_trial_finds_the_plan_it_was_reserved_by_before_its_config_grows(tmp_path):
    """A trial whose measured step fitted only with gradient checkpointing gains it after the plan is looked up (it
    is in the plan's key); a task's sweep inputs (lesion QA's question file) are in the config the driver measured."""
    from gx_ray.sweep.trial import gpu_plan_key, task_key

    fixed = {"task": "lesion_qa", "resources.gpus_per_worker": "auto", "resources.cpus_per_worker": 2,
             "task_options.family": "img2size"}  # fmt: skip
    params = {"schema": "image_only", "seed": 0}
    bare = _context(tmp_path, fixed, {"schema": ["image_only"], "seed": [0]})
    inputs = {task_key(bare.setting(params).config): {"questions_file": "/questions/img2size.json"}}
    measured = _context(tmp_path, fixed, {"schema": ["image_only"], "seed": [0]}, task_inputs=inputs)
    entry = {"share": 0.25, "micro_batch": 4, "gradient_checkpointing": True}
    key = gpu_plan_key(measured.setting(params).config)
    context = _context(
        tmp_path, fixed, {"schema": ["image_only"], "seed": [0]}, task_inputs=inputs, gpu_plan={key: entry}
    )
    setting = context.setting(params)
    assert setting.plan == entry and setting.gpu_share == 0.25 == context.resources(params)["gpu"]
    assert setting.config.task_options["questions_file"] == "/questions/img2size.json"
    assert setting.config.model.gradient_checkpointing is True
    assert gpu_plan_key(setting.config) not in context.gpu_plan  # looked up after, it would have found nothing


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


# --- batch keys -------------------------------------------------------------------------------------------


def test_the_old_ambiguous_batch_key_is_refused_with_what_to_write_instead():
    with pytest.raises(ValueError, match="data.effective_batch .* data.micro_batch"):
        TrialConfig.from_flat({"task": "vqa", "data.batch_size": 8})
    with pytest.raises(ValueError, match="data.grad_accum"):
        TrialConfig.from_flat({"task": "vqa", "data.grad_accum": 2})


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"data.effective_batch": 32, "data.micro_batch": 5}, "positive divisor of the per-rank batch 32"),
        ({"data.effective_batch": 6, "resources.workers": 4}, "multiple of resources.workers 4"),
        ({"data.effective_batch": 0}, "data.effective_batch = 0 is not valid"),
        ({"resources.workers": 2, "resources.gpus_per_worker": 0.5}, "whole GPUs"),
        ({"resources.gpus_per_worker": "most"}, "must be auto"),
    ],
)
def test_inconsistent_batch_and_resource_keys_fail_naming_the_values(keys, message):
    with pytest.raises(ValueError, match=message):
        TrialConfig.from_flat({"task": "stage_classification", **keys})


def test_accumulation_makes_up_the_effective_batch():
    config = TrialConfig.from_flat(
        {"task": "vqa", "data.effective_batch": 32, "data.micro_batch": 4, "resources.workers": 2}
    )
    assert config.data.per_rank_batch(2) == 16 and config.data.accumulation(2, 4) == 4
    assert optimiser_steps(100, 4, 4, config) == 6  # whole effective batches per rank only


# --- data parts -------------------------------------------------------------------------------------------


def test_ranks_read_disjoint_parts_that_cover_the_split_in_a_seeded_order_per_epoch(demo_prepared):
    pieces = row_groups(demo_prepared.shard_dir, "train")
    keys = {(p["path"], p["row_group"]) for p in pieces}
    for world in (1, 2, 3):
        for seed in (None, 0, 1):
            parts = [rank_pieces(pieces, r, world, seed) for r in range(world)]
            seen = [(p["path"], p["row_group"]) for part in parts for p in part]
            assert len(seen) == len(set(seen)) and set(seen) == keys
            assert parts == [rank_pieces(pieces, r, world, seed) for r in range(world)]  # reproducible
    orders = {tuple((p["path"], p["row_group"]) for p in rank_pieces(pieces, 0, 1, s)) for s in range(6)}
    assert len(orders) > 1 or len(pieces) < 3  # a new order per epoch


def _stream(
    shards, in_memory: bool | str, rank: int = 0, world: int = 1, seed: int = 3, shuffle_buffer: int = 16
) -> data_stream.SplitStream:
    config = TrialConfig.from_flat(
        {"task": "stage_classification", "data.shards": str(shards), "data.in_memory": in_memory, "seed": seed,
         "data.shuffle_buffer": shuffle_buffer}
    )  # fmt: skip
    manifest = read_manifest(shards)
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    return data_stream.SplitStream(config.data, "train", layout, 3, seed=config.seed, rank=rank, world_size=world)


def _epoch(stream: data_stream.SplitStream, epoch: int) -> dict[str, torch.Tensor]:
    return {case: ct for batch in stream.batches(epoch) for case, ct in zip(batch["case_id"], batch["ct"], strict=True)}


def test_an_in_memory_split_gives_every_epoch_the_streamed_rows_in_a_seeded_order_reading_each_row_group_once(
    ray_cluster, demo_prepared, monkeypatch
):
    reads = []
    real_read = data_stream.read_shard
    monkeypatch.setattr(data_stream, "read_shard", lambda path, **kw: reads.append((path, kw)) or real_read(path, **kw))
    kept, again = _stream(demo_prepared.shard_dir, True), _stream(demo_prepared.shard_dir, True)
    streamed = _stream(demo_prepared.shard_dir, False)
    orders = []
    for epoch in range(3):
        rows, same_seed, reference = _epoch(kept, epoch), _epoch(again, epoch), _epoch(streamed, epoch)
        assert rows.keys() == reference.keys()  # the same rows as the stream, nothing dropped or doubled
        assert all(torch.equal(rows[case], reference[case]) for case in rows)  # with the same volumes
        assert list(rows) == list(same_seed)  # reproducible
        # the epoch's seeded permutation of the share, row for row (each batch is gathered from its row groups)
        share = [c for p in kept.my_pieces(epoch) for c in real_read(p["path"], row_group=p["row_group"])["case_id"]]
        permutation = np.random.default_rng(kept.order_seed(epoch)).permutation(len(share))
        assert list(rows) == [share[i].as_py() for i in permutation]
        orders.append(list(rows))
    assert len({tuple(order) for order in orders}) == 3  # a new order every epoch
    assert len(reads) == 2 * len(row_groups(demo_prepared.shard_dir, "train"))  # each stream read each group once
    # two ranks: disjoint shares that cover the split, epoch by epoch
    ranks = [_stream(demo_prepared.shard_dir, True, rank, 2) for rank in range(2)]
    for epoch in range(2):
        shares = [set(_epoch(stream, epoch)) for stream in ranks]
        assert not shares[0] & shares[1] and shares[0] | shares[1] == set(orders[0])


def test_an_in_memory_splits_first_epoch_flows_as_its_row_groups_are_read_shuffled_within_a_window(
    ray_cluster, demo_prepared
):
    """While the share is being read (its first epoch), each batch waits for its own row groups only: rows come in
    the epoch's row-group order, permuted within windows of ``data.shuffle_buffer`` rows as the stream shuffles; from
    the next epoch, every group kept, the whole share is permuted."""
    small, again = (_stream(demo_prepared.shard_dir, True, shuffle_buffer=1) for _ in range(2))  # a window: a batch
    pieces = small.my_pieces(0)
    groups = [data_stream.read_shard(p["path"], row_group=p["row_group"])["case_id"].to_pylist() for p in pieces]
    assert len(groups) >= 2 and len(groups[0]) >= small.batch_size
    rows = list(_epoch(small, 0))
    assert rows == list(_epoch(again, 0)) and sorted(rows) == sorted(c for group in groups for c in group)
    assert set(rows[: small.batch_size]) <= set(groups[0])  # the first batch from the first group read, alone
    assert small.in_memory and len(small._kept) == len(pieces)
    whole = list(_epoch(small, 1))  # every group kept: the whole share permuted with the epoch's seed
    share = [c for p in small.my_pieces(1) for c in small._kept[p["path"], p["row_group"]].result()["case_id"]]
    permutation = np.random.default_rng(small.order_seed(1)).permutation(len(share))
    assert whole == [share[i].as_py() for i in permutation]


@pytest.mark.parametrize("seed", range(40))
def test_the_first_epochs_windows_hold_every_row_once_near_its_groups_place(seed):
    """The windowed order over many random row-group layouts: every row exactly once, full batches but the last,
    each row within a window (and a batch's carry) of where its group comes, reproducible, unshuffled when the
    split does not shuffle."""
    rng = np.random.default_rng(seed)
    batch, buffer = int(rng.integers(1, 9)), int(rng.integers(0, 33))
    sizes = [int(n) for n in rng.integers(1, 12, size=int(rng.integers(1, 30)))]
    stream = data_stream.SplitStream.__new__(data_stream.SplitStream)  # the ordering alone: no shards needed
    stream.batch_size, stream.shuffle = batch, buffer
    chunks = stream._windowed_order(sizes, np.random.default_rng(seed))
    order = [tuple(row) for chunk in chunks for row in chunk]
    everything = [(g, r) for g, n in enumerate(sizes) for r in range(n)]
    assert sorted(order) == everything and all(len(chunk) == batch for chunk in chunks[:-1])
    reach = max(buffer, batch) + max(sizes) + batch
    assert all(abs(order.index(row) - k) < reach for k, row in enumerate(everything))
    again = stream._windowed_order(sizes, np.random.default_rng(seed))
    assert all(np.array_equal(a, b) for a, b in zip(chunks, again, strict=True))
    assert [tuple(row) for chunk in stream._windowed_order(sizes, None) for row in chunk] == everything


def test_auto_keeps_a_share_in_memory_only_while_it_fits_half_the_available_memory_over_the_hosts_trial_slots(
    ray_cluster, demo_prepared
):
    pieces = row_groups(demo_prepared.shard_dir, "train")
    for piece in pieces:  # a row group's footer size is what keeping it costs (Arrow's buffers, within 5 %)
        kept = data_stream.read_shard(piece["path"], row_group=piece["row_group"]).nbytes
        assert 0.95 < kept / piece["bytes"] < 1.05
    auto, kept = _stream(demo_prepared.shard_dir, "auto"), _stream(demo_prepared.shard_dir, True)
    assert auto.in_memory and list(_epoch(auto, 0)) == list(_epoch(kept, 0))  # the demo cohort fits: the same rows
    budget = psutil.virtual_memory().available / 2 / os.cpu_count()  # a worker of one CPU: one slot per core
    assert data_stream.in_memory_budget(1) == pytest.approx(budget, rel=0.05)
    assert data_stream.in_memory_budget(2 * os.cpu_count()) == pytest.approx(
        data_stream.in_memory_budget(1) * os.cpu_count(), 0.05
    )
    half, double = [{**pieces[0], "bytes": budget / 2}], [{**pieces[0], "bytes": budget}] * 2
    assert data_stream.keeps_in_memory("auto", half, 1) and not data_stream.keeps_in_memory(
        "auto", double, 1
    )  # the full crop
    larger = [{**pieces[0], "bytes": 1.5 * budget}]  # over one core's slot, within the host's half (2 cores or more)
    assert not data_stream.keeps_in_memory("auto", larger, 1) and data_stream.keeps_in_memory(
        "auto", larger, 4 * os.cpu_count()
    )
    assert data_stream.keeps_in_memory(True, double) and not data_stream.keeps_in_memory(False, half)  # set: as set
    assert not _stream(demo_prepared.shard_dir, False).in_memory


def test_the_stream_counts_the_time_the_loop_waits_for_its_batches(ray_cluster, demo_prepared):
    stream = _stream(demo_prepared.shard_dir, True)
    list(stream.batches(0))
    quick = stream.waited
    collate = stream.collate
    stream.collate = lambda table: time.sleep(0.3) or collate(table)  # a data path slower than the loop
    batches = len(list(stream.batches(1)))
    assert 0 <= quick < 0.3 * batches <= stream.waited + 0.3  # every batch but the one collated ahead was waited for


# --- accumulation ---------------------------------------------------------------------------------------------


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
    """Four micro-batches of 2 with accumulation 4 give the gradients of one batch of 8: the loss of each is a mean
    over equal micro-batches (stage classification), normalisation layers in eval mode (batch statistics differ by
    definition) and no dropout."""
    config = tiny_config(demo_prepared.shard_dir, schema="image_table", **{"data.effective_batch": 8, "amp": "off"})
    torch.manual_seed(0)
    device = torch.device("cpu")
    task, model, layout = build_trial(config, device)
    model.eval()
    batch = first_rows(demo_prepared.shard_dir, "train", 8, layout)
    loss_of = loss_function(task, config, device)

    def gradients(micro_batches: list[dict], accumulation: int) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        probe.accumulate(model, loss_of, micro_batches, accumulation)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole = gradients([batch], 1)
    parts = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
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


# --- DDP on CPU ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_two_worker_ddp_trial_trains_each_rank_on_its_own_rows(ray_cluster, demo_prepared, tmp_path):
    """Two Ray Train workers (gloo) train one trial: one MLflow run, its effective batch 2 ranks x micro-batch x
    accumulation, and the ranks' weights in step (DDP averaged the gradients: the test metrics exist)."""
    document = {
        "description": "two-worker DDP trial",
        "fixed": {
            "task": "stage_classification",
            "schema": "image_only",
            "model.vision": "resnet10_3d",
            "model.vision_kwargs": {"block_inplanes": [4, 8, 8, 8]},
            "model.text": "bert_tiny",
            "model.hidden": 16,
            "optimiser.lr": 1.0e-3,
            "schedule.epochs": 2,
            "data.effective_batch": 4,
            "data.micro_batch": 1,
        },
        "grid": {"seed": [0]},
        "resources": {"workers": 2, "cpus_per_worker": 0.5, "gpus_per_worker": 0},
    }
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    with LocalMlflowServer(tmp_path / "mlflow") as server:
        result = run_sweep(
            SweepOptions(space=str(path), output=tmp_path, data=demo_prepared.shard_dir, mlflow_uri=server.uri)
        )
        assert (result.finished, result.failed) == (1, 0)
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        (child,) = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{result.parent_run_id}'"
        )
        metrics = child.data.metrics
        assert child.info.status == "FINISHED" and child.data.params["resources.workers"] == "2"
        # `auto` kept each rank's share of the tiny cohort in memory, and the run says so split by split
        assert {s: child.data.tags[f"gx_ray.in_memory.{s}"] for s in ("train", "val", "test")} == dict.fromkeys(
            ("train", "val", "test"), "true"
        )
        assert (metrics["micro_batch"], metrics["accumulation"], metrics["effective_batch"]) == (1, 2, 4)
        assert np.isfinite(metrics["train_loss"]) and "test_accuracy" in metrics
        losses = [m.step for m in client.get_metric_history(child.info.run_id, "train_loss")]
        assert losses == [0, 1]  # rank 0 logs each epoch once


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


def test_the_projection_spreads_every_cell_over_the_gpus_with_the_measured_packing():
    from benchmarks.cluster import GASTRIC_X, PAPER_ABLATION, project
    from gx_ray.schema import PAPER_TASKS as TASKS

    cells = {}
    for i, task in enumerate(TASKS):
        for schema, rate in (("image_only", 40.0 + i), ("image_table_bbox", 20.0 + i)):
            cells[f"{task}/{schema}"] = {
                "train_samples_per_s": rate,
                "eval_seconds_per_row": 0.01,
                "startup_seconds": 5.0,
                "warmup_seconds": 30.0 + i,
                "gpu_share": 0.5,
            }
    figures = project({"cells": cells, "scheduling_efficiency": 0.8}, gpus=8)
    trials = PAPER_ABLATION["schemas"] * PAPER_ABLATION["seeds"]
    jobs = []
    for i, _ in enumerate(TASKS):  # the slower (heavier) schema stands for all four; warm-up once a trial
        epoch = GASTRIC_X["train"] / (20.0 + i) + GASTRIC_X["val"] * 0.01
        jobs += [(PAPER_ABLATION["epochs"] * epoch + 5.0 + 30.0 + i) * 0.5] * trials
    assert figures["hours_at_slice_efficiency"] == pytest.approx(sum(jobs) / 8 / 0.8 / 3600)
    # longest first on the least loaded GPU: never below the even spread, never more than one trial above it
    assert sum(jobs) / 8 / 3600 <= figures["hours"] <= (sum(jobs) / 8 + max(jobs)) / 3600
    whole_cards = {k: {**c, "gpu_share": 1.0} for k, c in cells.items()}
    assert all(t["trials_per_gpu"] == 2 for t in figures["per_task"].values())
    assert project({"cells": whole_cards}, gpus=8)["hours"] > 1.9 * figures["hours"]  # twice the GPU-seconds
    # a task the slice did not measure leaves the projection undefined, never silently smaller
    partial = {k: v for k, v in cells.items() if not k.startswith("vqa/")}
    assert np.isnan(project({"cells": partial}, gpus=8)["hours"])


def test_a_trial_process_imports_none_of_the_drivers_machinery():
    """Trials unpickle ``gx_ray.sweep.trial.run_trial``: importing it must not pull in the MLflow server, Optuna,
    data preparation, the analysis, or peft and transformers' trainer (seconds of start-up in every trial process; a
    LoRA model imports peft when it is built)."""
    import subprocess
    import sys

    code = (
        "import sys, gx_ray.sweep.trial; "
        "print(sorted(m for m in sys.modules if m.startswith(('gx_ray.tracking.server', 'optuna', 'SimpleITK', "
        "'gx_ray.analysis', 'gx_ray.data.prepare', 'gx_ray.sweep.driver', 'peft', 'transformers.trainer'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_what_a_sweep_driver_reads_of_a_task_imports_no_monai_nor_transformers():
    """The driver reads each task's class (its primary metric, direction, labels, whether it packs on a GPU) before
    the trials start and again for the report: MONAI's package import (seconds: it loads every submodule) and
    transformers' belong to the processes that build a model, not to the driver's launch → first step."""
    import subprocess
    import sys

    code = (
        "import sys; from gx_ray.tasks import task_class; from gx_ray.schema import PAPER_TASKS; "
        "print([(t, task_class(t).shares_a_gpu) for t in PAPER_TASKS]); "
        "print(sorted(m for m in sys.modules if m.startswith(('monai', 'transformers', 'gx_ray.tasks.retinanet'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    classes, modules = out.strip().splitlines()
    assert "('lesion_detection', False)" in classes and modules == "[]", out


class _StoppedByTheScheduler(Exception):
    """What a scheduler's stop looks like to the loop: its report never returns."""


def test_the_run_ends_before_the_last_report_which_a_scheduler_may_stop_the_trial_at(ray_cluster, demo_prepared):
    """ASHA stops every trial at the report of its last epoch, and nothing after that report runs: the hook that
    ends the trial's run (status, telemetry) is called once the test split is scored, before that report."""
    config = TrialConfig.from_flat(
        {"task": "stage_classification", "data.shards": str(demo_prepared.shard_dir), "schedule.epochs": 2,
         "schedule.max_steps_per_epoch": 1, "data.effective_batch": 2, "model.vision": "resnet10_3d",
         "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.text": "bert_tiny",
         "model.fusion": "concat", "model.hidden": 32}
    )  # fmt: skip
    calls = []

    def report(metrics: dict, checkpoint=None) -> None:
        calls.append(("report", "test_primary" in metrics))
        if "test_primary" in metrics:
            raise _StoppedByTheScheduler

    ctx = loop.WorkerContext(
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        report=report,
        latest_checkpoint=None,
        before_final_report=lambda: calls.append("end"),
    )
    with pytest.raises(_StoppedByTheScheduler):
        loop.run_loop(config, ctx)
    assert calls == [("report", False), "end", ("report", True)]


RESUMED_TASKS = {
    "stage_classification": {},
    # the demo preset's report writing: its own vocabulary, the final epoch tested
    "report_generation": {"task_options.vocabulary": "training", "task_options.max_report_tokens": 24,
                          "task_options.max_new_tokens": 8, "schedule.select": "last"},
}  # fmt: skip


@pytest.mark.parametrize("task", RESUMED_TASKS)
def test_a_trial_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(ray_cluster, demo_prepared, tmp_path, task):
    """A trial retried from its last checkpoint (its worker or node lost) trains on exactly as if nothing happened:
    the checkpoint keeps the random generators' state with the weights (dropout draws from torch's), so every later
    epoch's loss and validation, and the test score, are the uninterrupted run's, bit for bit on the CPU."""
    from ray.train import Checkpoint

    config = TrialConfig.from_flat(
        {"task": task, "data.shards": str(demo_prepared.shard_dir), "schedule.epochs": 3,
         "schedule.max_steps_per_epoch": 2, "data.effective_batch": 2, "model.vision": "resnet10_3d",
         "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.text": "bert_tiny",
         "model.fusion": "concat", "model.hidden": 32, "seed": 3, "data.in_memory": True, "data.shuffle_buffer": 2,
         **RESUMED_TASKS[task]}
    )  # fmt: skip

    def run(latest: Checkpoint | None) -> list[dict]:
        reports: list[dict] = []

        def report(metrics: dict, checkpoint: Checkpoint | None = None) -> None:
            reports.append(dict(metrics))
            if checkpoint is not None and metrics["epoch"] == 0:  # the one a retried trial would start from
                checkpoint.to_directory(str(tmp_path / "epoch0"))

        loop.run_loop(
            config,
            loop.WorkerContext(
                rank=0, world_size=1, device=torch.device("cpu"), report=report, latest_checkpoint=latest
            ),
        )
        return reports

    whole = run(None)
    torch.manual_seed(12345)  # a retried trial's process has drawn other numbers before it resumes
    random.seed(12345)
    np.random.seed(12345)
    resumed = run(Checkpoint.from_directory(str(tmp_path / "epoch0")))
    assert [r["epoch"] for r in whole] == [0, 1, 2] and [r["epoch"] for r in resumed] == [1, 2]
    compared = ("train_loss", "val_primary", "val_accuracy", "test_primary", "test_accuracy")  # None where none
    for before, after in zip(whole[1:], resumed, strict=True):
        assert {k: before.get(k) for k in compared} == {k: after.get(k) for k in compared}
    assert whole[-1]["train_loss"] != whole[-2]["train_loss"]  # the epochs did train


def test_select_last_tests_the_final_epochs_model_where_best_tests_the_best_validated_one(
    ray_cluster, demo_prepared, tmp_path
):
    """``schedule.select``: the same training either way (same seed, same per-epoch validation); ``last`` scores the
    test split with the final epoch's weights (as the last checkpoint keeps them, re-scored here from scratch),
    ``best`` with the best-validated epoch's; anything else is refused naming the key."""
    from ray.train import Checkpoint

    flat = {"task": "vqa", "data.shards": str(demo_prepared.shard_dir), "schedule.epochs": 4,
            "schedule.max_steps_per_epoch": 2, "data.effective_batch": 2, "model.vision": "resnet10_3d",
            "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.text": "bert_tiny",
            "model.fusion": "concat", "model.hidden": 32, "seed": 5}  # fmt: skip

    def run(select: str) -> tuple[TrialConfig, list[dict], Path]:
        config = TrialConfig.from_flat({**flat, "schedule.select": select})
        reports: list[dict] = []
        kept = tmp_path / select

        def report(metrics: dict, checkpoint: Checkpoint | None = None) -> None:
            reports.append(dict(metrics))
            if checkpoint is not None and metrics["epoch"] == config.schedule.epochs - 1:
                checkpoint.to_directory(str(kept))

        loop.run_loop(
            config,
            loop.WorkerContext(rank=0, world_size=1, device=torch.device("cpu"), report=report, latest_checkpoint=None),
        )
        return config, reports, kept

    def rescored(config: TrialConfig, kept: Path) -> float:
        task, model, layout = build_trial(config, torch.device("cpu"))
        state = torch.load(kept / loop.CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        stream = data_stream.SplitStream(
            config.data, "test", layout, config.data.eval_batch_size or 2, seed=config.seed
        )
        return loop.evaluate(model, task, stream, config, torch.device("cpu"))[0][task.primary_metric]

    last_config, last, last_kept = run("last")
    best_config, best, best_kept = run("best")
    assert [r["val_primary"] for r in last] == [r["val_primary"] for r in best]  # the same training
    assert last[-1]["best_epoch"] == 3 and last[-1]["best_val_primary"] == last[-1]["val_primary"]
    assert last[-1]["test_primary"] == pytest.approx(rescored(last_config, last_kept), abs=1e-9)
    vals = [r["val_primary"] for r in best]
    assert best[-1]["best_epoch"] == vals.index(max(vals)) < 3  # (not the last here: the two selections differ)
    tested = [torch.load(k / loop.CHECKPOINT_FILE, weights_only=True)["model"] for k in (last_kept, best_kept)]
    assert any(not torch.equal(tested[0][name], tested[1][name]) for name in tested[0])  # two models were tested
    assert best[-1]["test_primary"] == pytest.approx(rescored(best_config, best_kept), abs=1e-9)
    with pytest.raises(ValueError, match="schedule.select"):
        TrialConfig.from_flat({**flat, "schedule.select": "worst"})
