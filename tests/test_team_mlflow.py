"""The team MLflow set-up: a tracking server backed by a real PostgreSQL (started here, as a team would run it),
a sweep logging into it, and the rule that a sweep on several Ray nodes refuses an MLflow only one node reaches."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.tracking import KIND_TAG, UnreachableTrackingError, check_reachable_from
from gx_ray.tracking.server import LocalMlflowServer, free_port


@pytest.mark.parametrize(
    "uri, nodes, refused",
    [
        ("http://127.0.0.1:5000", 1, False),  # one node: its own loopback server is fine
        ("http://127.0.0.1:5000", 2, True),
        ("http://127.8.0.3:5000", 3, True),
        ("http://localhost:5000", 2, True),
        ("http://[::1]:5000", 2, True),
        ("sqlite:////shared/mlflow.db", 2, True),
        ("/shared/mlruns", 2, True),
        ("file:///shared/mlruns", 2, True),
        ("http://mlflow.team.svc:5000", 2, False),
        ("https://10.0.0.7:443", 4, False),
    ],
)
def test_an_mlflow_only_this_node_reaches_is_refused_on_a_cluster(uri, nodes, refused):
    if refused:
        with pytest.raises(UnreachableTrackingError, match=f"{nodes} nodes.*--mlflow-uri"):
            check_reachable_from(uri, nodes)
    else:
        check_reachable_from(uri, nodes)


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
