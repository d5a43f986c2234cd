"""The training data stream (:mod:`gx_ray.data.stream`): per-rank parts of a split, in-memory splits in a seeded
order per epoch, the first epoch's windowed order, the ``auto`` memory rule and the time the loop waits."""

from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest
import torch

from gx_ray.data import stream as data_stream
from gx_ray.data.shards import TensorLayout, rank_pieces, read_manifest, row_groups
from gx_ray.train.config import TrialConfig


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
    reader = data_stream.Reader(rank=rank, world_size=world)
    return data_stream.SplitStream(config.data, "train", layout, 3, seed=config.seed, reader=reader)


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
