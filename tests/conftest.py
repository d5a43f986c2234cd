"""Shared fixtures: one local Ray cluster and one tiny demo cohort (raw and prepared) per test session, and the real CT
(``find_real_ct_dir`` finds it), in a network namespace of the session's own whose one interface is loopback. Plain
helper functions and constants are in ``common.py``."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray

from gx_ray.runtime import init_ray
from tests.common import tiny_cohort, tiny_prepare

# The real CT lives outside the project (never committed): beside the checkout, or where GX_REAL_CT_DIR says.
REAL_CT_CANDIDATES = [
    Path(os.environ.get("GX_REAL_CT_DIR", "/nonexistent")),
    Path(__file__).resolve().parents[2] / "shared" / "data" / "real_ct",
    Path("/work/shared/data/real_ct"),
]


def pytest_configure(config: pytest.Config) -> None:
    """Every Ray node, MLflow server, database and browser the tests start is on loopback and reaches nothing
    outside: the session (this thread, and every process and thread it starts) enters a loopback-only network
    namespace (:mod:`tests.netns`) before anything starts. Ray cannot be kept to loopback on the host's own network.
    Where namespaces cannot be made (no root), the session runs as it is and says so."""
    from tests.netns import enter_loopback_namespace

    try:
        enter_loopback_namespace()
    except OSError as err:
        config.issue_config_time_warning(pytest.PytestConfigWarning(f"tests run on the host's network: {err}"), 2)


LONGEST_FILES = (
    "test_faults_searchers.py",
    "test_faults.py",
    "test_sweep_share.py",
    "test_multinode.py",
    "test_deploy.py",
    "test_sweep_driver.py",
    "test_lesion_qa.py",
)
"""The files that take longest (3–15 min each on 2 cores, ``--durations`` of a clean-clone run), dealt out first: two
of them left to the end ran side by side for 5 minutes while the quick files had long finished."""

SPREAD_FILES = ("test_faults_searchers.py", "test_faults.py", "test_sweep_share.py", "test_multinode.py")
"""Files whose tests each start their own sweep or nodes and share no module fixture: their tests are dealt out one
by one, so that no one process runs a whole file of 3-minute tests while the other has finished. Every other file
goes whole to one process, so that its module fixtures (the smoke ablation, lesion QA's sweep) are built once."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the ``xdist_group`` marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow end-to-end tests first, the longest files first among them, each file one group (``--dist
    loadgroup``, the order kept by ``--no-loadscope-reorder``): pytest-xdist's workers start on them and share the
    quick ones out at the end, rather than one worker finishing a long test alone while the other idles. Without
    ``--no-loadscope-reorder`` xdist deals the files with the most tests first, whatever their order here."""

    def order(item: pytest.Item) -> tuple[bool, int]:
        name = item.path.name
        return item.get_closest_marker("slow") is None, LONGEST_FILES.index(name) if name in LONGEST_FILES else 99

    items.sort(key=order)
    for item in items:
        if item.path.name not in SPREAD_FILES:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every pytest-xdist worker of this run shares (the run's own base folder, never an earlier run's), for
    what the tests only read: made once, by whichever worker asks first (:func:`made_once`)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@contextmanager
def made_once(folder: Path) -> Iterator[bool]:
    """Hold ``folder``'s lock; yields whether it still has to be made (the block then makes it, marked done last)."""
    from filelock import FileLock

    with FileLock(f"{folder}.lock"):
        done = folder.parent / f"{folder.name}.done"  # beside it: the folder holds only what it is made of
        todo = not done.is_file()
        yield todo
        if todo:
            done.touch()


@pytest.fixture(scope="session")
def demo_raw(ray_cluster, tmp_path_factory) -> Path:
    """A tiny demo cohort in the release layout, written once per run (all workers); treat it as read-only."""
    from gx_ray.data.demo.cohort import generate_cohort

    root = shared_folder(tmp_path_factory, "demo_raw")
    with made_once(root) as todo:
        if todo:
            generate_cohort(root, tiny_cohort())
    return root


@pytest.fixture(scope="session")
def demo_prepared(demo_raw, tmp_path_factory):
    """The tiny cohort preprocessed into shards (``PrepareResult``), once per run (all workers); treat it as
    read-only."""
    from gx_ray.data.prepare import prepare_shards

    out = shared_folder(tmp_path_factory, "demo_prepared")
    record = out.parent / f"{out.name}.pickle"
    with made_once(out) as todo:
        if todo:
            record.write_bytes(pickle.dumps(prepare_shards(demo_raw, out, tiny_prepare())))
    return pickle.loads(record.read_bytes())


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One MLflow server per test process for the in-process sweeps that only need somewhere to log (each sweep's
    runs are told apart by its sweep id): a server's start-up costs ~5 s of CPU on 2 cores. Sweeps whose own server
    is what a test checks start it themselves."""
    from gx_ray.tracking.server import LocalMlflowServer

    with LocalMlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def find_real_ct_dir() -> Path:
    for folder in REAL_CT_CANDIDATES:
        if (folder / "example_ct_sm.nii.gz").is_file():
            return folder
    raise FileNotFoundError(f"the real CT the tests use is in none of {[str(p) for p in REAL_CT_CANDIDATES]}")


@pytest.fixture
def mlflow_polled_quickly(monkeypatch):
    """A fault test's own polls of a sweep's MLflow server, which may be down, fail at once; the sweep's processes
    keep their retries (``SweepProcess`` starts them without these settings)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


@pytest.fixture(scope="session")
def real_ct_dir() -> Path:
    return find_real_ct_dir()
