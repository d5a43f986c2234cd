"""Files where every node reaches them: a local path, a shared filesystem mounted on every node, or an object store
(``s3://``, ``gs://``, ``hdfs://``), named by one location string and opened through ``pyarrow.fs``, the filesystem
layer Ray Tune and Train use for their own ``storage_path``. The shards, their manifest and split file, a sweep's
Tune state, checkpoints and report all go through here, so a trial on any node reads what the driver wrote.

An S3-compatible store (MinIO, moto) is named in the URI, ``s3://bucket/prefix?endpoint_override=host:9000&scheme=http``,
or by ``AWS_ENDPOINT_URL`` on every node; credentials are the usual AWS ones and never travel in a location.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.fs as pafs


class UnreachableStorageError(ValueError):
    """A local location that some node of the cluster does not see (not on a filesystem every node mounts)."""


def is_uri(location: str | os.PathLike) -> bool:
    """Whether ``location`` names a filesystem by scheme (``s3://``, ``file://`` ...) rather than a local path."""
    return "://" in str(location)


def normalize(location: str | os.PathLike) -> str:
    """A local path made absolute (a relative path means nothing on another node); a URI as given, less a trailing
    slash."""
    if not is_uri(location):
        return str(Path(location).expanduser().resolve())
    base, sep, query = str(location).partition("?")
    return base.rstrip("/") + sep + query


def join(location: str | os.PathLike, *parts: str) -> str:
    """``location/part/...``; a URI keeps its query (an endpoint) after the joined path."""
    if not is_uri(location):
        return str(Path(location).joinpath(*parts))
    base, sep, query = str(location).partition("?")
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)]) + sep + query


def local_path(location: str | os.PathLike) -> Path | None:
    """The local path a location names (``file://`` included), or None for a remote store."""
    if not is_uri(location):
        return Path(location)
    parsed = urlsplit(str(location))
    return Path(parsed.path) if parsed.scheme == "file" else None


def resolve(location: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path within it. One filesystem object per store and process: an S3 client is costly to
    create, and a Ray read task opens many files."""
    local = local_path(location)
    if local is not None:
        return _local(), str(local.expanduser().resolve())
    parsed = urlsplit(str(location))
    fs = _filesystem(parsed.scheme, parsed.netloc, parsed.query)
    return fs, (parsed.netloc + parsed.path).rstrip("/")


@lru_cache(maxsize=1)
def _local() -> pafs.LocalFileSystem:
    return pafs.LocalFileSystem()


@lru_cache(maxsize=16)
def _filesystem(scheme: str, netloc: str, query: str) -> pafs.FileSystem:
    try:
        fs, _ = pafs.FileSystem.from_uri(f"{scheme}://{netloc}" + (f"?{query}" if query else ""))
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{scheme}://{netloc}: no filesystem for this location ({err})") from err
    return fs


def info(location: str | os.PathLike) -> pafs.FileInfo:
    fs, path = resolve(location)
    return fs.get_file_info(path)


def exists(location: str | os.PathLike) -> bool:
    return info(location).type != pafs.FileType.NotFound


def is_file(location: str | os.PathLike) -> bool:
    return info(location).type == pafs.FileType.File


def size(location: str | os.PathLike) -> int:
    """The file's size in bytes; FileNotFoundError naming the location when there is none."""
    found = info(location)
    if found.type != pafs.FileType.File:
        raise FileNotFoundError(f"{location}: no such file")
    return found.size


def read_bytes(location: str | os.PathLike) -> bytes:
    fs, path = resolve(location)
    with fs.open_input_stream(path) as f:
        return f.read()


def read_text(location: str | os.PathLike) -> str:
    if not is_file(location):
        raise FileNotFoundError(f"{location}: no such file")
    return read_bytes(location).decode("utf-8")


def write_bytes(location: str | os.PathLike, data: bytes) -> None:
    """Write a whole file; the folders above it are made (an object store has none to make). On a local disk the file
    appears whole or not at all (written aside, then renamed), as an object store's put does."""
    fs, path = resolve(location)
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    target = f"{path}.tmp-{os.getpid()}" if local_path(location) is not None else path
    with fs.open_output_stream(target) as f:
        f.write(data)
    if target != path:
        fs.move(target, path)


def write_text(location: str | os.PathLike, text: str) -> None:
    write_bytes(location, text.encode("utf-8"))


def open_input(location: str | os.PathLike) -> pafs.NativeFile:
    """A random-access file (what ``pq.ParquetFile`` reads a footer and row groups from)."""
    fs, path = resolve(location)
    return fs.open_input_file(path)


def listdir(location: str | os.PathLike) -> list[str]:
    """The names directly under a folder (or prefix); empty when there is none."""
    fs, path = resolve(location)
    found = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(entry.base_name for entry in found)


def copy_tree(source: str | os.PathLike, destination: str | os.PathLike, skip: tuple[str, ...] = ()) -> int:
    """Copy a folder's files (recursively) from one location to another, e.g. local shards to a bucket, leaving out
    the entries of its top level named in ``skip``. Returns the number of files copied."""
    src_fs, src = resolve(source)
    dst_fs, dst = resolve(destination)
    files = [
        entry
        for entry in src_fs.get_file_info(pafs.FileSelector(src, recursive=True))
        if entry.type == pafs.FileType.File and entry.path[len(src) :].lstrip("/").split("/", 1)[0] not in skip
    ]
    for entry in files:
        relative = entry.path[len(src) :].lstrip("/")
        target = f"{dst}/{relative}"
        dst_fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        pafs.copy_files(entry.path, target, source_filesystem=src_fs, destination_filesystem=dst_fs)
    return len(files)
