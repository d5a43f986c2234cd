"""GPU telemetry without a GPU: the quiet no-NVML path, UUID handling, and the summary maths on synthetic samples
checked by hand and against numpy."""

from __future__ import annotations

import logging
import math
import time
import uuid
import warnings

import numpy as np
import pytest

from gx_ray.train import telemetry
from gx_ray.train.telemetry import (
    GIB,
    GpuSampler,
    Sample,
    busy_fraction,
    sample_metrics,
    summarise,
    visible_gpu_uuids,
)

NAN = float("nan")
no_nvml = pytest.mark.skipif(telemetry._nvml() is not None, reason="this machine has an NVIDIA driver")


def sample(gpu=0, step=0, util=0.0, used=0.0, total=80 * GIB, own=NAN, others=0, t=None) -> Sample:
    return Sample(float(step) if t is None else t, step, gpu, util, used, total, own, others)


# --- without NVML ---------------------------------------------------------------------------------------------


@no_nvml
def test_no_nvml_means_no_gpus_quietly(caplog):
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert visible_gpu_uuids() == []
        sampler = GpuSampler(interval_s=0.01).start()
        time.sleep(0.03)
        summary = sampler.stop()
        with GpuSampler(["GPU-00000000-0000-0000-0000-000000000000"], interval_s=0.01) as named:
            pass
    assert not caplog.records
    assert sampler.drain() == [] and named.samples == [] and named.uuids == []
    assert summary.gpus == [] and summary.duration_s >= 0.02 and not summary.shared
    metrics = summary.as_metrics()
    assert metrics["gpu_count"] == 0.0 and metrics["gpu_shared"] == 0.0
    assert math.isnan(metrics["gpu_utilization_mean"]) and math.isnan(metrics["gpu_busy_fraction"])
    assert math.isnan(metrics["gpu_memory_peak_gib"])
    assert named.summary().as_metrics()["gpu_count"] == 0.0
    assert summary.to_dict()["utilization_mean"] is None and summary.to_dict()["uuids"] == []


# --- UUIDs ----------------------------------------------------------------------------------------------------


def test_cuda_uuids_spelt_as_nvml():
    u = uuid.UUID("5f6a7c1e-0b2d-4e3f-9a8b-7c6d5e4f3a2b")
    expected = f"GPU-{u}"

    class CUuuid:  # torch 2.x's _CUuuid: raw bytes, and a str() without NVML's prefix
        bytes = u.bytes

        def __str__(self):
            return str(u)

    for value in (u, u.bytes, CUuuid(), str(u), str(u).upper(), expected):
        assert telemetry._as_nvml_uuid(value) == expected
    assert telemetry._as_nvml_uuid("MIG-abc") == "MIG-abc"


def test_cuda_visible_devices_resolved_against_the_host():
    host = ["GPU-aa11", "GPU-aa22", "GPU-bb33", "GPU-cc44"]
    parse = telemetry._parse_visible
    assert parse("2", host) == ["GPU-bb33"]
    assert parse("0,3", host) == ["GPU-aa11", "GPU-cc44"]
    assert parse("3, 1", host) == ["GPU-cc44", "GPU-aa22"]
    assert parse("GPU-bb33,GPU-aa11", host) == ["GPU-bb33", "GPU-aa11"]
    assert parse("GPU-cc,bb", host) == ["GPU-cc44", "GPU-bb33"]  # unique prefixes, with or without "GPU-"
    assert parse("MIG-x1", host) == ["MIG-x1"]
    # CUDA stops at the first entry that names no GPU, is ambiguous or repeats one
    assert parse("", host) == []
    assert parse("1,7,0", host) == ["GPU-aa22"]
    assert parse("-1,0", host) == []
    assert parse("3,GPU-aa,0", host) == ["GPU-cc44"]
    assert parse("0,0,1", host) == ["GPU-aa11"]


# --- summary maths --------------------------------------------------------------------------------------------


def test_summary_by_hand():
    samples = [
        sample(0, 0, util=0, used=1 * GIB, own=0.5 * GIB, others=0),
        sample(0, 1, util=50, used=3 * GIB, own=2 * GIB, others=0),
        sample(0, 2, util=100, used=2 * GIB, own=1 * GIB, others=1),
        sample(0, 3, util=NAN, used=NAN, total=NAN, own=NAN, others=-1),  # NVML couldn't tell: left out
        sample(1, 0, util=20, used=4 * GIB, total=40 * GIB, others=1),  # our pid never seen: the one is us
        sample(1, 1, util=0, used=5 * GIB, total=40 * GIB, others=1),
    ]
    s = summarise(samples, ["GPU-a", "GPU-b"], ["H100", "H100"], duration_s=4.0)
    a, b = s.gpus
    assert (a.samples, a.utilization_mean, a.busy_fraction, a.active_fraction) == (4, 50.0, 0.5, 2 / 3)
    assert (a.memory_peak_bytes, a.memory_total_bytes, a.process_memory_peak_bytes) == (3 * GIB, 80 * GIB, 2 * GIB)
    assert a.shared and not b.shared
    assert (b.utilization_mean, b.active_fraction, b.memory_peak_bytes) == (10.0, 0.5, 5 * GIB)
    assert math.isnan(b.process_memory_peak_bytes)
    # Overall: means over all five known samples, peaks of any GPU
    assert s.utilization_mean == pytest.approx(34.0) and s.busy_fraction == pytest.approx(0.34)
    assert s.active_fraction == pytest.approx(3 / 5)
    assert (s.memory_peak_bytes, s.memory_total_bytes, s.process_memory_peak_bytes) == (5 * GIB, 80 * GIB, 2 * GIB)
    assert s.shared and s.uuids == ["GPU-a", "GPU-b"] and s.names == ["H100", "H100"]

    m = s.as_metrics()
    assert m["gpu_count"] == 2.0 and m["gpu_duration_s"] == 4.0 and m["gpu_shared"] == 1.0
    assert m["gpu_memory_peak_gib"] == 5.0 and m["gpu_process_memory_peak_gib"] == 2.0
    assert m["gpu_1_utilization_mean"] == 10.0 and m["gpu_0_shared"] == 1.0 and m["gpu_1_shared"] == 0.0
    assert all(isinstance(v, float) for v in m.values())
    assert set(summarise(samples[:1], ["GPU-a"]).as_metrics()) == {k for k in m if not k[4].isdigit()}
    d = s.to_dict()
    assert d["gpus"][1]["process_memory_peak_bytes"] is None and d["gpus"][0]["uuid"] == "GPU-a"


@pytest.mark.parametrize(
    ("rows", "shared"),
    [
        ([(0.0, 0)], False),  # alone
        ([(0.0, 1)], True),  # ours listed, and another
        ([(NAN, 1)], False),  # ours never listed: the one unknown process is taken to be us (PID namespaces)
        ([(NAN, 2)], True),
        ([(NAN, 1), (0.0, 0)], True),  # once ours is seen, the earlier other process was someone else
        ([(0.0, -1), (NAN, -1)], False),  # NVML couldn't list the processes
    ],
)
def test_shared_flag(rows, shared):
    samples = [sample(0, i, own=own, others=others) for i, (own, others) in enumerate(rows)]
    assert summarise(samples, ["GPU-a"]).shared is shared


def test_gpu_without_samples_is_nan():
    s = summarise([sample(0, 0, util=30)], ["GPU-a", "GPU-b"])
    assert s.gpus[1].samples == 0 and math.isnan(s.gpus[1].utilization_mean) and not s.gpus[1].shared
    assert s.utilization_mean == 30.0


def test_summary_matches_numpy_on_random_samples():
    rng = np.random.default_rng(0)
    for _ in range(20):
        gpus, rounds = int(rng.integers(1, 5)), int(rng.integers(1, 60))
        util = rng.integers(0, 101, size=(rounds, gpus)).astype(float)
        util[rng.random(util.shape) < 0.1] = np.nan
        util[rng.random(util.shape) < 0.2] = 0.0
        used = rng.random((rounds, gpus)) * 80 * GIB
        own = np.where(rng.random((rounds, gpus)) < 0.3, np.nan, used * rng.random((rounds, gpus)))
        samples = [
            sample(g, r, util=util[r, g], used=used[r, g], own=own[r, g]) for r in range(rounds) for g in range(gpus)
        ]
        s = summarise(samples, [f"GPU-{g}" for g in range(gpus)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: numpy warns, we want NaN
            per_gpu_mean = np.nanmean(util, axis=0)
            per_gpu_active = [np.mean(col[~np.isnan(col)] > 0) for col in util.T]
            own_peak = np.nanmax(own, axis=0)
        for g, stats in enumerate(s.gpus):
            np.testing.assert_allclose(stats.utilization_mean, per_gpu_mean[g])
            np.testing.assert_allclose(stats.busy_fraction, per_gpu_mean[g] / 100)
            np.testing.assert_allclose(stats.active_fraction, per_gpu_active[g])
            np.testing.assert_allclose(stats.memory_peak_bytes, used[:, g].max())
            np.testing.assert_allclose(stats.process_memory_peak_bytes, own_peak[g])
        np.testing.assert_allclose(s.utilization_mean, np.nanmean(util))
        np.testing.assert_allclose(s.active_fraction, np.mean(util[~np.isnan(util)] > 0))
        np.testing.assert_allclose(s.memory_peak_bytes, used.max())


def test_window_busy_fraction():
    samples = [sample(0, i, util=u, t=10.0 + i) for i, u in enumerate([0, 100, 50, 30, 100])]
    samples += [sample(1, i, util=u, t=10.0 + i) for i, u in enumerate([80, 80, NAN, 0, 0])]
    assert busy_fraction(samples, 11.0, 13.0) == {0: pytest.approx(0.6), 1: pytest.approx(0.4)}
    assert busy_fraction(samples, 0.0, 100.0) == {0: pytest.approx(0.56), 1: pytest.approx(0.4)}
    window = busy_fraction(samples, 20.0, 30.0)
    assert set(window) == {0, 1} and all(math.isnan(v) for v in window.values())
    assert busy_fraction([], 0.0, 1.0) == {}

    rng = np.random.default_rng(1)
    t = np.sort(rng.random(200) * 100)
    util = rng.integers(0, 101, size=200).astype(float)
    gpu = rng.integers(0, 3, size=200)
    samples = [sample(int(g), i, util=u, t=float(ti)) for i, (g, u, ti) in enumerate(zip(gpu, util, t, strict=True))]
    for start, end in [(0.0, 100.0), (20.0, 70.0), (33.3, 41.0)]:
        got = busy_fraction(samples, start, end)
        for g in range(3):
            inside = (gpu == g) & (t >= start) & (t <= end)
            np.testing.assert_allclose(got[g], util[inside].mean() / 100)


def test_sample_metrics_follow_mlflow_names():
    samples = [
        sample(0, 0, util=40, used=2e9, total=8e9, t=100.5),
        sample(1, 0, util=NAN, used=1e9, total=8e9, t=100.5),
        sample(0, 1, util=60, used=3e9, total=8e9, t=101.5),
    ]
    points = sample_metrics(samples)
    got = {(p.key, p.step): (p.value, p.timestamp_ms) for p in points}
    assert got == {
        ("system/gpu_0_utilization_percentage", 0): (40.0, 100500),
        ("system/gpu_0_memory_usage_megabytes", 0): (2000.0, 100500),
        ("system/gpu_0_memory_usage_percentage", 0): (25.0, 100500),
        ("system/gpu_1_memory_usage_megabytes", 0): (1000.0, 100500),  # no utilisation known: not logged
        ("system/gpu_1_memory_usage_percentage", 0): (12.5, 100500),
        ("system/gpu_0_utilization_percentage", 1): (60.0, 101500),
        ("system/gpu_0_memory_usage_megabytes", 1): (3000.0, 101500),
        ("system/gpu_0_memory_usage_percentage", 1): (37.5, 101500),
    }
    assert len(points) == len(got)
    assert {p.key for p in sample_metrics(samples[:1], prefix="system/rank_1/")} >= {
        "system/rank_1/gpu_0_utilization_percentage"
    }


# --- the sampler thread, on a stand-in GPU (the NVML reads are replaced, not pynvml) ---------------------------


class FakeGpuSampler(GpuSampler):
    def _open(self):
        return [("GPU-fake", "Fake GPU", None)]

    def _read(self, step, t):
        return [sample(0, step, util=float(step % 2) * 100, used=GIB, own=GIB / 2, t=t)]


def test_sampler_thread_drains_in_batches():
    with FakeGpuSampler(interval_s=0.01) as sampler:
        first = sampler.drain()
        assert [s.step for s in first] == [0]  # taken in start()
        time.sleep(0.15)
        second = sampler.drain()
        time.sleep(0.05)
    third = sampler.drain()
    steps = [s.step for s in first + second + third]
    assert steps == list(range(len(steps))) and len(steps) >= 5
    assert sampler.drain() == []
    summary = sampler.summary()
    assert summary is sampler.stop()  # stopping again changes nothing
    assert summary.gpus[0].samples == len(steps) and summary.names == ["Fake GPU"]
    assert summary.duration_s >= 0.2 and summary.process_memory_peak_bytes == GIB / 2
    assert summary.utilization_mean == pytest.approx(100 * sum(s % 2 for s in steps) / len(steps))
    time.sleep(0.05)
    assert len(sampler.samples) == len(steps)  # the thread is gone
