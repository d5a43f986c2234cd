"""`python jobs/benchmark.py loop`: the training loop against the raw step of the same model, one trial at a time.

Each (task, schema, variant) runs the trial's own loop (:func:`~gx_ray.train.loop.run_loop`, Ray Data stream and
all) in one process per GPU (in this process on a machine without one), with no sweep around it, right after the raw
step of the same model on one batch already on the device (:func:`~benchmarks.cluster.raw_step_rate`).
Their ratio is the loop's cost alone, apart from packing and start-up; the variants tell which part of the loop
costs it:

- ``stream``: the split streamed through Ray Data (shuffle buffer, collation in its prefetch threads), as a trial
  whose share does not fit its host's memory (``data.in_memory: auto``) reads it;
- ``in_memory``: row groups read once, collated in one thread of the loop's own (``data.in_memory``);
- ``no_shuffle``: the stream without its shuffle buffer;
- ``switch_0.5ms``: the stream with Python's thread switch interval at 0.5 ms instead of 5: a step that waits on the
  GPU many times hands the interpreter to the data threads at each wait and may wait up to the interval to get it back.

With ``--profile`` each cell's ``stream`` runs once more under cProfile (the loop's own thread; its rate is not
comparable) and the functions that took longest are printed beside the figures.

With ``--neighbours N`` every (cell, variant) runs a second time (``+ neighbours``) on a card of its own while N
trial loops train on each of the other cards: the slice's mix of tasks and schemas, each in its own process at a
1/N GPU share, as a sweep packs them. What a trial loses only when the node is full shows there, and the host's
CPU use, CPU steal (a virtual machine's cores taken by its host) and memory beside each phase tell which resource
the neighbours take from it; each cell beside them also samples its process's thread stacks (:class:`StackSampler`).
On 4 x H200 beside six neighbours the streamed detection loop fell to 0.11-0.15 of its raw step with its card idle,
its Ray Data executor threads busy in their own bookkeeping, while the same loop kept in memory held 0.94: hence
``data.in_memory: auto``.
"""

from __future__ import annotations

import cProfile
import io
import json
import math
import pstats
import sys
import threading
import time
from collections import Counter, defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from benchmarks.cluster import (
    SLICE_SCHEMAS,
    ClusterBenchmarkConfig,
    HostCpuSampler,
    _bench_cohort,
    _data_wait_share,
    _space,
    cell_flat,
    format_host,
    raw_step_rate,
)
from gx_ray.runtime import GpuProcess, init_ray, one_process_per_gpu
from gx_ray.schema import PAPER_TASKS

VARIANTS: dict[str, dict[str, Any]] = {
    "stream": {"data.in_memory": False},
    "in_memory": {"data.in_memory": True},
    "no_shuffle": {"data.in_memory": False, "data.shuffle_buffer": 0},
    "switch_0.5ms": {"data.in_memory": False, "switch_interval_s": 0.0005},
}


@dataclass(frozen=True)
class LoopBenchmarkConfig:
    tasks: tuple[str, ...] = ("lesion_detection", "stage_classification")
    schemas: tuple[str, ...] = ("image_only",)
    variants: tuple[str, ...] = tuple(VARIANTS)
    steps_per_epoch: int = 10
    epochs: int = 2
    micro_batch: int = 8
    effective_batch: int = 32
    profile: bool = False
    gpus: int | None = None
    neighbours: int = 0
    """Trial loops training on each other GPU while every cell runs a second time (0: no second run)."""
    neighbours_ready_s: float = 90.0
    """How long the neighbours may take to finish their first (10-step) epoch before the cells run beside them."""


def run_loop_benchmark(out: Path, config: LoopBenchmarkConfig = LoopBenchmarkConfig()) -> dict[str, Any]:
    out = Path(out)
    init_ray(None, num_gpus=config.gpus)
    cluster = ClusterBenchmarkConfig(
        steps_per_epoch=config.steps_per_epoch, epochs=config.epochs, micro_batch=config.micro_batch,
        effective_batch=config.effective_batch, tasks=config.tasks,
    )  # fmt: skip
    shards = _bench_cohort(out, cluster)
    from gx_ray.sweep.spaces import load_space

    space = load_space(str(_space(out / "loop.yaml", cluster, config.schemas, workers=None)))
    items = []
    for task in config.tasks:
        for schema in config.schemas:
            flat = cell_flat(space, task, schema, shards)
            cell = f"{task}/{schema}"
            items += [{"cell": cell, "variant": v, "flat": flat, "profile": False} for v in config.variants]
            if config.profile:  # apart: rates under the profiler are not comparable
                items.append({"cell": cell, "variant": "stream", "flat": flat, "profile": True})
    started = time.perf_counter()
    gpus = int(ray.cluster_resources().get("GPU", 0))
    with HostCpuSampler() as host:
        rows = one_process_per_gpu(loop_against_raw, items) if gpus else [loop_against_raw(item) for item in items]
    hosts = {"alone": host.summary()}
    if config.neighbours and gpus >= 2:
        print("\n".join(map(format_row, rows)), flush=True)  # what a run cut by its time limit still shows
        flats = [cell_flat(space, t, s, shards) for t in PAPER_TASKS for s in SLICE_SCHEMAS]
        measured = [item for item in items if not item["profile"]]
        beside, hosts["neighbours"] = beside_neighbours(measured, flats, config.neighbours, gpus, config)
        rows += beside
    result = {"config": asdict(config), "seconds": time.perf_counter() - started, "rows": rows, "host": hosts}
    (out / "loop_benchmark.json").write_text(json.dumps(result, indent=1, default=float) + "\n", encoding="utf-8")
    return result


@ray.remote(max_concurrency=2)
class Neighbour:
    """A trial loop that trains until it is killed, counting its epochs (asked from a second thread)."""

    def __init__(self) -> None:
        self.epochs = 0

    def train(self, flat: dict[str, Any]) -> None:
        import torch

        from gx_ray.runtime import quiet_data_context
        from gx_ray.train.config import TrialConfig
        from gx_ray.train.loop import WorkerContext, run_loop

        quiet_data_context()

        def count(metrics: dict, checkpoint: Any = None) -> None:
            self.epochs += 1
            rate = metrics["train_samples_per_second"]
            print(f"neighbour {flat['task']}/{flat['schema']}: epoch {self.epochs} {rate:.1f} samples/s", flush=True)

        # short epochs: the first ends (and the measured cells start) soon after the neighbour trains at all
        config = TrialConfig.from_flat({**flat, "schedule.epochs": 10_000, "schedule.max_steps_per_epoch": 10})
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        run_loop(config, WorkerContext(rank=0, world_size=1, device=device, report=count, latest_checkpoint=None))

    def epochs_done(self) -> int:
        return self.epochs


def _fewest_epochs(neighbours: list[Any], timeout_s: float = 10.0) -> int:
    """The fewest epochs any neighbour has finished; 0 while one is not answering yet (not yet placed, or starting)."""
    asked = [n.epochs_done.remote() for n in neighbours]
    answered, _ = ray.wait(asked, num_returns=len(asked), timeout=timeout_s)
    return min(ray.get(answered)) if len(answered) == len(asked) else 0


def _warm(_: Any) -> None:
    import torch

    import gx_ray.train.loop  # noqa: F401

    if torch.cuda.is_available():
        torch.cuda.init()


def beside_neighbours(
    items: list[dict[str, Any]], flats: list[dict[str, Any]], per_gpu: int, gpus: int, config: LoopBenchmarkConfig
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every item again in one process holding a card of its own, once ``per_gpu`` neighbour loops (``flats`` in
    turn) train on each of the other cards; with the host's use over that phase."""
    measured = GpuProcess.remote()
    # its whole card held before any neighbour is placed, and its imports and CUDA start paid apart from the cells
    # (30 s on a fresh GPU machine: a time-boxed run spends it before the neighbours, not beside them)
    ray.get(measured.run.remote(_warm, None))
    share = math.floor(10_000 / per_gpu) / 10_000  # Ray counts GPUs in 1e-4: N shares must fit one card
    neighbours = [Neighbour.options(num_gpus=share, num_cpus=1).remote() for _ in range((gpus - 1) * per_gpu)]
    training = [n.train.remote(flats[i % len(flats)]) for i, n in enumerate(neighbours)]
    try:
        deadline = time.monotonic() + config.neighbours_ready_s
        while time.monotonic() < deadline and _fewest_epochs(neighbours) < 1:
            ready, _ = ray.wait(training, timeout=5)
            if ready:
                ray.get(ready)  # a neighbour that failed says why
        rows, ended = [], []
        with HostCpuSampler() as host:
            for item in items:
                rows.append(ray.get(measured.run.remote(loop_against_raw, {**item, "sample_stacks": True})))
                ended = _ended(training)  # one out of memory, say, stops early
                rows[-1]["neighbours_training"] = len(neighbours) - len(ended)
                rows[-1]["variant"] += f" + {len(neighbours)} neighbours" + (
                    f" ({len(neighbours) - len(ended)} training)" if ended else ""
                )
                print(format_row(rows[-1]), flush=True)
        summary = {**host.summary(), "neighbours": len(neighbours), "neighbours_ended": ended}
    finally:
        for actor in [measured, *neighbours]:
            ray.kill(actor)
    return rows, summary


def _ended(training: list[Any]) -> list[str]:
    """Why each neighbour that is no longer training ended (it trains until killed, so any end is a failure)."""
    ended, _ = ray.wait(training, num_returns=len(training), timeout=0)
    reasons = []
    for ref in ended:
        try:
            ray.get(ref)
            reasons.append("returned")
        except Exception as err:  # what the neighbour died of, in one line
            reasons.append(f"{type(err).__name__}: {str(err).splitlines()[-1][:160]}")
    return reasons


def sync_round_trip_us(device: Any, repeats: int = 2000) -> float:
    """Microseconds for one tiny kernel and the read of its result back to the host: what each of detection's
    hundreds of small GPU reads a step pays, apart from the work itself."""
    import torch

    x = torch.zeros((), device=device)
    for _ in range(50):  # CUDA's lazy start, the allocator's first block
        (x + 1).item()
    started = time.perf_counter()
    for _ in range(repeats):
        (x + 1).item()
    return (time.perf_counter() - started) / repeats * 1e6


class StackSampler(threading.Thread):
    """Where each thread of this process is, sampled every ``interval_s``: a sample is taken only when the sampler
    gets the interpreter, so a thread that holds it shows up in the Python code it runs, and the others where they
    gave it up (a blocking call) or wait for it."""

    IDLE = ("threading.py:wait", "queue.py:get", "selectors.py:select", "threading.py:_wait_for", "thread.py:_worker")

    def __init__(self, interval_s: float = 0.02, depth: int = 3) -> None:
        super().__init__(daemon=True, name="stack-sampler")
        self.interval_s, self.depth = interval_s, depth
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == self.ident:
                    continue
                where = []
                while frame is not None and len(where) < self.depth:
                    where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                name = names.get(ident, "?").rstrip("0123456789_-")  # pool threads counted together
                self.counts[name][" < ".join(where)] += 1

    def __enter__(self) -> StackSampler:
        self.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop_event.set()
        self.join()

    def summary(self, top: int = 4) -> str:
        lines = [f"{self.samples} samples, every {self.interval_s * 1000:.0f} ms; each thread's busiest places"]
        for name, counts in sorted(self.counts.items()):
            busy = [(k, n) for k, n in counts.most_common() if not k.startswith(self.IDLE)]
            idle = sum(n for k, n in counts.items() if k.startswith(self.IDLE))
            lines.append(f"  {name}: idle (waiting on a lock or queue) {idle}")
            lines += [f"    {n:>5}  {k}" for k, n in busy[:top]]
        return "\n".join(lines)


def loop_against_raw(item: dict[str, Any]) -> dict[str, Any]:
    """The round trip of one small GPU read, the raw step's rate, then the loop's epochs, of one trial in this
    process."""
    import torch

    from gx_ray.runtime import quiet_data_context
    from gx_ray.train.config import TrialConfig
    from gx_ray.train.loop import WorkerContext, run_loop

    quiet_data_context()
    overrides = dict(VARIANTS[item["variant"]])
    switch = overrides.pop("switch_interval_s", None)
    flat = {**item["flat"], **overrides}
    name = f"{item['cell']} {item['variant']}"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    round_trip = sync_round_trip_us(device)
    print(f"{name}: one small GPU read {round_trip:.0f} us", flush=True)
    raw = raw_step_rate(flat)
    print(f"{name}: raw step {raw['samples_per_s']:.1f} samples/s", flush=True)  # progress of a long cell
    epochs: list[dict[str, float]] = []

    def report(metrics: dict[str, float], checkpoint: Any = None) -> None:
        epochs.append(metrics)
        print(f"{name}: epoch {metrics['epoch']} {metrics['train_samples_per_second']:.1f} samples/s", flush=True)

    ctx = WorkerContext(rank=0, world_size=1, device=device, report=report, latest_checkpoint=None)
    before = sys.getswitchinterval()
    profiler = cProfile.Profile() if item["profile"] else None
    with StackSampler() if item.get("sample_stacks") else nullcontext() as sampler:
        try:
            if switch:
                sys.setswitchinterval(switch)
            if profiler:
                profiler.enable()
            run_loop(TrialConfig.from_flat(flat), ctx)
        finally:
            if profiler:
                profiler.disable()
            sys.setswitchinterval(before)
    rates = [e["train_samples_per_second"] for e in epochs]
    row = {
        "cell": item["cell"],
        "variant": item["variant"] + (" (profiled)" if item["profile"] else ""),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU",
        "sync_round_trip_us": round_trip,
        "raw_samples_per_s": raw["samples_per_s"],
        "loop_samples_per_s": rates,
        "loop_over_raw": rates[-1] / raw["samples_per_s"],
        "eval_seconds": [e["eval_seconds"] for e in epochs],
        "data_wait_share": _data_wait_share(epochs, epochs[-1]["epoch"]),  # of the last epoch's training time
    }
    if sampler:
        row["threads"] = sampler.summary()
        print(f"{name}: threads\n{row['threads']}", flush=True)
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        row["profile"] = text.getvalue()
    return row


def format_row(r: dict[str, Any]) -> str:
    loop = " ".join(f"{x:.1f}" for x in r["loop_samples_per_s"])
    return (
        f"{r['cell']:<36} {r['variant']:<26} {r['raw_samples_per_s']:>7.1f} {loop:>24} {r['loop_over_raw']:>9.2f}"
        f" {r['data_wait_share']:>5.0%} {r.get('sync_round_trip_us', math.nan):>6.0f}"
    )


def format_loop_result(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"training loop against the raw step, {rows[0]['gpu'] if rows else '?'} ({result['seconds']:.0f} s)",
        f"{'cell':<36} {'variant':<26} {'raw':>7} {'loop (epoch by epoch)':>24} {'loop/raw':>9} {'wait':>5}"
        f" {'read':>6}",
    ]
    lines += [format_row(r) for r in rows]
    lines.append(
        "samples/s; loop/raw from the last epoch (the first pays kernel selection); wait: its share of that epoch's "
        "training time spent waiting for the next batch; read: microseconds for one tiny kernel and the read of its "
        "result (each of detection's many small GPU reads a step pays it)"
    )
    lines += [f"{phase}: {format_host(host)}" for phase, host in result.get("host", {}).items()]
    ended = result.get("host", {}).get("neighbours", {}).get("neighbours_ended", [])
    if ended:  # the cells beside them had fewer neighbours than asked for, from then on
        lines.append(f"{len(ended)} neighbour(s) stopped training early: " + "; ".join(sorted(set(ended))))
    for r in rows:
        if "profile" in r:
            lines += [f"--- profile of {r['cell']} {r['variant']} (loop thread, by own time)", r["profile"]]
    return "\n".join(lines)
