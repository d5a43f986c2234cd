"""The sweep's own MLflow server (:mod:`gx_ray.tracking.server`): a new store starts from a copy of an empty one."""

from __future__ import annotations

import sqlite3

from mlflow.tracking import MlflowClient

from gx_ray.tracking.server import LocalMlflowServer, empty_store


def _experiments(store) -> list[str]:
    with sqlite3.connect(store) as db:
        return [name for (name,) in db.execute("SELECT name FROM experiments ORDER BY experiment_id")]


def _default_created(store) -> int:
    with sqlite3.connect(store) as db:
        return db.execute("SELECT creation_time FROM experiments WHERE experiment_id = 0").fetchone()[0]


def test_a_new_store_starts_from_the_empty_store_the_first_server_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert not empty_store().exists()
    with LocalMlflowServer(tmp_path / "first") as server:  # creates its tables, then keeps a copy before any use
        MlflowClient(server.uri).create_experiment("used")
    assert _experiments(empty_store()) == ["Default"]  # the copy was taken before the experiment was made
    second = LocalMlflowServer(tmp_path / "second").launch()  # its store is in place before its process runs
    second.stop()
    store = tmp_path / "second" / "mlflow.db"
    # the copy (its Default experiment made when the first's was), a store MLflow takes as it is, with no migration
    assert _default_created(store) == _default_created(empty_store())
    client = MlflowClient(f"sqlite:///{store}")
    run = client.create_run(client.create_experiment("gx-ray"))
    client.log_metric(run.info.run_id, "val_primary", 0.5)
    assert client.get_run(run.info.run_id).data.metrics == {"val_primary": 0.5}
    assert _experiments(store) == ["Default", "gx-ray"]
    assert _experiments(empty_store()) == ["Default"]  # the new store is a copy: the empty one stays empty
