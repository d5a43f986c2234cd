"""Shared fixtures: one local Ray cluster and one tiny demo cohort (raw and prepared) per test session, and the real CT
(``find_real_ct_dir`` finds it), in a network namespace of the session's own whose one interface is loopback. Plain
helper functions and constants are in ``common.py``."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_raw(ray_cluster, tmp_path_factory) -> Path:
    """A tiny demo cohort in the release layout, written once per session; treat it as read-only."""
    from gx_ray.data.demo.cohort import generate_cohort

    root = tmp_path_factory.mktemp("demo_raw")
    generate_cohort(root, tiny_cohort())
    return root


@pytest.fixture(scope="session")
def demo_prepared(demo_raw, tmp_path_factory):
    """The tiny cohort preprocessed into shards (``PrepareResult``); treat it as read-only."""
    from gx_ray.data.prepare import prepare_shards

    return prepare_shards(demo_raw, tmp_path_factory.mktemp("demo_prepared"), tiny_prepare())


def find_real_ct_dir() -> Path:
    for folder in REAL_CT_CANDIDATES:
        if (folder / "example_ct_sm.nii.gz").is_file():
            return folder
    raise FileNotFoundError(f"the real CT the tests use is in none of {[str(p) for p in REAL_CT_CANDIDATES]}")


@pytest.fixture(scope="session")
def real_ct_dir() -> Path:
    return find_real_ct_dir()
