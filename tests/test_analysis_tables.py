"""Paper-style tables (best bold, second underlined; Markdown, LaTeX, CSV) and the beside-the-paper table."""

from __future__ import annotations

import io
import math
import re

import pandas as pd
import pytest

from gx_ray.analysis.reference import beside_paper, beside_paper_markdown, load_reference, paper_model_of
from gx_ray.analysis.runs import higher_is_better
from gx_ray.analysis.stats import cell_statistics
from gx_ray.analysis.tables import (
    format_cell,
    metric_label,
    task_table,
    to_csv,
    to_latex,
    to_markdown,
    write_task_tables,
)
from tests.common import SCHEMAS, make_runs


def constructed(means: dict[str, float], metric: str = "auc", task: str = "stage_classification", n: int = 3):
    """One model, one metric: schema -> mean (sd 0.5)."""
    rows = [
        {"task": task, "model": "m", "fusion": "concat", "schema": s, "metric": metric, "mean": v, "sd": 0.5, "n": n}
        for s, v in means.items()
    ]
    cells = pd.DataFrame(rows)
    cells["ci_low"], cells["ci_high"] = cells["mean"] - 1, cells["mean"] + 1
    cells["higher_is_better"] = higher_is_better(metric)
    return cells


def ranks(table, metric: str) -> dict[str, int | None]:
    return {s: table.cell(table.rows[0], s, metric)[1] for s in table.schemas}


def test_known_best_bold_and_second_underlined():
    cells = cell_statistics(make_runs(noise=0.01, tasks=("stage_classification",)))
    table = task_table(cells, "stage_classification")
    assert table.schemas == list(SCHEMAS)
    expected = {"image_only": None, "image_table": None, "image_bbox": 2, "image_table_bbox": 1}
    assert ranks(table, "auc") == ranks(table, "f1") == expected
    row = to_markdown(table).splitlines()[2].strip("| ").split(" | ")  # columns: schema x (f1, auc)
    assert row[-1] == "**56.0 ± 0.0**" and row[-3] == "*54.0 ± 0.0*" and row[-5] == "52.0 ± 0.0"


def test_ties_both_bold_and_next_value_underlined():
    table = task_table(
        constructed({"image_only": 60.0, "image_table": 60.0, "image_bbox": 58.0, "image_table_bbox": 50.0}),
        "stage_classification",
    )
    assert ranks(table, "auc") == {"image_only": 1, "image_table": 1, "image_bbox": 2, "image_table_bbox": None}


def test_values_equal_at_one_decimal_are_tied():
    cells = constructed({"image_only": 60.04, "image_table": 59.96, "image_bbox": 59.0, "image_table_bbox": 58.9})
    table = task_table(cells, "stage_classification")
    assert ranks(table, "auc") == {"image_only": 1, "image_table": 1, "image_bbox": 2, "image_table_bbox": None}
    assert to_markdown(table).count("**60.0 ± 0.5**") == 2


def test_lower_is_better_smallest_is_bold():
    metric = "image_to_text_median_rank"
    cells = constructed(
        {"image_only": 15.0, "image_table": 12.0, "image_bbox": 10.0, "image_table_bbox": 11.0}, metric, "retrieval"
    )
    table = task_table(cells, "retrieval")
    assert ranks(table, metric) == {"image_only": None, "image_table": None, "image_bbox": 1, "image_table_bbox": 2}
    assert metric_label(metric) == "I→T MedR ↓"


def test_nan_and_missing_cells_are_never_ranked():
    cells = constructed({"image_only": float("nan"), "image_table": 40.0, "image_bbox": 50.0})
    cells = pd.concat([cells, constructed({"image_table_bbox": 45.0}, metric="f1")], ignore_index=True)
    table = task_table(cells, "stage_classification")
    assert table.cell("m", "image_only", "auc") == ("—", None)
    assert table.cell("m", "image_table_bbox", "auc") == ("—", None)  # no such cell at all
    assert ranks(table, "auc") == {"image_only": None, "image_table": 2, "image_bbox": 1, "image_table_bbox": None}
    assert table.cell("m", "image_table_bbox", "f1") == ("45.0 ± 0.5", 1)  # a lone value is best


def test_sd_left_out_below_two_seeds_and_fusion_in_label_when_several():
    assert format_cell(50.0, float("nan"), 1) == "50.0" and format_cell(50.0, 0.25, 3) == "50.0 ± 0.2"
    assert format_cell(float("nan"), 1.0, 3) == "—"
    models = (("resnet10_3d", "bert_tiny", "concat"), ("resnet10_3d", "bert_tiny", "film"))
    table = task_table(cell_statistics(make_runs(seeds=1, tasks=("vqa",), models=models)), "vqa")
    assert table.rows == ["resnet10_3d+bert_tiny (concat)", "resnet10_3d+bert_tiny (film)"]
    assert "±" not in to_markdown(table).split("\n\n")[0]


def marks_markdown(table) -> dict:
    body = to_markdown(table).split("\n\n")[0].splitlines()[2:]
    columns = [(s, m) for s in table.schemas for m in table.metrics]
    marks = {}
    for line in body:
        row, *texts = [c.strip() for c in line.strip("| ").split(" | ")]
        for (schema, metric), text in zip(columns, texts, strict=True):
            marks[row, schema, metric] = 1 if text.startswith("**") else 2 if text.startswith("*") else None
    return marks


def marks_latex(table) -> dict:
    lines = to_latex(table).splitlines()
    body = lines[lines.index(r"\midrule") + 1 : lines.index(r"\bottomrule")]
    columns = [(s, m) for s in table.schemas for m in table.metrics]
    marks = {}
    for line, row in zip(body, table.rows, strict=True):
        _, *texts = line.removesuffix(r" \\").split(" & ")
        for (schema, metric), text in zip(columns, texts, strict=True):
            marks[row, schema, metric] = (
                1 if text.startswith(r"\textbf") else 2 if text.startswith(r"\underline") else None
            )
    return marks


def test_markdown_latex_and_csv_mark_the_same_cells():
    # first model 50, 53, 53, 51 (a tie for best); second 49, 50, 51, 52 (the second best); ranks mirrored
    first = make_runs(
        effects=dict(zip(SCHEMAS, (0.0, 3.0, 3.0, 1.0), strict=True)), noise=0.001, tasks=("vqa", "retrieval")
    )
    other = (("swin3d", "minilm", "concat"),)
    second = make_runs(
        dict(zip(SCHEMAS, (-1.0, 0.0, 1.0, 2.0), strict=True)), noise=0.001, tasks=("vqa", "retrieval"), models=other
    )
    cells = cell_statistics(pd.concat([first, second], ignore_index=True))
    for task in ("vqa", "retrieval"):
        table = task_table(cells, task)
        csv = pd.read_csv(io.StringIO(to_csv(table)))
        assert list(csv.columns) == [
            "task",
            "model",
            "fusion",
            "schema",
            "metric",
            "mean",
            "sd",
            "n",
            "ci_low",
            "ci_high",
            "rank",
        ]
        from_csv = {
            (m, s, k): None if math.isnan(r) else int(r)
            for m, s, k, r in zip(csv["model"], csv["schema"], csv["metric"], csv["rank"], strict=True)
        }
        md, tex = marks_markdown(table), marks_latex(table)
        assert md == tex == from_csv
        marked = list(md.values())
        assert marked.count(1) == 2 * len(table.metrics) and marked.count(2) == len(table.metrics)


def test_arrows_in_headers():
    cells = cell_statistics(make_runs(seeds=2, tasks=("retrieval",)))
    table = task_table(cells, "retrieval")
    header = to_markdown(table).splitlines()[0]
    assert header.count("I→T R@5 ↑") == 4 and header.count("I→T MedR ↓") == 4 and "R@5 ↓" not in header
    tex = to_latex(table)
    assert tex.count(r"R@5 $\uparrow$") == 4 and tex.count(r"MedR $\downarrow$") == 4
    assert "↑" not in tex and "↓" not in tex and "→" not in tex


def test_latex_escapes_underscores_and_has_the_right_number_of_columns():
    cells = cell_statistics(make_runs(seeds=2, tasks=("vqa",)))
    table = task_table(cells, "vqa")
    tex = to_latex(table)
    ncols = 1 + 4 * 3  # model + 4 schemas x (accuracy, f1, auc)
    assert rf"\begin{{tabular}}{{l{'c' * (ncols - 1)}}}" in tex
    assert r"resnet10\_3d+bert\_tiny" in tex
    assert not re.search(r"(?<!\\)_", tex)
    rows = [line for line in tex.splitlines() if line.endswith(r"\\")]
    groups = rows[0]
    assert sum(int(k) for k in re.findall(r"\\multicolumn\{(\d+)\}", groups)) == ncols - 1
    assert groups.count(" & ") == 4 and all(line.count(" & ") == ncols - 1 for line in rows[1:])
    assert len(rows) == 1 + 1 + 1  # groups, metric headers, one model


def test_write_task_tables_one_set_per_task(tmp_path):
    cells = cell_statistics(make_runs(seeds=2, tasks=("vqa", "lesion_detection")))
    paths = write_task_tables(cells, tmp_path / "tables")
    assert sorted(p.name for p in paths) == sorted(
        f"table_{t}.{x}" for t in ("vqa", "lesion_detection") for x in ("md", "tex", "csv")
    )
    assert all(p.stat().st_size > 0 for p in paths)
    assert "AP@0.5 ↑" in (tmp_path / "tables" / "table_lesion_detection.md").read_text(encoding="utf-8")


def test_reference_loads_369_rows_and_maps_retrieval():
    reference = load_reference()
    assert len(reference) == 369
    retrieval = reference[reference["task"] == "retrieval"]
    expected = {
        f"{d}_{m}"
        for d in ("image_to_text", "text_to_image")
        for m in ("recall_at_1", "recall_at_5", "recall_at_10", "median_rank", "mean_rank", "map")
    }
    assert set(retrieval["metric"]) == expected and len(retrieval) == 72
    row = retrieval[(retrieval["model"] == "LLaVA-1.5-7B") & (retrieval["metric"] == "text_to_image_median_rank")]
    assert row["value"].item() == 12.4 and not row["higher_is_better"].item()
    assert set(reference.loc[reference["task"] != "retrieval", "metric"]) >= {"auc", "rouge_l", "ap_50"}
    with pytest.raises(FileNotFoundError, match="nowhere.csv"):
        load_reference("/nonexistent/nowhere.csv")


def test_beside_paper_labels_the_cohort_and_places_the_papers_numbers():
    cells = cell_statistics(make_runs(tasks=("stage_classification", "retrieval")))
    frame = beside_paper(cells, load_reference(), cohort="demo")
    assert len(frame) == len(cells)
    assert frame["cohort"].str.contains("synthetic").all() and frame["cohort"].str.contains("not comparable").all()
    stage = frame[
        (frame["task"] == "stage_classification") & (frame["schema"] == "image_table_bbox") & (frame["metric"] == "auc")
    ]
    assert stage["paper: X2-VLM-Med"].item() == 90.8 and stage["paper: Swin Transformer"].item() == 90.1
    assert stage["ours"].item() == format_cell(*stage[["mean", "sd", "n"]].iloc[0])
    recall = frame[(frame["task"] == "retrieval") & (frame["metric"] == "image_to_text_recall_at_5")].set_index(
        "schema"
    )
    assert (
        recall.at["image_only", "paper: LLaVA-1.5-7B"] == 52.7 and "image_only only" in recall.at["image_only", "note"]
    )
    papers = [c for c in frame.columns if c.startswith("paper: ")]
    assert recall.loc["image_table", papers].isna().all() and "no input settings" in recall.at["image_table", "note"]
    text = beside_paper_markdown(frame)
    assert text.startswith("**Our cohort: built-in demo cohort (synthetic) — not comparable")
    assert "| Image + Table + BBox | AUC ↑ |" in text and "| 90.8 |" in text
    assert text.index("### retrieval") < text.index("### stage_classification")  # the paper's task order


def test_a_paper_model_run_here_stands_beside_the_papers_own_number_for_it():
    """The paper's VLMs under their hub names, folders or tiny stand-ins (``paper_models``'s): each cell gets the number
    the paper printed for that same model first; an encoder or another VLM gets none."""
    assert paper_model_of("vlm:llava-hf/llava-1.5-7b-hf") == paper_model_of("vlm:tiny:llava-1.5") == "LLaVA-1.5-7B"
    assert paper_model_of("vlm:models/llava-med-v1.5-mistral-7b-hf") == "LLaVA-Med v1.5"  # not LLaVA-1.5
    assert paper_model_of("vlm:Salesforce/blip2-opt-2.7b") == "BLIP-2"
    assert paper_model_of("vlm:tiny:med-flamingo") == "Med-Flamingo"
    assert paper_model_of("vlm:Qwen/Qwen2-VL-2B-Instruct") is None and paper_model_of("swin3d+minilm") is None
    cells = constructed({"image_only": 50.0, "image_table_bbox": 60.0}, task="vqa", metric="accuracy")
    cells = pd.concat([cells.assign(model="vlm:tiny:llava-1.5"), cells.assign(model="vlm:tiny:blip2-opt"), cells])
    frame = beside_paper(cells, load_reference(), cohort="demo").set_index(["model", "schema"])
    reference = load_reference().query("task == 'vqa' and metric == 'accuracy'").set_index(["model", "schema"])
    for ours, paper in (("vlm:tiny:llava-1.5", "LLaVA-1.5-7B"), ("vlm:tiny:blip2-opt", "BLIP-2")):
        for schema in ("image_only", "image_table_bbox"):
            assert frame.at[(ours, schema), "paper, same model"] == reference.at[(paper, schema), "value"]
    assert frame.loc[cells["model"].iloc[-1], "paper, same model"].isna().all()  # the encoder's rows
    text = beside_paper_markdown(frame.reset_index())
    assert "| Our model | Ours | 95 % CI | paper, same model | paper: LLaVA-1.5-7B |" in text


def test_each_format_names_the_mark_it_prints_for_the_second_best():
    """Markdown prints the second best in italics (it has no underline): its caption says so; LaTeX underlines."""
    means = {"image_only": 80.0, "image_table": 85.0, "image_table_bbox": 90.0}
    table = task_table(constructed(means), "stage_classification")
    markdown, latex = to_markdown(table), to_latex(table)
    assert "*85.0 ± 0.5*" in markdown and "second best in italics" in markdown and "underlined" not in markdown
    assert r"\underline{85.0" in latex and "second best underlined" in latex


def test_no_number_prints_as_negative_zero():
    """A value that rounds to zero prints unsigned: "0.0", never "-0.0" (nor "[-0.0, 12.5]" in an interval)."""
    assert format_cell(-0.04, 0.01, 3) == "0.0 ± 0.0" and format_cell(-0.04, math.nan, 1) == "0.0"
    assert format_cell(-0.06, 0.5, 3) == "-0.1 ± 0.5"
    cells = constructed({"image_only": -0.01, "image_table_bbox": 3.0}, n=1)
    cells["ci_low"], cells["ci_high"] = -0.02, 12.5
    cells["n"] = 3
    frame = beside_paper(cells, load_reference(), cohort="demo")
    text = beside_paper_markdown(frame)
    assert "[0.0, 12.5]" in text and "-0.0" not in text


def test_beside_the_paper_shows_the_bootstrap_interval_of_a_one_seed_cell():
    """One seed has no t interval; the report's two-level bootstrap gives one, and the table beside the paper shows
    that same interval, as the headline table does, instead of "—"."""
    cells = constructed({"image_only": 80.0, "image_table_bbox": 90.0}, n=1)
    cells["ci_low"] = cells["ci_high"] = math.nan
    cells["interval"] = "two-level bootstrap"
    cells["boot_low"], cells["boot_high"] = cells["mean"] - 4, cells["mean"] + 3
    text = beside_paper_markdown(beside_paper(cells, load_reference(), cohort="demo"))
    assert "| 80.0 | [76.0, 83.0] |" in text and "| 90.0 | [86.0, 93.0] |" in text


def test_counts_read_singular_or_plural_as_they_are():
    """The appendix's sample size reads "1 seed per cell", never "1 seeds"."""
    from gx_ray.analysis.appendix import _sample_size

    one, three = (_sample_size(make_runs(tasks=("vqa",), seeds=s), None) for s in (1, 3))
    assert "\n1 seed per cell;" in one and "\n3 seeds per cell;" in three
