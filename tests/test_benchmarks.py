"""The benchmarks (:mod:`benchmarks`) on CPU at tiny sizes: they run from the command line, and each compares like with
like (the VLM benchmark's two sides compute the same loss on the same batch, so their rate ratio is the platform's cost
only); the cluster projection spreads the measured cells over the GPUs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.results import machine, read_results
from benchmarks.vlm import VlmBenchmarkConfig, benchmark_batch, build_llava, run_vlm_benchmark
from gx_ray.models.vlm import VisionLanguageModel
from jobs.benchmark import main


def test_the_model_benchmark_command_runs_and_writes_its_figures_named_by_their_conditions(capsys, tmp_path):
    assert main(["model", "--model", "swin3d", "--shape", "1,32,32,32", "--batch", "2", "--steps", "1",
                 "--warmup", "1", "--device", "cpu", "--results", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "ratio registry/raw" in out
    (path,) = tmp_path.glob("benchmark-model-*.csv")
    assert path.name == f"benchmark-model-swin3d-1x32x32x32-b2-bf16-eager-{machine()}.csv"
    figures = read_results(path)
    assert figures["condition.model"] == "swin3d" and figures["machine"] == machine()
    assert float(figures["registry.samples_per_s"]) > 0 and float(figures["raw.samples_per_s"]) > 0
    assert float(figures["ratio"]) == pytest.approx(
        float(figures["registry.samples_per_s"]) / float(figures["raw.samples_per_s"]), rel=1e-4
    )


def test_the_vlm_benchmark_sides_compute_the_same_loss_and_train_only_lora(tmp_path):
    folder = build_llava(tmp_path / "llava", "tiny", torch.float32)
    vlm = VisionLanguageModel(str(folder))
    images, questions, answers = benchmark_batch(3)
    inputs, labels = vlm._taught(images, questions, answers)
    vlm.eval()  # no dropout: both sides must give the very same number
    ours = vlm.loss(images, questions, answers)
    raw = vlm.model(**inputs, labels=labels).loss
    torch.testing.assert_close(ours, raw)
    taught = (labels != -100).sum(1)
    assert taught.min() >= 2  # the answer letter and the end of text, nothing of the prompt or the image
    assert taught.max() <= 4

    result = run_vlm_benchmark(VlmBenchmarkConfig(size="tiny", batch=2, steps=1, warmup=1, device="cpu"))
    assert 0 < result["trainable"] < result["parameters"] / 10
    for side in ("gx_ray", "raw"):
        assert result[side]["samples_per_s"] > 0
    assert math.isclose(result["ratio"], result["gx_ray"]["samples_per_s"] / result["raw"]["samples_per_s"])
    assert result["tokens_per_sample"] > (56 // 14) ** 2  # the image's tokens and the question's


@pytest.mark.parametrize("name", ["llava_1_5", "llava_med", "blip2_opt", "blip2_flan_t5"])
def test_the_vlm_benchmark_builds_each_paper_model_whose_step_is_the_raw_models(tmp_path, name):
    """``--size <paper model>`` (here one layer of it): the released architecture with its tiny namesake's processor at
    the model's image size; gx-ray's loss is the raw model's on the same batch, and only LoRA's adapters train."""
    from benchmarks.vlm import build_paper_model

    folder = build_paper_model(tmp_path / name, name, torch.float32, tiny=True)
    vlm = VisionLanguageModel(str(folder))
    images, questions, answers = benchmark_batch(2)
    inputs, labels = vlm._taught(images, questions, answers)
    vlm.eval()
    torch.testing.assert_close(vlm.loss(images, questions, answers), vlm.model(**inputs, labels=labels).loss)
    assert inputs["pixel_values"].shape[-1] == vlm.model.config.vision_config.image_size
    assert 0 < sum(p.numel() for p in vlm.trainable().values()) < sum(p.numel() for p in vlm.parameters()) / 10


def test_the_vlm_benchmark_packs_its_batch_with_the_padded_batchs_loss_and_measures_both(tmp_path, capsys):
    """``--packing --varied``: the benchmark's LLaVA (a Qwen2 language model) packs questions of different lengths
    with the padded batch's loss, and the command times the packed steps beside the raw padded one."""
    folder = build_llava(tmp_path / "llava", "tiny", torch.float32)
    vlm = VisionLanguageModel(str(folder), packing=True)
    vlm.eval()
    images, questions, answers = benchmark_batch(3, varied=True)
    packed = vlm.loss(images, questions, answers)
    vlm.packing = False
    torch.testing.assert_close(packed, vlm.loss(images, questions, answers), rtol=1e-5, atol=1e-6)

    assert main(["vlm", "--size", "tiny", "--batch", "3", "--steps", "1", "--device", "cpu", "--packing",
                 "--varied", "--results", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "packed: one row" in out and "ratio raw packed / raw padded" in out
    padding = float(out.split("padding would be ")[1].split(" %")[0])
    assert 10 < padding < 50  # the varied questions' padding, packed away


@pytest.mark.slow
def test_the_loop_benchmark_runs_a_trials_own_loop_beside_its_raw_step(ray_cluster, demo_prepared):
    import itertools
    import sys

    from benchmarks.loop import format_loop_result, loop_against_raw

    flat = {
        "task": "stage_classification", "schema": "image_only", "data.shards": str(demo_prepared.shard_dir),
        "model.vision": "resnet10_3d", "model.vision_kwargs": {"block_inplanes": [4, 8, 8, 8]},
        "model.text": "bert_tiny", "model.hidden": 16, "data.micro_batch": 2, "data.effective_batch": 4,
        "schedule.epochs": 2, "schedule.max_steps_per_epoch": 1,
    }  # fmt: skip
    before = sys.getswitchinterval()
    rows = [
        loop_against_raw({"cell": "stage/image_only", "variant": variant, "flat": flat, "profile": profile,
                          "sample_stacks": not profile})
        for variant, profile in (("switch_0.5ms", False), ("stream", True))
    ]  # fmt: skip
    assert sys.getswitchinterval() == before  # the variant's interval lasts only its own run
    for row in rows:
        assert len(row["loop_samples_per_s"]) == 2 and min(row["loop_samples_per_s"]) > 0
        assert row["raw_samples_per_s"] > 0 and 0 < row["loop_over_raw"] < math.inf
        assert 0 <= row["data_wait_share"] <= 1
        assert 0 < row["sync_round_trip_us"] < 10_000  # one tiny op and its read back (CPU here: microseconds)
    # the sampled stacks: the loop's own thread at work in the trial, and the Ray Data stream's threads beside it
    lines = rows[0]["threads"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  MainThread:")) + 1
    main_thread = list(itertools.takewhile(lambda line: line.startswith("    "), lines[start:]))
    assert any(f in line for line in main_thread for f in ("loop.py", "probe.py", "module.py"))
    assert "StreamingExecutor" in rows[0]["threads"] and "threads" not in rows[1]
    assert "function calls" in rows[1]["profile"]  # cProfile's statistics of the loop's thread
    text = format_loop_result({"seconds": 1.0, "rows": rows})
    assert "stream (profiled)" in text and "switch_0.5ms" in text


def test_a_neighbour_that_stopped_training_is_named_with_what_it_died_of(ray_cluster):
    import time

    import ray

    from benchmarks.loop import _ended, format_loop_result

    @ray.remote(num_cpus=0)
    def out_of_memory() -> None:
        raise MemoryError("CUDA out of memory. Tried to allocate 10.52 GiB")

    @ray.remote(num_cpus=0)
    def training() -> None:
        time.sleep(30)

    refs = [out_of_memory.remote(), training.remote()]
    ray.wait(refs[:1])
    (reason,) = _ended(refs)  # the one still training is not counted
    assert "MemoryError" in reason and "10.52 GiB" in reason
    host = {"neighbours": {"neighbours": 2, "neighbours_ended": [reason]}}
    assert "1 neighbour(s) stopped training early: " in format_loop_result({"seconds": 1.0, "rows": [], "host": host})
    ray.cancel(refs[1], force=True)


def test_the_stack_sampler_finds_a_busy_thread_where_it_spins():
    import threading
    import time

    from benchmarks.loop import StackSampler

    stop = threading.Event()

    def spin_in_python() -> None:
        while not stop.is_set():
            sum(i * i for i in range(1000))

    busy = threading.Thread(target=spin_in_python, name="busy-1")
    with StackSampler(interval_s=0.005) as sampler:
        busy.start()
        time.sleep(0.5)
        stop.set()
        busy.join()
    places = sampler.counts["busy"]  # pool-style numbering dropped
    spinning = sum(n for where, n in places.items() if "spin_in_python" in where)
    assert sampler.samples > 10 and spinning > 0.5 * sum(places.values())
    assert "busy: idle" in sampler.summary() and "spin_in_python" in sampler.summary()


def test_the_host_sampler_reads_this_machines_cores_steal_and_memory():
    """What the cluster and loop benchmarks print beside each phase: real readings of this host."""
    import time

    import psutil

    from benchmarks.cluster import HostCpuSampler, format_host

    with HostCpuSampler(interval_s=0.05) as host:
        sum(i * i for i in range(3_000_000))  # some work of this process's own to see
        time.sleep(0.2)
    summary = host.summary()
    assert len(host.samples) >= 3 and summary["cores"] == psutil.cpu_count()
    assert 0 < summary["peak_busy"] <= 1 and 0 <= summary["mean_busy"] <= summary["peak_busy"]
    assert 0 <= summary["mean_steal"] <= summary["peak_steal"] <= 1
    assert summary["memory_gib_first"] == pytest.approx(psutil.virtual_memory().total / 2**30, rel=0.5)
    in_use = (psutil.virtual_memory().total - psutil.virtual_memory().available) / 2**30
    assert 0 < summary["used_gib_peak"] < summary["memory_gib_first"] and summary["used_gib_peak"] > 0.5 * in_use
    text = format_host(summary)
    assert text.startswith("host CPUs busy") and "steal" in text and "GiB" in text
    assert "steal" not in format_host(HostCpuSampler().summary())  # no samples: no figures to give


@pytest.mark.slow
def test_the_vlm_trials_benchmark_runs_the_bench_preset_on_the_model_it_built(ray_cluster, demo_prepared, tmp_path):
    """``vlm --trials``: a trial per task through the sweep (here one), on the random model the benchmark built (not the
    preset's hub name), its epochs' rates read back from MLflow and set beside the step's."""
    from benchmarks.vlm_trials import format_vlm_trials, run_vlm_trials

    short = {"schedule.epochs": 2, "schedule.max_steps_per_epoch": 2, "data.effective_batch": 2,
             "data.micro_batch": 1, "data.eval_batch_size": 2, "vlm.max_new_tokens": 2}  # fmt: skip
    rows = run_vlm_trials("tiny", ("stage_classification",), tmp_path, False, demo_prepared.shard_dir, fixed=short)
    assert [row["task"] for row in rows] == ["stage_classification"]
    for row in rows:
        assert row["status"] == "FINISHED" and row["model"].startswith("/") and "gx-vlm-trials-" in row["model"]
        assert len(row["samples_per_s"]) == 2 and all(rate > 0 for rate in row["samples_per_s"])
        assert row["eval_seconds"] > 0 and row["trial_seconds"] > row["eval_seconds"]
    step = {"gx_ray": {"samples_per_s": rows[0]["samples_per_s"][-1]}, "raw": {"samples_per_s": 1.0}}
    text = format_vlm_trials(rows, step)
    assert "stage_classification   FINISHED" in text and "last / step 1.00" in text


def test_the_attention_benchmark_times_each_pass_under_the_backend_it_names():
    """Each variant sets the backend it names (cuDNN attention on for ``default``, off for ``no_cudnn``) and decodes the
    full ``max_new_tokens``: a cold and a warm pass of the very same work, so cold − warm is the one-off cost."""
    from benchmarks.attention import AttentionBenchmarkConfig, format_attention_result, measure

    config = AttentionBenchmarkConfig(train_batch=4, eval_batch=3, lengths=(16,), max_new_tokens=3, memory_tokens=5)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        results = []
        for variant in ("no_cudnn", "default"):
            results.append(measure(variant, config))
            assert torch.backends.cuda.cudnn_sdp_enabled() is (variant == "default")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    for r in results:
        assert r["generated_tokens"] == config.max_new_tokens
        assert all(r[f"{part}_{pass_}_s"] > 0 for part in ("text", "generate") for pass_ in ("cold", "warm"))
    table = format_attention_result(results, config)
    assert "no_cudnn" in table and "default" in table
    with pytest.raises(ValueError, match="unknown attention variant"):
        measure("flash_only", config)


def test_the_projection_spreads_every_cell_over_the_gpus_with_the_measured_packing():
    from benchmarks.cluster import GASTRIC_X, PAPER_ABLATION, project
    from gx_ray.schema import PAPER_TASKS as TASKS

    cells = {}
    for i, task in enumerate(TASKS):
        for schema, rate in (("image_only", 40.0 + i), ("image_table_bbox", 20.0 + i)):
            cells[f"{task}/{schema}"] = {
                "train_samples_per_s": rate,
                "eval_seconds_per_row": 0.01,
                "startup_seconds": 5.0,
                "warmup_seconds": 30.0 + i,
                "gpu_share": 0.5,
            }
    figures = project({"cells": cells, "scheduling_efficiency": 0.8}, gpus=8)
    trials = PAPER_ABLATION["schemas"] * PAPER_ABLATION["seeds"]
    jobs = []
    for i, _ in enumerate(TASKS):  # the slower (heavier) schema stands for all four; warm-up once a trial
        epoch = GASTRIC_X["train"] / (20.0 + i) + GASTRIC_X["val"] * 0.01
        jobs += [(PAPER_ABLATION["epochs"] * epoch + 5.0 + 30.0 + i) * 0.5] * trials
    assert figures["hours_at_slice_efficiency"] == pytest.approx(sum(jobs) / 8 / 0.8 / 3600)
    # longest first on the least loaded GPU: never below the even spread, never more than one trial above it
    assert sum(jobs) / 8 / 3600 <= figures["hours"] <= (sum(jobs) / 8 + max(jobs)) / 3600
    whole_cards = {k: {**c, "gpu_share": 1.0} for k, c in cells.items()}
    assert all(t["trials_per_gpu"] == 2 for t in figures["per_task"].values())
    assert project({"cells": whole_cards}, gpus=8)["hours"] > 1.9 * figures["hours"]  # twice the GPU-seconds
    # a task the slice did not measure leaves the projection undefined, never silently smaller
    partial = {k: v for k, v in cells.items() if not k.startswith("vqa/")}
    assert np.isnan(project({"cells": partial}, gpus=8)["hours"])


def test_the_slice_is_sized_so_that_every_task_is_measured_however_few_the_gpus():
    from benchmarks.cluster import MIN_STEPS, SLICE_SCHEMAS, ClusterBenchmarkConfig, size_slice
    from gx_ray.schema import PAPER_TASKS as TASKS

    rng = np.random.default_rng(0)
    config = ClusterBenchmarkConfig()
    for _ in range(200):
        raw = {f"{t}/{s}": {"samples_per_s": float(rng.uniform(5, 120))} for t in TASKS for s in SLICE_SCHEMAS}
        if rng.random() < 0.2:  # a cell whose raw step failed
            raw.pop(f"{TASKS[0]}/{SLICE_SCHEMAS[-1]}")
        gpus, seconds = int(rng.choice([1, 2, 4, 8])), float(rng.uniform(60, 900))
        sized = size_slice(config, raw, gpus, seconds)
        assert sized["schemas"][-1] == SLICE_SCHEMAS[-1]  # the heaviest schema, which the projection reads, always
        assert MIN_STEPS <= sized["steps_per_epoch"] <= config.steps_per_epoch
        # it fits, or nothing smaller was left to try
        fits = sized["estimated_seconds"] <= seconds
        assert fits or (sized["schemas"] == list(SLICE_SCHEMAS[-1:]) and sized["steps_per_epoch"] == MIN_STEPS)
        if sized["schemas"] == list(SLICE_SCHEMAS):  # both schemas only where they fit
            assert fits
        more = size_slice(config, raw, gpus * 2, seconds)  # more cards never measure less
        assert len(more["schemas"]) >= len(sized["schemas"])
        if more["schemas"] == sized["schemas"]:
            assert more["steps_per_epoch"] >= sized["steps_per_epoch"]


def test_the_sweep_benchmark_sets_a_budgets_forecast_beside_what_each_trial_spent(tmp_path):
    """Abandoned runs (a killed driver's) are not the sweep's trials; per trial, only those that trained every epoch
    are compared (an early-stopped one spent less than it was costed for), in the budget's own metric."""
    from benchmarks.sweep import forecast_against_ledger
    from gx_ray.sweep.budget import LEDGER_FILE

    header = "trial,trial_id,status,gpu_seconds,cpu_seconds,parameters,epochs\n"
    rows = ["a,1,FINISHED,0,20,10,4", "b,2,ABANDONED,0,99,10,1", "c,3,STOPPED_EARLY,0,5,10,1", "d,4,FINISHED,0,10,10,4"]
    (tmp_path / LEDGER_FILE).write_text(header + "\n".join(rows) + "\n", encoding="utf-8")
    budget = {"metric": "cpu_seconds", "forecast_seconds": {"per_trial": [30.0, 12.0, 8.0], "total": 50.0}}
    got = forecast_against_ledger(budget, tmp_path)
    assert got["metric"] == "cpu_seconds" and got["spent_seconds"] == 35.0
    assert got["ratio"] == pytest.approx(50 / 35) and got["trials_compared"] == 2
    assert (got["trial_ratio_min"], got["trial_ratio_max"]) == (pytest.approx(0.8), pytest.approx(1.5))


def test_the_startup_parts_add_up_to_launch_to_first_step_with_imports_done_ahead_counted_once():
    """``jobs/benchmark.py startup``'s parts tile launch → first step: the driver's parts from its timings, the trial's
    from its run's wall clocks; imports a process finished before Tune started count for nothing."""
    from benchmarks.startup import PARTS, launch_parts, summed

    launched, driver = 1000.0, 1002.0  # the command started; the driver's clock began 2 s later
    timings = {"ray_seconds": 5.0, "data_seconds": 1.0, "mlflow_seconds": 3.0, "tune_started_seconds": 12.0,
               "first_step_seconds": 30.0}  # fmt: skip
    trial = {"import_started_at": driver + 13.0, "imported_at": driver + 18.0, "trial_started_at": driver + 19.0,
             "setup_started_at": driver + 20.0, "cohort_seconds": 0.5, "build_seconds": 6.5, "setup_seconds": 7.0,
             "first_batch_at": driver + 28.0, "first_step_at": driver + 30.0}  # fmt: skip
    parts = launch_parts(launched, timings, trial)
    assert list(parts) == [name for name, _ in PARTS]
    assert list(parts.values()) == pytest.approx([2, 5, 1, 3, 3, 1, 5, 1, 1, 0.5, 6, 0.5, 1, 2])
    total = summed(parts, trial["first_step_at"] - launched)
    assert total["sum_of_parts"] == pytest.approx(32.0) and total["unaccounted"] == pytest.approx(0.0)

    ahead = {**trial, "import_started_at": driver + 4.0, "imported_at": driver + 9.0}  # done before Tune's start
    parts = launch_parts(launched, timings, ahead)
    assert parts["the trial process: Ray starts it"] == 0 and parts["the trial process: its imports"] == 0
    assert parts["Tune's trial set-up"] == pytest.approx(7.0)  # Tune's start → the trial function
    assert summed(parts, 32.0)["unaccounted"] == pytest.approx(0.0)


def test_the_vlm_memory_estimate_counts_the_released_sizes_and_grows_by_each_samples_activations():
    """Without a GPU the LoRA step's peak is estimated: the parameters counted on the meta device (LLaVA-1.5-7B's
    7.06 B without the adapters, as released), and a sample more adds its checkpointed layer inputs and logits."""
    from benchmarks.vlm_memory import ANSWER_TOKENS, PROMPT_TOKENS, estimate

    figures = estimate("llava_1_5", (1, 2, 32))
    base = figures["parameters"] - figures["trainable"]
    assert round(base / 1e9, 2) == 7.06 and figures["trainable"] == 32 * 2 * 2 * 16 * 4096  # q and v, rank 16
    weights = base * 2 / 2**30
    one, two, many = (figures[f"batch_{b}"]["peak_gib"] for b in (1, 2, 32))
    tokens = 576 + PROMPT_TOKENS + ANSWER_TOKENS
    per_sample = (32 * tokens * 4096 * 2 + tokens * 32064 * 10) / 2**30  # layer inputs and logits (they dominate)
    assert weights < one < two < many and two - one == pytest.approx(per_sample, abs=0.1)
    assert many - one == pytest.approx(31 * per_sample, abs=0.1)
