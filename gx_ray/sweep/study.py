"""Where an Optuna search keeps its study: a store that outlives the driver, that ``--resume`` finds again, that two
drivers can share, and that ``optuna-dashboard`` reads while the trials run.

A study is kept in an RDB (``postgresql://…``, ``sqlite:///…``) or a journal file (an append-only log with file locks,
safe for several processes on a shared filesystem, without SQLite's locking): by default ``optuna.journal`` in the
sweep's Tune state folder, named by the sweep id; on an object store (``s3://``), in memory unless ``--study`` names a
database. Two drivers given the same ``--study`` and ``--study-name`` search one study, each sampler learning from
both drivers' trials and seeded by its own output folder, so the two never propose the same first points.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from gx_ray import storage

# a sweep's saved Tune state names the searcher's class by the module it was defined in: older sweeps' name this one
from gx_ray.compat import ResumableOptunaSearch  # noqa: F401

JOURNAL_FILE = "optuna.journal"
RDB_SCHEMES = ("postgresql", "mysql", "sqlite", "oracle", "mssql")


def study_location(requested: str | None, state: str, sweep_id: str) -> str | None:
    """The study's store: ``requested`` (a database URL or a journal path), else the journal in the sweep's Tune
    state where that is a local or mounted folder, else None (in memory)."""
    if requested:
        return requested
    local = storage.local_path(storage.join(state, sweep_id))
    return str(local / JOURNAL_FILE) if local is not None else None


def optuna_storage(location: str) -> Any:
    """Optuna's storage for ``location``: an ``RDBStorage`` for a database URL, a ``JournalStorage`` for a file."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    scheme = location.split("://", 1)[0].split("+", 1)[0] if "://" in location else ""
    if scheme in RDB_SCHEMES:
        return optuna.storages.RDBStorage(location)
    if scheme:
        raise ValueError(
            f"--study {location!r}: a database URL ({', '.join(RDB_SCHEMES)}) or a journal file path every node reaches"
        )
    path = Path(location).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def driver_seed(study_name: str, output: Path) -> int:
    """The sampler's seed: the same for a rerun of one driver (reproducible), another for a second driver of the same
    study (which would otherwise propose the same first points)."""
    return zlib.crc32(f"{study_name}|{Path(output).resolve()}".encode()) % 2**31


def dashboard_command(location: str) -> str:
    """The command that opens the study in optuna-dashboard (it reads the same store the sweep writes)."""
    return f"optuna-dashboard {location} --host 127.0.0.1 --port 8080"
