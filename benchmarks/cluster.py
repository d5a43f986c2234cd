"""`python jobs/benchmark.py cluster`: the paper's ablation on every GPU of a node, measured in one time-boxed run.

1. A bench-shape cohort (4 x 64 x 128 x 128): demo cases preprocessed at the ``bench`` preset, their rows replicated
   to Gastric-X's size (about 1.2 K training rows). Replicated rows are for rates only, never for metrics.
2. Raw step rates: each task's registry model at the slice's micro-batch on one GPU, inputs already on the GPU, text
   at the loop's bucket lengths (one process per GPU, its cells in turn).
3. The slice: every task under the lightest and the heaviest schema (``image_only``, ``image_table_bbox``), one seed,
   a few capped epochs, the paper's model (3D Swin + MiniLM + cross-attention), ``gpus_per_worker: auto``: the sweep
   itself, through :func:`~gx_ray.sweep.driver.run_sweep`, with its GPU busy fraction per GPU, start-up share,
   trials per GPU-hour and loop/raw ratio per cell.
4. DDP weak scaling: stage classification at micro-batch 8 per rank on 1, 2 and 4 GPUs (epoch 2's rate).
5. The projection for the paper's whole ablation (5 tasks x 4 schemas x 3 seeds, 20 epochs) at Gastric-X's size
   on one 8-GPU node: each task's measured epoch time (training at its measured per-trial rate, evaluation at its
   measured rate) and one-off warm-up, with the measured packing, the 60 trials placed longest first.

With ``compile`` the models are compiled (``model.compile``, the ``compiled`` preset): the raw step, the slice and DDP
all measure the compiled model, and the raw phase measures the eager step beside it. Compilation costs each trial
process 35-140 s (4 x H200), more than a slice trial's whole training, so the default measures the eager model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray
import yaml
from mlflow.tracking import MlflowClient

from benchmarks.ingest import replicate_splits
from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.prepare import PrepareConfig, prepare_data
from gx_ray.data.preprocess import PreprocessConfig
from gx_ray.runtime import init_ray, one_process_per_gpu
from gx_ray.schema import PAPER_TASKS
from gx_ray.sweep.driver import SweepOptions, SweepResult, run_sweep
from gx_ray.sweep.spaces import space_path
from gx_ray.tracking import child_runs, on_one_host
from gx_ray.tracking.server import LocalMlflowServer
from gx_ray.train.probe import adamw, trials_per_gpu

GASTRIC_X = {"train": 1190, "val": 255, "test": 255}
"""Gastric-X's 1.7 K cases split 70/15/15."""
PAPER_ABLATION = {"tasks": len(PAPER_TASKS), "schemas": 4, "seeds": 3, "epochs": 20}
SLICE_SCHEMAS = ("image_only", "image_table_bbox")
HEAVY_FIRST = ("report_generation", "vqa", "lesion_detection", "retrieval", "stage_classification")
"""The slice's tasks longest first (as measured on H100), so that the last wave of trials is short."""
DDP_BUDGET_S = 120.0
"""DDP weak scaling's share of the budget: N = 1 and 2 side by side, then N = 4 once they free their GPUs. On 4 x H200
the first two take ~80 s and N = 4 ~60 s more (TorchTrainer start, the model's cold build), which a ten-minute command
holding the whole slice cannot give: at 165 s the slice lost two trials and N = 4 was still cut. The slice comes
first; N = 4 is measured by a run whose slice is small (``--tasks stage_classification``)."""
WIND_DOWN_S = 25.0
"""What a sweep takes after its time budget ends (trials save their state, the report, MLflow stops): kept free of
each sweep's budget, so that the whole run ends inside ``budget_s`` (4 x H200: a slice given the rest of a 520 s
budget, counted from Tune's start, left the DDP phase to run past a 600 s command)."""


RELAUNCH_S = 75.0
"""The relaunch phase: a one-trial sweep started as a user starts one, its GPU plan cached by the slice (Ray's start,
the MLflow server's, the trial process's and its first step)."""
TRIAL_OVERHEAD_S = 35.0
"""A slice trial's time outside its training steps, for sizing the slice: its process and model build, evaluation of
the capped splits, its checkpoints (1 x H200: start-up 8-25 s, evaluation 2-10 s an epoch)."""
PLAN_S = 45.0
"""The slice's GPU plan, measured cold (one step of each setting, one process per GPU), for sizing the slice."""
MIN_STEPS = 8
"""Fewer training steps an epoch than this measure the loop's warm-up, not its rate."""


@dataclass(frozen=True)
class ClusterBenchmarkConfig:
    gpus: int | None = None
    """GPUs to use (default: every GPU Ray sees)."""
    budget_s: float = 540.0
    """Wall-clock budget of the whole run: each sweep is cut at its share (Tune's time budget)."""
    cases: int = 16
    train_rows: int = GASTRIC_X["train"]
    eval_rows: int = 64
    micro_batch: int = 8
    effective_batch: int = 32
    eval_batch: int = 32
    """Evaluation needs no gradients: a larger batch keeps the GPU busy (generation above all), as the gpu preset."""
    steps_per_epoch: int = 30
    epochs: int = 2
    gpus_per_trial: float | str = "auto"
    ddp_sizes: tuple[int, ...] = (1, 2, 4)
    raw_steps: int = 10
    target_gpus: int = 8
    compile: bool = False
    """``model.compile`` for every measured model."""
    tasks: tuple[str, ...] = PAPER_TASKS
    """The slice's tasks (the projection needs all five)."""
    address: str | None = None
    """An existing Ray cluster (``jobs/cluster/two_nodes_one_host.sh``). Its sweeps log to their own loopback MLflow
    where every node is on this host, else to one this run starts on the node's network address, for the others."""


def run_cluster_benchmark(out: Path, config: ClusterBenchmarkConfig = ClusterBenchmarkConfig()) -> dict[str, Any]:
    started = time.perf_counter()
    out = Path(out)
    init_ray(config.address, num_gpus=config.gpus)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus < 1:
        raise RuntimeError("the cluster benchmark needs GPUs: Ray sees none on this node")
    nodes = len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")])
    server = None
    # the sweeps' own loopback server serves nodes of one host (two_nodes_one_host.sh's); across machines it is refused
    if not on_one_host([n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]], ray.util.get_node_ip_address()):
        server = LocalMlflowServer(out / "mlflow", host=ray.util.get_node_ip_address()).launch().wait()
    try:
        return _run(out, config, gpus, nodes, server.uri if server else None, started)
    finally:
        if server:
            server.stop()


def _run(
    out: Path, config: ClusterBenchmarkConfig, gpus: int, nodes: int, mlflow_uri: str | None, started: float
) -> dict[str, Any]:
    shards = _bench_cohort(out, config)
    # the last run's sweeps: scratch (its figures are in cluster_benchmark.json), ~10 GB of checkpoints, and a slice
    # of the same space and cohort would otherwise be refused as an existing sweep
    shutil.rmtree(out / "sweeps", ignore_errors=True)
    prepared_at = time.perf_counter()
    result: dict[str, Any] = {"config": asdict(config), "gpus": gpus, "gpu": _gpu_name(), "seconds": {}}
    result["nodes"] = nodes
    result["nccl"] = {k: v for k, v in os.environ.items() if k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")}
    result["seconds"]["cohort"] = prepared_at - started
    cluster = {"address": config.address, "mlflow_uri": mlflow_uri}

    cells = [(task, schema) for task in config.tasks for schema in SLICE_SCHEMAS]
    raw_space = _space(out / "raw.yaml", config, SLICE_SCHEMAS, workers=None)
    result["raw"] = _phase(result, "raw", lambda: _raw_rates(shards, raw_space, cells), {})
    sizes = [n for n in config.ddp_sizes if n <= gpus]
    ddp_budget = DDP_BUDGET_S if len(sizes) > 1 else 0.0
    left = config.budget_s - (time.perf_counter() - started) - ddp_budget - RELAUNCH_S - WIND_DOWN_S
    result["sized"] = size_slice(config, result["raw"], gpus, left)
    sized = replace(config, steps_per_epoch=result["sized"]["steps_per_epoch"])
    slice_space = _space(out / "slice.yaml", sized, tuple(result["sized"]["schemas"]), workers=None)

    def slice_run() -> dict[str, Any]:
        left = config.budget_s - (time.perf_counter() - started) - ddp_budget - RELAUNCH_S - WIND_DOWN_S
        options = SweepOptions(str(slice_space), out / "sweeps", shards, time_budget_s=left, **cluster)
        with HostCpuSampler() as host:
            figures = _slice_figures(run_sweep(options), result["raw"], config.eval_rows)
        return {**figures, "host_cpu": host.summary()}

    result["slice"] = _phase(result, "slice", slice_run, {"cells": {}})
    if config.address is None:  # a fresh command on this node, the slice's GPU plan now cached
        schema = result["sized"]["schemas"][0]
        result["relaunch"] = _phase(result, "relaunch", lambda: _relaunch(out, sized, shards, schema), {})
    # last: a DDP trial that Tune's time budget stops leaves its TorchTrainer's GPU workers to Ray's placement-group
    # cleaner, and a sweep after it would wait for those GPUs
    if ddp_budget:

        def ddp_run() -> dict[str, Any]:
            space = _space(out / "ddp.yaml", config, ("image_only",), workers=sizes)
            budget = max(DDP_BUDGET_S / 2, config.budget_s - (time.perf_counter() - started) - WIND_DOWN_S)
            # two at a time: N = 1 and 2 side by side, then N = 4 once the first ends (all three at once left the
            # four-rank trainer waiting for GPUs past Ray Train's 60 s worker-group timeout on 4 x H200)
            options = SweepOptions(
                str(space), out / "sweeps", shards, time_budget_s=budget, max_concurrent=2, **cluster
            )
            return _ddp_figures(run_sweep(options))

        result["ddp"] = _phase(result, "ddp", ddp_run, {})
    result["projection"] = project(result["slice"], config.target_gpus)
    result["seconds"]["total"] = time.perf_counter() - started
    (out / "cluster_benchmark.json").write_text(json.dumps(result, indent=1, default=float) + "\n", encoding="utf-8")
    return result


def size_slice(
    config: ClusterBenchmarkConfig, raw: dict[str, dict[str, float]], gpus: int, seconds: float
) -> dict[str, Any]:
    """The slice that fits ``seconds`` on ``gpus`` GPUs: both schemas where they fit, else the heaviest alone (the
    projection reads only each task's heaviest cell); then fewer steps an epoch (down to :data:`MIN_STEPS`), so that
    every task is measured however few the GPUs. Each trial is costed at its raw step rate, a card to itself (packing
    only shortens it), plus :data:`TRIAL_OVERHEAD_S`; the trials are spread over the GPUs after the GPU plan."""

    def seconds_of(schemas: tuple[str, ...], steps: int) -> float:
        total = 0.0
        for task in config.tasks:
            for schema in schemas:
                rate = raw.get(f"{task}/{schema}", {}).get("samples_per_s", math.nan)
                rate = rate if math.isfinite(rate) and rate > 0 else 1.0  # unmeasured: sized as very slow
                total += TRIAL_OVERHEAD_S + config.epochs * steps * config.effective_batch / rate
        return PLAN_S + total / gpus

    for schemas in (SLICE_SCHEMAS, SLICE_SCHEMAS[-1:]):
        steps = config.steps_per_epoch
        while steps > MIN_STEPS and seconds_of(schemas, steps) > seconds:
            steps = max(MIN_STEPS, int(steps * 0.8))
        if seconds_of(schemas, steps) <= seconds or schemas == SLICE_SCHEMAS[-1:]:
            break
    return {
        "schemas": list(schemas),
        "steps_per_epoch": steps,
        "estimated_seconds": seconds_of(schemas, steps),
        "seconds": seconds,
    }


def _relaunch(out: Path, config: ClusterBenchmarkConfig, shards: Path, schema: str) -> dict[str, Any]:
    """Launch → first training step of ``python jobs/sweep.py`` as a user runs it again: a new process, its own Ray
    and MLflow server, one slice cell (stage classification) whose GPU plan the slice cached."""
    one = replace(config, tasks=("stage_classification",), epochs=1, steps_per_epoch=2)
    space = _space(out / "relaunch.yaml", one, (schema,), workers=None)
    folder = out / "sweeps-relaunch"
    shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, str(Path(__file__).resolve().parents[1] / "jobs" / "sweep.py"), "--space", str(space),
               "--data", str(shards), "--output", str(folder), "--address", "local"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=300)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the relaunch sweep failed ({done.returncode}): {done.stderr[-2000:]}")
    sweep = json.loads(next(folder.glob("*/sweep.json")).read_text(encoding="utf-8"))
    return {"wall_seconds": wall, **sweep["timings_seconds"]}


class HostCpuSampler:
    """This host's CPU use every 2 s while a phase runs: how busy its cores were, on average and at the busiest
    sample (trials that wait on the GPU from Python slow down when the host's cores are all taken), the share of time
    its host took from this virtual machine's cores (steal), the memory in use at the fullest sample, and the memory
    the machine has (a microVM's grows as it is used, ~3 s per 8 GiB, stalling whoever touches new pages)."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s, self.samples, self.steal, self.memory, self.used = interval_s, [], [], [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-cpu", daemon=True)

    def __enter__(self) -> HostCpuSampler:
        psutil.cpu_percent(percpu=True)  # the first reading starts psutil's interval
        psutil.cpu_times_percent()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(psutil.cpu_percent(percpu=True))
            self.steal.append(getattr(psutil.cpu_times_percent(), "steal", 0.0) / 100)
            memory = psutil.virtual_memory()
            self.memory.append(memory.total / 2**30)
            self.used.append((memory.total - memory.available) / 2**30)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"cores": psutil.cpu_count(), "mean_busy": math.nan, "peak_busy": math.nan}
        busy = [float(np.mean(sample)) / 100 for sample in self.samples]
        return {
            "cores": len(self.samples[0]),
            "mean_busy": float(np.mean(busy)),
            "peak_busy": max(busy),
            "mean_steal": float(np.mean(self.steal)),
            "peak_steal": max(self.steal),
            "memory_gib_first": self.memory[0],
            "memory_gib_last": self.memory[-1],
            "used_gib_peak": max(self.used),
        }


def format_host(host: dict[str, float]) -> str:
    """A :class:`HostCpuSampler` summary in one phrase."""
    text = (
        f"host CPUs busy {_pct(host.get('mean_busy', math.nan))} (busiest sample "
        f"{_pct(host.get('peak_busy', math.nan))} of {host.get('cores', '?')})"
    )
    if "mean_steal" in host:
        text += (
            f", steal {_pct(host['mean_steal'])} (peak {_pct(host['peak_steal'])}), memory in use at most "
            f"{host.get('used_gib_peak', math.nan):.0f} GiB of the VM's {host['memory_gib_first']:.0f}"
            + (f" → {host['memory_gib_last']:.0f}" if host["memory_gib_last"] != host["memory_gib_first"] else "")
        )
    return text


def _phase(result: dict[str, Any], name: str, run: Any, empty: Any) -> Any:
    """One part of the benchmark, timed; a failure is recorded and the other parts still run."""
    started = time.perf_counter()
    try:
        return run()
    except Exception as err:  # a benchmark reports what it could measure
        traceback.print_exc()
        result.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
        return empty
    finally:
        result["seconds"][name] = time.perf_counter() - started


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unknown GPU"


def _bench_cohort(out: Path, config: ClusterBenchmarkConfig) -> Path:
    """Prepared once per output folder: a second run (another cluster shape) measures on the very same rows."""
    shards = out / "cohort"
    if not (shards / "manifest.json").is_file():
        prepared = prepare_data(
            "demo",
            out / "prepared",
            PrepareConfig(preprocess=PreprocessConfig.preset("bench"), endoscopy_size=64),
            DemoConfig(cases=config.cases, seed=0),
        )
        rows = {"train": config.train_rows, "val": config.eval_rows, "test": config.eval_rows}
        replicate_splits(prepared.shard_dir, shards, rows)
    return shards


def _space(path: Path, config: ClusterBenchmarkConfig, schemas: tuple[str, ...], workers: list[int] | None) -> Path:
    """The paper's ablation space (its model and recipe), cut to a capped slice; ``workers``: the DDP sizes."""
    document = yaml.safe_load(space_path("modality_ablation").read_text(encoding="utf-8"))
    document.pop("presets")
    document["fixed"].update(
        {
            "schedule.epochs": config.epochs,
            "schedule.max_steps_per_epoch": config.steps_per_epoch,
            "data.micro_batch": config.micro_batch,
            "data.effective_batch": config.effective_batch,
            "data.eval_batch_size": config.eval_batch,
            "model.compile": config.compile,
        }
    )
    tasks = sorted(config.tasks, key=lambda t: HEAVY_FIRST.index(t) if t in HEAVY_FIRST else len(HEAVY_FIRST))
    document["grid"] = {"task": tasks, "schema": list(schemas), "seed": [0]}
    document["resources"] = {"workers": 1, "cpus_per_worker": 4, "gpus_per_worker": config.gpus_per_trial}
    if workers:  # weak scaling: the micro-batch per rank stays; the effective batch grows with the ranks
        document["grid"] = {"task": ["stage_classification"], "schema": list(schemas), "resources.workers": workers}
        document["resources"]["gpus_per_worker"] = 1
        document["fixed"]["data.effective_batch"] = config.micro_batch
        document["fixed"]["resources.torch_trainer"] = True
        document["overrides"] = [
            {"when": {"resources.workers": n}, "set": {"data.effective_batch": config.micro_batch * n}} for n in workers
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


def _raw_rates(shards: Path, space: Path, cells: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """Each cell's raw training step (samples/s, peak GiB) on one GPU, the cells spread over the GPUs."""
    from gx_ray.sweep.spaces import load_space

    loaded = load_space(str(space))
    flats = [cell_flat(loaded, t, s, shards) for t, s in cells]
    compiled = [flat.get("model.compile", False) for flat in flats]
    eager = [{**flat, "model.compile": False} for flat, on in zip(flats, compiled, strict=True) if on]
    rates = one_process_per_gpu(raw_step_rate, flats + eager)  # every cell compiles the same 3D encoder
    eager_rates = iter(rates[len(flats) :])
    return {
        f"{t}/{s}": {**rate, **({"eager": next(eager_rates)} if on else {})}
        for (t, s), rate, on in zip(cells, rates[: len(flats)], compiled, strict=True)
    }


def cell_flat(space: Any, task: str, schema: str, shards: Path) -> dict[str, Any]:
    """One (task, schema) cell of a loaded bench space at seed 0, as a trial's flat config on ``shards``."""
    chosen = space.resolve({"task": task, "schema": schema, "seed": 0})
    return {**space.resource_keys(), **chosen, "data.shards": str(shards)}


def raw_step_rate(flat: dict[str, Any], steps: int = 10, warmup: int = 3) -> dict[str, float]:
    """Training samples/s of the trial's own model (built as the loop builds it) on one fixed batch already on the
    GPU (the CPU where there is none): forward, backward, clipping and AdamW, as the loop's step, with no data path at
    all. ``warmup_seconds``: the first steps in this process pay kernel selection and compilation, a later cell on
    the same GPU little."""
    import gc

    import torch

    from benchmarks.model import synchronize
    from gx_ray.data.stream import first_rows, on_device
    from gx_ray.train import probe
    from gx_ray.train.build import build_trial, loss_function
    from gx_ray.train.config import TrialConfig

    gc.collect()  # the previous cell's model and optimiser state, before this one's peak is measured
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    config = TrialConfig.from_flat(flat)
    task, model, layout = build_trial(config, device)
    micro = int(config.data.micro_batch)
    batch = on_device(first_rows(config.data.shards, "train", micro, layout), device)
    loss_of = loss_function(task, config, device)
    optimiser = adamw(model.parameters(), config.optimiser.lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    built = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            synchronize(device)
            start = time.perf_counter()
        probe.accumulate(model, loss_of, [batch], 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimiser.grad_clip)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "samples_per_s": steps * micro / seconds,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan,
        "warmup_seconds": start - built,  # the first steps: kernel selection, and compilation where compiled
    }


def run_epochs(client: MlflowClient, run: Any) -> list[dict[str, float]]:
    """Per epoch: its seconds, the validation's seconds within them, the training rate and the seconds the loop
    waited for batches."""
    series = {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in ("epoch_seconds", "eval_seconds", "train_samples_per_second", "data_wait_seconds")
    }
    return [
        {"epoch": step, **{key: values.get(step, math.nan) for key, values in series.items()}}
        for step in sorted(series["epoch_seconds"])
    ]


def _epoch_rate(epochs: list[dict[str, float]], epoch: int = 1) -> float:
    """``train_samples_per_second`` of one epoch (epoch 1: the loop warmed up, its data stream running), else the
    last epoch's."""
    rates = [e["train_samples_per_second"] for e in epochs if e["epoch"] == epoch] or [
        e["train_samples_per_second"] for e in epochs
    ]
    return rates[-1] if rates else math.nan


def _data_wait_share(epochs: list[dict[str, float]], epoch: int = 1) -> float:
    """The share of one epoch's training time (epoch 1, as the rate) the loop spent waiting for its next batch."""
    for e in [e for e in epochs if e["epoch"] == epoch] or epochs[-1:]:
        return e["data_wait_seconds"] / (e["epoch_seconds"] - e["eval_seconds"])
    return math.nan


def _warmup_seconds(epochs: list[dict[str, float]]) -> float:
    """Epoch 0's seconds over epoch 1's (the slice's epochs are equal, capped): what a trial pays once."""
    if len(epochs) < 2 or not all(math.isfinite(e["epoch_seconds"]) for e in epochs[:2]):
        return 0.0
    return max(0.0, epochs[0]["epoch_seconds"] - epochs[1]["epoch_seconds"])


def _slice_figures(sweep: SweepResult, raw: dict[str, dict[str, float]], eval_rows: int) -> dict[str, Any]:
    client = MlflowClient(sweep.store_uri)
    cells, slots = {}, []
    for run in child_runs(client, sweep.parent_run_id):
        params, metrics = run.data.params, run.data.metrics
        key = f"{params['task']}/{params['schema']}"
        epoch_timings = run_epochs(client, run)
        rate = _epoch_rate(epoch_timings)
        trial = metrics.get("trial_seconds", math.nan)
        train = metrics.get("train_seconds", math.nan)
        epochs = max(1, int(metrics.get("epoch", 0)) + 1)
        cells[key] = {
            "status": run.info.status,
            "train_samples_per_s": rate,
            "raw_samples_per_s": raw.get(key, {}).get("samples_per_s", math.nan),
            "loop_over_raw": rate / raw.get(key, {}).get("samples_per_s", math.nan),
            "data_wait_share": _data_wait_share(epoch_timings),
            "in_memory": run.data.tags.get("gx_ray.in_memory.train"),  # data.in_memory auto's choice: kept or streamed
            "gpu_share": metrics.get("gpu_share", 1.0),
            "probe_peak_gib": metrics.get("probe_peak_gib", math.nan),  # the plan's measured peak (auto only)
            "micro_batch": metrics.get("micro_batch"),
            "trial_seconds": trial,
            "train_seconds": train,
            "startup_seconds": trial - train,
            "startup_share": (trial - train) / trial,
            "epoch_seconds": train / epochs,
            "warmup_seconds": _warmup_seconds(epoch_timings),
            "eval_seconds_per_row": metrics.get("eval_seconds", math.nan) / eval_rows,
            "gpu_busy_fraction": metrics.get("gpu_busy_fraction", math.nan),
            "gpu_shared": metrics.get("gpu_shared", math.nan),
            "setup_seconds": metrics.get("setup_seconds", math.nan),
            "build_seconds": metrics.get("build_seconds", math.nan),
            "process_start_seconds": metrics.get("process_start_seconds", math.nan),  # a trial in a new process only
            "trial_start_seconds": metrics.get("trial_start_seconds", math.nan),
            "epochs": epoch_timings,
        }
        if run.info.start_time and run.info.end_time:
            slots.append((run.info.end_time - run.info.start_time) / 1000)
    window = sweep.gpus.get("trials_window_seconds", math.nan)
    shares = [c["gpu_share"] for c in cells.values()]
    return {
        "cells": cells,
        "trials": len(cells),
        "finished": sweep.finished,
        "wall_seconds": sweep.timings.get("total_seconds"),
        "first_step_after_seconds": sweep.timings.get("first_step_seconds"),
        "gpu_busy_fraction": sweep.gpus.get("gpu_busy_fraction"),
        "gpu_busy_fraction_per_gpu": sweep.gpus.get("gpu_busy_fraction_per_gpu"),
        "trials_per_gpu_hour": sweep.gpus.get("trials_per_gpu_hour"),
        "startup_share": float(np.nanmean([c["startup_share"] for c in cells.values()])) if cells else math.nan,
        "loop_over_raw": {k: c["loop_over_raw"] for k, c in cells.items()},
        # how well the slice kept its GPU slots filled: trial time over (slots x window)
        "scheduling_efficiency": sum(slots) / (window * sweep.gpus.get("gpus", 1) / min(shares)) if slots else math.nan,
        # where launch → first step went, driver side (the trials' side is each cell's start-up and setup)
        "sweep_seconds": {k: v for k, v in sweep.timings.items() if k.endswith("_seconds")},
    }


def _ddp_figures(sweep: SweepResult) -> dict[str, Any]:
    client = MlflowClient(sweep.store_uri)
    rates = {}
    for run in child_runs(client, sweep.parent_run_id):
        rates[int(run.data.params["resources.workers"])] = _epoch_rate(run_epochs(client, run))
    one = rates.get(1, math.nan)
    return {"samples_per_s": rates, "speed_up": {n: r / one for n, r in sorted(rates.items())}}


def project(slice_figures: dict[str, Any], gpus: int = 8) -> dict[str, Any]:
    """Hours for the paper's whole ablation at Gastric-X's size on ``gpus`` GPUs: per task, the slice's heaviest
    schema's per-trial training rate and evaluation time scaled to Gastric-X's splits, 20 epochs, plus once per trial
    its start-up and its first epoch's warm-up (kernel selection, compilation: epoch 0's seconds over epoch 1's);
    12 trials a task (4 schemas x 3 seeds), each taking its measured GPU share.

    ``hours``: the 60 trials' GPU-seconds placed longest first on the GPUs (the schedule's tail included).
    ``hours_at_slice_efficiency``: their sum spread evenly, over the slice's own scheduling efficiency: a pessimistic
    bound, since a slice of ten short trials on a few GPUs is mostly tail."""
    cells = slice_figures.get("cells", {})
    efficiency = slice_figures.get("scheduling_efficiency") or 1.0
    efficiency = efficiency if math.isfinite(efficiency) else 1.0
    per_task, jobs = {}, []
    # a trial the time budget ended has its epochs' figures but no start-up time (logged at its end): the slice's
    # typical start-up stands in for it, so that a task whose trials all ran out of time is still projected
    startups = [c["startup_seconds"] for c in cells.values() if math.isfinite(c.get("startup_seconds", math.nan))]
    typical_startup = float(np.median(startups)) if startups else 0.0
    for task in PAPER_TASKS:
        measured = [c for k, c in cells.items() if k.startswith(f"{task}/") and math.isfinite(c["train_samples_per_s"])]
        if not measured:
            per_task[task] = None
            continue
        cell = min(measured, key=lambda c: c["train_samples_per_s"])  # the heaviest schema stands for all four
        epoch = GASTRIC_X["train"] / cell["train_samples_per_s"] + GASTRIC_X["val"] * cell["eval_seconds_per_row"]
        trials = PAPER_ABLATION["schemas"] * PAPER_ABLATION["seeds"]
        startup = cell["startup_seconds"] if math.isfinite(cell.get("startup_seconds", math.nan)) else typical_startup
        slot = PAPER_ABLATION["epochs"] * epoch + startup + cell.get("warmup_seconds", 0.0)
        packed = trials_per_gpu(cell["gpu_share"])
        per_task[task] = {"epoch_seconds": epoch, "trial_seconds": slot, "trials_per_gpu": packed}
        jobs += [slot * cell["gpu_share"]] * trials
    measured = all(per_task.values())  # a task not measured leaves the projection undefined, not smaller
    loads = [0.0] * gpus
    for job in sorted(jobs, reverse=True):  # longest first, each onto the least loaded GPU
        loads[loads.index(min(loads))] += job
    return {
        "gpus": gpus,
        "hours": max(loads) / 3600 if measured else math.nan,
        "hours_at_slice_efficiency": sum(jobs) / gpus / max(efficiency, 1e-6) / 3600 if measured else math.nan,
        "per_task": per_task,
        "scheduling_efficiency": efficiency,
    }


def _nodes(result: dict[str, Any]) -> str:
    nodes = result.get("nodes", 1)
    off = ", ".join(f"{k}={v}" for k, v in sorted(result.get("nccl", {}).items()))
    return f"{nodes} Ray node{'s' if nodes > 1 else ''}" + (f", {off}" if off else "")


def _data_path(in_memory: str | None) -> str:
    """How a cell's training split reached its loop: kept in memory, streamed through Ray Data, or not said."""
    return {"true": "memory", "false": "stream"}.get(in_memory or "", "?")


def _launch_line(s: dict[str, Any]) -> str:
    """Launch → first step, by part: the driver's (Ray, data, the GPU plan's measured steps, what was left of MLflow's
    start), then the trials' medians: the process's age at its first trial (Ray starting the actor, the imports),
    the trial's own start (its MLflow run, its config), and the loop's set-up (the model's build among it)."""
    driver = s.get("sweep_seconds", {})
    parts = [("Ray", "ray_seconds"), ("data", "data_seconds"), ("GPU plan", "gpu_plan_seconds"),
             ("MLflow wait", "mlflow_seconds")]  # fmt: skip
    said = ", ".join(f"{name} {driver[key]:.1f} s" for name, key in parts if key in driver)
    trial = [("process", "process_start_seconds"), ("trial start", "trial_start_seconds"),
             ("loop set-up", "setup_seconds"), ("of it the model", "build_seconds")]  # fmt: skip
    parts_said = []
    for name, key in trial:
        values = [x for c in s.get("cells", {}).values() if math.isfinite(x := c.get(key, math.nan))]
        if values:
            parts_said.append(f"{name} {float(np.median(values)):.1f} s")
    medians = ", ".join(parts_said)
    first = s.get("first_step_after_seconds") or math.nan
    return (f"launch → first step {first:.1f} s: {said or 'no driver timings'}"
            f"{f'; a trial (median): {medians}' if medians else ''}")  # fmt: skip


def format_cluster_result(result: dict[str, Any]) -> str:
    s, seconds = result["slice"], result["seconds"]
    lines = [
        f"cluster benchmark on {result['gpus']} x {result['gpu']} ({_nodes(result)}): {seconds['total']:.0f} s in all "
        f"(cohort {seconds.get('cohort', 0):.0f} s, raw steps {seconds.get('raw', 0):.0f} s)",
    ]
    if s.get("cells"):
        lines += [
            f"slice: {s['finished']} of {s['trials']} trials, {s['wall_seconds']:.0f} s; first step after "
            f"{s['first_step_after_seconds'] or math.nan:.1f} s; GPU busy {_pct(s['gpu_busy_fraction'])} (per GPU "
            f"{s['gpu_busy_fraction_per_gpu']}), start-up share {_pct(s['startup_share'])}, "
            f"{s['trials_per_gpu_hour'] or math.nan:.1f} trials per GPU-hour; {format_host(s.get('host_cpu', {}))}",
            _launch_line(s),
            f"{'cell':<38}{'share':>6}{'peak':>6}{'micro':>6}{'loop/s':>8}{'raw/s':>8}{'loop/raw':>9}{'wait':>6}{'data':>7}"
            f"{'start-up s':>11}{'warm-up s':>10}{'epoch s (val s)':>24}{'busy':>6}",
        ]
    for key, c in sorted(s.get("cells", {}).items()):
        epochs = " ".join(f"{e['epoch_seconds']:.1f}({e['eval_seconds']:.1f})" for e in c.get("epochs", []))
        lines.append(
            f"{key:<38}{c['gpu_share']:>6.2f}{c.get('probe_peak_gib', math.nan):>6.1f}{c['micro_batch'] or 0:>6.0f}"
            f"{c['train_samples_per_s']:>8.1f}"
            f"{c['raw_samples_per_s']:>8.1f}{c['loop_over_raw']:>9.2f}{_pct(c.get('data_wait_share', math.nan)):>6}"
            f"{_data_path(c.get('in_memory')):>7}{c['startup_seconds']:>11.1f}"
            f"{c.get('warmup_seconds', math.nan):>10.1f}{epochs:>24}"
            f"{_pct(c['gpu_busy_fraction']):>6}"
        )
    raw = result.get("raw", {})
    if any("eager" in r for r in raw.values()):
        lines.append("raw step, compiled vs eager (samples/s; peak GiB; warm-up s, the first cell on a GPU pays all):")
        for key, r in sorted(raw.items()):
            e = r["eager"]
            lines.append(
                f"  {key:<36}{r['samples_per_s']:7.1f} vs {e['samples_per_s']:5.1f} "
                f"({r['samples_per_s'] / e['samples_per_s']:.2f}x); {r['peak_gib']:.1f} vs {e['peak_gib']:.1f}; "
                f"{r['warmup_seconds']:.0f} vs {e['warmup_seconds']:.0f}"
            )
    if result.get("ddp"):
        d = result["ddp"]
        sizes = sorted(d["speed_up"])
        scaling = ", ".join(
            f"{n} GPU {d['samples_per_s'][n]:.1f}/s ({d['speed_up'][n]:.2f}x)"
            if math.isfinite(d["speed_up"][n])
            else f"{n} GPU not measured (the budget ended it; --tasks stage_classification leaves DDP the time)"
            for n in sizes
        )
        lines.append(f"DDP weak scaling (micro-batch 8 per rank): {scaling}")
    if "sized" in result:
        z = result["sized"]
        lines.insert(
            1,
            f"slice sized to {z['seconds']:.0f} s on {result['gpus']} GPU(s): {', '.join(z['schemas'])}, "
            f"{z['steps_per_epoch']} steps an epoch (estimated {z['estimated_seconds']:.0f} s)",
        )
    if r := result.get("relaunch"):
        lines.append(
            f"relaunch, the GPU plan cached (a new `jobs/sweep.py`, one trial): launch → first step "
            f"{r.get('first_step_seconds', math.nan):.1f} s (Ray {r.get('ray_seconds', math.nan):.1f} s, data "
            f"{r.get('data_seconds', math.nan):.1f} s, GPU plan {r.get('gpu_plan_seconds', math.nan):.1f} s); "
            f"the command {r['wall_seconds']:.0f} s"
        )
    p = result["projection"]
    hours = (
        f"{p['hours']:.2f} h ({p['hours_at_slice_efficiency']:.2f} h at the slice's scheduling efficiency "
        f"{p['scheduling_efficiency']:.0%})"
        if math.isfinite(p["hours"])
        else "n/a (needs all five tasks in the slice)"
    )
    lines.append(f"projection: the paper's whole ablation at Gastric-X size on {p['gpus']} GPUs: {hours}")
    for name, error in result.get("errors", {}).items():
        lines.append(f"{name} failed: {error}")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.0%}"
