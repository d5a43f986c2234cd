"""Search spaces (:mod:`gx_ray.sweep.spaces`): a malformed space or a bad value in one fails before Ray starts, naming
the file, the key and the valid choices; every shipped space and preset stays valid; later presets win."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gx_ray.schema import PAPER_TASKS as TASKS
from gx_ray.sweep.spaces import SpaceError, _probe_value, available_presets, load_space, space_path
from gx_ray.train.config import TrialConfig
from tests.common import ROOT


def ablation_space_with(tmp_path: Path, **changes) -> Path:
    document = yaml.safe_load((ROOT / "search_spaces" / "modality_ablation.yaml").read_text(encoding="utf-8"))
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            document.setdefault(section, {})[name.replace("_DOT_", ".")] = value
        else:
            document[section] = value
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "changes, key, hint",
    [
        ({"searcher": "hyperopt"}, "searcher", "valid: grid, random, optuna, bohb"),
        ({"fixed__model_DOT_vision": "vit"}, "vision model 'vit'", "valid: swin3d"),
        ({"grid__schema": ["image_only", "image_and_everything"]}, "schema=image_and_everything", "valid presets"),
        ({"fixed__optimiser_DOT_learning_rate": 0.1}, "fixed.optimiser.learning_rate", "not a trial config key"),
        ({"overrides": []}, "task=lesion_detection", "box_cues_in_detection"),
        ({"colour": "blue"}, "colour", "unknown key"),
    ],
    ids=["searcher", "model-name", "schema-name", "config-key", "leak", "top-level"],
)
def test_malformed_space_names_file_key_and_choices(tmp_path, changes, key, hint):
    path = ablation_space_with(tmp_path, **changes)
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    assert str(path) in str(info.value) and key in str(info.value) and hint in str(info.value)


def test_malformed_space_fails_before_ray_starts(tmp_path):
    path = ablation_space_with(tmp_path, searcher="hyperopt")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", str(path), "--output", str(tmp_path)],
        capture_output=True,
        encoding="utf-8",  # Tune's tables are box-drawn, and CI's locale may be ASCII
        errors="replace",
        timeout=120,
    )
    assert (
        result.returncode == 2 and "searcher" in result.stderr and "valid: grid, random, optuna, bohb" in result.stderr
    )
    assert "Ray" not in result.stderr and not (tmp_path / "ray").exists()
    assert time.monotonic() - started < 60


def test_every_shipped_space_and_preset_is_valid():
    for path in sorted((ROOT / "search_spaces").glob("*.yaml")):
        combined = [("demo", "smoke"), ("gpu", "compiled")]
        for presets in [(), *[(p,) for p in available_presets(path.stem)], *combined]:
            if not set(presets) <= set(available_presets(path.stem)):
                continue
            # the trial configs, not the VLMs' hub weights, absent offline (test_vlm_trials.py tests that check)
            space = load_space(path.stem, presets, weights=False)
            assert space.trial_count() >= 1, (path, presets)
            # sampled keys at a valid value, as load_space checks them (an Optuna space may sample the task itself)
            probe = {key: _probe_value(spec) for key, spec in space.sample.items()}
            for cell in space.cells()[:3]:  # every key the preset sets is one a trial config takes
                flat = space.resolve({**probe, **cell})
                TrialConfig.from_flat({**flat, "data.shards": "x"})


def test_a_later_preset_s_fixed_keys_win_over_the_rules_before_it():
    """``demo`` trains report generation longer through an override rule; ``smoke`` after it still cuts every task to
    its one short epoch, and the rule's other settings stay."""
    demo = load_space("modality_ablation", ("demo",))
    smoke = load_space("modality_ablation", ("demo", "smoke"))
    for task in TASKS:
        cell = {"task": task, "schema": "image_only", "seed": 0}
        assert smoke.resolve(cell)["schedule.epochs"] == 1
        assert smoke.resolve(cell)["schedule.max_steps_per_epoch"] == 2
    report = {"task": "report_generation", "schema": "image_only", "seed": 0}
    assert demo.resolve(report)["schedule.epochs"] > demo.resolve({**report, "task": "vqa"})["schedule.epochs"]
    tokens = "task_options.max_report_tokens"
    assert smoke.resolve(report)[tokens] == demo.resolve(report)[tokens] == 96


def test_a_bad_value_in_a_space_fails_before_ray_naming_file_and_key(tmp_path):
    document = yaml.safe_load(space_path("modality_ablation").read_text(encoding="utf-8"))
    document["fixed"]["optimiser.lr"] = -5.0e-5
    path = tmp_path / "negative_lr.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    with pytest.raises(SpaceError) as info:
        load_space(str(path))
    assert str(path) in str(info.value) and "optimiser.lr = -5e-05 is not valid" in str(info.value)


def test_a_declared_primary_family_names_schemas_the_space_trains(tmp_path):
    """``analysis.primary`` lists schemas the space (its presets overlaid) trains: a preset may declare it, as
    ``null_input`` sets ``analysis.margin``; an unknown schema is refused naming the key and the valid schemas."""
    two = {"grid": {"schema": ["image_only", "image_table"], "seed": [0]}}
    presets = {"two": two, "declared": {**two, "analysis": {"primary": ["image_table"]}}}
    space = load_space(str(ablation_space_with(tmp_path, presets=presets)), ("declared",), weights=False)
    assert space.analysis["primary"] == ["image_table"]
    path = ablation_space_with(tmp_path, analysis={"primary": ["image_bbox"]}, presets=presets)
    assert load_space(str(path), weights=False).analysis["primary"] == ["image_bbox"]
    with pytest.raises(SpaceError) as info:  # the preset's grid no longer trains image_bbox
        load_space(str(path), ("two",), weights=False)
    assert "analysis.primary" in str(info.value) and "unknown schema 'image_bbox'; valid: image_only, image_table" in (
        str(info.value)
    )
    with pytest.raises(SpaceError, match=r"analysis\.primary: 'image_table': a list of schema names"):
        load_space(str(ablation_space_with(tmp_path, analysis={"primary": "image_table"})), weights=False)


def test_exclude_leaves_out_the_cells_its_rules_match_and_refuses_what_names_no_axis_or_value(tmp_path):
    """``exclude`` drops every cell that matches all of a rule's axes (a value or a list of them); a preset with fewer
    seeds may meet a rule about seeds another preset adds; a key that is no grid axis, a value the file never gives
    the axis (a typo), or rules that leave nothing are refused naming the rule and key."""
    rule = {"task": "report_generation", "seed": [2, 3]}
    presets = {"more": {"grid": {"seed": [0, 1, 2, 3]}}, "one": {"grid": {"seed": [0]}}}
    path = ablation_space_with(tmp_path, exclude=[rule], presets=presets)
    grid = load_space(str(path), ("more",), weights=False)
    cells = grid.cells()
    every = [(t, s, k) for t in grid.grid["task"] for s in grid.grid["schema"] for k in grid.grid["seed"]]
    kept = [(t, s, k) for t, s, k in every if not (t == "report_generation" and k in (2, 3))]
    assert sorted((c["task"], c["schema"], c["seed"]) for c in cells) == sorted(kept)
    assert grid.trial_count() == len(every) - 2 * len(grid.grid["schema"])
    assert len(load_space(str(path), ("one",), weights=False).cells()) == len(TASKS) * len(grid.grid["schema"])
    bad = [
        ([{"model.fusion": "concat"}], "exclude[0].model.fusion", "not a grid axis; valid: schema, seed, task"),
        ([{"task": "report_generation"}, {"task": "report_gen"}], "exclude[1].task", "'report_gen' is no value"),
        ([{"seed": [0, 1, 2]}], "exclude", "leaves out every cell"),
        ([[]], "exclude[0]", "a non-empty mapping"),
    ]
    for rules, key, message in bad:
        path = ablation_space_with(tmp_path, exclude=rules)
        with pytest.raises(SpaceError) as info:
            load_space(str(path), weights=False)
        assert f"{path}: {key}: " in str(info.value) and message in str(info.value), info.value
