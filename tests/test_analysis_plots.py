"""Radar (the paper's Figure 4) and CI dot chart: files, one polygon per schema, outward is better; CT-Bench's box
effect heatmap."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from gx_ray.analysis.plots import (
    SCHEMA_COLOURS,
    box_effect,
    box_effect_figure,
    box_effect_plot,
    interval_figure,
    interval_plot,
    normalise_axis,
    radar_figure,
    radar_plot,
    slice_context,
    slice_context_figure,
    slice_context_plot,
)
from gx_ray.analysis.stats import cell_statistics
from tests.common import SCHEMAS, make_runs

TASKS = ("vqa", "retrieval", "stage_classification")


@pytest.fixture(scope="module")
def cells() -> pd.DataFrame:
    """The cells contract from the fixture's test split: image_table_bbox best everywhere (effects 0, 2, 4, 6)."""
    return cell_statistics(make_runs(tasks=TASKS, noise=0.1), split="test")


def test_normalise_axis_maps_best_to_one_and_inverts_lower_is_better():
    np.testing.assert_allclose(normalise_axis([10.0, 20.0, 30.0]), [0.2, 0.6, 1.0])
    np.testing.assert_allclose(normalise_axis([10.0, 20.0, 30.0], higher_is_better=False), [1.0, 0.6, 0.2])
    np.testing.assert_allclose(normalise_axis([5.0, np.nan, 7.0], floor=0.0), [0.0, np.nan, 1.0])
    np.testing.assert_allclose(normalise_axis([4.0, 4.0]), [0.6, 0.6])  # a tie: neither best nor worst


def radar_lines(fig) -> dict:
    return {line.get_gid().removeprefix("radar-"): line for line in fig.axes[0].lines if line.get_gid()}


def test_radar_one_closed_polygon_per_schema_outward_is_better(cells):
    fig = radar_figure(cells, metric_per_task={"retrieval": "image_to_text_median_rank"})
    try:
        lines = radar_lines(fig)
        assert list(lines) == list(SCHEMAS)
        assert {schema: line.get_color() for schema, line in lines.items()} == SCHEMA_COLOURS
        lines = {schema: line.get_ydata() for schema, line in lines.items()}
        fills = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("radar-fill-")]
        assert len(fills) == len(SCHEMAS)
        for values in lines.values():
            assert len(values) == len(TASKS) + 1 and values[0] == values[-1]  # closed
        # best setting on the rim on every axis, the MedR axis (smallest best) included; worst on the 0.2 ring
        np.testing.assert_allclose(lines["image_table_bbox"], 1.0)
        np.testing.assert_allclose(lines["image_only"], 0.2)
        labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        assert labels == ["vqa\nAccuracy ↑", "retrieval\nI→T MedR ↓", "stage_classification\nAUC ↑"]
    finally:
        plt.close(fig)


def test_radar_and_interval_files_are_valid_png_and_svg(cells, tmp_path):
    radar = radar_plot(cells, tmp_path / "figs" / "radar")
    interval = interval_plot(cells, tmp_path / "figs" / "ci")
    assert [p.name for p in radar + interval] == ["radar.png", "radar.svg", "ci.png", "ci.svg"]
    for png in (radar[0], interval[0]):
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size[0] > 300
    svg = radar[1].read_text(encoding="utf-8")
    assert "<svg" in svg and "<svg" in interval[1].read_text(encoding="utf-8")
    assert sorted(re.findall(r'id="radar-(?!fill)([a-z_]+)"', svg)) == sorted(SCHEMAS)
    assert plt.get_fignums() == []  # closed after saving


def test_interval_one_panel_per_task_one_dot_per_schema_with_ci(cells):
    fig = interval_figure(cells)
    try:
        assert len(fig.axes) == len(TASKS)
        for ax, task in zip(fig.axes, TASKS, strict=True):
            assert ax.get_title().startswith(task) and len(ax.containers) == len(SCHEMAS)
            assert [t.get_text() for t in ax.get_yticklabels()][-1] == "Image + Table + BBox"
            dots = [line for line in ax.lines if line.get_marker() == "o"]  # the means, beside the intervals' bars
            assert [d.get_color() for d in dots] == [SCHEMA_COLOURS[s] for s in SCHEMAS]
        vqa = cells.query("task == 'vqa' and metric == 'accuracy'").set_index("schema")
        bars = fig.axes[0].containers[3].lines[2][0].get_segments()[0]  # image_table_bbox's CI segment
        np.testing.assert_allclose(bars[:, 0], vqa.loc["image_table_bbox", ["ci_low", "ci_high"]].to_numpy(float))
        means = [line.get_xdata()[0] for line in fig.axes[0].lines if line.get_marker() == "o"]
        assert means[3] == vqa.loc["image_table_bbox", "mean"]
    finally:
        plt.close(fig)


def test_a_mean_outside_its_percentile_interval_is_drawn_where_it_is(cells):
    """A percentile bootstrap's interval need not hold the mean (a skewed score near its bound): the dot stays at the
    mean and the bar at the interval, where an error bar measured from the mean could not be drawn at all."""
    outside = cells.copy()
    row = (outside["task"] == "vqa") & (outside["metric"] == "accuracy") & (outside["schema"] == "image_only")
    outside.loc[row, ["ci_low", "ci_high"]] = outside.loc[row, "mean"].to_numpy()[0] + np.array([1.0, 2.0])
    fig = interval_figure(outside)
    try:
        bars = fig.axes[0].containers[0].lines[2][0].get_segments()[0]
        np.testing.assert_allclose(bars[:, 0], outside.loc[row, ["ci_low", "ci_high"]].to_numpy(float)[0])
        means = [line.get_xdata()[0] for line in fig.axes[0].lines if line.get_marker() == "o"]
        assert means[0] == outside.loc[row, "mean"].to_numpy()[0]
    finally:
        plt.close(fig)


def test_an_axis_where_every_setting_scores_the_same_is_drawn_and_labelled_as_a_tie(cells):
    tied = cells.copy()
    stage = tied["task"] == "stage_classification"
    tied.loc[stage, "mean"] = 0.0  # e.g. AP 0.0 for every schema: nobody is best
    fig = radar_figure(tied)
    try:
        for schema, line in radar_lines(fig).items():
            assert line.get_ydata()[2] == pytest.approx(0.6), f"{schema} not half-way on the tied axis"
        labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        assert labels[2].endswith("(tie)") and not labels[0].endswith("(tie)")
        assert "tie" in " ".join(t.get_text() for t in fig.texts)  # the caption says what a tie looks like
    finally:
        plt.close(fig)


def test_the_box_effect_is_with_box_minus_without_per_model_and_family(tmp_path):
    """CT-Bench's Figure 2 from random cells: each heatmap value is the image_bbox mean minus the image_only mean of
    its model and family; families without both conditions and the paper's tasks stay out."""
    rng = np.random.default_rng(0)
    rows, expected = [], {}
    for model in ("a+bert", "b+bert"):
        for family in ("img2txt", "ct2txt", "img2attrib"):
            task = f"lesion_qa.{family}.matched"
            means = {schema: rng.uniform(0, 100) for schema in ("image_only", "image_bbox")}
            expected[(model, family)] = means["image_bbox"] - means["image_only"]
            rows += [
                {"task": task, "model": model, "schema": s, "metric": "accuracy", "mean": m} for s, m in means.items()
            ]
    rows.append(
        {
            "task": "lesion_qa.img2size.matched",
            "model": "a+bert",
            "schema": "image_only",
            "metric": "accuracy",
            "mean": 40.0,
        }
    )
    rows.append({"task": "vqa", "model": "a+bert", "schema": "image_bbox", "metric": "accuracy", "mean": 40.0})
    cells = pd.DataFrame(rows)
    effect = box_effect(cells)
    # columns: family and distractor kind; img2size has no with-box cell
    assert set(effect.columns) == {"img2txt.matched", "ct2txt.matched", "img2attrib.matched"}
    for (model, family), value in expected.items():
        assert effect.at[model, f"{family}.matched"] == pytest.approx(value)
    fig = box_effect_figure(cells)
    shown = fig.axes[0].images[0].get_array()
    np.testing.assert_allclose(np.asarray(shown), effect.to_numpy())
    low, high = fig.axes[0].images[0].get_clim()
    assert low == -high and high >= np.abs(effect.to_numpy()).max()  # zero is the neutral colour
    plt.close(fig)
    assert [p.suffix for p in box_effect_plot(cells, tmp_path / "box_effect")] == [".png", ".svg"]
    assert box_effect_plot(cells[~cells["task"].str.startswith("lesion_qa")], tmp_path / "none") == []


def test_the_box_effect_writes_its_values_as_the_tables_do():
    """A box effect that rounds to zero reads "0.0", never "-0.0"; one that has no value reads "—"."""
    means = {("a+bert", "img2txt", "image_only"): 40.0, ("a+bert", "img2txt", "image_bbox"): 39.99,
             ("a+bert", "ct2txt", "image_only"): 50.0, ("a+bert", "ct2txt", "image_bbox"): 52.0,
             ("b+bert", "img2txt", "image_only"): 30.0, ("b+bert", "img2txt", "image_bbox"): 30.0}  # fmt: skip
    cells = pd.DataFrame(
        [{"task": f"lesion_qa.{family}.matched", "model": model, "schema": schema, "metric": "accuracy", "mean": mean}
         for (model, family, schema), mean in means.items()]
    )  # fmt: skip
    fig = box_effect_figure(cells)
    try:
        texts = sorted(t.get_text() for t in fig.axes[0].texts)
    finally:
        plt.close(fig)
    assert texts == ["0.0", "0.0", "2.0", "—"]


def test_one_slice_or_nine_pairs_img2txt_with_ct2txt_per_schema(tmp_path):
    """CT-Bench's Figure 3 from random cells: each pair's two bars are exactly the two families' means; a family
    without its partner, or another task, draws nothing."""
    rng = np.random.default_rng(1)
    rows, expected = [], {}
    for schema in ("image_only", "image_bbox"):
        for family in ("img2txt", "ct2txt"):
            mean = rng.uniform(20, 80)
            expected[(schema, family)] = mean
            rows.append(
                {
                    "task": f"lesion_qa.{family}.random",
                    "model": "m",
                    "schema": schema,
                    "metric": "accuracy",
                    "mean": mean,
                    "ci_low": mean - 5,
                    "ci_high": mean + 5,
                }  # fmt: skip
            )
    rows.append({"task": "lesion_qa.img2attrib.random", "model": "m", "schema": "image_only", "metric": "accuracy",
                 "mean": 50.0, "ci_low": 45.0, "ci_high": 55.0})  # fmt: skip
    cells = pd.DataFrame(rows)
    table = slice_context(cells)
    assert len(table) == 2
    for (schema, distractors, model), row in table.iterrows():
        assert distractors == "random" and model == "m"
        for family in ("img2txt", "ct2txt"):
            assert row[("mean", family)] == pytest.approx(expected[(schema, family)])
    fig = slice_context_figure(cells)
    heights = sorted(p.get_height() for p in fig.axes[0].patches)
    assert heights == pytest.approx(sorted(expected.values()))
    plt.close(fig)
    assert [p.suffix for p in slice_context_plot(cells, tmp_path / "slices")] == [".png", ".svg"]
    only_one = cells[cells["task"] != "lesion_qa.ct2txt.random"]
    assert slice_context(only_one).empty and slice_context_plot(only_one, tmp_path / "none") == []


def test_the_interval_figure_draws_the_tables_own_interval_with_one_seed():
    """One seed: no t interval, but the report's two-level bootstrap gives one; the figure draws that one, as the
    headline table shows it, not a bare dot."""
    cells = cell_statistics(make_runs(tasks=("vqa",), seeds=1, noise=0.1), split="test")
    assert cells["ci_low"].isna().all()
    cells["interval"] = "two-level bootstrap"
    cells["boot_low"], cells["boot_high"] = cells["mean"] - 2.0, cells["mean"] + 3.0
    fig = interval_figure(cells)
    try:
        vqa = cells.query("metric == 'accuracy'").set_index("schema")
        bars = fig.axes[0].containers[3].lines[2][0].get_segments()[0]  # image_table_bbox's CI segment
        np.testing.assert_allclose(bars[:, 0], vqa.loc["image_table_bbox", ["boot_low", "boot_high"]].to_numpy(float))
    finally:
        plt.close(fig)
