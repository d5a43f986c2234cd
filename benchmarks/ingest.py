"""`python jobs/benchmark.py ingest`: how fast cases are preprocessed, and how fast shards reach a training loop.

Three figures from one run, on the same files:

* preprocessing: demo cases per minute per core (Appendix-B pipeline at the chosen preset);
* raw: one process reading the Parquet shards with pyarrow alone into tensors (the ceiling);
* stream: the Ray Data path training uses (``read_split`` → ``iter_torch_batches`` with ``BatchCollate``),
  per consumer; with several consumers the dataset is ``streaming_split`` between Ray actors, like DDP ranks.

The stream is measured on the same rows replicated to ``stream_rows`` so an epoch is long enough to time;
every pass reads files already in the page cache, as a second epoch of training does.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from gx_ray.data.demo.cohort import DemoConfig, generate_cohort
from gx_ray.data.prepare import PrepareConfig, prepare_shards
from gx_ray.data.preprocess import PreprocessConfig
from gx_ray.data.shards import (
    BatchCollate,
    ShardWriter,
    TensorLayout,
    fixed_tensor,
    open_shard,
    read_manifest,
    read_shard,
    read_split,
    split_files,
    write_manifest,
)
from gx_ray.runtime import init_ray

SHARD_ROWS = 64
"""Rows per replicated shard file (as ``prepare_data``'s default)."""


@dataclass(frozen=True)
class IngestBenchmarkConfig:
    cases: int = 16
    preset: str = "bench"
    stream_rows: int = 384
    batch_size: int = 8
    consumers: int = 1
    epochs: int = 3
    cpus: int | None = None
    codec: str = "lz4"


def _replicate_rows(prepared: Path, out: Path, rows: int, codec: str) -> Path:
    """A train split of ``rows`` rows cycling through the prepared cases (real content, realistic compression)."""
    return replicate_splits(prepared, out, {"train": rows}, codec)


def replicate_splits(
    prepared: Path, out: Path, rows: dict[str, int], codec: str = "lz4", threads: int | None = None
) -> Path:
    """Shards whose splits hold ``rows[split]`` rows each, cycling through every prepared case (real content,
    realistic compression): a cohort of a chosen size for throughput benchmarks. Each row is a new patient id, but
    the same case appears in several splits: never use it for a metric, only for a rate.

    Each shard file is written by a thread of its own (``threads``, default one per core): Parquet's compression and
    the files' SHA-256 run outside the GIL, and the cluster benchmark's 1,700 rows of 8 MB took 40 s in one thread
    (4 x H200), a tenth of its ten-minute command."""
    tables = [read_shard(p) for p in sorted(prepared.glob("*.parquet"))]
    source = [row for table in tables for row in table.to_pylist()]
    schema = tables[0].schema
    parts = [(split, start, min(start + SHARD_ROWS, count)) for split, count in rows.items() for start in
             range(0, count, SHARD_ROWS)]  # fmt: skip

    def write(part: tuple[str, int, int]) -> list[dict]:
        split, start, stop = part
        writer = ShardWriter(out, schema, SHARD_ROWS, 8, codec, first_shard=start // SHARD_ROWS)
        for i in range(start, stop):
            case = f"R{split[:2]}{i:05d}"
            writer.write(dict(source[i % len(source)], case_id=case, patient_id=case, split=split))
        return writer.close()

    with ThreadPoolExecutor(max(1, min(len(parts), threads or os.cpu_count() or 1))) as pool:
        files = sorted((f for written in pool.map(write, parts) for f in written), key=lambda f: f["file"])
    write_manifest(out, files, TensorLayout.from_schema(schema), {"replicated_from": str(prepared)}, codec)
    return out


def _raw_rate(files: list[Path], layout: TensorLayout, batch_size: int) -> float:
    start, rows = time.perf_counter(), 0
    for path in files:
        # checksums verified, as every read in training does: the rate measured is the rate training gets
        for batch in open_shard(path).iter_batches(batch_size=batch_size, columns=["ct", "stage_label"]):
            ct = torch.from_numpy(fixed_tensor(batch.column(0), layout.ct_shape, np.float16))
            rows += ct.shape[0]
    return rows / (time.perf_counter() - start)


def _consume(iterator: Any, layout: TensorLayout, batch_size: int) -> tuple[int, float]:
    start, rows = time.perf_counter(), 0
    batches = iterator.iter_torch_batches(batch_size=batch_size, collate_fn=BatchCollate(layout), prefetch_batches=4)
    for batch in batches:
        rows += batch["ct"].shape[0]
    return rows, time.perf_counter() - start


@ray.remote(num_cpus=0)
class _Consumer:
    def run(self, shard: Any, layout: TensorLayout, batch_size: int) -> tuple[int, float]:
        return _consume(shard, layout, batch_size)


def _stream_rates(shard_dir: Path, layout: TensorLayout, config: IngestBenchmarkConfig) -> list[float]:
    """Samples/s of each consumer, averaged over the passes after the first (warm-up) one."""
    passes = []
    for _ in range(config.epochs):
        dataset = read_split(shard_dir, "train", columns=["ct", "stage_label"])
        if config.consumers == 1:
            results = [_consume(dataset.iterator(), layout, config.batch_size)]
        else:
            shards = dataset.streaming_split(config.consumers, equal=True)
            actors = [_Consumer.remote() for _ in shards]
            results = ray.get([a.run.remote(s, layout, config.batch_size) for a, s in zip(actors, shards, strict=True)])
        passes.append([rows / seconds for rows, seconds in results])
    return [float(r) for r in np.mean(passes[1:] or passes, axis=0)]


def run_ingest_benchmark(out: Path, config: IngestBenchmarkConfig = IngestBenchmarkConfig()) -> dict[str, Any]:
    init_ray(num_cpus=config.cpus)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    out = Path(out)
    generate_cohort(out / "raw", DemoConfig(cases=config.cases, seed=0))
    prepare_config = PrepareConfig(preprocess=PreprocessConfig.preset(config.preset), endoscopy_size=64)
    start = time.perf_counter()
    prepared = prepare_shards(out / "raw", out / "prepared", prepare_config)
    prep_seconds = time.perf_counter() - start
    stream_dir = _replicate_rows(prepared.shard_dir, out / f"stream-{config.codec}", config.stream_rows, config.codec)
    manifest = read_manifest(stream_dir)
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    volume_mb = float(np.prod(layout.ct_shape)) * 2 / 1e6
    files = split_files(stream_dir, "train")
    raw_passes = [_raw_rate(files, layout, config.batch_size) for _ in range(config.epochs)]
    raw = float(np.mean(raw_passes[1:] or raw_passes))
    stream = _stream_rates(stream_dir, layout, config)
    cases_done = sum(prepared.rows.values())
    result = {
        "config": asdict(config),
        "cpus": cpus,
        "ct_shape": list(layout.ct_shape),
        "volume_mb": round(volume_mb, 2),
        "preprocess_cases_per_min_per_core": round(cases_done / prep_seconds * 60 / cpus, 2),
        "preprocess_seconds": round(prep_seconds, 1),
        "raw_samples_per_s": round(raw, 1),
        "raw_mb_per_s": round(raw * volume_mb, 1),
        "stream_samples_per_s_per_consumer": [round(r, 1) for r in stream],
        "stream_mb_per_s_per_consumer": [round(r * volume_mb, 1) for r in stream],
        "stream_over_raw": round(float(np.mean(stream)) / raw, 3),
        "codec": config.codec,
        "bytes_on_disk_per_sample": round(sum(f["bytes"] for f in manifest["files"]) / config.stream_rows),
    }
    (out / "ingest_benchmark.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def format_ingest_result(result: dict[str, Any]) -> str:
    shape = "×".join(map(str, result["ct_shape"]))
    stream = ", ".join(f"{r:.1f}" for r in result["stream_samples_per_s_per_consumer"])
    on_disk = result["bytes_on_disk_per_sample"] / 1e6
    return "\n".join(
        [
            f"ingest benchmark on {result['cpus']} CPUs, CT {shape} float16 ({result['volume_mb']} MB per sample, "
            f"{on_disk:.2f} MB on disk with {result['codec']})",
            f"  preprocessing       {result['preprocess_cases_per_min_per_core']:8.1f} cases/min per core",
            f"  raw pyarrow         {result['raw_samples_per_s']:8.1f} samples/s  {result['raw_mb_per_s']:8.1f} MB/s",
            f"  Ray Data stream     {stream} samples/s per consumer "
            f"({', '.join(f'{m:.0f}' for m in result['stream_mb_per_s_per_consumer'])} MB/s)",
            f"  stream / raw        {result['stream_over_raw']:8.2f}   (target ≥ 0.80)",
        ]
    )
