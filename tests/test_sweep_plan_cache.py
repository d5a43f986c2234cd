"""The GPU plan cache: a repeated sweep reuses what an earlier one measured on the same card kind, code and cohort,
and measures again whatever differs."""

from __future__ import annotations

from typing import Any

from gx_ray.sweep.plan_cache import default_cache_dir, measured_plan

CARD = {"cards": ["accelerator_type:H100"], "gx_ray.code": "git:abc", "gx_ray.manifest_sha256": "m1"}


class Measure:
    """Counts which settings it was asked to measure; a setting's 'peak' is derived from its key."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, settings: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        self.asked += list(settings)
        return {key: {"micro_batch": 8, "peak_bytes": 1000 + len(key), "card_bytes": 80_000} for key in settings}


def test_a_repeated_sweep_measures_nothing_and_says_the_plan_was_cached(tmp_path):
    settings = {"vqa": {"task": "vqa"}, "retrieval": {"task": "retrieval"}}
    first, again = Measure(), Measure()
    plan = measured_plan(settings, first, CARD, tmp_path)
    assert first.asked == ["vqa", "retrieval"] and not any(m.get("cached") for m in plan.values())
    cached = measured_plan(settings, again, CARD, tmp_path)
    assert again.asked == []
    assert all(cached[k]["cached"] and cached[k]["peak_bytes"] == plan[k]["peak_bytes"] for k in settings)
    assert list(cached) == list(settings)


def test_only_a_new_setting_is_measured_and_then_kept_beside_the_old(tmp_path):
    measured_plan({"vqa": {}}, Measure(), CARD, tmp_path)
    more = Measure()
    plan = measured_plan({"retrieval": {}, "vqa": {}}, more, CARD, tmp_path)
    assert more.asked == ["retrieval"] and plan["vqa"]["cached"] and "cached" not in plan["retrieval"]
    last = Measure()
    measured_plan({"retrieval": {}, "vqa": {}}, last, CARD, tmp_path)
    assert last.asked == []


def test_another_card_code_or_cohort_measures_again(tmp_path):
    measured_plan({"vqa": {}}, Measure(), CARD, tmp_path)
    for change in (
        {"cards": ["accelerator_type:H200"]},
        {"gx_ray.code": "git:def"},
        {"gx_ray.manifest_sha256": "m2"},
    ):
        other = Measure()
        measured_plan({"vqa": {}}, other, {**CARD, **change}, tmp_path)
        assert other.asked == ["vqa"], change


def test_a_damaged_cache_file_costs_a_measurement_not_the_sweep(tmp_path):
    measured_plan({"vqa": {}}, Measure(), CARD, tmp_path)
    (file,) = tmp_path.glob("*.json")
    file.write_text("{not json", encoding="utf-8")
    again = Measure()
    assert measured_plan({"vqa": {}}, again, CARD, tmp_path)["vqa"]["micro_batch"] == 8
    assert again.asked == ["vqa"]


def test_the_cache_lives_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "gx-ray" / "gpu_plans"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "gx-ray" / "gpu_plans"


def test_the_plan_tells_settings_apart_by_what_decides_their_memory():
    """The evaluation batch decides a trial's peak as much as its micro-batch (a 3D Swin evaluated 32 at a time
    needed more than its training step at 8); a seed or a learning rate decides nothing."""
    from gx_ray.sweep.trial import gpu_plan_key
    from gx_ray.train.config import TrialConfig

    def key(flat: dict) -> str:
        return gpu_plan_key(TrialConfig.from_flat(flat))

    base = {"task": "vqa", "schema": "image_only", "model.vision": "swin3d", "data.micro_batch": 8, "seed": 0}
    assert key({**base, "data.eval_batch_size": 32}) != key({**base, "data.eval_batch_size": 8})
    assert key({**base, "seed": 1, "optimiser.lr": 1e-3}) == key(base)
    assert key({**base, "model.compile": True}) != key(base)
