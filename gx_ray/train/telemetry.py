"""GPU telemetry for a trial: which GPUs this process uses, how busy they were, and whether it had them to itself.

A `GpuSampler` thread reads NVML once a second while a trial trains; `GpuSummary` turns the samples into the few
numbers a sweep compares and `sample_metrics` into MLflow's system-metric series (MLflow's own hook works only with
fluent runs; our trials log through `MlflowClient`). NVML sees every GPU of the host whatever
``CUDA_VISIBLE_DEVICES`` says, and Ray hands trials physical indices or shares a GPU, so GPUs are matched by UUID,
never by index. Without a driver or the package everything degrades quietly to "no GPUs" (NaN, no samples).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

GIB = 2**30
NAN = float("nan")
UUID_PREFIXES = ("GPU-", "MIG-")


class Sample(NamedTuple):
    """One GPU at one sampling round. Unknown values are NaN (or -1 for ``others``)."""

    t: float
    """Wall-clock seconds (``time.time``): comparable across the trials of a sweep, unlike a monotonic clock."""
    step: int
    """Sampling round of the sampler, from 0."""
    gpu: int
    """Position of the GPU in the sampler's UUID list (the process's CUDA ordinal for `visible_gpu_uuids`)."""
    utilization: float
    """Percent of the last sample period in which a kernel ran (NVML's ``utilization.gpu``)."""
    memory_used: float
    """Bytes used on the GPU by every process."""
    memory_total: float
    process_memory: float
    """Bytes used by our pids; NaN when none of them is listed among the GPU's compute processes."""
    others: int
    """Compute processes on the GPU other than ours; -1 when NVML can't list them."""


class MetricPoint(NamedTuple):
    """One point of an MLflow time series: ``mlflow.entities.Metric(key, value, timestamp_ms, step)``."""

    key: str
    value: float
    step: int
    timestamp_ms: int


# --------------------------------------------------------------------------------------------------------------
# NVML and the GPUs this process may use


@functools.cache
def _nvml() -> Any:
    """The initialised ``pynvml`` module, or None without the package or a driver (decided once per process)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()  # reference-counted and kept for the life of the process: sampling needs it throughout
    except pynvml.NVMLError as error:
        log.debug("NVML unavailable, no GPU telemetry: %s", error)
        return None
    return pynvml


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes
    return value.decode() if isinstance(value, bytes) else value


def _as_nvml_uuid(value: Any) -> str:
    """A CUDA device UUID (torch's ``_CUuuid``, `uuid.UUID`, 16 bytes or a string) as NVML spells it: ``GPU-…``."""
    raw = getattr(value, "bytes", value)  # torch 2.x: an object whose ``bytes`` are the 16 raw bytes
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        return f"GPU-{uuidlib.UUID(bytes=bytes(raw))}"
    text = str(value).strip()
    if text.startswith(UUID_PREFIXES):
        return text
    try:
        return f"GPU-{uuidlib.UUID(text)}"
    except ValueError:
        return f"GPU-{text}"


def _host_uuids(nvml: Any) -> list[str]:
    """Every GPU of the host, in NVML (PCI bus) order."""
    count = nvml.nvmlDeviceGetCount()
    return [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]


def _parse_visible(value: str, host_uuids: Sequence[str]) -> list[str]:
    """The UUIDs a ``CUDA_VISIBLE_DEVICES`` value (indices in NVML's PCI bus order, or unique UUID prefixes) selects;
    as in CUDA, the list ends at the first entry that names no GPU, is ambiguous or repeats one."""
    chosen: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        match = _match_entry(entry, host_uuids)
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen


def _match_entry(entry: str, host_uuids: Sequence[str]) -> str | None:
    if entry.lstrip("-").isdigit():
        index = int(entry)
        return host_uuids[index] if 0 <= index < len(host_uuids) else None
    if entry.startswith("MIG-"):
        return entry  # MIG instances aren't in the host list; NVML opens them by UUID
    prefix = entry if entry.startswith("GPU-") else f"GPU-{entry}"
    matches = [u for u in host_uuids if u.startswith(prefix)] if entry else []
    return matches[0] if len(matches) == 1 else None


def _torch_uuids() -> list[str] | None:
    """The UUIDs of torch's CUDA devices in ordinal order, or None when torch has no CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return [_as_nvml_uuid(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except (ImportError, RuntimeError, AttributeError) as error:
        log.debug("torch can't name its CUDA devices: %s", error)
        return None


def visible_gpu_uuids() -> list[str]:
    """The NVML UUIDs of the GPUs this process may use, in CUDA ordinal order ([] without NVML): torch's view when it
    has CUDA, else ``CUDA_VISIBLE_DEVICES`` resolved through NVML, else every GPU of the host."""
    nvml = _nvml()
    if nvml is None:
        return []
    from_torch = _torch_uuids()
    if from_torch is not None:
        return from_torch
    try:
        host = _host_uuids(nvml)
    except nvml.NVMLError as error:
        log.debug("NVML can't list the GPUs: %s", error)
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return host if visible is None else _parse_visible(visible, host)


# --------------------------------------------------------------------------------------------------------------
# Summary: pure functions of the samples


@dataclass(frozen=True)
class GpuStats:
    """One GPU over a sampling window. NaN where there were no (known) samples."""

    index: int
    uuid: str
    name: str
    samples: int
    utilization_mean: float
    """Mean of NVML's utilisation, percent."""
    busy_fraction: float
    """``utilization_mean / 100``: the fraction of the window a kernel ran."""
    active_fraction: float
    """Fraction of samples with any kernel running (utilisation > 0)."""
    memory_peak_bytes: float
    memory_total_bytes: float
    process_memory_peak_bytes: float
    shared: bool
    """Another process computed on the GPU during the window."""


@dataclass(frozen=True)
class GpuSummary:
    """The GPUs a sampler watched: each GPU, and all of them together (means over all samples, peaks of any GPU)."""

    duration_s: float
    gpus: list[GpuStats]
    utilization_mean: float
    busy_fraction: float
    active_fraction: float
    memory_peak_bytes: float
    """The highest memory use of any one GPU: what decides whether a trial fits."""
    memory_total_bytes: float
    process_memory_peak_bytes: float
    shared: bool

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.gpus]

    @property
    def names(self) -> list[str]:
        return [g.name for g in self.gpus]

    def as_metrics(self, prefix: str = "gpu_") -> dict[str, float]:
        """Flat floats for MLflow; per-GPU keys (``gpu_1_…``) only when there are several GPUs."""
        metrics = {f"{prefix}count": float(len(self.gpus)), f"{prefix}duration_s": self.duration_s}
        metrics.update(_stat_metrics(prefix, self))
        if len(self.gpus) > 1:
            for gpu in self.gpus:
                metrics.update(_stat_metrics(f"{prefix}{gpu.index}_", gpu))
        return metrics

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; NaN becomes None, which JSON has and NaN isn't."""
        data = asdict(self)
        data["uuids"], data["names"] = self.uuids, self.names
        return _nan_to_none(data)


def _stat_metrics(prefix: str, stats: GpuStats | GpuSummary) -> dict[str, float]:
    return {
        f"{prefix}utilization_mean": stats.utilization_mean,
        f"{prefix}busy_fraction": stats.busy_fraction,
        f"{prefix}active_fraction": stats.active_fraction,
        f"{prefix}memory_peak_gib": stats.memory_peak_bytes / GIB,
        f"{prefix}memory_total_gib": stats.memory_total_bytes / GIB,
        f"{prefix}process_memory_peak_gib": stats.process_memory_peak_bytes / GIB,
        f"{prefix}shared": float(stats.shared),
    }


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def _known(values: Iterable[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def _mean(values: Iterable[float]) -> float:
    known = _known(values)
    return sum(known) / len(known) if known else NAN


def _peak(values: Iterable[float]) -> float:
    known = _known(values)
    return max(known) if known else NAN


def _active(utilizations: Iterable[float]) -> float:
    return _mean(float(u > 0) for u in _known(utilizations))


def _shared(samples: Sequence[Sample]) -> bool:
    """Whether a process other than ours computed on the GPU. When our pid never shows up (a container's PID
    namespace differs from the driver's), one unrecognised process is taken to be us."""
    ours_seen = any(not math.isnan(s.process_memory) for s in samples)
    tolerated = 0 if ours_seen else 1
    return any(s.others > tolerated for s in samples)


def _gpu_stats(index: int, uuid: str, name: str, samples: Sequence[Sample]) -> GpuStats:
    utilizations = [s.utilization for s in samples]
    mean = _mean(utilizations)
    return GpuStats(
        index=index,
        uuid=uuid,
        name=name,
        samples=len(samples),
        utilization_mean=mean,
        busy_fraction=mean / 100,
        active_fraction=_active(utilizations),
        memory_peak_bytes=_peak(s.memory_used for s in samples),
        memory_total_bytes=_peak(s.memory_total for s in samples),
        process_memory_peak_bytes=_peak(s.process_memory for s in samples),
        shared=_shared(samples),
    )


def _by_gpu(samples: Iterable[Sample]) -> dict[int, list[Sample]]:
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.gpu, []).append(sample)
    return groups


def summarise(
    samples: Sequence[Sample], uuids: Sequence[str], names: Sequence[str] = (), duration_s: float = NAN
) -> GpuSummary:
    """The summary of ``samples`` of the GPUs ``uuids`` (``Sample.gpu`` indexes them); a pure function."""
    groups = _by_gpu(samples)
    gpus = [_gpu_stats(i, uuid, names[i] if i < len(names) else "", groups.get(i, [])) for i, uuid in enumerate(uuids)]
    watched = [s for s in samples if s.gpu < len(uuids)]
    utilization = _mean(s.utilization for s in watched)
    return GpuSummary(
        duration_s=duration_s,
        gpus=gpus,
        utilization_mean=utilization,
        busy_fraction=utilization / 100,
        active_fraction=_active(s.utilization for s in watched),
        memory_peak_bytes=_peak(g.memory_peak_bytes for g in gpus),
        memory_total_bytes=_peak(g.memory_total_bytes for g in gpus),
        process_memory_peak_bytes=_peak(g.process_memory_peak_bytes for g in gpus),
        shared=any(g.shared for g in gpus),
    )


def busy_fraction(samples: Iterable[Sample], start: float, end: float) -> dict[int, float]:
    """Per GPU (``Sample.gpu``), the mean utilisation / 100 of the samples taken in ``[start, end]`` (wall clock);
    NaN for a GPU sampled but never inside the window."""
    return {
        gpu: _mean(s.utilization / 100 for s in rows if start <= s.t <= end)
        for gpu, rows in sorted(_by_gpu(samples).items())
    }


def sample_metrics(samples: Iterable[Sample], prefix: str = "system/") -> list[MetricPoint]:
    """The samples as MLflow system-metric time series (``system/gpu_0_utilization_percentage``, …), step = round.
    Names, units (MB = 10⁶ bytes) and rounding follow MLflow's GPU monitor; unknown values are left out, not NaN."""
    points: list[MetricPoint] = []
    for s in samples:
        stamp, name = int(s.t * 1000), f"{prefix}gpu_{s.gpu}_"
        values = {
            "utilization_percentage": s.utilization,
            "memory_usage_megabytes": s.memory_used / 1e6,
            "memory_usage_percentage": round(s.memory_used / s.memory_total * 100, 1) if s.memory_total else NAN,
        }
        points.extend(MetricPoint(name + key, v, s.step, stamp) for key, v in values.items() if not math.isnan(v))
    return points


# --------------------------------------------------------------------------------------------------------------
# The sampler thread


class GpuSampler:
    """Samples the GPUs ``uuids`` (None: every GPU of the host; those NVML can't open are left out) every
    ``interval_s`` seconds on a daemon thread: ``with GpuSampler(...) as s:`` then ``s.summary()``, or ``start()`` and
    ``stop()``. Memory and processes are attributed to our pid and ``pids``."""

    def __init__(self, uuids: Sequence[str] | None = None, interval_s: float = 1.0, pids: Iterable[int] = ()):
        self.interval_s = interval_s
        self.pids = frozenset({os.getpid(), *pids})
        self._requested = None if uuids is None else list(uuids)
        self._gpus: list[tuple[str, str, Any]] = []  # (uuid, name, NVML handle) of the GPUs watched
        self._samples: list[Sample] = []
        self._drained = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = self._stopped = NAN
        self._summary: GpuSummary | None = None

    def start(self) -> GpuSampler:
        """Opens the GPUs, takes the first sample now (so even a short window has one) and starts the thread."""
        self._gpus = self._open()
        self._started = time.time()
        if self._gpus:
            self._take(0)
            self._thread = threading.Thread(target=self._run, name="gx-ray-gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> GpuSummary:
        """Stops sampling (once) and returns the summary of the whole window."""
        if self._summary is None:
            self._stopping.set()
            if self._thread is not None:
                self._thread.join(timeout=self.interval_s + 10)  # an NVML call can stall; never hang the trial
            self._stopped = time.time()
            self._summary = self.summary()
        return self._summary

    def summary(self) -> GpuSummary:
        """The summary so far (the final one after `stop`)."""
        if self._summary is not None:
            return self._summary
        end = self._stopped if not math.isnan(self._stopped) else time.time()
        uuids, names = [g[0] for g in self._gpus], [g[1] for g in self._gpus]
        return summarise(self.samples, uuids, names, duration_s=end - self._started)

    @property
    def samples(self) -> list[Sample]:
        """Every sample so far."""
        with self._lock:
            return list(self._samples)

    @property
    def uuids(self) -> list[str]:
        """The GPUs watched (after `start`); ``Sample.gpu`` indexes this list."""
        return [g[0] for g in self._gpus]

    def drain(self) -> list[Sample]:
        """The samples taken since the last drain."""
        with self._lock:
            fresh, self._drained = self._samples[self._drained :], len(self._samples)
        return fresh

    def __enter__(self) -> GpuSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        step, due = 1, time.monotonic() + self.interval_s
        while not self._stopping.wait(max(0.0, due - time.monotonic())):
            self._take(step)
            # A late round doesn't trigger a burst of catch-up rounds: the next one is an interval away at most
            step, due = step + 1, max(due + self.interval_s, time.monotonic())

    def _take(self, step: int) -> None:
        batch = self._read(step, time.time())
        with self._lock:
            self._samples.extend(batch)

    def _open(self) -> list[tuple[str, str, Any]]:
        """(uuid, name, handle) of each requested GPU NVML can open."""
        nvml = _nvml()
        if nvml is None:
            return []
        try:
            wanted = self._requested if self._requested is not None else _host_uuids(nvml)
        except nvml.NVMLError as error:
            log.debug("NVML can't list the GPUs: %s", error)
            return []
        gpus = []
        for uuid in wanted:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                gpus.append((uuid, _text(nvml.nvmlDeviceGetName(handle)), handle))
            except nvml.NVMLError as error:
                log.debug("NVML can't open GPU %s: %s", uuid, error)
        return gpus

    def _read(self, step: int, t: float) -> list[Sample]:
        """One sample of every GPU watched."""
        return [_read_gpu(_nvml(), handle, self.pids, gpu, step, t) for gpu, (_, _, handle) in enumerate(self._gpus)]


def _nvml_call(nvml: Any, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or None where NVML can't tell (MIG has no utilisation, a lost GPU answers nothing)."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _read_gpu(nvml: Any, handle: Any, pids: frozenset[int], gpu: int, step: int, t: float) -> Sample:
    rates = _nvml_call(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
    memory = _nvml_call(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    procs = _nvml_call(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, handle)
    ours = [p for p in procs or [] if p.pid in pids]
    return Sample(
        t=t,
        step=step,
        gpu=gpu,
        utilization=NAN if rates is None else float(rates.gpu),
        memory_used=NAN if memory is None else float(memory.used),
        memory_total=NAN if memory is None else float(memory.total),
        process_memory=float(sum(p.usedGpuMemory or 0 for p in ours)) if ours else NAN,
        others=-1 if procs is None else len(procs) - len(ours),
    )
