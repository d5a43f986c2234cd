"""The Pareto front (gx_ray/analysis/pareto.py) against a brute-force dominance check, and a search's objectives
(gx_ray/sweep/objectives.py): named, directed, refused with a clear error before Ray starts."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from gx_ray.analysis.pareto import pareto_front
from gx_ray.sweep.objectives import objectives, search_metric
from gx_ray.sweep.spaces import SpaceError, load_space
from tests.common import small_stage_space


def brute_force_front(points: np.ndarray, directions: list[str]) -> list[int]:
    """Row i is on the front unless some row j is at least as good in every objective and better in one."""
    signed = points * np.array([1.0 if d == "max" else -1.0 for d in directions])  # all "higher is better"
    return [
        i for i, p in enumerate(signed)
        if not any(np.all(q >= p) and np.any(q > p) for j, q in enumerate(signed) if j != i)
    ]  # fmt: skip


@pytest.mark.parametrize("objectives_count", [2, 3])
def test_the_front_is_the_brute_force_non_dominated_set_on_random_points(objectives_count: int):
    rng = np.random.default_rng(objectives_count)
    for case in range(200):
        n = int(rng.integers(1, 40))
        directions = [str(d) for d in rng.choice(["max", "min"], objectives_count)]
        # small integers half the time: ties and equal rows, where a front is easiest to get wrong
        points = (
            rng.integers(0, 4, (n, objectives_count)).astype(float)
            if case % 2
            else rng.normal(size=(n, objectives_count))
        )
        assert pareto_front(points, directions) == brute_force_front(points, directions), (points, directions)


def test_objectives_are_directed_and_costs_minimised():
    assert objectives(["primary", "gpu_seconds"]) == [("val_primary", "max"), ("gpu_seconds", "min")]
    assert objectives(["val_auc", "parameters", "cpu_seconds"]) == [
        ("val_auc", "max"), ("parameters", "min"), ("cpu_seconds", "min")
    ]  # fmt: skip
    assert objectives(["primary", "val_image_to_text_median_rank"])[1] == ("val_image_to_text_median_rank", "min")
    assert search_metric("primary") == ("val_primary", "max")  # one objective: what single searches always used
    assert search_metric(["primary", "parameters"]) == (["val_primary", "parameters"], ["max", "min"])


@pytest.mark.parametrize(
    ("metric", "searcher", "says"),
    [
        (["primary", "auc"], "optuna", "unknown objective 'auc'; valid: primary, val_<metric>"),
        (["primary", "primary"], "optuna", "names an objective twice"),
        (["gpu_seconds", "parameters"], "optuna", "costs alone find the cheapest model"),
        (["primary", "gpu_seconds"], "grid", r"need searcher: optuna"),
        ([], "optuna", "a metric name or a list of names"),
    ],
)
def test_a_bad_metric_is_refused_naming_the_file_and_key(tmp_path, metric, searcher, says):
    path = small_stage_space(tmp_path / "space.yaml", 1, [0], "objectives")
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    document["metric"] = metric
    if searcher == "optuna":
        document.update(
            searcher="optuna", grid={}, sample={"optimiser.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2}}
        )
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    with pytest.raises(SpaceError, match=f"{path}: metric: .*{says}"):
        load_space(str(path))
