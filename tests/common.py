"""Helpers shared by the test files: plain functions and constants (pytest fixtures live in ``conftest.py``).

Heavy packages (MLflow, Ray Tune, MONAI) are imported inside the functions that need them, so importing this module
(``conftest.py`` does, for every test run) stays quick.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import yaml

if TYPE_CHECKING:
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from gx_ray.data.demo.cohort import DemoConfig
    from gx_ray.data.demo.findings import Findings
    from gx_ray.data.prepare import PrepareConfig
    from gx_ray.sweep.driver import SweepResult

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root: ``jobs/``, ``search_spaces/``, ``docs/`` are below it."""


def command_module(script: Path) -> ModuleType:
    """A command's script (``jobs/*.py``, ``analysis/*.py``) loaded as a module, whose ``main(argv)`` a test runs in
    its own process: a fresh interpreter's imports (and, for a command that uses Ray, a cluster of its own) cost
    ~15-25 s of CPU on 2 cores."""
    spec = importlib.util.spec_from_file_location(f"gx_command_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the demo cohort ------------------------------------------------------------------------------------------


def tiny_cohort() -> DemoConfig:
    """The ``DemoConfig`` of the session's demo cohort (``demo_raw``): 10 small cases."""
    from gx_ray.data.demo.cohort import DemoConfig

    return DemoConfig(cases=10, seed=7, endoscopy_size=64, vqa_per_case=6)


def tiny_prepare() -> PrepareConfig:
    """The ``PrepareConfig`` the session's cohort is prepared with (``demo_prepared``): demo preprocessing, 4 rows a
    shard."""
    from gx_ray.data.prepare import PrepareConfig
    from gx_ray.data.preprocess import PreprocessConfig

    return PrepareConfig(preprocess=PreprocessConfig.preset("demo"), endoscopy_size=32, rows_per_shard=4)


def findings_for(seed: int, tnm: tuple[str, str, str] = ("T3", "N1", "M0")) -> Findings:
    """One demo case's ``Findings`` at the stage ``tnm``, drawn with ``seed`` (every modality shows that stage)."""
    from gx_ray.data.demo.findings import sample_findings
    from gx_ray.schema import Staging

    return sample_findings(np.random.default_rng(seed), f"case{seed:04d}", Staging.parse(*tnm))


def first_shard_batch(shard_dir: Path | str, split: str = "train") -> dict:
    """The first shard of a prepared split (4 cases of the session's cohort) as one collated batch."""
    import pyarrow.parquet as pq

    from gx_ray.data.shards import BatchCollate, TensorLayout, split_files

    table = pq.read_table(split_files(shard_dir, split)[0])
    return BatchCollate(TensorLayout.from_schema(table.schema))(table)


# --- sweeps ---------------------------------------------------------------------------------------------------


def small_stage_space(
    path: Path, epochs: int, seeds: list[int], description: str, budget: dict | None = None, **fixed: Any
) -> Path:
    """A search space small enough for end-to-end sweeps on 2 cores (stage classification with a tiny 3D ResNet and
    BERT-tiny, two steps an epoch; one trial per seed, ``fixed`` on top), written to ``path``; returns it."""
    document = {
        "description": description,
        "fixed": {
            "task": "stage_classification",
            "model.vision": "resnet18_3d",
            "model.vision_kwargs": {"block_inplanes": [8, 16, 32, 64]},
            "model.text": "bert_tiny",
            "model.hidden": 32,
            "schedule.epochs": epochs,
            "schedule.max_steps_per_epoch": 2,
            "data.effective_batch": 2,
            **fixed,
        },
        "grid": {"seed": list(seeds)},
        **({"budget": budget} if budget is not None else {}),
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


@contextmanager
def run_smoke_sweep(
    space: str, data: Path | str, output: Path, mlflow_uri: str, presets: tuple[str, ...] = ("demo", "smoke")
) -> Iterator[SweepResult]:
    """``python jobs/sweep.py --space SPACE --preset smoke`` on prepared ``data`` (demo-sized models; a space without
    a ``demo`` preset names its ``presets``), logging to the MLflow server at ``mlflow_uri`` (the session's
    ``mlflow_server``: one server's start-up for every such sweep of a test process), which the block reads the runs'
    artifacts through (``result.tracking_uri``)."""
    from gx_ray.sweep.driver import SweepOptions, run_sweep

    yield run_sweep(SweepOptions(space=space, output=output, data=data, mlflow_uri=mlflow_uri, presets=presets))


def process_alive(pid: int) -> bool:
    """Whether the process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- a sweep hurt from outside: the fault tests' harness ---------------------------------------------------------

FAULT_EPOCHS, FAULT_SEEDS = 3, (0, 1)


def fault_space(tmp_path: Path) -> Path:
    """The fault tests' sweep: two small stage-classification trials (seeds 0 and 1), three epochs each."""
    description = "two small stage-classification trials, three epochs each"
    # the splits in memory, shuffled in windows smaller than the training share: a resumed epoch must draw the
    # uninterrupted epoch's batches although its process has not read the split before
    fixed = {"optimiser.lr": 1.0e-3, "data.in_memory": True, "data.shuffle_buffer": 2}
    return small_stage_space(tmp_path / "faults.yaml", FAULT_EPOCHS, FAULT_SEEDS, description, **fixed)


class SweepProcess:
    """``jobs/sweep.py`` in a process group of its own (as a terminal runs it), one trial at a time."""

    def __init__(self, tmp_path: Path, data: Path, space: Path | None = None, at_once: int = 1):
        self.cwd, self.output = tmp_path, tmp_path / "out"
        self.command = [  # a relative --output, as users type it (Tune's restore once refused one)
            sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", str(space or fault_space(tmp_path)),
            "--output", "out", "--data", str(data), "--max-concurrent", str(at_once),
        ]  # fmt: skip
        self.log = tmp_path / "sweep.log"

    def start(self, *extra: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}  # the sweep's own
        with open(self.log, "ab") as log:
            command = [*self.command, *extra]
            return subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd, env=env
            )

    def run(self, *extra: str, timeout: float = 600) -> int:
        process = self.start(*extra)
        return process.wait(timeout=timeout)

    def tail(self) -> str:
        return self.whole()[-4000:]

    def whole(self) -> str:
        """Everything the sweep's runs printed: a message asserted on must not fall out of a tail that later output
        (once, Tune's twenty-line report of a trial error) has filled."""
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    @property
    def folder(self) -> Path | None:
        folders = [p.parent.parent for p in self.output.glob("*/mlflow/mlflow.db")]
        return folders[0] if folders else None

    def client(self, live: bool = False) -> MlflowClient:
        """While the sweep runs, through its server (a second writer could race the server creating the store);
        once it has ended, the store itself."""
        from mlflow.tracking import MlflowClient

        if live:
            return MlflowClient(f"http://127.0.0.1:{server_record(self)['port']}")
        return MlflowClient(f"sqlite:///{self.folder / 'mlflow' / 'mlflow.db'}")

    def runs(self, live: bool = False) -> list:
        from gx_ray.sweep.driver import EXPERIMENT

        client = self.client(live)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        return client.search_runs([experiment.experiment_id]) if experiment else []

    def wait_for(self, condition: Callable[[list], bool], process: subprocess.Popen, what: str) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert process.poll() is None, f"the sweep ended before {what}:\n{self.tail()}"
            try:
                if self.folder and condition(self.runs(live=True)):
                    return
            except Exception:  # the store is being created, or is busy
                pass
            time.sleep(0.3)
        raise AssertionError(f"no {what} within 300 s:\n{self.tail()}")


def trial_runs(runs: list) -> list:
    """The trial runs among a sweep's MLflow runs (not its parent)."""
    from gx_ray.tracking import KIND_TAG

    return [r for r in runs if r.data.tags.get(KIND_TAG) == "trial"]


def training(runs: list, past_epoch: int = 0) -> bool:
    """A trial has logged epoch ``past_epoch`` (or a later one) and not yet finished: it is training."""
    return any(r.info.status == "RUNNING" and r.data.metrics.get("epoch", -1) >= past_epoch for r in trial_runs(runs))


def server_record(sweep: SweepProcess) -> dict:
    """The sweep's MLflow server as its pid file records it (``pid``, ``port``)."""
    from gx_ray.tracking.server import PID_FILE

    return json.loads((sweep.folder / "mlflow" / PID_FILE).read_text(encoding="utf-8"))


def trial_workers(driver: int) -> list[psutil.Process]:
    """This sweep's trial workers only (its local Ray runs under its driver): another test's sweep may run beside it."""
    found = []
    for child in psutil.Process(driver).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
            if "ray::ImplicitFunc" in " ".join(child.cmdline()):
                found.append(child)
    return found


# --- a constructed runs table for the analysis ----------------------------------------------------------------

TASK_METRICS = {
    "vqa": ("accuracy", "f1", "auc"),
    "report_generation": ("rouge_l", "bleu_4"),
    "retrieval": ("image_to_text_recall_at_5", "image_to_text_median_rank"),
    "stage_classification": ("auc", "f1"),
    "lesion_detection": ("ap_50", "map_50_95"),
}
SCHEMAS = ("image_only", "image_table", "image_bbox", "image_table_bbox")
"""The paper's four modality schemas."""


def make_runs(
    effects: dict[str, float] | None = None,
    seeds: int = 3,
    noise: float = 0.5,
    tasks: tuple[str, ...] = tuple(TASK_METRICS),
    models: tuple[tuple[str, str, str], ...] = (("resnet10_3d", "bert_tiny", "concat"),),
    searched: dict[str, list] | None = None,
    rng_seed: int = 0,
) -> pd.DataFrame:
    """A tidy runs table (the contract of :mod:`gx_ray.analysis.runs`) with known effects: every task x schema x model
    x seed as a finished trial; ``effects``: schema -> shift of every metric.

    A metric's test value is ``50 + effect + seed noise`` (ranks: ``20 - effect + noise``, lower is better); the
    validation value is the test value plus 1. ``searched``: parameter -> values, cycled over the trials.
    """
    import pandas as pd

    from gx_ray.analysis.runs import RUN_COLUMNS

    effects = effects if effects is not None else {s: 2.0 * i for i, s in enumerate(SCHEMAS)}
    rng = np.random.default_rng(rng_seed)
    rows, trial = [], 0
    for task in tasks:
        for vision, text, fusion in models:
            for schema, effect in effects.items():
                for seed in range(seeds):
                    trial += 1
                    params = {k: v[trial % len(v)] for k, v in (searched or {}).items()}
                    for metric in TASK_METRICS[task]:
                        rank = metric.endswith(("median_rank", "mean_rank"))
                        test = (20.0 - effect if rank else 50.0 + effect) + rng.normal(0, noise)
                        for split, value in (("val", test + 1.0), ("test", test)):
                            rows.append(
                                {
                                    "sweep_id": "fixture",
                                    "run_id": f"run{trial:03d}",
                                    "trial": f"trial-{trial:03d}",
                                    "status": "FINISHED",
                                    "start_time": 1_700_000_000_000 + 1000 * trial,
                                    "task": task,
                                    "schema": schema,
                                    "model": f"{vision}+{text}",
                                    "vision": vision,
                                    "text": text,
                                    "fusion": fusion,
                                    "seed": seed,
                                    "split": split,
                                    "metric": metric,
                                    "value": float(value),
                                    **params,
                                }
                            )
    table = pd.DataFrame(rows, columns=[*RUN_COLUMNS, *(searched or {})])
    table.attrs["searched"] = list(searched or {})
    return table


def brighter_venous_phase(shards: Path, hu: float = 40.0) -> None:
    """The cohort at ``shards`` as if re-prepared from another scanner: its fingerprint's venous median ``hu`` brighter,
    and the manifest's record of the fingerprint's SHA-256 updated to match (a consistent, changed cohort)."""
    import hashlib
    import json

    from gx_ray.data.fingerprint import FINGERPRINT_FILE
    from gx_ray.data.shards import MANIFEST_FILE, read_manifest

    fingerprint = json.loads((shards / FINGERPRINT_FILE).read_text(encoding="utf-8"))
    fingerprint["intensity_hu"]["venous"]["p50"] += hu
    text = json.dumps(fingerprint, indent=1, sort_keys=True) + "\n"
    (shards / FINGERPRINT_FILE).write_text(text, encoding="utf-8")
    manifest = read_manifest(shards)
    manifest["fingerprint"]["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (shards / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
