"""A trial's side of a sweep (:mod:`gx_ray.sweep.trial`): the GPU share a setting is reserved by and runs with
(:meth:`SweepContext.setting`), and what a trial process and the driver import."""

from __future__ import annotations

from pathlib import Path


def _context(tmp_path: Path, fixed: dict, grid: dict, **kwargs):
    """A sweep's context over a space of ``fixed`` and ``grid`` keys, as the driver builds it."""
    import yaml

    from gx_ray.sweep.spaces import load_space
    from gx_ray.sweep.trial import SweepContext

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"fixed": fixed, "grid": grid}), encoding="utf-8")
    return SweepContext("sweep", load_space(str(path)), "/cohort", str(tmp_path / "ray"), **kwargs)


def test_a_trial_is_reserved_and_logs_its_fixed_or_measured_gpu_share(tmp_path):
    """The share Ray reserves is the one the trial logs and keeps its memory to: the plan's for ``auto``, the space's
    own for a fixed fraction (a fixed share logged as a whole card made the cluster benchmark project 3/2 x the
    GPU-hours of a slice packed two to a card)."""
    from gx_ray.sweep.trial import gpu_plan_key

    fixed = {"task": "vqa", "resources.cpus_per_worker": 4}
    measured = _context(tmp_path, {**fixed, "resources.gpus_per_worker": "auto"}, {"schema": ["image_only"]})
    key = gpu_plan_key(measured.setting({"schema": "image_only"}).config)
    for gpus, share in ((0.25, 0.25), (1, 1.0), (0, 0.0), ("auto", 0.3333)):
        space = {**fixed, "resources.gpus_per_worker": gpus}
        context = _context(
            tmp_path, space, {"schema": ["image_only", "image_table"]}, gpu_plan={key: {"share": 0.3333}}
        )
        assert context.setting({"schema": "image_only"}).gpu_share == share
        assert context.resources({"schema": "image_only"}) == {"cpu": 4, "gpu": share}
    # a setting the plan never saw gets a whole GPU
    assert context.setting({"schema": "image_table"}).gpu_share == 1.0


def test_a_trial_finds_the_plan_it_was_reserved_by_before_its_config_grows(tmp_path):
    """A trial whose measured step fitted only with gradient checkpointing gains it after the plan is looked up (it
    is in the plan's key); a task's sweep inputs (lesion QA's question file) are in the config the driver measured."""
    from gx_ray.sweep.trial import gpu_plan_key, task_key

    fixed = {"task": "lesion_qa", "resources.gpus_per_worker": "auto", "resources.cpus_per_worker": 2,
             "task_options.family": "img2size"}  # fmt: skip
    params = {"schema": "image_only", "seed": 0}
    bare = _context(tmp_path, fixed, {"schema": ["image_only"], "seed": [0]})
    inputs = {task_key(bare.setting(params).config): {"questions_file": "/questions/img2size.json"}}
    measured = _context(tmp_path, fixed, {"schema": ["image_only"], "seed": [0]}, task_inputs=inputs)
    entry = {"share": 0.25, "micro_batch": 4, "gradient_checkpointing": True}
    key = gpu_plan_key(measured.setting(params).config)
    context = _context(
        tmp_path, fixed, {"schema": ["image_only"], "seed": [0]}, task_inputs=inputs, gpu_plan={key: entry}
    )
    setting = context.setting(params)
    assert setting.plan == entry and setting.gpu_share == 0.25 == context.resources(params)["gpu"]
    assert setting.config.task_options["questions_file"] == "/questions/img2size.json"
    assert setting.config.model.gradient_checkpointing is True
    assert gpu_plan_key(setting.config) not in context.gpu_plan  # looked up after, it would have found nothing


def test_a_trial_reserves_the_host_memory_its_setting_was_measured_to_need(tmp_path, monkeypatch):
    """The GPU plan's probe measured the setting's host memory (``host_bytes``): Ray reserves it as ``memory``, so a
    node of N GiB takes floor(N / need) trials, and the sweep's concurrency counts them node by node (two trials at 9.0
    and 10.8 GB on one 24 GiB node were killed by Ray's memory monitor). Nothing measured: nothing reserved."""
    from gx_ray.sweep import gpu_plan
    from gx_ray.sweep.trial import gpu_plan_key

    fixed = {"task": "vqa", "resources.cpus_per_worker": 1, "resources.gpus_per_worker": "auto"}
    bare = _context(tmp_path, fixed, {"seed": [0]})
    key = gpu_plan_key(bare.setting({"seed": 0}).config)
    context = _context(tmp_path, fixed, {"seed": [0]}, gpu_plan={key: {"share": 0.125, "host_bytes": 9 * 2**30}})
    assert context.resources({"seed": 0}) == {"cpu": 1, "gpu": 0.125, "memory": 9 * 2**30}
    assert bare.resources({"seed": 0}) == {"cpu": 1, "gpu": 1.0}
    nodes = [{"Alive": True, "Resources": {"memory": gib * 2**30}} for gib in (24, 17.9, 8)]
    monkeypatch.setattr(gpu_plan.ray, "nodes", lambda: [*nodes, {"Alive": False, "Resources": {"memory": 2**40}}])
    monkeypatch.setattr(gpu_plan.ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    assert gpu_plan.concurrency(context) == 2 + 1 + 0  # not the 64 trials the CPUs and GPU shares hold
    assert gpu_plan.concurrency(bare) == 64  # no memory measured: the CPUs decide


# --- imports ----------------------------------------------------------------------------------------------


def test_a_trial_process_imports_none_of_the_drivers_machinery():
    """Trials unpickle ``gx_ray.sweep.trial.run_trial``: importing it must not pull in the MLflow server, Optuna,
    data preparation, the analysis, or peft and transformers' trainer (seconds of start-up in every trial process; a
    LoRA model imports peft when it is built)."""
    import subprocess
    import sys

    code = (
        "import sys, gx_ray.sweep.trial; "
        "print(sorted(m for m in sys.modules if m.startswith(('gx_ray.tracking.server', 'optuna', 'SimpleITK', "
        "'gx_ray.analysis', 'gx_ray.data.prepare', 'gx_ray.sweep.driver', 'peft', 'transformers.trainer'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_what_a_sweep_driver_reads_of_a_task_imports_no_monai_nor_transformers():
    """The driver reads each task's class (its primary metric, direction, labels, whether it packs on a GPU) before
    the trials start and again for the report: MONAI's package import (seconds: it loads every submodule) and
    transformers' belong to the processes that build a model, not to the driver's launch → first step."""
    import subprocess
    import sys

    code = (
        "import sys; from gx_ray.tasks import task_class; from gx_ray.schema import PAPER_TASKS; "
        "print([(t, task_class(t).shares_a_gpu) for t in PAPER_TASKS]); "
        "print(sorted(m for m in sys.modules if m.startswith(('monai', 'transformers', 'gx_ray.tasks.retinanet'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    classes, modules = out.strip().splitlines()
    assert "('lesion_detection', False)" in classes and modules == "[]", out


def test_a_trial_with_several_workers_or_asked_to_trains_under_a_torch_trainer_holding_a_sliver(tmp_path):
    """The branch every trial takes: in itself (its CPUs and GPU share reserved), or under Ray Train's TorchTrainer
    (several workers, or ``resources.torch_trainer``), whose workers ask for their own while the trial holds a sliver.
    The TorchTrainer path itself runs end to end in test_train_loop.py's DDP trial."""
    from gx_ray.sweep.trial import under_torch_trainer

    cases = [({}, False, {"cpu": 2.0, "gpu": 0.0}), ({"resources.torch_trainer": True}, True, {"cpu": 0.1}),
             ({"resources.workers": 2, "data.effective_batch": 4}, True, {"cpu": 0.1})]  # fmt: skip
    for fixed, trainer, reserved in cases:
        context = _context(tmp_path, {"task": "vqa", "resources.cpus_per_worker": 2, **fixed}, {"seed": [0]})
        assert under_torch_trainer(context.setting({"seed": 0}).config) is trainer
        assert context.resources({"seed": 0}) == reserved
