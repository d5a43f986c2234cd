"""How a trial reads its data: the data section of its config, and one split's batches for one rank, epoch by epoch,
streamed through Ray Data or kept in memory, in a seeded order that a resumed trial draws again.

The row groups of a split are ordered by a seed per epoch (training only) and dealt to the ranks, so every rank reads
its own rows with no coordinator between ranks; the next epoch's first batch is fetched while this epoch validates.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import torch

from gx_ray.data.folds import FOLDED_SPLITS, fold_rows
from gx_ray.data.shards import (
    TENSOR_COLUMNS,
    BatchCollate,
    TensorLayout,
    open_shard,
    rank_pieces,
    read_shard,
    read_split,
    row_groups,
    split_files,
    to_device,
)
from gx_ray.schema import AUTO

IN_MEMORY_SHARE_OF_SLOT = 1 / 2
"""``data.in_memory: auto`` keeps a split whose share is at most this fraction of the host memory available over the
trial workers the host's CPUs hold (its cores over ``resources.cpus_per_worker``): trials start side by side and each
sees the memory before the others fill it, and Ray starts no more of them than the CPUs hold, so however many start
at once their kept training splits take at most half of it."""


@dataclass(frozen=True)
class DataConfig:
    shards: str = ""
    """The shard folder (``prepare_data`` output's ``shards/``); filled in by the sweep."""
    folds_file: str = ""
    """A fold assignment (:mod:`gx_ray.data.folds`); filled in by a sweep whose space asks for ``cv``."""
    fold: int | None = None
    """The cross-validation fold this trial validates on (it trains on the others); None: the cohort's own
    train/val split. A sweep with ``cv`` makes it a grid axis."""
    refit: bool = False
    """Train on the training and validation patients together: the final model of a chosen configuration
    (``jobs/finalize.py``). Validation still runs each epoch, but on patients the model trained on: its scores choose
    nothing (``schedule.select: last``)."""
    effective_batch: int = 32
    """Samples per optimiser step, over all ranks and accumulation steps: the batch size a paper reports."""
    micro_batch: int | str = AUTO
    """Samples per rank per forward pass; ``auto``: the whole per-rank batch on the CPU, on a GPU the largest divisor
    of it whose training step fits the trial's share of the card (measured). Accumulation makes up the rest."""
    eval_batch_size: int | None = None
    """Samples per rank per evaluation forward pass; None: the micro-batch."""
    shuffle_buffer: int = 16
    """Rows in the local shuffle buffer, on top of a seeded per-epoch order of row groups (8 rows each)."""
    read_cpus: float = 0.0
    """CPUs each read task asks for. 0: the trial's workers already hold the CPUs the sweep gave them, and a read
    task that waits for one more would wait for ever on a machine whose CPUs the trials fill; reading then runs
    beside training, ``read_concurrency`` tasks at a time per split."""
    read_concurrency: int = 2
    in_memory: bool | str = AUTO
    """Read this rank's row groups once and keep them in the trial's memory; each epoch then takes them in its seeded
    order with its rows permuted, instead of streaming the split through Ray Data again. ``auto``: a split is kept
    when this rank's share of it, uncompressed, is at most half of the host memory available as the trial starts over
    the trial workers the host's CPUs hold (:data:`IN_MEMORY_SHARE_OF_SLOT`), streamed otherwise (the paper's full
    crop at Gastric-X size).

    Why: on a GPU node full of trials a streamed trial trains at a fraction of its raw step while its card idles
    (lesion detection 0.11-0.15 of raw beside six neighbour trials on 4 x H200; kept in memory 0.94:
    docs/benchmarks.md); on two cores a stream's start-up costs 0.1-3 s per epoch and split, most of a short trial."""

    def per_rank_batch(self, workers: int) -> int:
        return self.effective_batch // workers

    def accumulation(self, workers: int, micro_batch: int) -> int:
        """Micro-batches per optimiser step on each rank."""
        return self.per_rank_batch(workers) // micro_batch


@dataclass(frozen=True, kw_only=True)
class Reader:
    """Who reads a :class:`SplitStream`: rank ``rank`` of ``world_size``, onto ``device``, in a trial worker holding
    ``cpus_per_worker`` CPUs (``data.in_memory: auto`` shares the host's memory over the workers its CPUs hold)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    cpus_per_worker: float = 1.0


class SplitStream:
    """One split's batches for one rank, epoch by epoch, on the device.

    The row groups are ordered by a seed per epoch (training only) and dealt to the ranks, so every rank streams its
    own rows and an epoch's batches are the same on every run with the same seed. :meth:`prefetch` starts the next
    epoch's stream (its first batch waits for reads and the shuffle buffer to fill) while the current epoch ends.
    """

    def __init__(
        self, data: DataConfig, split: str, layout: TensorLayout, batch_size: int, *, seed: int,
        reader: Reader = Reader(),
    ):  # fmt: skip
        self.data, self.split, self.layout, self.batch_size, self.seed = data, split, layout, batch_size, seed
        self.rank, self.world_size, self.device = reader.rank, reader.world_size, reader.device
        self.pieces = split_pieces(data, split)
        self.shuffle = data.shuffle_buffer if split == "train" else 0
        self.collate = BatchCollate(layout, pin_memory=self.device.type == "cuda")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prefetch-{split}")
        self._next: tuple[int, Iterator, Future] | None = None
        self._kept: dict[tuple[str, int], Future] = {}
        """Row groups read or being read, with ``data.in_memory``: (path, row group) → the read's table."""
        self.waited = 0.0
        self.in_memory = keeps_in_memory(data.in_memory, self.my_pieces(0), reader.cpus_per_worker)
        self._collator = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"collate-{split}")
        """With ``data.in_memory``: collates (and pins) the next batch while the loop trains on this one, as Ray's
        prefetch threads do for a stream."""
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"read-{split}")
        """With ``data.in_memory``: reads the row groups, in the order an epoch first asks for them."""

    def order_seed(self, epoch: int) -> int | None:
        return self.seed * 1000 + epoch if self.split == "train" else None

    def my_pieces(self, epoch: int, rank: int | None = None) -> list[dict[str, Any]]:
        rank = self.rank if rank is None else rank
        return rank_pieces(self.pieces, rank, self.world_size, self.order_seed(epoch))

    def fewest_rows(self, epoch: int) -> int:
        """The rows of the rank with fewest this epoch: every rank takes as many optimiser steps as it allows."""
        return min(sum(p["rows"] for p in self.my_pieces(epoch, r)) for r in range(self.world_size))

    def _iterator(self, epoch: int) -> Iterator[dict]:
        data = self.data
        if self.in_memory:
            return self._kept_batches(epoch)
        dataset = read_split(
            data.shards, self.split, num_cpus=data.read_cpus, concurrency=data.read_concurrency,
            pieces=self.my_pieces(epoch),
        )  # fmt: skip
        seed = self.order_seed(epoch)
        batches = dataset.iter_torch_batches(
            batch_size=self.batch_size,
            collate_fn=self.collate,
            prefetch_batches=2,
            local_shuffle_buffer_size=max(self.shuffle, self.batch_size) if self.shuffle else None,
            local_shuffle_seed=seed if self.shuffle else None,
        )
        return iter(batches)

    def _kept_batches(self, epoch: int) -> Iterator[dict]:
        """``data.in_memory``: the epoch's row groups (each read once, pages verified) in its order. A reader thread
        reads the groups an epoch asks for first in the epoch's order. In epoch 0 the rows flow as their groups arrive,
        shuffled within windows of ``data.shuffle_buffer`` rows as the stream shuffles: the first batch waits for its
        own groups, not for the whole share (11.5 s of a 9.5 GB share on an H200 node). Every later epoch permutes the
        whole share with the epoch's seed when training shuffles, whether or not this process has read its groups
        yet: a trial resumed at epoch k (its first here) draws epoch k's batches as the uninterrupted trial did."""
        pieces = self.my_pieces(epoch)
        keys = [(piece["path"], piece["row_group"]) for piece in pieces]
        for key, piece in zip(keys, pieces, strict=True):  # read in the epoch's order, each group once
            if key not in self._kept:
                self._kept[key] = self._reader.submit(read_piece, piece)
        rng = np.random.default_rng(self.order_seed(epoch)) if self.shuffle else None
        # the order depends on the epoch and the seed only: never on how fast the reads went, nor on which epoch this
        # process started at (choosing the windowed order by "some group unread" trained a resumed trial on another
        # order: report generation's ROUGE-L 28.3 against 46.0 uninterrupted, killed at epoch 3 of 6)
        if epoch == 0:
            chunks = self._windowed_order([piece["rows"] for piece in pieces], rng)
        else:
            starts = np.cumsum([0] + [piece["rows"] for piece in pieces])
            order = rng.permutation(starts[-1]) if rng is not None else np.arange(starts[-1])
            group = np.searchsorted(starts, order, side="right") - 1
            rows = np.stack([group, order - starts[group]], axis=1)
            chunks = [rows[start : start + self.batch_size] for start in range(0, len(rows), self.batch_size)]

        def collated(chunk: np.ndarray) -> dict:
            """The rows ``chunk`` (row group, row) in that order, sliced from their own row groups and copied once: a
            take on the concatenated share would copy the whole share for every batch (Arrow joins a column's chunks
            first: 2.7 samples/s against 37 streamed at the bench shape, H200)."""
            rows = pa.concat_tables([self._kept[keys[g]].result().slice(i, 1) for g, i in chunk])
            return self.collate(rows.combine_chunks())

        ahead = [self._collator.submit(collated, chunk) for chunk in chunks[:1]]
        for chunk in chunks[1:]:  # one batch gathered and collated ahead, in its own thread
            ahead.append(self._collator.submit(collated, chunk))
            yield ahead.pop(0).result()
        yield from (batch.result() for batch in ahead)

    def _windowed_order(self, group_rows: list[int], rng: np.random.Generator | None) -> list[np.ndarray]:
        """Batches of (row group, row) in the groups' order, the rows of each window of consecutive groups (at least
        ``data.shuffle_buffer`` rows) permuted together, after the few rows the window before left over."""
        window = max(self.shuffle, self.batch_size)
        chunks, carried, filling = [], np.empty((0, 2), dtype=np.int64), []
        for g, count in enumerate(group_rows):
            filling.append(np.stack([np.full(count, g), np.arange(count)], axis=1))
            last = g == len(group_rows) - 1
            if sum(map(len, filling)) < window and not last:
                continue
            rows = np.concatenate(filling)
            pending = np.concatenate([carried, rows[rng.permutation(len(rows))] if rng is not None else rows])
            whole = len(pending) if last else len(pending) // self.batch_size * self.batch_size
            chunks += [pending[start : start + self.batch_size] for start in range(0, whole, self.batch_size)]
            carried, filling = pending[whole:], []
        return chunks

    def prefetch(self, epoch: int) -> None:
        """Start the stream of ``epoch`` now: its first batch is fetched in the background."""
        if self._next is None or self._next[0] != epoch:
            iterator = self._iterator(epoch)
            self._next = (epoch, iterator, self._pool.submit(next, iterator, None))

    def batches(self, epoch: int) -> Iterator[dict]:
        """The epoch's batches on the device, each copied while the one before it trains. ``waited``: the seconds the
        loop has spent in this epoch waiting for a batch (the data path not keeping up)."""
        self.prefetch(epoch)
        _, iterator, first = self._next
        self._next = None
        asked = time.perf_counter()
        batch = first.result()
        self.waited = time.perf_counter() - asked
        if batch is None:
            return
        current = on_device(batch, self.device)
        while True:
            asked = time.perf_counter()
            batch = next(iterator, None)
            self.waited += time.perf_counter() - asked
            if batch is None:
                break
            upcoming = on_device(batch, self.device)
            yield current
            current = upcoming
        yield current


def keeps_in_memory(setting: bool | str, pieces: list[dict[str, Any]], cpus_per_worker: float = 1.0) -> bool:
    """``data.in_memory`` for a rank's share of a split: as set, or with ``auto`` whether the share (uncompressed)
    is at most :func:`in_memory_budget` bytes."""
    if setting != AUTO:
        return bool(setting)
    return sum(p["bytes"] for p in pieces) <= in_memory_budget(cpus_per_worker)


def in_memory_budget(cpus_per_worker: float) -> float:
    """:data:`IN_MEMORY_SHARE_OF_SLOT` of the host memory available now, over the trial workers its CPUs hold (a
    1 x H200 VM of 16 cores and 126 GiB, 4 CPUs a worker: 15.7 GB; a sixteenth of the host, the rule before, kept the
    bench cohort's 9.5 GB share out of memory there, and streamed VQA trained at 0.31 of its raw step)."""
    slots = max(1, int((os.cpu_count() or 1) / cpus_per_worker))  # the config holds cpus_per_worker positive
    return IN_MEMORY_SHARE_OF_SLOT * psutil.virtual_memory().available / slots


def on_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A batch with its volumes on ``device`` (asynchronously, from pinned memory); the rest stays on the host."""
    return to_device(batch, device, keys=TENSOR_COLUMNS)


def split_rows(
    shard_dir: str, split: str, folds_file: str = "", fold: int | None = None, refit: bool = False
) -> list[dict]:
    """A split's rows without the image columns (what a task may learn from, e.g. VQA answers); with a ``fold``, the
    rows of that fold's ``train`` or ``val`` (their ``split`` says so); with ``refit``, ``train`` is the training and
    validation rows (all marked ``train``: they are what the final model learns from)."""
    if refit and split == "train":
        return [{**row, "split": "train"} for source in FOLDED_SPLITS for row in split_rows(shard_dir, source)]
    if fold is None or split == "test":
        files = split_files(shard_dir, split)
        columns = [c for c in open_shard(files[0]).schema_arrow.names if c not in TENSOR_COLUMNS]
        return [row for f in files for row in read_shard(f, columns=columns).to_pylist()]
    pieces = split_pieces(DataConfig(shards=shard_dir, folds_file=folds_file, fold=fold), split)
    columns = [c for c in open_shard(pieces[0]["path"]).schema_arrow.names if c not in TENSOR_COLUMNS]
    return [{**row, "split": split} for piece in pieces for row in read_piece(piece, columns).to_pylist()]


def split_pieces(data: DataConfig, split: str) -> list[dict[str, Any]]:
    """The row groups ``split`` reads (:func:`~gx_ray.data.shards.row_groups`); under a cross-validation fold, the
    training and validation shards' row groups that hold the fold's rows, each with the rows it keeps (``keep``)."""
    if data.refit and data.fold is not None:
        raise ValueError("data.refit trains on every training and validation patient: it takes no data.fold")
    if data.refit and split == "train":
        return [piece for source in FOLDED_SPLITS for piece in row_groups(data.shards, source)]
    if data.fold is None or split == "test":
        return row_groups(data.shards, split)
    if not data.folds_file:
        raise ValueError("data.fold needs data.folds_file: a sweep whose space sets cv fills it in")
    keep = fold_rows(data.shards, split, data.folds_file, data.fold)
    pieces = []
    for piece in (p for source in FOLDED_SPLITS for p in row_groups(data.shards, source)):
        rows = keep.get((piece["path"], piece["row_group"]))
        if rows:  # a row group's bytes in proportion to the rows kept: what keeping it in memory costs
            pieces.append(
                {**piece, "rows": len(rows), "keep": rows, "bytes": piece["bytes"] * len(rows) // piece["rows"]}
            )
    return pieces


def read_piece(piece: dict[str, Any], columns: list[str] | None = None) -> pa.Table:
    """One row group of :func:`split_pieces`, only the rows it keeps."""
    table = read_shard(piece["path"], columns=columns, row_group=piece["row_group"])
    return table.take(piece["keep"]) if piece.get("keep") is not None else table


def first_rows(shard_dir: Path | str, split: str, rows: int, layout: TensorLayout) -> dict[str, Any]:
    """The first ``rows`` rows of a split as one collated batch (what a probe step trains on)."""
    tables = []
    for f in split_files(shard_dir, split):
        for batch in open_shard(f).iter_batches(batch_size=rows):  # page checksums verified
            tables.append(batch)
            if sum(len(b) for b in tables) >= rows:
                break
        if sum(len(b) for b in tables) >= rows:
            break
    return slice_batch(BatchCollate(layout)(pa.Table.from_batches(tables).slice(0, rows)), rows)


def slice_batch(batch: dict[str, Any], rows: int) -> dict[str, Any]:
    """The first ``rows`` samples of a collated batch; a batch smaller than ``rows`` is repeated to fill it."""
    size = len(batch["case_id"])
    index = [i % size for i in range(rows)]
    return {k: v[index] if isinstance(v, torch.Tensor) else [v[i] for i in index] for k, v in batch.items()}
