"""The team MLflow set-up: a tracking server backed by a real PostgreSQL (started here, as a team would run it),
a sweep logging into it, and the rule that a sweep whose Ray nodes are not all on one host refuses an MLflow only
that host reaches."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.tracking import KIND_TAG, UnreachableTrackingError, check_reachable_from, on_one_host
from gx_ray.tracking.server import LocalMlflowServer, free_port

THIS, OTHER = "10.0.0.7", "10.0.0.8"  # the driver's node address, and another machine's


@pytest.mark.parametrize(
    "uri, nodes, refused",
    [
        ("http://127.0.0.1:5000", [THIS], False),  # one node: its own loopback server is fine
        ("http://127.0.0.1:5000", [THIS, OTHER], True),
        ("http://127.8.0.3:5000", [THIS, OTHER, THIS], True),
        ("http://localhost:5000", [OTHER, THIS], True),
        ("http://[::1]:5000", [THIS, OTHER], True),
        ("http://0.0.0.0:5000", [THIS, OTHER], True),
        ("sqlite:////shared/mlflow.db", [THIS, OTHER], True),
        ("/shared/mlruns", [THIS, OTHER], True),
        ("file:///shared/mlruns", [THIS, OTHER], True),
        ("http://mlflow.team.svc:5000", [THIS, OTHER], False),
        ("https://10.0.0.9:443", [THIS, OTHER, "10.0.0.10", "10.0.0.11"], False),
        # several nodes of one host: all on its loopback, or all at the driver's own address
        ("http://127.0.0.1:5000", ["127.0.0.1", "127.0.0.1", "127.0.0.1"], False),
        ("http://127.0.0.1:5000", ["127.0.0.1", "127.0.0.2", "::1"], False),
        ("sqlite:////tmp/mlflow.db", [THIS, THIS], False),
        ("http://127.0.0.1:5000", ["127.0.0.1", OTHER], True),
        ("http://127.0.0.1:5000", ["127.0.0.1", THIS], True),  # one host perhaps, but not shown to be
    ],
)
def test_an_mlflow_only_this_host_reaches_is_refused_where_a_node_is_elsewhere(uri, nodes, refused):
    if refused:
        with pytest.raises(UnreachableTrackingError, match=f"{len(nodes)} nodes.*{OTHER if OTHER in nodes else ''}"):
            check_reachable_from(uri, nodes, THIS)
    else:
        check_reachable_from(uri, nodes, THIS)


LOCAL_URIS = ["http://127.0.0.1:5000", "http://127.3.2.1:8080", "http://localhost:5000", "http://[::1]:5000",
              "http://0.0.0.0:5000", "sqlite:////tmp/mlflow.db", "file:///tmp/mlruns", "mlruns"]  # fmt: skip
TEAM_URIS = ["http://mlflow.team.svc:5000", "https://10.1.2.3:443", "http://[fd00::5]:5000", "http://192.168.4.4:80"]


def _address(rng: random.Random, kind: str) -> str:
    if kind == "loopback":
        return rng.choice([f"127.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}", "::1"])
    return rng.choice([f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}",
                       f"192.168.{rng.randrange(256)}.{rng.randrange(1, 255)}", f"fd00::{rng.randrange(1, 9999):x}",
                       f"node-{rng.randrange(100)}.cluster.internal"])  # fmt: skip


def test_the_one_host_rule_over_generated_clusters():
    """2,000 generated clusters: nodes on loopback, at the driver's own address, or elsewhere, in every mix. A local
    MLflow is accepted exactly when the nodes are all on loopback or all at the driver's address; a server every node
    reaches always is; a refusal names every node elsewhere and no other."""
    rng = random.Random(20)
    for _ in range(2000):
        own = _address(rng, "elsewhere")
        kinds = rng.choice([["loopback"], ["own"], ["elsewhere"], ["loopback", "own"], ["loopback", "elsewhere"],
                            ["own", "elsewhere"], ["loopback", "own", "elsewhere"]])  # fmt: skip
        nodes = [own if kind == "own" else _address(rng, kind) for kind in rng.choices(kinds, k=rng.randint(1, 6))]
        rng.shuffle(nodes)
        one_host = all(_is_loopback(n) for n in nodes) or set(nodes) == {own}
        check_reachable_from(rng.choice(TEAM_URIS), nodes, own)
        uri = rng.choice(LOCAL_URIS)
        if one_host:
            check_reachable_from(uri, nodes, own)
        else:
            with pytest.raises(UnreachableTrackingError) as refused:
                check_reachable_from(uri, nodes, own)
            message = str(refused.value)
            assert f"{len(nodes)} nodes" in message and uri in message and "--mlflow-uri" in message
            named = message.split("those at ", 1)[1].split(" (not this host")[0].split(", ")
            assert sorted(named) == sorted({n for n in nodes if n != own}), (nodes, own, message)
        assert on_one_host(nodes, own) == one_host
        assert on_one_host(list(reversed(nodes)), own) == one_host


def _is_loopback(address: str) -> bool:
    return address == "::1" or address.startswith("127.")


def _as_postgres() -> dict:
    """PostgreSQL refuses to run as root: as root, its commands run as the ``postgres`` user."""
    return {"user": "postgres", "group": "postgres", "extra_groups": []} if os.geteuid() == 0 else {}


def _postgres_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))), None)
    if found is None:
        raise FileNotFoundError(f"PostgreSQL's {name} is not installed (README: Set-up installs it)")
    return str(found)


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A real PostgreSQL server on a free loopback port with an ``mlflow`` database; yields its URI."""
    folder = Path(tempfile.mkdtemp(prefix="gx-postgres-"))  # outside pytest's root-only tmp: postgres must enter it
    folder.chmod(0o755)
    data, sockets = folder / "data", folder / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
        shutil.chown(sockets, "postgres")
    port = free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": 120, "cwd": folder, **_as_postgres()}
    # UTF-8 whatever the locale: under LC_ALL=C initdb picks SQL_ASCII, whose text psycopg returns as bytes
    subprocess.run(
        [_postgres_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-locale"], **run
    )
    options = f"-p {port} -k {sockets} -h 127.0.0.1"
    pg_ctl = _postgres_bin("pg_ctl")
    start = [pg_ctl, "-D", str(data), "-o", options, "-l", str(folder / "log"), "-w", "start"]
    subprocess.run(start, **run)
    try:
        import psycopg  # SQLAlchemy's default PostgreSQL driver, as MLflow's server uses it

        # CREATE DATABASE runs outside a transaction
        with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True) as db:
            db.execute("CREATE DATABASE mlflow")
        yield f"postgresql://postgres@127.0.0.1:{port}/mlflow"
    finally:
        stop = [pg_ctl, "-D", str(data), "-m", "fast", "stop"]
        subprocess.run(stop, capture_output=True, timeout=60, **_as_postgres())
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_sweep_logs_into_a_postgresql_backed_mlflow(ray_cluster, demo_prepared, postgres, tmp_path):
    import psycopg

    space = tmp_path / "team.yaml"
    space.write_text(
        yaml.safe_dump(
            {
                "fixed": {
                    "task": "stage_classification", "model.vision": "resnet18_3d", "model.text": "bert_tiny",
                    "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]}, "model.hidden": 32,
                    "optimiser.lr": 1.0e-3, "schedule.epochs": 1, "schedule.max_steps_per_epoch": 1,
                    "data.effective_batch": 2,
                },
                "grid": {"seed": [0, 1]},
            }
        ),
        encoding="utf-8",
    )  # fmt: skip
    with LocalMlflowServer(tmp_path / "mlflow", backend_store_uri=postgres) as server:
        options = SweepOptions(str(space), tmp_path / "out", demo_prepared.shard_dir, mlflow_uri=server.uri)
        result = run_sweep(options)
        assert (result.finished, result.failed) == (2, 0)
        runs = MlflowClient(server.uri).search_runs(
            [MlflowClient(server.uri).get_experiment_by_name(result.experiment).experiment_id]
        )
        assert sorted(r.data.tags[KIND_TAG] for r in runs) == ["sweep", "trial", "trial"]
        assert (result.output / "report" / "summary.md").is_file()  # the report read its runs back from there
    # the runs are rows of the PostgreSQL database itself, not of a file beside the server
    assert not (tmp_path / "mlflow" / "mlflow.db").exists()
    host_port = postgres.split("@")[1].split("/")[0]
    host, port = host_port.split(":")
    with psycopg.connect(host=host, port=int(port), user="postgres", dbname="mlflow") as db:
        assert dict(db.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall()) == {"FINISHED": 3}
        assert db.execute("SELECT count(*) FROM metrics WHERE key = 'test_primary'").fetchone()[0] == 2
