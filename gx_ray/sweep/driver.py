"""The sweep: a search space → Ray Tune trials (:mod:`gx_ray.sweep.trial`) → MLflow → a summary per task and schema
and the report. The driver starts Ray, its MLflow server and the demo cohort, checks the data and the space before any
trial, builds what trials share (:class:`~gx_ray.sweep.trial.SweepContext`), runs Tune and stops cleanly on a signal.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from mlflow.tracking import MlflowClient
from ray import tune

from gx_ray import storage
from gx_ray.compat import ResumableOptunaSearch, memory_kills_fail_trials
from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.fingerprint import FINGERPRINT_FORMAT, read_fingerprint
from gx_ray.data.folds import fold_patients, fold_sha256, read_custom_folds, write_fold_file
from gx_ray.data.prepare import SHARD_DIR, PrepareConfig, prepare_data
from gx_ray.data.preprocess import PreprocessConfig
from gx_ray.data.shards import FORMAT_VERSION, MANIFEST_FILE, check_shards, read_manifest
from gx_ray.runtime import init_ray, mlflow_retries, nodes_without
from gx_ray.sweep.budget import budgeted, sweep_budget, write_ledger
from gx_ray.sweep.callbacks import ReportWarmUp, TrialProgress, TrialRecord, report_modules
from gx_ray.sweep.gpu_plan import concurrency, gpu_plan, gpu_usage
from gx_ray.sweep.objectives import objectives, search_metric
from gx_ray.sweep.resume import check_resumable, record_inputs, sweep_inputs
from gx_ray.sweep.schedulers import (
    PAUSING,
    check_cluster,
    check_schedule,
    replay_scheduler,
    replay_sweep,
    scheduler_for,
    searcher_for,
    trained_to_the_end,
    tune_domain,
)
from gx_ray.sweep.share import named, refuse_a_live_twin, share_cluster, trial_footprint
from gx_ray.sweep.signals import Interruption, signals_stop_the_sweep
from gx_ray.sweep.spaces import SearchSpace, available_presets, load_space
from gx_ray.sweep.study import dashboard_command, driver_seed, optuna_storage, study_location
from gx_ray.sweep.summary import (
    POOLED_AXES,
    format_summary,
    result_rows,
    summarise,
    trial_dirname,
    trial_name,
    write_sweep_file,
)
from gx_ray.sweep.trial import SweepContext, run_trial, task_key
from gx_ray.tasks import task_class
from gx_ray.tracking import (
    abandon_unknown_runs,
    check_reachable_from,
    child_runs,
    end_open_runs,
    log_metrics,
    parent_run,
    provenance,
    runs_table_url,
    share_trials_view,
)
from gx_ray.tracking.server import LocalMlflowServer, free_port
from gx_ray.train.telemetry import GpuSampler

EXPERIMENT = "gx-ray"


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
    gpu_hours: float | None = None
    """A budget of GPU-hours (reserved GPU share × wall time, over the trials): forecast before the trials, a hard stop
    when spent, continued by ``--resume`` (:mod:`gx_ray.sweep.budget`)."""
    cpu_hours: float | None = None
    """The same budget in CPU-hours (reserved CPUs × wall time), for trials on CPUs."""
    time_budget_s: float | None = None
    """Stop the trials this many seconds after the sweep's launch (default: the space's ``budget.time_s``): its set-up
    (Ray, MLflow, the cohort, the GPU plan) counts, so that a sweep given a budget ends near it."""
    verify: bool = False
    """Check every shard's full SHA-256 against the manifest before the sweep starts (sizes and footers always)."""
    study: str | None = None
    """An Optuna search's study store: a database URL or a journal file path every node reaches (default: the journal
    in the sweep's Tune state, :mod:`gx_ray.sweep.study`)."""
    study_name: str | None = None
    """The study's name (default: the sweep id); two drivers given the same store and name search one study."""
    replay: str | None = None
    """A PBT schedule to train again as one trial: a ``pbt_policy_*.txt`` file, or the number of an exploited trial of
    this space's sweep (:func:`~gx_ray.sweep.schedulers.replay_sweep`)."""
    share: float | None = None
    """This sweep's weight in sharing the cluster's CPUs and GPUs with the other sweeps given one
    (:mod:`~gx_ray.sweep.share`); None: the sweep takes what Ray gives it."""
    name: str | None = None
    """Appended to the sweep id: another sweep of the same space and cohort, with outputs and runs of its own."""


@dataclass(kw_only=True)
class SweepResult:
    """What a sweep ran and how it ended (``sweep.json`` holds it, :func:`~gx_ray.sweep.summary.write_sweep_file`)."""

    sweep_id: str
    output: Path
    tracking_uri: str
    experiment: str
    parent_run_id: str
    finished: int = 0
    failed: int = 0
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
    costs: dict[str, Any] = field(default_factory=dict)
    """The trials' device-seconds in all (``gpu_seconds``, ``cpu_seconds``), the ledger's path and, with a budget, its
    hours, what was spent, its forecast and whether it stopped the sweep (:mod:`gx_ray.sweep.budget`)."""

    @property
    def store_uri(self) -> str:
        """The sweep's MLflow store, readable after its own server has stopped (else the tracking URI)."""
        store = self.output / "mlflow" / "mlflow.db"
        return f"sqlite:///{store}" if store.is_file() else self.tracking_uri


def _sweep_id(space: SearchSpace, shards: str) -> str:
    """Deterministic: the same space, presets and data give the same id (and so the same names on resume)."""
    decides = [space.fixed, space.grid, space.sample, space.overrides, shards] + ([space.cv] if space.cv else [])
    digest = hashlib.sha1(json.dumps(decides, sort_keys=True, default=str).encode()).hexdigest()[:8]
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
    wanted = json.dumps([asdict(demo), asdict(config), FORMAT_VERSION, FINGERPRINT_FORMAT], default=str, sort_keys=True)
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


def _budget_left(budget_s: float | None, launched_at: float) -> float | None:
    """What is left for Tune of a sweep's time budget counted from its launch (at least a second), or None."""
    return None if budget_s is None else max(1.0, budget_s - (time.time() - launched_at))


def _param_space(space: SearchSpace) -> dict[str, Any]:
    grid = {} if space.exclude else space.grid  # a grid that leaves cells out: its searcher gives the cells
    params: dict[str, Any] = {key: tune.grid_search(values) for key, values in grid.items()}
    return {**params, **{key: tune_domain(spec) for key, spec in space.sample.items()}}


@dataclass(kw_only=True)
class SweepRun:
    """One run of a sweep (a ``--resume`` is another run of it), as the driver's steps share it."""

    options: SweepOptions
    space: SearchSpace
    sweep_id: str
    shards: str
    """The cohort's shards: an absolute path or a URI."""
    output: Path
    """The driver's own files of the sweep: ``OPTIONS.output/<sweep id>``."""
    state: str
    """Tune's and Train's state, on storage every node reaches."""
    started: float
    """``time.perf_counter()`` at the launch; ``timings["launched_at"]`` is its ``time.time()``."""
    timings: dict[str, float] = field(default_factory=dict)
    interruption: Interruption = field(default_factory=Interruption)


def run_sweep(options: SweepOptions) -> SweepResult:
    """Run (or resume) a sweep; writes ``OUTPUT/sweep.json`` and prints a summary table. Ctrl-C or SIGTERM stops it
    cleanly (Tune saves its trials' state, the result says ``interrupted``); ``--resume`` goes on from there."""
    run = plan_sweep(options, time.perf_counter(), time.time())
    mlflow_retries()  # an unreachable server fails a call after ~30 s, not ~4 minutes
    _quiet_tune()
    with signals_stop_the_sweep() as run.interruption:
        # the MLflow server, Ray and the demo cohort start side by side: the server is only waited for once both are up
        server = LocalMlflowServer(run.output / "mlflow").launch() if options.mlflow_uri is None else None
        try:
            context = _start(run, options.mlflow_uri or server.uri)
            result = _tune(run, context, server)
            if not result.interrupted and result.mlflow_error is None:  # one who pressed Ctrl-C wants out, not a report
                result.report = _write_report(result, run.shards)
        finally:
            if server:
                server.stop()
    _finish(run, result, server)
    return result


def plan_sweep(options: SweepOptions, started: float, launched_at: float) -> SweepRun:
    """The sweep the options name, checked before anything starts: its space (a malformed one, a PBT interval or BOHB
    rung between two checkpoints, a changed space or cohort on ``--resume`` and a bad budget are refused here), its
    id, and where its files go."""
    presets = options.presets
    if options.data is None and "demo" not in presets and "demo" in available_presets(options.space):
        presets = ("demo", *presets)  # on the built-in demo cohort a space's "demo" preset (CPU-sized models) first
    space = load_space(options.space, presets)
    check_schedule(space)
    shards = _shard_path(options)
    sweep_id = named(_sweep_id(space, shards), options.name)  # --name: one more sweep of this space and cohort
    if options.replay:  # the schedule a PBT sweep found, trained again as a sweep of its own
        found = storage.normalize(options.storage or Path(options.output).resolve() / sweep_id / "ray")
        space, sweep_id, policy = replay_sweep(space, sweep_id, options.replay, storage.join(found, sweep_id))
        options = replace(options, replay=str(policy))
    output = Path(options.output).resolve() / sweep_id
    state = storage.normalize(options.storage or output / "ray")  # Tune's and Train's, on storage every node reaches
    if options.resume:
        check_resumable(Path(options.output), sweep_id, sweep_inputs(space, shards, _named_study(options)))
    elif storage.exists(storage.join(state, sweep_id)):
        where = f"--storage {options.storage}" if options.storage else output
        raise FileExistsError(f"{where} holds this sweep already: pass --resume to continue it, or another --output")
    output.mkdir(parents=True, exist_ok=True)
    sweep_budget(options, space, output)  # a given budget is recorded for --resume
    return SweepRun(options=options, space=space, sweep_id=sweep_id, shards=shards, output=output, state=state,
                    started=started, timings={"launched_at": launched_at})  # fmt: skip


def _quiet_tune() -> None:
    """Tune's and MLflow's console output that the sweep says its own way, or that is not the user's to act on."""
    # Tune snapshots its state whenever a trial has checkpointed num_to_keep times, i.e. every 2 epochs of a short
    # trial, and warns about it each time: expected here
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # MLflow prints emoji links whenever a run ends, to a server that stops with the sweep: the sweep prints its own
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # Tune logs a trial's error as a whole Ray traceback (ray.get, the auto-init hook, the worker's get_objects, …);
    # the progress bar says it in one line instead (TrialProgress), the traceback stays in the trial's error file
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    # Tune's console output (its tables, "View detailed results", a TensorBoard hint) gives way to the sweep's own
    # progress bar of trials and summary; Tune's classic reporter at verbosity 0 prints nothing
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")


def _start(run: SweepRun, tracking_uri: str) -> SweepContext:
    """Ray, the data checked (on every node, whole), what trials share: what the sweep needs before its first trial."""
    init_ray(run.options.address)
    # nodes on several hosts: a loopback MLflow (the sweep's own) is refused before any work
    check_reachable_from(tracking_uri, [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]])
    run.timings["ray_seconds"] = time.perf_counter() - run.started
    _prepare_demo(run.options)
    run.timings["data_seconds"] = time.perf_counter() - run.started - run.timings["ray_seconds"]
    _check_every_node_reaches({"--data": run.shards, "--storage": run.state})
    check_shards(run.shards, verify=run.options.verify)  # a truncated or altered shard is named before any trial
    record_inputs(run.output, sweep_inputs(run.space, run.shards, _named_study(run.options)))
    tags = provenance(storage.join(run.shards, MANIFEST_FILE))
    return SweepContext(
        sweep_id=run.sweep_id, space=run.space, shards=run.shards, storage_path=run.state, provenance=tags
    )


def _tune(run: SweepRun, context: SweepContext, server: LocalMlflowServer | None) -> SweepResult:
    """The trials: what they share, the parent run, Tune's searcher, scheduler and configs, the fit, the summary."""
    context = _trial_inputs(run, context)
    tracking_uri = _mlflow_ready(run, server)
    client = MlflowClient(tracking_uri)
    parent = _parent_run(run, context, client)
    # the live sweep's MLflow reaches trials through the trainable (tune.with_parameters), never through their saved
    # configs: a resumed sweep's trials log to its own MLflow server and parent run
    context = replace(context, tracking_uri=tracking_uri, parent_run_id=parent)
    experiment_id = client.get_run(parent).info.experiment_id
    view = share_trials_view(client, experiment_id, context.sweep_id)  # the runs table as the links below open it
    search_alg, scheduler, param_space = _search(run, context)
    at_once = run.timings["concurrency"] = concurrency(context, run.options.max_concurrent)
    budget = budgeted(run.options, context, run.output, client, parent, at_once)  # forecast; stops the sweep when spent
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    check_cluster(run.space, at_once, nodes, context.resources(run.space.cells()[0]))  # a trial fits; BOHB's brackets
    tune_config = _tune_config(run, context, search_alg, scheduler, at_once)
    tuner = _tuner(run, context, param_space, tune_config, _run_config(run, context, budget))
    print(
        f"sweep {context.sweep_id}: {run.space.trial_count()} trials, {at_once} at a time\n"
        f"watch the runs:  {runs_table_url(tracking_uri, experiment_id, view)}",
        file=sys.stderr,
    )
    grid, host = _fit(run, tuner)
    time_left = tune_config.time_budget_s
    cut_short = run.interruption.signalled or budget.spent or (time_left and run.timings["tune_seconds"] >= time_left)
    # Tune's trials, ended or not (in the grid's order): their status, and which runs are theirs. A sweep resumed from
    # a state saved without the callback: the trials as Tune saved them last
    trials = TrialRecord.ended.pop(context.sweep_id, None) or tune.ExperimentAnalysis(_experiment(context)).trials
    result = SweepResult(sweep_id=context.sweep_id, output=run.output, tracking_uri=tracking_uri, experiment=EXPERIMENT,
                         parent_run_id=parent, experiment_id=experiment_id, view=view, timings=run.timings,
                         interrupted=run.interruption.signalled)  # fmt: skip
    rows = result_rows(grid, trials, context, cut_short=bool(cut_short))
    stopped, total = _summarise(result, rows, run.space)
    _close(result, client, total, stopped, {t.trial_id for t in trials}, host)
    return result


def _mlflow_ready(run: SweepRun, server: LocalMlflowServer | None) -> str:
    """The tracking URI, once the sweep's own server (launched before Ray, the data and the GPU plan) is up."""
    if server is None:
        return run.options.mlflow_uri
    waited = time.perf_counter()
    server.wait().keep_alive()
    run.timings["mlflow_seconds"] = time.perf_counter() - waited
    return server.uri


def _trial_inputs(run: SweepRun, context: SweepContext) -> SweepContext:
    """What trials need before any of them starts: the folds, a task's sweep inputs, the GPU plan's measured steps;
    built while the MLflow server is still starting (the parent run is the first thing that needs it)."""
    root = run.options.storage or str(Path(run.options.output).resolve())  # where a cohort's sweeps share files
    if run.space.cv:  # every run is tagged with the folds' hash
        folds_file = fold_file(run.space.cv, context.shards, root)
        tags = {**context.provenance, "gx_ray.folds_sha256": fold_sha256(folds_file)}
        context = replace(context, folds_file=folds_file, provenance=tags)
    context = replace(context, task_inputs=task_inputs(context, root))
    started = time.perf_counter()
    context = replace(context, gpu_plan=gpu_plan(context, run.output))
    if context.gpu_plan:
        run.timings["gpu_plan_seconds"] = time.perf_counter() - started
    return context


def _parent_run(run: SweepRun, context: SweepContext, client: MlflowClient) -> str:
    """The sweep's parent run (the one of an earlier run of it on ``--resume``), its params, the cohort's fingerprint
    and the folds beside it."""
    space = run.space
    if not run.options.resume:  # a live sweep of this id on this server would share its parent run
        refuse_a_live_twin(client, EXPERIMENT, context.sweep_id, client.tracking_uri)
    params = {
        "space": space.name,
        "presets": ",".join(space.presets_applied),
        "data": context.shards,  # the report reads its manifest (which cohort) from anywhere
        **{f"fixed.{k}": v for k, v in space.fixed.items()},
        **{f"grid.{k}": v for k, v in space.grid.items()},
        **({"exclude": json.dumps(space.exclude)} if space.exclude else {}),
    }
    for key, value in space.analysis.items():  # the report reads the margin(s) and the declared family here
        params[f"analysis.{key}"] = json.dumps(value)
    if space.multi_objective:  # the report's Pareto front reads the objectives and their directions here
        params["objectives"] = json.dumps(objectives(space.metric, task=space.fixed.get("task")))
    parent = parent_run(client, EXPERIMENT, context.sweep_id, params, context.provenance)
    if fingerprint := read_fingerprint(context.shards, read_manifest(context.shards)):
        client.log_dict(parent, fingerprint, "fingerprint.json")  # what the cohort looked like, beside its runs
    if context.folds_file:  # which patients each fold held, beside the runs that trained on them
        client.log_text(parent, storage.read_text(context.folds_file), "folds.json")
    return parent


def _search(run: SweepRun, context: SweepContext) -> tuple[Any, Any, dict[str, Any]]:
    """Tune's searcher (None: its variant generator), scheduler (None: FIFO) and param space for the space
    (:mod:`gx_ray.sweep.schedulers`; Optuna's over the sweep's study); a replay runs one trial under its policy."""
    space, options = run.space, run.options
    if space.searcher == "optuna":
        metric, mode = search_metric(space.metric, space.fixed.get("task"))  # costs minimised (sweep.objectives)
        search_alg = optuna_search(options, context, run.output, metric, mode)
    else:  # BOHB's, or none (grid, random)
        search_alg = searcher_for(space, driver_seed(options.study_name or context.sweep_id, run.output))
    if options.replay:  # one trial, its config changed at the epochs the policy found
        return search_alg, replay_scheduler(Path(options.replay))[0], {}
    return search_alg, scheduler_for(space), _param_space(space)


def _tune_config(run: SweepRun, context: SweepContext, search_alg: Any, scheduler: Any, at_once: int) -> Any:
    """Tune's TuneConfig: the searcher and scheduler, how many trials and how many at once, the time left of the
    budget, the trials' names; under ``--share`` its trials wait for the cluster's share registry."""
    space = run.space
    metric, mode = search_metric(space.metric, space.fixed.get("task"))
    given = search_alg or scheduler  # they carry their own metric; Tune refuses it given twice
    # a grid with exclude rules: its searcher gives each cell's trials (Tune's num_samples counts them all)
    samples = space.trial_count() if space.searcher == "grid" and space.exclude else space.samples
    config = tune.TuneConfig(
        metric=None if given else metric,
        mode=None if given else mode,
        search_alg=search_alg,
        scheduler=scheduler,
        num_samples=samples,
        max_concurrent_trials=at_once,
        time_budget_s=_budget_left(run.options.time_budget_s or space.time_s, run.timings["launched_at"]),
        trial_name_creator=functools.partial(trial_name, space.fixed),
        trial_dirname_creator=trial_dirname,
        reuse_actors=True,
    )
    if run.options.share is not None:  # trials created only when the cluster's share registry grants their resources
        config = share_cluster(config, context.sweep_id, run.options.share, trial_footprint(context))
    return config


def checkpoint_config(space: SearchSpace) -> tune.CheckpointConfig:
    """The checkpoints Tune keeps of a trial: the latest two. Each holds the best weights so far (the loop's ``best``),
    whichever way the task's primary metric goes: ranked by the validation score, a task whose metric is minimised
    kept its worst. PBT keeps every one: a donor's may be restored after the donor has trained on (a trial paused
    while others run), and Tune's retention could have deleted it by then."""
    return tune.CheckpointConfig(num_to_keep=None if space.scheduler == "pbt" else 2)


def _run_config(run: SweepRun, context: SweepContext, budget: tune.Callback) -> tune.RunConfig:
    """Tune's RunConfig: where its state goes, retries, the checkpoints kept, the sweep's callbacks."""
    space = run.space
    return tune.RunConfig(
        name=context.sweep_id,
        storage_path=context.storage_path,
        # a trial that fails three times is reported, not fatal. Twice would do but for Tune's reuse of processes: a
        # retry can land on a cached trial process that died in the same event (a lost node, a kill), before Tune
        # has heard of its death, and that counts as a failure too (seen in tests/test_faults_searchers.py, random+asha)
        failure_config=tune.FailureConfig(max_failures=2),
        checkpoint_config=checkpoint_config(space),
        stop=trained_to_the_end if space.scheduler in PAUSING or run.options.replay else None,
        verbose=0,
        callbacks=[
            TrialProgress(space.trial_count()),
            ReportWarmUp(report_modules(space)),
            budget,
            TrialRecord(context.sweep_id),
        ],
    )


def _experiment(context: SweepContext) -> str:
    """The sweep's Tune experiment: absolute (Tune reads a relative path as a URI)."""
    return storage.join(context.storage_path, context.sweep_id)


def _tuner(run: SweepRun, context: SweepContext, param_space: dict, tune_config: tune.TuneConfig,
           run_config: tune.RunConfig) -> tune.Tuner:  # fmt: skip
    """The sweep's Tuner: restored on ``--resume`` (with the configs it was started with), else new."""
    path = _experiment(context)
    trainable = tune.with_resources(tune.with_parameters(run_trial, context=context), context.resources)
    if run.options.resume and tune.Tuner.can_restore(path):
        return tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=False,
                                  restart_errored=True, param_space=param_space)  # fmt: skip
    return tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)


def _fit(run: SweepRun, tuner: tune.Tuner) -> tuple[tune.ResultGrid, GpuSampler | None]:
    """Tune's fit, timed; on GPUs every GPU of the driver's node sampled meanwhile. A signal meanwhile is Tune's to
    stop (its trials' state saved)."""
    tune_started = time.perf_counter()
    host = GpuSampler(None, interval_s=1.0).start() if run.space.gpus_per_worker != 0 else None
    run.interruption.tuning = True
    memory_kills_fail_trials()  # a trial Ray kills for memory fails (and is retried) rather than ending the sweep
    run.timings["tune_started_seconds"] = time.perf_counter() - run.started  # launch → the trials' first moment
    try:
        grid = tuner.fit()
    finally:
        run.interruption.tuning = False
        if host:
            host.stop()
    run.timings["tune_seconds"] = time.perf_counter() - tune_started
    return grid, host


def _summarise(result: SweepResult, rows: list[dict[str, Any]], space: SearchSpace) -> tuple[list[str], int]:
    """The result's counts and best trials from the rows, the summary printed; the trials the scheduler stopped and
    the sweep's total of trials."""
    result.failed = sum(1 for r in rows if r["error"])
    result.finished = sum(1 for r in rows if r["completed"] and not r["error"])
    stopped = [r["trial"] for r in rows if r["stopped_early"]]
    axes = [key for key in space.grid if key not in POOLED_AXES]  # a cell per model, fusion, ... the grid compares
    result.stopped_early, result.best = len(stopped), summarise(rows, axes)
    # Tune's results hold only the trials it created: an interrupted or time-boxed sweep has more cells than that
    total = max(len(rows), space.trial_count())
    print(format_summary(result.best, result.finished, result.failed, total, len(stopped)))
    return stopped, total


def _close(result: SweepResult, client: MlflowClient, total: int, stopped: list[str], known: set[str],
           host: GpuSampler | None) -> None:  # fmt: skip
    """The runs closed and the ledger written; MLflow unreachable, the summary and ``sweep.json`` still say what ran."""
    try:
        _close_runs(client, result, total, stopped, known, host)
        result.costs = write_ledger(client, result.parent_run_id, result.output, result.sweep_id)  # ledger.csv
    except Exception as err:
        result.mlflow_error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        print(
            f"MLflow could not be reached at the sweep's end ({result.mlflow_error}); run statuses, GPU figures and "
            "the report are missing: write the report later with python analysis/report.py",
            file=sys.stderr,
        )


def _finish(run: SweepRun, result: SweepResult, server: LocalMlflowServer | None) -> None:
    """``sweep.json`` written, where to browse the runs printed, the driver's files copied beside the sweep's state."""
    result.timings["total_seconds"] = time.perf_counter() - run.started
    write_sweep_file(result, run.space)
    if server:  # its own server has stopped: a UI on a free port, and where its runs table will be
        port = free_port()
        print(f"\nbrowse the runs:  {server.ui_command(port)}")
        print(f"then open:        {runs_table_url(f'http://127.0.0.1:{port}', result.experiment_id, result.view)}")
    elif result.experiment_id:
        print(f"\nthe runs:  {runs_table_url(result.tracking_uri, result.experiment_id, result.view)}")
    if run.options.storage:  # the summary and report beside the sweep's state, where the whole team reaches them
        storage.copy_tree(run.output, storage.join(run.state, run.sweep_id, "driver"), skip=("mlflow", "ray"))


def _named_study(options: SweepOptions) -> dict[str, str]:
    """The study the options name (none named: the sweep's own, which its id already names)."""
    named = {"store": options.study, "name": options.study_name}
    return {k: v for k, v in named.items() if v}


def optuna_search(
    options: SweepOptions, context: SweepContext, output: Path, metric: str | list[str], mode: str | list[str]
) -> ResumableOptunaSearch:
    """Tune's Optuna searcher over the sweep's study (:mod:`gx_ray.sweep.study`), whose dashboard command it prints."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created in Journal ...": said below
    # a resumed trial trains again from its checkpoint the epochs it reported after it (the study outlived the killed
    # driver): the study keeps its first report of each, and warns of the second with nothing for the user to do
    warnings.filterwarnings("ignore", "The reported value is ignored because this `step", UserWarning)
    location = study_location(options.study, context.storage_path, context.sweep_id)
    name = options.study_name or context.sweep_id
    if location is None:
        print(f"the Optuna study {name} is kept in memory: give --study a database URL to keep it", file=sys.stderr)
    else:
        print(f"Optuna study {name}:  {dashboard_command(location)}", file=sys.stderr)
    return ResumableOptunaSearch(
        metric=metric,
        mode=mode,
        seed=driver_seed(name, output),
        study_name=name,
        storage=optuna_storage(location) if location else None,
    )


def fold_file(cv: dict[str, Any], shards: str, root: str) -> str:
    """The sweep's fold assignment (its space's ``cv``), checked against the cohort and written under ``root`` named by
    its hash: dealt by stratum, or a file of one's own (refused when it leaks or leaves a patient out)."""
    if "file" in cv:
        folds, how = read_custom_folds(cv["file"], shards), {"file": cv["file"]}
    else:
        folds, how = fold_patients(shards, cv["folds"], cv["stratify"], cv["seed"]), {"dealt": cv}
    return write_fold_file(shards, root, folds, how)


def task_inputs(context: SweepContext, root: str) -> dict[str, dict[str, Any]]:
    """What each task of the space's cells builds once for the cohort before any trial (its
    :meth:`~gx_ray.tasks.Task.sweep_inputs`, written under ``root``), by :func:`~gx_ray.sweep.trial.task_key`."""
    configs = {task_key(c): c for c in (context.setting(cell).config for cell in context.space.cells())}
    built = {key: task_class(c.task).sweep_inputs(c.task_options, context.shards, root) for key, c in configs.items()}
    return {key: inputs for key, inputs in built.items() if inputs}


def _close_runs(client: MlflowClient, result: SweepResult, total: int, stopped: list[str], known: set[str],
                host: GpuSampler | None) -> None:  # fmt: skip
    """End the sweep's runs in MLflow: the scheduler's stopped trials KILLED and tagged, trials a signal stopped
    KILLED (``--resume`` opens them again), runs of trials Tune does not hold deleted, the sweep's counts and GPU
    figures on the parent, and its status."""
    parent, timings = result.parent_run_id, result.timings
    runs = child_runs(client, parent)
    end_open_runs(client, runs, stopped)  # Tune has ended: no trial of this sweep runs any more
    if abandoned := abandon_unknown_runs(client, runs, known):
        print(f"{len(abandoned)} trial run(s) of an earlier attempt deleted from MLflow (their trials were run again "
              "under other ids); the ledger keeps their cost", file=sys.stderr)  # fmt: skip
        runs = [r for r in runs if r.info.run_id not in abandoned]
    counts = {"trials_finished": result.finished, "trials_failed": result.failed, "trials_stopped_early": len(stopped)}
    first_steps = [r.data.metrics["first_step_at"] for r in runs if "first_step_at" in r.data.metrics]
    if first_steps:  # launch → the first optimiser step of any trial: what a user waits before GPUs work
        timings["first_step_seconds"] = min(first_steps) - timings["launched_at"]
    result.gpus = gpu_usage(client, parent, runs, host, result.finished) if host else {}
    numbers = {k: v for k, v in result.gpus.items() if isinstance(v, int | float)}
    log_metrics(client, parent, {**counts, **numbers}, step=0)
    # an interrupted sweep's parent stays open for --resume; one whose trials all failed is FAILED
    done = result.finished + result.failed + len(stopped) == total and not result.interrupted
    status = "FAILED" if result.failed == total else "FINISHED" if done else "KILLED"
    client.set_terminated(parent, status)


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
