"""Preprocessed cases as Parquet shards, their manifest, and the streaming Ray Dataset that training reads.

One row per case. The CT phases travel as one ``large_binary`` column of raw float16 bytes, shape and dtype in the
schema metadata: five times faster to read than a tensor column (measured), and a whole batch becomes one tensor
without an element-wise copy (``np.frombuffer`` over Arrow's buffer). Shards are written per split
(``train-00000.parquet`` ...); ``manifest.json`` lists every file with its rows, size and SHA-256.

Integrity: every page carries a CRC-32 that every read verifies, so a flipped bit fails the read naming the file
instead of turning into wrong voxels; :func:`check_shards` (a sweep opening ``--data``) checks sizes and footers.

Row layout (all fixed-size lists are in :mod:`gx_ray.schema` order):

=====================  =========================================================================
``case_id``            case folder name; ``patient_id``: the patient (splits are per patient)
``split``              train / val / test
``ct``                 float16 bytes of ``(len(PHASES), D, H, W)``, z-scored per phase; ``phase_present``: bool
                       per phase; ``ct_hu_mean``, ``ct_hu_std``: per phase, what the z-score divided out (HU,
                       NaN where absent; format 2), so :func:`hounsfield` recovers HU for windowed views
``endoscopy``          uint8 bytes of ``(3, S, S)`` RGB or null; ``endoscopy_present``
``labs``               float32 per numeric model-input variable (NaN if missing); ``labs_missing``
``lab_abnormal``       abnormal values as short text descriptors (paper Sec. 4)
``boxes``              int32 ``(len(PHASES), len(BOX_LEVELS), 6)`` on the CT grid; ``box_present``
``t`` ``n`` ``m``      pathological categories; ``stage`` (e.g. IIIA); ``stage_label``: index in
                       STAGE_GROUPS or -1
``<report kind>``      English reports; ``<report kind>_zh``: Chinese
``vqa``, ``vqa_zh``    list of {question, answer, category}
=====================  =========================================================================
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
import torch
from ray.data.collate_fn import ArrowBatchCollateFn

from gx_ray import storage
from gx_ray.data.splits import SPLITS
from gx_ray.schema import BOX_LEVELS, PHASES, REPORT_KINDS

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 2
"""See ``FORMAT_HISTORY``: 2 added ``ct_hu_mean``/``ct_hu_std`` (HU windows, e.g. CT-Bench's soft-tissue window)."""
COMPRESSION = "lz4"
"""Parquet codec of the shards, chosen with `python jobs/benchmark.py ingest --codec ...` (docs/benchmarks.md)."""
TENSOR_COLUMNS = ("ct", "endoscopy")

_VQA_TYPE = pa.list_(pa.struct([("question", pa.string()), ("answer", pa.string()), ("category", pa.string())]))


def shard_schema(ct_shape: tuple[int, ...], endoscopy_size: int, lab_names: list[str]) -> pa.Schema:
    """The Arrow schema of a shard; tensor shapes and the lab order travel in its metadata."""
    fields = [
        ("case_id", pa.string()),
        ("patient_id", pa.string()),
        ("split", pa.string()),
        ("ct", pa.large_binary()),
        ("phase_present", pa.list_(pa.bool_())),
        ("ct_hu_mean", pa.list_(pa.float32())),
        ("ct_hu_std", pa.list_(pa.float32())),
        ("endoscopy", pa.large_binary()),
        ("endoscopy_present", pa.bool_()),
        ("labs", pa.list_(pa.float32())),
        ("labs_missing", pa.list_(pa.bool_())),
        ("lab_abnormal", pa.list_(pa.string())),
        ("boxes", pa.list_(pa.int32())),
        ("box_present", pa.list_(pa.bool_())),
        ("t", pa.string()),
        ("n", pa.string()),
        ("m", pa.string()),
        ("stage", pa.string()),
        ("stage_label", pa.int8()),
        *((kind, pa.string()) for kind in REPORT_KINDS),
        *((f"{kind}_zh", pa.string()) for kind in REPORT_KINDS),
        ("vqa", _VQA_TYPE),
        ("vqa_zh", _VQA_TYPE),
    ]
    metadata = {
        "gx_ray.format_version": str(FORMAT_VERSION),
        "gx_ray.ct_shape": json.dumps(list(ct_shape)),
        "gx_ray.ct_dtype": "float16",
        "gx_ray.phases": json.dumps(list(PHASES)),
        "gx_ray.box_levels": json.dumps(list(BOX_LEVELS)),
        "gx_ray.endoscopy_shape": json.dumps([3, endoscopy_size, endoscopy_size]),
        "gx_ray.lab_names": json.dumps(lab_names),
    }
    return pa.schema(fields, metadata=metadata)


@dataclass(frozen=True)
class TensorLayout:
    """Shapes of the fixed-size columns, read back from a shard's schema metadata."""

    ct_shape: tuple[int, ...]
    endoscopy_shape: tuple[int, ...]
    lab_names: tuple[str, ...]

    @classmethod
    def from_schema(cls, schema: pa.Schema) -> TensorLayout:
        meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
        if "gx_ray.ct_shape" not in meta:
            raise ValueError("not a gx-ray shard: its schema metadata has no gx_ray.ct_shape")
        return cls(
            ct_shape=tuple(json.loads(meta["gx_ray.ct_shape"])),
            endoscopy_shape=tuple(json.loads(meta["gx_ray.endoscopy_shape"])),
            lab_names=tuple(json.loads(meta["gx_ray.lab_names"])),
        )


class ShardWriter:
    """Writes rows into per-split Parquet files of at most ``rows_per_shard`` rows, in the order given; files are
    numbered per split from ``first_shard`` (writers that each write a part of a split side by side)."""

    def __init__(
        self,
        out_dir: Path,
        schema: pa.Schema,
        rows_per_shard: int = 64,
        row_group_rows: int = 8,
        compression: str = COMPRESSION,
        first_shard: int = 0,
    ):
        self.out_dir, self.schema, self.compression = Path(out_dir), schema, compression
        self.rows_per_shard, self.row_group_rows = rows_per_shard, row_group_rows
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._writers: dict[str, tuple[pq.ParquetWriter, Path, int]] = {}
        self._pending: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        self._counts = {s: first_shard for s in SPLITS}
        self.files: list[dict[str, Any]] = []

    def write(self, row: dict[str, Any]) -> None:
        split = row["split"]
        self._pending[split].append(row)
        if len(self._pending[split]) >= self.row_group_rows:
            self._flush(split)

    def _flush(self, split: str) -> None:
        rows, self._pending[split] = self._pending[split], []
        while rows:
            writer, path, written = self._writers.get(split) or self._open(split)
            take = rows[: self.rows_per_shard - written]
            rows = rows[len(take) :]
            writer.write_table(pa.Table.from_pylist(take, schema=self.schema), row_group_size=self.row_group_rows)
            self._writers[split] = (writer, path, written + len(take))
            if written + len(take) >= self.rows_per_shard:
                self._close(split)

    def _open(self, split: str) -> tuple[pq.ParquetWriter, Path, int]:
        path = self.out_dir / f"{split}-{self._counts[split]:05d}.parquet"
        self._counts[split] += 1
        writer = pq.ParquetWriter(
            path, self.schema, compression=self.compression, use_dictionary=False, write_page_checksum=True
        )
        return writer, path, 0

    def _close(self, split: str) -> None:
        writer, path, rows = self._writers.pop(split)
        writer.close()
        self.files.append(
            {"file": path.name, "split": split, "rows": rows, "bytes": path.stat().st_size, "sha256": _sha256(path)}
        )

    def close(self) -> list[dict[str, Any]]:
        """Flush and close every file; returns the manifest entries."""
        for split in SPLITS:
            self._flush(split)
            if split in self._writers:
                self._close(split)
        return sorted(self.files, key=lambda f: f["file"])


def _sha256(location: Path | str) -> str:
    digest = hashlib.sha256()
    with storage.open_input(location) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(
    out_dir: Path,
    files: list[dict[str, Any]],
    layout: TensorLayout,
    extra: dict[str, Any],
    compression: str = COMPRESSION,
) -> Path:
    manifest = {
        "format_version": FORMAT_VERSION,
        "ct_shape": list(layout.ct_shape),
        "ct_dtype": "float16",
        "phases": list(PHASES),
        "endoscopy_shape": list(layout.endoscopy_shape),
        "lab_names": list(layout.lab_names),
        "compression": compression,
        "rows": {s: sum(f["rows"] for f in files if f["split"] == s) for s in SPLITS},
        "files": files,
        **extra,
    }
    path = Path(out_dir) / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return path


class ShardIntegrityError(ValueError):
    """A shard file that is missing, truncated, altered or unreadable; the message names the file."""


class ShardFormatError(ValueError):
    """Shards older than what a task needs: prepared before the columns it reads existed."""


def require_format(shard_dir: Path | str, version: int, needed_by: str) -> None:
    """Refuse shards of a format older than ``version``, naming what needs it and how to get it."""
    check_format(_load_manifest(shard_dir), version, needed_by, str(shard_dir))


def check_format(manifest: Mapping[str, Any], version: int, needed_by: str, where: str = "the shards") -> None:
    """:func:`require_format` on a manifest already read."""
    found = int(manifest.get("format_version", 1))
    if found < version:
        raise ShardFormatError(
            f"{where} holds shard format {found}; {needed_by} needs format {version} or later "
            f"({FORMAT_HISTORY[version]}): prepare the data again with python jobs/prepare_data.py"
        )


FORMAT_HISTORY = {1: "the first layout", 2: "each phase's HU mean and sd, for windows in HU"}


def hounsfield(ct: np.ndarray, hu_mean: np.ndarray, hu_std: np.ndarray) -> np.ndarray:
    """``(C, D, H, W)`` z-scored phases back in HU (float32), undoing preprocessing's step 7 per phase; values stay
    inside the clip window the data were prepared with. Absent phases (NaN statistics) come back NaN."""
    mean = np.asarray(hu_mean, np.float32).reshape(-1, 1, 1, 1)
    std = np.asarray(hu_std, np.float32).reshape(-1, 1, 1, 1)
    return np.asarray(ct, np.float32)[: len(mean)] * std + mean


def read_manifest(shard_dir: Path | str, verify: bool = False) -> dict[str, Any]:
    """The manifest of a shard folder (a path or a URI): every file it lists exists with its recorded size, and with
    ``verify`` its SHA-256. Raises :class:`ShardIntegrityError` naming the first file that differs."""
    manifest = _load_manifest(shard_dir)
    for entry in manifest["files"]:
        shard = storage.join(shard_dir, entry["file"])
        try:
            size = storage.size(shard)
        except OSError as err:
            raise ShardIntegrityError(f"{shard}: listed in {MANIFEST_FILE} but cannot be read ({err})") from err
        if "bytes" in entry and size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "grown"
            raise ShardIntegrityError(
                f"{shard}: {size} bytes, the manifest records {entry['bytes']} ({what} or rewritten since it was made)"
            )
        if verify:
            actual = _sha256(shard)
            if actual != entry["sha256"]:
                raise ShardIntegrityError(
                    f"{shard}: SHA-256 {actual} does not match the manifest's {entry['sha256']} (altered)"
                )
    return manifest


def _load_manifest(shard_dir: Path | str) -> dict[str, Any]:
    """The manifest as written, nothing checked (one read: in an object store each file checked is a request)."""
    path = storage.join(shard_dir, MANIFEST_FILE)
    if not storage.is_file(path):
        raise FileNotFoundError(f"{path} not found: prepare the data first (python jobs/prepare_data.py)")
    return json.loads(storage.read_text(path))


def check_shards(shard_dir: Path | str, verify: bool = False) -> dict[str, Any]:
    """What a sweep checks before it trusts ``shard_dir``; returns the manifest. Cheap (ms per file): every listed
    file exists with its recorded size and its footer parses with the recorded rows; ``verify`` (every byte): SHA-256.
    Page checksums are verified later, on every read. Raises :class:`ShardIntegrityError` naming the file."""
    manifest = read_manifest(shard_dir, verify=verify)
    for entry in manifest["files"]:
        shard = storage.join(shard_dir, entry["file"])
        rows = open_shard(shard).metadata.num_rows
        if rows != entry["rows"]:
            raise ShardIntegrityError(f"{shard}: {rows} rows, the manifest records {entry['rows']}")
    return manifest


def open_shard(path: Path | str) -> pq.ParquetFile:
    """A shard (a local path or a URI) opened for reading with page checksum verification; a footer that does not
    parse (a truncated file) raises :class:`ShardIntegrityError` naming the file."""
    try:
        source = storage.open_input(path) if storage.is_uri(path) else path
        return pq.ParquetFile(source, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as err:
        raise ShardIntegrityError(f"{path}: not a readable Parquet shard ({err})") from err


def read_shard(path: Path | str, columns: Iterable[str] | None = None, row_group: int | None = None) -> pa.Table:
    """One shard (or one of its row groups) as a table, every page's checksum verified; a corrupt page raises
    :class:`ShardIntegrityError` naming the file, not a bare pyarrow error."""
    shard = open_shard(path)
    columns = list(columns) if columns is not None else None
    try:
        return shard.read(columns=columns) if row_group is None else shard.read_row_group(row_group, columns=columns)
    except (OSError, pa.ArrowException) as err:
        where = f"row group {row_group}" if row_group is not None else "data"
        raise ShardIntegrityError(f"{path}: {where} is corrupt ({err})") from err


def split_files(shard_dir: Path | str, split: str) -> list[str]:
    """The shard files of one split, as locations (paths or URIs) in the manifest's order. The files are not checked
    here: the sweep checks them all before any trial (:func:`check_shards`), each trial once more
    (:func:`read_manifest`), and every read verifies its pages; a trial lists splits several times."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    manifest = _load_manifest(shard_dir)
    return [storage.join(shard_dir, f["file"]) for f in manifest["files"] if f["split"] == split]


# --- reading -----------------------------------------------------------------------------------------


def fixed_tensor(column: pa.ChunkedArray | pa.Array, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A binary column of equal-size raw arrays as one ``(rows, *shape)`` array; nulls become zeros. A single chunk
    without nulls is viewed in place; ``combine_chunks`` would copy even that."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            return fixed_tensor(column.chunk(0), shape, dtype)
        parts = [fixed_tensor(chunk, shape, dtype) for chunk in column.chunks]
        return np.concatenate(parts) if parts else np.zeros((0, *shape), dtype=dtype)
    rows, item = len(column), int(np.prod(shape)) * np.dtype(dtype).itemsize
    if column.null_count:
        out = np.zeros((rows, *shape), dtype=dtype)
        for i, value in enumerate(column.to_pylist()):
            if value is not None:
                out[i] = np.frombuffer(value, dtype=dtype).reshape(shape)
        return out
    offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    offsets = np.frombuffer(column.buffers()[1], dtype=offset_type)
    start, end = int(offsets[column.offset]), int(offsets[column.offset + rows])
    if end - start != rows * item:
        raise ValueError(f"binary column values are not all {item} bytes: cannot view as {shape} {dtype}")
    values = np.frombuffer(column.buffers()[2], dtype=np.uint8, count=end - start, offset=start)
    return values.view(dtype).reshape(rows, *shape)


def list_tensor(column: pa.ChunkedArray | pa.Array, dtype: np.dtype) -> np.ndarray:
    """A list column whose lists all have the same length, as a ``(rows, length)`` array."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = array.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return values.reshape(len(array), -1)


def row_groups(shard_dir: Path | str, split: str) -> list[dict[str, Any]]:
    """Every Parquet row group of a split in file order: ``{"path", "row_group", "rows", "bytes"}`` (the unit a read
    task reads, a rank owns and an epoch orders; ``bytes`` uncompressed, from the file's footer)."""
    files = split_files(shard_dir, split)
    if not files:
        raise ValueError(f"{shard_dir} has no {split} shards")
    pieces = []
    for f in files:
        metadata = open_shard(f).metadata
        pieces += [
            {
                "path": str(f),
                "row_group": i,
                "rows": metadata.row_group(i).num_rows,
                "bytes": metadata.row_group(i).total_byte_size,  # uncompressed: what holding it in memory costs
            }
            for i in range(metadata.num_row_groups)
        ]
    return pieces


def rank_pieces(
    pieces: list[dict[str, Any]], rank: int = 0, world: int = 1, order_seed: int | None = None
) -> list[dict[str, Any]]:
    """The row groups rank ``rank`` of ``world`` reads: every ``world``-th of them, after a permutation seeded with
    ``order_seed`` (a new order each epoch, the same on every rank, so the ranks' parts never overlap)."""
    if order_seed is not None:
        pieces = [pieces[i] for i in np.random.default_rng(order_seed).permutation(len(pieces))]
    return pieces[rank::world]


def read_split(
    shard_dir: Path | str,
    split: str,
    columns: Iterable[str] | None = None,
    num_cpus: float = 1.0,
    concurrency: int | None = None,
    pieces: list[dict[str, Any]] | None = None,
) -> ray.data.Dataset:
    """The rows of one split (or of the given row groups, :func:`rank_pieces`) as a streaming Ray Dataset, one Arrow
    block per Parquet row group, in order; feed it to ``iter_torch_batches(collate_fn=BatchCollate(...))``.

    Each read task costs ``num_cpus`` (0 lets a one-worker Tune trial that holds its CPUs read without asking for
    more; ``concurrency`` then bounds the tasks in flight). Not ``read_parquet``: it first samples the files in a
    one-CPU task that never starts while trials hold every CPU (a deadlock on small machines), and costs 0.8-6 s
    before every epoch's first batch. Where the tasks run is Ray Data's choice (Ray 2.60 deprecates every
    locality setting); from an object store no node is nearer the data anyway.
    """
    pieces = [
        {"path": p["path"], "row_group": p["row_group"], "keep": p.get("keep")}
        for p in (pieces or row_groups(shard_dir, split))
    ]
    if not pieces:
        raise ValueError(f"no {split} row groups to read from {shard_dir}")
    dataset = ray.data.from_items(pieces, override_num_blocks=len(pieces)).map_batches(
        _read_row_groups,
        fn_kwargs={"columns": list(columns) if columns else None},
        batch_size=1,
        batch_format="pyarrow",
        zero_copy_batch=True,
        num_cpus=num_cpus,
        # no more tasks than row groups: Ray warns about a pool larger than its inputs (a one-file val split)
        compute=ray.data.TaskPoolStrategy(size=min(concurrency, len(pieces))) if concurrency else None,
    )
    # blocks in the order of the pieces, whichever read task finishes first: a seeded run sees the same batches
    dataset.context.execution_options.preserve_order = True
    return dataset


def _read_row_groups(pieces: pa.Table, columns: list[str] | None) -> pa.Table:
    tables = []
    for path, group, keep in zip(*(pieces[k].to_pylist() for k in ("path", "row_group", "keep")), strict=True):
        table = read_shard(path, columns, group)
        tables.append(table if keep is None else table.take(keep))  # a cross-validation fold's rows of the group
    return pa.concat_tables(tables)


# Batches are views of Arrow buffers in Ray's object store, which are read-only by design: the training loop
# casts (and so copies) the CT before touching it, and every other column is copied below.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


class BatchCollate(ArrowBatchCollateFn):
    """Turns an Arrow batch of shard rows into tensors (lists of strings for the text columns): the ``collate_fn``
    of ``iter_torch_batches``. The output holds non-tensor values, so :func:`to_device` moves it, not Ray."""

    def __init__(self, layout: TensorLayout, pin_memory: bool = False):
        self.layout = layout
        self.pin_memory = pin_memory
        """Pin here, in Ray's prefetch threads, so that the loop's copy to the GPU is asynchronous and free."""

    def __call__(self, batch: pa.Table) -> dict[str, Any]:
        out = self._collate(batch)
        if self.pin_memory:
            out = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        return out

    def _collate(self, batch: pa.Table) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in batch.column_names:
            column = batch.column(name)
            if name == "ct":
                out[name] = torch.from_numpy(fixed_tensor(column, self.layout.ct_shape, np.float16))
            elif name == "endoscopy":
                out[name] = torch.from_numpy(fixed_tensor(column, self.layout.endoscopy_shape, np.uint8))
            elif name in ("phase_present", "labs_missing", "box_present"):
                out[name] = torch.tensor(list_tensor(column, np.bool_))
            elif name in ("labs", "ct_hu_mean", "ct_hu_std"):
                out[name] = torch.tensor(list_tensor(column, np.float32))
            elif name == "boxes":
                boxes = list_tensor(column, np.int32).reshape(len(column), len(PHASES), len(BOX_LEVELS), 6)
                out[name] = torch.tensor(boxes)
            elif name == "stage_label":
                out[name] = torch.from_numpy(column.to_numpy().astype(np.int64))
            elif name == "endoscopy_present":
                out[name] = torch.tensor(column.to_numpy(zero_copy_only=False).astype(np.bool_))
            else:
                out[name] = column.to_pylist()
        return out


def to_device(
    batch: dict[str, Any], device: Any, non_blocking: bool = True, keys: Iterable[str] | None = None
) -> dict[str, Any]:
    """Move the tensors of a collated batch (those under ``keys``, default all) to ``device``; text stays as it is."""
    keys = set(batch) if keys is None else set(keys)
    return {
        k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) and k in keys else v
        for k, v in batch.items()
    }
