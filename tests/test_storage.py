"""Locations every node reaches (:mod:`gx_ray.storage`): local paths and object-store URIs through one set of calls,
checked against an S3-protocol endpoint started here (moto's server, a stand-in for S3/MinIO), and shards read and
checked from a bucket exactly as from a folder. Trials streaming them from a bucket on several nodes:
``test_multinode.py``."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pyarrow as pa
import pytest

from gx_ray import storage
from gx_ray.data.shards import MANIFEST_FILE, ShardIntegrityError, check_shards, read_manifest, read_shard, split_files


@pytest.fixture(scope="module")
def bucket() -> Iterator[str]:
    """A fresh bucket on a moto S3 server; yields its URI with the endpoint in the query (the form that needs no
    ``AWS_ENDPOINT_URL``); the credentials are the environment's, as on a real node."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    credentials = {"aws_access_key_id": "gx-test", "aws_secret_access_key": "gx-test-secret"}
    boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1", **credentials).create_bucket(
        Bucket="gx-test"
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "gx-test")
        env.setenv("AWS_SECRET_ACCESS_KEY", "gx-test-secret")
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield f"s3://gx-test?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    server.stop()


@pytest.mark.parametrize(
    "location, parts, joined",
    [
        ("/data/gx", ("shards", "manifest.json"), "/data/gx/shards/manifest.json"),
        ("s3://team/gx/", ("shards",), "s3://team/gx/shards"),
        ("s3://team/gx?endpoint_override=minio:9000&scheme=http", ("a", "b.parquet"),
         "s3://team/gx/a/b.parquet?endpoint_override=minio:9000&scheme=http"),
        ("gs://lab/cohort", ("/shards/",), "gs://lab/cohort/shards"),
    ],
)  # fmt: skip
def test_join_keeps_an_endpoint_after_the_path(location, parts, joined):
    assert storage.join(location, *parts) == joined


def test_a_relative_path_is_made_absolute_and_a_uri_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.normalize("cohort") == str(tmp_path / "cohort")  # another node has another working directory
    assert storage.normalize("s3://team/gx/") == "s3://team/gx"
    assert storage.local_path("file:///data/gx") is not None and storage.local_path("s3://team/gx") is None


@pytest.mark.parametrize("remote", [False, True], ids=["local", "s3"])
def test_files_round_trip_through_either_kind_of_location(remote, bucket, tmp_path):
    root = storage.join(bucket, "round-trip") if remote else str(tmp_path / "round-trip")
    target = storage.join(root, "deep", "folder", "notes.txt")
    assert not storage.exists(target)
    storage.write_text(target, "Magenblase ✓")
    assert storage.is_file(target) and storage.read_text(target) == "Magenblase ✓"
    assert storage.size(target) == len("Magenblase ✓".encode())
    assert storage.listdir(storage.join(root, "deep")) == ["folder"]
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        storage.read_text(storage.join(root, "missing.txt"))
    assert storage.listdir(storage.join(root, "nothing-here")) == []


def test_shards_copied_to_a_bucket_read_and_check_as_in_a_folder(demo_prepared, bucket, tmp_path):
    local = demo_prepared.shard_dir
    remote = storage.join(bucket, "cohort", "shards")
    copied = storage.copy_tree(local, remote, skip=(MANIFEST_FILE,))
    assert MANIFEST_FILE not in storage.listdir(remote) and copied == len(storage.listdir(remote))
    storage.write_bytes(storage.join(remote, MANIFEST_FILE), (local / MANIFEST_FILE).read_bytes())

    assert check_shards(remote, verify=True) == read_manifest(local)  # sizes, footers and every SHA-256
    for split in ("train", "val", "test"):
        here = [_ipc(read_shard(f)) for f in split_files(local, split)]
        there = [_ipc(read_shard(f)) for f in split_files(remote, split)]
        assert there == here, f"{split} differs when read from the bucket"

    first = split_files(remote, "train")[0]
    storage.write_bytes(first, storage.read_bytes(first)[:-100])  # truncated in the bucket
    with pytest.raises(ShardIntegrityError, match="train-00000.parquet.*truncated"):
        check_shards(remote)


def _ipc(table: pa.Table) -> bytes:
    """A table's Arrow IPC bytes: equal tables give equal bytes, missing labs (NaN) included."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
