"""The sweep: a search space → Ray Tune trials (each a training run, :mod:`gx_ray.sweep.trial`) → MLflow → a summary
per task and schema, the GPU plan and usage, and the report.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
from mlflow.tracking import MlflowClient
from ray import tune
from ray.tune.search.optuna import OptunaSearch
from ray.tune.utils.util import warn_if_slow
from tqdm import tqdm

from gx_ray import storage
from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.prepare import SHARD_DIR, PrepareConfig, prepare_data
from gx_ray.data.preprocess import PreprocessConfig
from gx_ray.data.shards import FORMAT_VERSION, MANIFEST_FILE, check_shards, read_manifest
from gx_ray.runtime import init_ray, mlflow_retries, nodes_without, one_process_per_gpu
from gx_ray.sweep.plan_cache import measured_plan
from gx_ray.sweep.resume import check_resumable, record_inputs, sweep_inputs
from gx_ray.sweep.spaces import SearchSpace, available_presets, load_space
from gx_ray.sweep.trial import gpu_plan_key, resolve, run_trial, task_options, trial_resources
from gx_ray.tasks import task_class, task_of
from gx_ray.tracking import (
    check_reachable_from,
    child_runs,
    end_open_runs,
    log_metrics,
    log_series,
    parent_run,
    provenance,
    runs_table_url,
    share_trials_view,
)
from gx_ray.tracking.server import LocalMlflowServer, free_port
from gx_ray.train.config import AUTO
from gx_ray.train.loop import probe_trial, split_rows
from gx_ray.train.probe import CONTEXT_BYTES, MAX_TRIALS_PER_GPU, gpu_share, trials_per_gpu
from gx_ray.train.telemetry import GpuSampler, busy_fraction, sample_metrics

SWEEP_FILE = "sweep.json"
EXPERIMENT = "gx-ray"
METRIC = "val_primary"  # every task reports its primary metric under this name too; all are "higher is better"


@dataclass
class SweepOptions:
    space: str
    output: Path = Path("outputs/sweeps")
    """The driver's own files: the sweep's summary, its MLflow server's store, the report."""
    data: Path | str | None = None
    """A prepared dataset (its ``shards/`` folder or the folder above it), a path or a URI (:mod:`gx_ray.storage`);
    None prepares the demo cohort once. Only read."""
    storage: str | None = None
    """Tune's and Train's state and checkpoints (and a copy of the report), a path or URI every node reaches;
    default ``OUTPUT/<sweep id>/ray`` (one node, or a shared filesystem)."""
    address: str | None = None
    mlflow_uri: str | None = None
    presets: tuple[str, ...] = ()
    resume: bool = False
    max_concurrent: int | None = None
    demo_cases: int = 200
    demo_dir: Path = Path("outputs/demo")
    time_budget_s: float | None = None
    """Stop the trials this many seconds after the sweep's launch (default: the space's ``budget.time_s``): its set-up
    (Ray, MLflow, the cohort, the GPU plan) counts, so that a sweep given a budget ends near it."""
    verify: bool = False
    """Check every shard's full SHA-256 against the manifest before the sweep starts (sizes and footers always)."""


@dataclass
class SweepResult:
    sweep_id: str
    output: Path
    tracking_uri: str
    experiment: str
    parent_run_id: str
    finished: int
    failed: int
    stopped_early: int = 0
    """Trials the scheduler (ASHA) stopped before their last epoch: no test metrics, by design."""
    best: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    report: Path | None = None
    """``OUTPUT/report/summary.md``, or None when the report failed (rerun ``analysis/report.py``)."""
    gpus: dict[str, Any] = field(default_factory=dict)
    """GPU sweeps: busy fraction per GPU from the first trial's start to the last one's end, trials per GPU-hour."""
    interrupted: bool = False
    """Stopped by a signal (Ctrl-C, SIGTERM): its trials' state is saved, ``--resume`` continues it."""
    mlflow_error: str | None = None
    """Set when MLflow could not be reached at the sweep's end: the summary and ``sweep.json`` are still written."""
    experiment_id: str = ""
    view: str | None = None
    """The key of the MLflow runs-table view of this sweep's trials (:func:`~gx_ray.tracking.share_trials_view`)."""

    @property
    def store_uri(self) -> str:
        """The sweep's MLflow store, readable after its own server has stopped (else the tracking URI)."""
        store = self.output / "mlflow" / "mlflow.db"
        return f"sqlite:///{store}" if store.is_file() else self.tracking_uri


def _sweep_id(space: SearchSpace, shards: str) -> str:
    """Deterministic: the same space, presets and data give the same id (and so the same names on resume)."""
    digest = hashlib.sha1(
        json.dumps(
            [space.fixed, space.grid, space.sample, space.overrides, shards], sort_keys=True, default=str
        ).encode()
    ).hexdigest()[:8]
    return "-".join([space.name, *space.presets_applied, digest])


def _shard_path(options: SweepOptions) -> str:
    """Where the sweep's shards are (the demo cohort's, once prepared): an absolute path or a URI."""
    if options.data is None:
        return storage.normalize(Path(options.demo_dir) / SHARD_DIR)
    data = storage.normalize(options.data)
    return data if storage.is_file(storage.join(data, MANIFEST_FILE)) else storage.join(data, SHARD_DIR)


DEMO_FRACTIONS = (0.56, 0.12, 0.32)
"""The demo cohort's train/val/test shares: the 160-case cohort's 112 training and 24 validation patients at 200
cases, and 64 test patients where the paper's 15 % gives 24: the paired tests between schemas gain power from test
patients at the cost of evaluation only, not training."""


def _prepare_demo(options: SweepOptions) -> None:
    """The built-in demo cohort, prepared once (a no-op when ``--data`` is given or the cohort is there): preparing
    it again would rewrite the shards a ``--resume`` checks against."""
    if options.data is not None:
        return
    config = PrepareConfig(preprocess=PreprocessConfig.preset("demo"), endoscopy_size=64, fractions=DEMO_FRACTIONS)
    demo = DemoConfig(cases=options.demo_cases)
    stamp = Path(options.demo_dir) / "prepared.json"
    # the shard format too: shards of an older format are remade, not refused by a task that needs the new one
    wanted = json.dumps([asdict(demo), asdict(config), FORMAT_VERSION], default=str, sort_keys=True)
    if (
        stamp.is_file()
        and stamp.read_text(encoding="utf-8") == wanted
        and storage.is_file(storage.join(_shard_path(options), MANIFEST_FILE))
    ):
        return
    prepare_data("demo", options.demo_dir, config, demo, address=options.address)
    stamp.write_text(wanted, encoding="utf-8")  # written last: its presence means the cohort is complete


def _check_every_node_reaches(locations: dict[str, str]) -> None:
    """Trials read the shards and write their state from whichever node Ray places them on: a local folder must be
    there on every node (a shared filesystem, or several nodes of one machine). Object stores are not checked."""
    for flag, location in locations.items():
        folder = storage.local_path(location)
        if folder is None:
            continue
        if flag == "--storage":
            folder.mkdir(parents=True, exist_ok=True)
        if missing := nodes_without(folder):
            raise storage.UnreachableStorageError(
                f"{flag} {location} is not on every Ray node (missing on {', '.join(missing)}): give a location every "
                "node reaches, s3://... or gs://... or a filesystem mounted at the same path on every node "
                "(jobs/cluster/README.md)"
            )


def _concurrency(space: SearchSpace, options: SweepOptions, context: dict[str, Any]) -> int:
    """How many trials fit the cluster at once, from its GPUs (or CPUs) and the trials' needs: the smallest GPU share
    of the plan decides how many trials a GPU holds; Ray places each trial by its own share."""
    resources = ray.cluster_resources()
    workers = 1 if space.workers == 1 and not context["fixed"].get("resources.torch_trainer") else space.workers
    fit = int(resources.get("CPU", 1) // (space.cpus_per_worker * workers))
    if space.gpus_per_worker != 0:
        shares = [plan["share"] for plan in context["gpu_plan"].values()] or [1.0]
        share = min(shares) if space.gpus_per_worker == AUTO else float(space.gpus_per_worker)
        fit = min(fit, round(resources.get("GPU", 0) / (share * workers), 6) // 1)
    fit = max(1, int(fit))
    return min(fit, options.max_concurrent) if options.max_concurrent else fit


def gpu_plan(space: SearchSpace, context: dict[str, Any], output: Path) -> dict[str, dict[str, Any]]:
    """Each distinct model setting's micro-batch and GPU share, from one measured training step of it on a GPU (Ray
    tasks, one setting per task, all GPUs at once), where the space asks for ``auto``; a setting an earlier sweep
    measured on the same kind of card, code and cohort is taken from the plan cache (:mod:`~gx_ray.sweep.plan_cache`).
    Written to ``OUTPUT/gpu_plan.json`` and read back on resume; empty for CPU sweeps and fixed settings."""
    if space.gpus_per_worker == 0:
        return {}
    path = output / "gpu_plan.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    settings: dict[str, dict[str, Any]] = {}
    for cell in space.cells():
        flat = {**resolve(context, cell), "data.shards": context["shards"]}
        if flat.get("resources.gpus_per_worker") == AUTO or flat.get("data.micro_batch") == AUTO:
            settings.setdefault(gpu_plan_key(flat), flat)
    if not settings:
        return {}
    resources = ray.cluster_resources()
    cards = sorted(k for k in resources if k.startswith("accelerator_type:"))
    measured = measured_plan(settings, _measure_steps, {"cards": cards, **context["provenance"]})
    trials_per_card = math.ceil(space.trial_count() / max(1, int(resources.get("GPU", 1))))
    plan = {}
    for key, flat in settings.items():
        m, gpus = measured[key], flat.get("resources.gpus_per_worker")
        share = float(gpus) if gpus != AUTO else _auto_share(flat, m, trials_per_card)
        plan[key] = {**m, "share": share, "trials_per_gpu": trials_per_gpu(share)}
    path.write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
    return plan


def _auto_share(flat: dict[str, Any], measured: dict[str, Any], trials_per_card: int = MAX_TRIALS_PER_GPU) -> float:
    """``auto``'s GPU share: as many trials as the measured peak lets fit, where the task packs well at all, and no
    more than the sweep needs: ``trials_per_card`` is its trials over the cluster's GPUs, rounded up. Ray fills one
    card before the next, so four trials packed two to a card on a 4-GPU node left a card idle (4 x H200)."""
    if not task_class(flat["task"]).shares_a_gpu:
        return 1.0
    most = max(1, min(MAX_TRIALS_PER_GPU, trials_per_card))
    return gpu_share(measured["peak_bytes"] + CONTEXT_BYTES, measured["card_bytes"], max_trials=most)


def question_files(space: SearchSpace, context: dict[str, Any], root: str) -> dict[str, str]:
    """Each lesion QA question recipe of the space's cells, built once for the cohort before any trial and written
    under ``root`` (the output folder, or ``--storage``) keyed by the shard manifest's hash; a file an earlier sweep
    wrote there is reused. Recipe (``family.distractors.seed``) → file; trials read theirs (``questions_file``)."""
    from gx_ray.tasks.lesion_qa import recipe_options, write_question_file  # its task's imports: only when asked

    recipes = set()
    for cell in space.cells():
        flat = resolve(context, cell)
        if flat.get("task") == "lesion_qa" and not flat.get("task_options.questions_file"):
            recipes.add(recipe_options(task_options(flat)))
    if not recipes:
        return {}
    shards = context["shards"]
    rows = {split: split_rows(shards, split) for split in ("train", "val", "test")}
    manifest = read_manifest(shards)
    return {
        ".".join(map(str, recipe)): write_question_file(rows, manifest, shards, root, *recipe)
        for recipe in sorted(recipes)
    }


def _measure_steps(settings: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    print(f"measuring a training step of {len(settings)} model settings on the GPUs ...", file=sys.stderr)
    return dict(zip(settings, one_process_per_gpu(probe_trial, list(settings.values())), strict=True))


def _budget_left(budget_s: float | None, launched_at: float) -> float | None:
    """What is left for Tune of a sweep's time budget counted from its launch (at least a second), or None."""
    return None if budget_s is None else max(1.0, budget_s - (time.time() - launched_at))


def _param_space(space: SearchSpace) -> dict[str, Any]:
    params: dict[str, Any] = {key: tune.grid_search(values) for key, values in space.grid.items()}
    for key, spec in space.sample.items():
        kind = spec["type"]
        params[key] = {
            "uniform": lambda s: tune.uniform(s["low"], s["high"]),
            "loguniform": lambda s: tune.loguniform(float(s["low"]), float(s["high"])),
            "int": lambda s: tune.randint(int(s["low"]), int(s["high"]) + 1),
            "categorical": lambda s: tune.choice(s["choices"]),
        }[kind](spec)
    return params


TASK_SHORT = {"stage_classification": "stage", "lesion_detection": "lesion", "report_generation": "report"}
SCHEMA_SHORT = {"image": "img", "table": "tab", "bbox": "box", "endoscopy": "endo", "only": ""}


def _trial_dirname(trial: Any) -> str:
    """The trial's folder under Tune's storage: its counter first (unique), then what it trains."""
    index = trial.trial_id.rsplit("_", 1)[-1]
    config = trial.config
    parts = [index, str(config.get("task", "")), str(config.get("schema", "")), f"s{config.get('seed', 0)}"]
    return "-".join(p for p in parts if p and p != "s")


def _trial_name(fixed: dict[str, Any], trial: Any) -> str:
    """What MLflow's runs table shows, which cuts names at ~20 characters: task, inputs and seed first
    (``stage img+tab+box s0``), the trial counter last (and as the ``gx_ray.trial`` tag). A task or schema the space
    fixes is in ``fixed``, not in the trial's config (which holds only what the space varies)."""
    config = {**fixed, **trial.config}
    task = str(config.get("task", ""))
    schema = config.get("schema", "")
    inputs = "+".join(filter(None, (SCHEMA_SHORT.get(p, p) for p in str(schema).split("_")))) if schema else ""
    index = trial.trial_id.rsplit("_", 1)[-1].lstrip("0") or "0"
    parts = [TASK_SHORT.get(task, task), inputs, f"s{config['seed']}" if "seed" in config else "", f"#{index}"]
    return " ".join(p for p in parts if p)


def run_sweep(options: SweepOptions) -> SweepResult:
    """Run (or resume) a sweep; writes ``OUTPUT/sweep.json`` and prints a summary table.

    Ctrl-C or SIGTERM stops it cleanly: Tune saves its trials' state, the MLflow server is stopped, ``sweep.json`` is
    written and the result says ``interrupted``; ``--resume`` goes on from there."""
    started = time.perf_counter()
    launched_at = time.time()
    # on the built-in demo cohort a space's "demo" preset (CPU-sized models) comes first, when it has one
    presets = options.presets
    if options.data is None and "demo" not in presets and "demo" in available_presets(options.space):
        presets = ("demo", *presets)
    space = load_space(options.space, presets)  # a malformed space fails here, before Ray starts
    shards = _shard_path(options)
    sweep_id = _sweep_id(space, shards)
    output = Path(options.output).resolve() / sweep_id
    state = storage.normalize(options.storage or output / "ray")  # Tune's and Train's, on storage every node reaches
    if options.resume:  # a changed space or cohort is refused before anything starts
        check_resumable(Path(options.output), sweep_id, sweep_inputs(space, shards))
    elif storage.exists(storage.join(state, sweep_id)):
        where = f"--storage {options.storage}" if options.storage else output
        raise FileExistsError(f"{where} holds this sweep already: pass --resume to continue it, or another --output")
    output.mkdir(parents=True, exist_ok=True)
    mlflow_retries()  # an unreachable server fails a call after ~30 s, not ~4 minutes
    # Tune snapshots its state whenever a trial has checkpointed num_to_keep times, i.e. every 2 epochs of a short
    # trial, and warns about it each time: expected here, and not the user's to act on
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # MLflow prints emoji links whenever a run ends, to a server that stops with the sweep: the sweep prints its own
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # Tune logs a trial's error as a whole Ray traceback (ray.get, the auto-init hook, the worker's get_objects, …);
    # the progress bar says it in one line instead (TrialProgress), the traceback stays in the trial's error file
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    # Tune's console output (its tables, "View detailed results", a TensorBoard hint) gives way to the sweep's own
    # progress bar of trials and summary; Tune's classic reporter at verbosity 0 prints nothing
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # "The `process_trial_result` operation took 0.512 s, which may be a performance bottleneck": Tune's 0.5 s
    # threshold (TUNE_WARN_THRESHOLD_S, read when Tune is imported) trips on a loaded 2-core machine; 5 s still warns
    warn_if_slow.DEFAULT_THRESHOLD = float(os.environ.get("TUNE_WARN_THRESHOLD_S", 5.0))
    with _signals_stop_the_sweep() as interrupted:
        # the MLflow server, Ray and the demo cohort start side by side: the server is only waited for once both are up
        server = LocalMlflowServer(output / "mlflow").launch() if options.mlflow_uri is None else None
        try:
            init_ray(options.address)
            # on several nodes, a loopback MLflow (the sweep's own) is refused before any work: trials log from anywhere
            check_reachable_from(
                options.mlflow_uri or server.uri, [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
            )
            timings: dict[str, float] = {"ray_seconds": time.perf_counter() - started, "launched_at": launched_at}
            _prepare_demo(options)
            timings["data_seconds"] = time.perf_counter() - started - timings["ray_seconds"]
            _check_every_node_reaches({"--data": shards, "--storage": state})
            check_shards(shards, verify=options.verify)  # a truncated or altered shard is named before any trial
            record_inputs(output, sweep_inputs(space, shards))
            tracking_uri = options.mlflow_uri or server.uri

            def mlflow_ready() -> None:  # launched before Ray, the data and the GPU plan: what is left of its start
                if server:
                    waited = time.perf_counter()
                    server.wait().keep_alive()
                    timings["mlflow_seconds"] = time.perf_counter() - waited

            result = _tune(
                space, options, shards, sweep_id, output, state, tracking_uri, timings, interrupted, mlflow_ready
            )
            if not result.interrupted and result.mlflow_error is None:  # one who pressed Ctrl-C wants out, not a report
                result.report = _write_report(result, shards)
        finally:
            if server:
                server.stop()
    result.timings["total_seconds"] = time.perf_counter() - started
    _write_sweep_file(result, space)
    if server:  # its own server has stopped: a UI on a free port, and where its runs table will be
        port = free_port()
        print(f"\nbrowse the runs:  {server.ui_command(port)}")
        print(f"then open:        {runs_table_url(f'http://127.0.0.1:{port}', result.experiment_id, result.view)}")
    elif result.experiment_id:
        print(f"\nthe runs:  {runs_table_url(tracking_uri, result.experiment_id, result.view)}")
    if options.storage:  # the summary and report beside the sweep's state, where the whole team reaches them
        storage.copy_tree(output, storage.join(state, sweep_id, "driver"), skip=("mlflow", "ray"))
    return result


class TrialProgress(tune.Callback):
    """A progress bar of the sweep's trials (finished, stopped, failed, and an ETA) on stderr, in place of Tune's
    tables. It counts Tune's ended trials, so a resumed sweep's bar starts where the interrupted one stopped; a trial
    Tune ended before its test metrics (the time budget, ASHA) is stopped, not finished."""

    def __init__(self, total: int):
        self.total, self.bar, self.shown = total, None, (0, 0, 0)

    def setup(self, **info: Any) -> None:
        interval = 1.0 if sys.stderr.isatty() else 30.0  # a log file gets a line now and then, not every update
        self.bar = tqdm(total=self.total, desc="trials", unit="trial", file=sys.stderr, mininterval=interval)

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        ended = [t for t in trials if t.status == "TERMINATED"]
        finished = sum("test_primary" in (t.last_result or {}) for t in ended)
        stopped, failed = len(ended) - finished, sum(t.status == "ERROR" for t in trials)
        if self.bar is not None and (finished, stopped, failed) != self.shown:
            self.shown = (finished, stopped, failed)
            counts = {"finished": finished, **({"stopped": stopped} if stopped else {}), "failed": failed}
            self.bar.set_postfix(counts, refresh=False)
            self.bar.update(finished + stopped + failed - self.bar.n)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(trial, "retried from its last checkpoint" if trial.checkpoint else "retried from the start")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(trial, f"failed; the traceback: {trial.error_file}")

    def _say(self, trial: Any, what: str) -> None:
        """One line above the bar: the trial, why it stopped (the exception inside Ray's wrapper), what happens now."""
        tqdm.write(f"trial {trial}: {trial_error(trial)}; {what}", file=sys.stderr)  # with or without a bar

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.on_step_end(0, trials)
        if self.bar is not None:
            self.bar.close()


REPORT_MODULES = ("gx_ray.analysis.report",)
DETECTION_MATCHING = "monai.apps.detection.metrics.matching"
"""The report rescoring detection trials matches boxes with MONAI, and importing MONAI imports all of it: 5 s on a
2-core machine, 10-14 s cold on a GPU node."""


class ReportWarmUp(tune.Callback):
    """Once the first trial has ended, imports ``modules`` in a background thread: what the report will import (its
    statistics and figures; MONAI's box matching for detection trials), so that the report, written after the last
    trial, does not pay for it. The driver is idle while the trials run, and by then the start of the sweep, which
    has launch → first step to keep short, is over."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.modules, self.thread = modules, None

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=_import_quietly, args=(self.modules,), name="report-warm-up", daemon=True
            )
            self.thread.start()


def report_modules(space: SearchSpace) -> tuple[str, ...]:
    """What the report on ``space``'s trials imports that the driver has not (:class:`ReportWarmUp`)."""
    sampled = space.sample.get("task", {}).get("choices", [])
    tasks = {task_of(str(t)) for t in [*space.grid.get("task", []), *sampled, space.fixed.get("task", "")]}
    return REPORT_MODULES + ((DETECTION_MATCHING,) if "lesion_detection" in tasks else ())


def _import_quietly(modules: tuple[str, ...]) -> None:
    for module in modules:
        with contextlib.suppress(Exception):  # a failed import is the report's to raise, where it is needed
            importlib.import_module(module)


def trial_error(trial: Any) -> str:
    """``Type: first line`` of the exception that ended a Tune trial, the trainable's own rather than Ray's wrapper
    (a ``RayTaskError`` carries it as ``cause``); a worker that died says so."""
    try:  # the driver's own copy: the one in the sweep's storage is synced later
        with open(trial.pickled_error_file, "rb") as file:
            error = ray.cloudpickle.load(file)
    except Exception:  # none written (an error Tune did not pickle) or unreadable: the status is still reported
        error = None
    if error is None:
        return "stopped with an error"
    error = getattr(error, "cause", None) or error
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": .")


@contextmanager
def _signals_stop_the_sweep() -> Iterator[dict[str, bool]]:
    """SIGINT, SIGTERM and SIGHUP stop the sweep as Ctrl-C stops Tune: the first one ends the running trials with
    their state saved (Tune's own stop, reached through its SIGUSR1 handler), a second one stops at once. Outside Tune
    (Ray or the server starting) the first one raises KeyboardInterrupt, so the server is still stopped."""
    state = {"interrupted": False, "tuning": False}
    previous = {}

    def handler(signum: int, frame: Any) -> None:
        if state["interrupted"] or not state["tuning"]:
            state["interrupted"] = True
            raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")
        state["interrupted"] = True
        print("\nstopping the sweep: running trials save their state (a second Ctrl-C stops at once)", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's graceful stop, which also answers SIGINT when it owns it

    if threading.current_thread() is not threading.main_thread():  # only the main thread may handle signals
        yield state
        return
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # ours is the one handler: Tune's own would hide the signal from us
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, handler)
    try:
        yield state
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _tune(
    space, options, shards, sweep_id, output, state, tracking_uri, timings, interrupted, mlflow_ready
) -> SweepResult:
    tags = provenance(storage.join(shards, MANIFEST_FILE))
    # what trials need before any of them starts (lesion QA's question files, the GPU plan's measured steps) is built
    # while the MLflow server is still starting: the parent run is the first thing that needs it
    context = {
        "sweep_id": sweep_id,
        "space": space.name,
        "shards": shards,
        "storage_path": state,
        # the space's resources section decides what every trial config says about resources
        "fixed": {**space.resource_keys(), **space.fixed},
        "overrides": space.overrides,
        "provenance": tags,
    }
    context["questions"] = question_files(space, context, options.storage or str(Path(options.output).resolve()))
    started = time.perf_counter()
    context["gpu_plan"] = gpu_plan(space, context, output)
    if context["gpu_plan"]:
        timings["gpu_plan_seconds"] = time.perf_counter() - started
    mlflow_ready()
    client = MlflowClient(tracking_uri)
    parent = parent_run(
        client,
        EXPERIMENT,
        sweep_id,
        {
            "space": space.name,
            "presets": ",".join(space.presets_applied),
            "data": shards,  # the report reads its manifest (which cohort) from anywhere
            **{f"fixed.{k}": v for k, v in space.fixed.items()},
            **{f"grid.{k}": v for k, v in space.grid.items()},
        },
        tags,
    )
    # the live sweep's context reaches trials through the trainable (tune.with_parameters), never through their
    # saved configs: a resumed sweep's trials log to its own MLflow server and parent run
    context.update(tracking_uri=tracking_uri, parent_run_id=parent)
    experiment_id = client.get_run(parent).info.experiment_id
    view = share_trials_view(client, experiment_id, sweep_id)  # the runs table as the links below open it
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, context=context), functools.partial(trial_resources, context)
    )
    metric, mode = (space.metric, ["max"] * len(space.metric)) if space.multi_objective else (METRIC, "max")
    search_alg = None
    if space.searcher == "optuna":
        search_alg = OptunaSearch(metric=metric, mode=mode, seed=0)
    scheduler = None
    if space.scheduler == "asha":  # stops on the primary metric, also when Optuna searches several objectives
        scheduler = tune.schedulers.ASHAScheduler(
            time_attr="epoch", metric=METRIC, mode="max", grace_period=1, reduction_factor=2
        )
    concurrency = _concurrency(space, options, context)
    timings["concurrency"] = concurrency
    tune_config = tune.TuneConfig(
        # the searcher and the scheduler carry their own metric; Tune refuses it given twice
        metric=None if search_alg or scheduler else metric,
        mode=None if search_alg or scheduler else mode,
        search_alg=search_alg,
        scheduler=scheduler,
        num_samples=space.samples,
        max_concurrent_trials=concurrency,
        time_budget_s=_budget_left(options.time_budget_s or space.time_s, timings["launched_at"]),
        trial_name_creator=functools.partial(_trial_name, space.fixed),
        trial_dirname_creator=_trial_dirname,
        reuse_actors=True,
    )
    run_config = tune.RunConfig(
        name=sweep_id,
        storage_path=state,
        failure_config=tune.FailureConfig(max_failures=1),  # a trial that fails twice is reported, not fatal
        checkpoint_config=tune.CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute=METRIC, checkpoint_score_order="max"
        ),
        verbose=0,
        callbacks=[TrialProgress(space.trial_count()), ReportWarmUp(report_modules(space))],
    )
    path = storage.join(state, sweep_id)  # absolute: Tune reads a relative path as a URI without a scheme
    if options.resume and tune.Tuner.can_restore(path):
        tuner = tune.Tuner.restore(
            path,
            trainable,
            resume_unfinished=True,
            resume_errored=False,
            restart_errored=True,
            param_space=_param_space(space),
        )
    else:
        tuner = tune.Tuner(trainable, param_space=_param_space(space), tune_config=tune_config, run_config=run_config)
    print(
        f"sweep {sweep_id}: {space.trial_count()} trials, {concurrency} at a time\n"
        f"watch the runs:  {runs_table_url(tracking_uri, experiment_id, view)}",
        file=sys.stderr,
    )
    tune_started = time.perf_counter()
    host = GpuSampler(None, interval_s=1.0).start() if space.gpus_per_worker != 0 else None  # every GPU of the node
    interrupted["tuning"] = True
    try:
        grid = tuner.fit()
    finally:
        interrupted["tuning"] = False
        if host:
            host.stop()
    timings["tune_seconds"] = time.perf_counter() - tune_started
    rows = _result_rows(grid, context)
    failed = sum(1 for r in rows if r["error"])
    finished = sum(1 for r in rows if r["completed"] and not r["error"])
    stopped = [r["trial"] for r in rows if r["stopped_early"]]
    best = summarise(rows)
    # Tune's results hold only the trials it created: an interrupted or time-boxed sweep has more cells than that
    total = max(len(rows), space.trial_count())
    print(format_summary(best, finished, failed, total, len(stopped)))
    result = SweepResult(
        sweep_id, output, tracking_uri, EXPERIMENT, parent, finished, failed, len(stopped), best, timings,
        interrupted=interrupted["interrupted"], experiment_id=experiment_id, view=view,
    )  # fmt: skip
    try:
        _close_runs(client, parent, total, stopped, result, timings, host)
    except Exception as err:  # MLflow unreachable: the summary and sweep.json still tell what ran
        result.mlflow_error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        print(
            f"MLflow could not be reached at the sweep's end ({result.mlflow_error}); run statuses, GPU figures and "
            "the report are missing: write the report later with python analysis/report.py",
            file=sys.stderr,
        )
    return result


def _close_runs(client, parent, total: int, stopped, result: SweepResult, timings, host) -> None:
    """End the sweep's runs in MLflow: the scheduler's stopped trials KILLED and tagged, trials a signal stopped
    KILLED (``--resume`` opens them again), the sweep's counts and GPU figures on the parent, and its status."""
    runs = child_runs(client, parent)
    end_open_runs(client, runs, stopped)  # Tune has ended: no trial of this sweep runs any more
    counts = {"trials_finished": result.finished, "trials_failed": result.failed, "trials_stopped_early": len(stopped)}
    first_steps = [r.data.metrics["first_step_at"] for r in runs if "first_step_at" in r.data.metrics]
    if first_steps:  # launch → the first optimiser step of any trial: what a user waits before GPUs work
        timings["first_step_seconds"] = min(first_steps) - timings["launched_at"]
    result.gpus = _gpu_usage(client, parent, runs, host, result.finished) if host else {}
    numbers = {k: v for k, v in result.gpus.items() if isinstance(v, int | float)}
    log_metrics(client, parent, {**counts, **numbers}, step=0)
    # an interrupted sweep's parent stays open for --resume; one whose trials all failed is FAILED
    done = result.finished + result.failed + len(stopped) == total and not result.interrupted
    status = "FAILED" if result.failed == total else "FINISHED" if done else "KILLED"
    client.set_terminated(parent, status)


def _gpu_usage(client: MlflowClient, parent: str, runs: list, host: GpuSampler, finished: int) -> dict[str, Any]:
    """The node's GPUs from the first trial's start to the last trial's end: busy fraction per GPU (mean NVML
    utilisation), trials finished per GPU-hour, and the node's GPU utilisation over time on the parent run."""
    starts = [r.info.start_time / 1000 for r in runs if r.info.start_time]
    ends = [r.info.end_time / 1000 for r in runs if r.info.end_time]
    samples = host.samples
    if not samples or not starts or not ends:
        return {}
    start, end = min(starts), max(ends)
    per_gpu = busy_fraction(samples, start, end)
    gpu_hours = len(per_gpu) * (end - start) / 3600
    log_series(client, parent, sample_metrics(samples))
    return {
        "gpu_busy_fraction": float(np.mean(list(per_gpu.values()))) if per_gpu else math.nan,
        "gpu_busy_fraction_per_gpu": {str(k): round(v, 4) for k, v in per_gpu.items()},
        "gpus": len(per_gpu),
        "trials_window_seconds": end - start,
        "trials_per_gpu_hour": finished / gpu_hours if gpu_hours else math.nan,
    }


def _write_report(result: SweepResult, shards: str) -> Path | None:
    """The sweep's report (tables, figures, statistics), also on the parent run; a failure is printed, not fatal:
    the trials are in MLflow, and ``analysis/report.py`` writes the report again."""
    from gx_ray.analysis.report import cohort_of, write_report

    started = time.perf_counter()
    try:
        report = write_report(
            result.tracking_uri, result.sweep_id, result.output, result.parent_run_id, cohort_of(read_manifest(shards))
        )
    except Exception:
        traceback.print_exc()
        print(f"the report failed; write it again with: python analysis/report.py --sweep {result.output}")
        return None
    result.timings["report_seconds"] = time.perf_counter() - started
    summary = report.folder / "summary.md"
    print(f"report: {summary}  ({summary.with_suffix('.html').name} beside it; also on the parent run)")
    return summary


def _result_rows(grid: Any, context: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for result in grid:
        params = dict(result.config or {})
        flat = resolve(context, params)
        metrics = result.metrics or {}
        rows.append(
            {
                "trial": metrics.get("trial_id") or (result.path and Path(result.path).name),
                "task": _task_label(flat),
                "schema": flat.get("schema", "image_only") if isinstance(flat.get("schema", ""), str) else "custom",
                "seed": flat.get("seed", 0),
                "chosen": {k: v for k, v in params.items() if k not in ("task", "schema", "seed")},
                "val_primary": metrics.get("best_val_primary"),
                "test_primary": metrics.get("test_primary"),
                "test_chance": metrics.get("test_chance"),
                "completed": "best_epoch" in metrics,  # the loop reports it with the test metrics, at its end
                # Tune marks the result at which the scheduler stopped a trial done; a trial that ran to its end
                # (or was interrupted) returned after its last report, which is not marked
                "stopped_early": bool(metrics.get("done")) and "best_epoch" not in metrics and not result.error,
                "error": str(result.error).splitlines()[0][:300] if result.error else None,
            }
        )
    return rows


def _task_label(flat: dict[str, Any]) -> str | None:
    """The trial's task, with the options that make it another question (lesion QA's family): its summary cell."""
    from gx_ray.tasks import task_label

    return task_label(flat.get("task"), task_options(flat))


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task and schema: test primary metric over seeds (mean, sd, n) and the best trial by validation. A trial
    that never started (a time budget ended first) has no config, so no task: it is in no cell."""
    from gx_ray.tasks import primary_metric

    cells: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row["task"] is not None:
            cells.setdefault((row["task"], row["schema"]), []).append(row)
    summary = []
    for (task, schema), members in sorted(cells.items()):
        done = [m for m in members if not m["error"] and m["completed"]]
        tests = np.array([m["test_primary"] for m in done], dtype=float)
        tests = tests[np.isfinite(tests)]  # a metric undefined on a split (one-class AUC) counts as no value
        chances = np.array([m.get("test_chance") for m in done], dtype=float)
        chances = chances[np.isfinite(chances)]
        best = max(done, key=lambda m: _finite(m["val_primary"]), default=None)
        summary.append(
            {
                "task": task,
                "schema": schema,
                "metric": primary_metric(task),
                "trials": len(members),
                "failed": len(members) - len(done),
                "test_mean": float(tests.mean()) if len(tests) else None,
                "test_sd": float(tests.std(ddof=1)) if len(tests) > 1 else None,
                # the bar the mean must clear: a predictor that never looks at the patient (seeds share the test split)
                "chance": float(chances.mean()) if len(chances) else None,
                "best_trial": best and best["trial"],
                "best_val": best and best["val_primary"],
                "best_test": best and best["test_primary"],
                "best_params": best and best["chosen"],
            }
        )
    return summary


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else -math.inf


def format_summary(
    summary: list[dict[str, Any]], finished: int, failed: int, total: int, stopped_early: int = 0
) -> str:
    unfinished = total - finished - failed - stopped_early
    lines = [
        f"\n{finished} of {total} trials finished, {failed} failed"
        + (f", {stopped_early} stopped early by the scheduler" if stopped_early else "")
        + (f", {unfinished} unfinished (resume with --resume)" if unfinished else ""),
    ]
    width = max([22, *(len(cell["task"]) + 1 for cell in summary)])  # lesion QA's tasks carry their family
    lines.append(
        f"{'task':<{width}} {'schema':<18} {'metric':<26} {'test mean ± sd (n)':<24} {'chance':>6}   best val → test"
    )
    for cell in summary:
        n = cell["trials"] - cell["failed"]
        mean = "—" if cell["test_mean"] is None else f"{cell['test_mean']:.1f}"
        sd = "" if cell["test_sd"] is None else f" ± {cell['test_sd']:.1f}"
        chance = "—" if cell.get("chance") is None else f"{cell['chance']:.1f}"
        best = "—" if cell["best_val"] is None else f"{cell['best_val']:.1f} → {cell['best_test']:.1f}"
        test = mean + sd + f" ({n})"
        lines.append(
            f"{cell['task']:<{width}} {cell['schema']:<18} {cell['metric']:<26} {test:<24} {chance:>6}   {best}"
        )
    return "\n".join(lines)


def _write_sweep_file(result: SweepResult, space: SearchSpace) -> Path:
    document = {
        "sweep_id": result.sweep_id,
        "space": space.name,
        "presets": list(space.presets_applied),
        "tracking_uri": result.tracking_uri,
        "experiment": result.experiment,
        "parent_run_id": result.parent_run_id,
        "trials": {"finished": result.finished, "failed": result.failed, "stopped_early": result.stopped_early},
        "report": str(result.report) if result.report else None,
        "best": result.best,
        "timings_seconds": {k: round(v, 1) for k, v in result.timings.items() if k != "launched_at"},
        "gpus": result.gpus,
        "interrupted": result.interrupted,
        "mlflow_error": result.mlflow_error,
    }
    path = result.output / SWEEP_FILE
    path.write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")
    return path
