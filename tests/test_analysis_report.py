"""The report from runs in a real MLflow server, with a planted difference between schemas: the loader, the paired
bootstrap over logged test predictions, Holm, and the files on disk and on the parent run."""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from gx_ray.analysis.reference import beside_related_markdown, load_related
from gx_ray.analysis.report import schema_comparisons, write_report
from gx_ray.analysis.runs import inputs_of, load_runs
from gx_ray.schema import STAGE_GROUPS
from gx_ray.sweep.validate import demo_checks
from gx_ray.tracking import child_run, log_metrics, parent_run, runs_table_url, share_trials_view
from gx_ray.tracking.server import LocalMlflowServer
from tests.common import make_runs

SWEEP = "planted-0001"
SKILL = {"image_only": 0.0, "image_table": 3.0, "image_bbox": 0.0}
"""How strongly each schema's predicted probabilities point at the true stage: image_table alone is informative."""


def _records(schema: str, seed: int, patients: int = 60) -> list[dict]:
    rng = np.random.default_rng([seed, list(SKILL).index(schema)])
    labels = np.arange(patients) % 4
    logits = rng.normal(size=(patients, 4)) + SKILL[schema] * np.eye(4)[labels]
    probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return [
        {"case_id": f"P{i:03d}", "prediction": STAGE_GROUPS[int(p.argmax())], "target": STAGE_GROUPS[labels[i]],
         "probabilities": p.round(4).tolist()}
        for i, p in enumerate(probabilities)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def planted_sweep(tmp_path_factory):
    """A sweep of stage classification, three schemas x three seeds, logged as the driver logs trials."""
    from gx_ray.metrics.classification import classification_metrics

    with LocalMlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        client = MlflowClient(server.uri)
        parent = parent_run(client, "gx-ray", SWEEP, {"space": "planted"})
        for schema in SKILL:
            for seed in range(3):
                model = {"model.vision": "resnet10_3d", "model.text": "bert_tiny", "model.fusion": "concat"}
                params = {**model, "optimiser.lr": 1e-3, "schema": schema, "seed": seed, "task": "stage_classification"}
                tags = {"task": "stage_classification", "schema": schema, "seed": str(seed)}
                run_id = child_run(client, parent, f"{schema}-{seed}", f"trial-{schema}-{seed}", tags, params).run_id
                records = _records(schema, seed)
                probabilities = np.array([r["probabilities"] for r in records])
                labels = np.array([STAGE_GROUPS.index(r["target"]) for r in records])
                test = classification_metrics(probabilities, labels)
                log_metrics(client, run_id, {f"test_{k}": v for k, v in test.items()}, step=0)
                log_metrics(client, run_id, {"best_val_primary": test["auc"], "test_chance": 50.0}, step=0)
                client.log_dict(run_id, records, "predictions/test.json")
                client.set_terminated(run_id, "FINISHED")
        yield server, parent


def test_the_runs_table_of_a_sweep(planted_sweep):
    server, _ = planted_sweep
    runs = load_runs(server.uri, SWEEP)
    assert runs["run_id"].nunique() == 9 and set(runs["schema"]) == set(SKILL)
    assert set(runs[runs["split"] == "test"]["metric"]) == {"precision", "recall", "f1", "accuracy", "auc", "chance"}
    assert runs.attrs["searched"] == []  # lr is the same in every trial
    assert sorted(runs.drop_duplicates("run_id")["seed"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_the_report_finds_the_planted_difference_and_only_it(planted_sweep, tmp_path):
    server, parent = planted_sweep
    report = write_report(server.uri, SWEEP, tmp_path, parent, cohort="demo", n_resamples=400)
    table = report.significance.set_index("schema_a")
    assert set(table["method"]) == {"two-level bootstrap: patients × seeds"} and set(table["n_cases"]) == {60}
    assert table.at["image_table", "significant"] and table.at["image_table", "better"] == "image_table"
    assert table.at["image_table", "ci_low"] > 0
    assert (
        not table.at["image_bbox", "significant"]
        and table.at["image_bbox", "ci_low"] < 0 < table.at["image_bbox", "ci_high"]
    )
    # the observed difference is the difference of the logged test AUCs, averaged over seeds
    runs = load_runs(server.uri, SWEEP)
    auc = runs[(runs["split"] == "test") & (runs["metric"] == "auc")].groupby("schema")["value"].mean()
    assert table.at["image_table", "diff"] == pytest.approx(auc["image_table"] - auc["image_only"], abs=0.05)
    on_disk = pd.read_csv(tmp_path / "report" / "significance.csv")
    assert len(on_disk) == 2 and on_disk["p_holm"].ge(on_disk["p_value"]).all()
    summary = (tmp_path / "report" / "summary.md").read_text(encoding="utf-8")
    assert "| stage_classification | auc | image_table |" in summary and "**yes**" in summary
    bbox = next(line for line in summary.splitlines() if line.startswith("| stage_classification | auc | image_bbox |"))
    # not significant is "not shown", never "no difference"; no margin: equivalence not tested; the design's reach
    assert "| not shown | equivalence not tested |" in bbox and "no difference" not in summary
    assert (
        float(bbox.split("|")[9]) == pytest.approx(table.at["image_bbox", "mde"], abs=0.01)
        and float(bbox.split("|")[9]) > 0
    )
    assert "| two-level bootstrap |" in summary  # the headline table says which interval each cell carries
    # MLflow's Markdown view resolves no image or link relative to the artifact: summary.md names those files
    assert not re.search(r"\]\((?![a-z][a-z0-9+.-]*:|#)", summary) and "`figures/radar.png`" in summary
    # failure analysis: the best cell's patients most wrong, by their share of the AUC averaged over seeds
    failures = next(
        line for line in summary.splitlines() if line.startswith("| stage_classification | image_table | auc")
    )
    worst = [part.split(" (")[0] for part in failures.split("|")[4].strip().split(", ")]
    assert len(worst) == 5 and all(case.startswith("P") for case in worst)
    true_class = pd.DataFrame(
        {
            seed: {
                r["case_id"]: r["probabilities"][STAGE_GROUPS.index(r["target"])] for r in _records("image_table", seed)
            }
            for seed in range(3)
        }  # fmt: skip
    ).mean(axis=1)
    assert (true_class[worst] < true_class.median()).all()  # the model's least confident patients, in every case
    logged = {a.path for a in MlflowClient(server.uri).list_artifacts(parent, "report")}
    assert {"report/summary.md", "report/summary.html", "report/significance.csv", "report/cells.csv"} <= logged
    # a grid of schemas searched no parameter: no search winner to correct
    assert "report/selection.csv" not in logged and "corrected for its selection" not in summary
    # the chance level stands beside each headline number
    assert "| chance | seeds |" in summary
    row = next(
        line
        for line in summary.splitlines()
        if line.startswith("| stage_classification | ") and "image_table |" in line
    )
    assert row.split("|")[-3].strip() == "50.0"


def test_a_searchs_winner_is_reported_beside_its_corrected_estimate_or_why_there_is_none(planted_sweep, tmp_path):
    """A search of ``optimiser.lr`` (two values x two seeds) logged to MLflow with validation predictions, informative
    for one value only: ``selection.csv`` names that value with the naive and the corrected figures from the trials'
    ``predictions/val.json``, the summary's row shows them, and a task without predictions says so in the cell."""
    from gx_ray.analysis.report import Report, _selection_markdown, write_selection
    from gx_ray.analysis.selection import NO_VALIDATION_PREDICTIONS

    server, _ = planted_sweep
    client = MlflowClient(server.uri)
    parent = parent_run(client, "gx-ray", "searched-0001", {"space": "searched"})
    for lr, schema in ((0.1, "image_only"), (0.001, "image_table")):  # the records' skill: image_table's informative
        for seed in range(2):
            model = {"model.vision": "resnet10_3d", "model.text": "bert_tiny", "model.fusion": "concat"}
            params = {**model, "optimiser.lr": lr, "schema": "image_only", "seed": seed, "task": "stage_classification"}
            tags = {"task": "stage_classification", "schema": "image_only", "seed": str(seed)}
            run_id = child_run(client, parent, f"lr{lr}-{seed}", f"t-{lr}-{seed}", tags, params).run_id
            log_metrics(client, run_id, {"best_val_primary": 60.0, "test_auc": 60.0}, step=0)
            client.log_dict(run_id, _records(schema, seed), "predictions/val.json")
            client.set_terminated(run_id, "FINISHED")
    report = Report(tmp_path)
    write_selection(report, load_runs(server.uri, "searched-0001"), server.uri, n_resamples=200)
    row = pd.read_csv(tmp_path / "selection.csv").iloc[0]
    assert (row["task"], row["configurations"], row["best"]) == ("stage_classification", 2, "optimiser.lr=0.001")
    assert row["method"] == "select-then-score" and row["patients"] == 60 and row["indistinguishable"] == 1
    assert row["naive"] > 90 and row["low"] <= row["corrected"] <= row["high"]
    corrected = f"{row['corrected']:.1f} [{row['low']:.1f}, {row['high']:.1f}] (select-then-score, 60 patients)"
    best = "optimiser.lr=0.001"
    cells = f"| stage_classification | auc | 2 | {best} | {row['naive']:.1f} | {corrected} | 1: {best} |"
    assert cells in _selection_markdown(report.selection)
    wide = report.selection.assign(indistinguishable=7, indistinguishable_configurations="; ".join("abcdefg"))
    assert "| 7: a; b; c; d; e; and 2 more |" in _selection_markdown(wide)  # a wide search's cell stays readable
    pooled = report.selection.assign(method="bbc-cv")  # under cross-validation: the pooled out-of-fold predictions'
    assert f"| {row['naive']:.1f} (pooled out-of-fold) | {row['corrected']:.1f} [" in _selection_markdown(pooled)
    silent = report.selection.assign(note=NO_VALIDATION_PREDICTIONS, corrected=np.nan)
    assert "| none: the trials logged no validation predictions | — |" in _selection_markdown(silent)


def test_the_demo_check_reads_chance_significance_and_time_from_the_report(planted_sweep, tmp_path):
    server, parent = planted_sweep
    report = write_report(server.uri, SWEEP, tmp_path, None, cohort="demo", n_resamples=400).folder
    checks = {c.name: c for c in demo_checks(report, 300.0, 9, full="image_table")}
    assert checks["stage_classification above chance"].passed  # AUC far above 50 in every seed
    assert "vs chance 50.0" in checks["stage_classification above chance"].line()
    beats = checks["image_table > image_only"]
    assert not beats.passed and "on 1 of 1 tasks: stage_classification; 2 needed" in beats.detail  # one task only
    assert checks["ten minutes"].passed and not demo_checks(report, 601.0, 9, full="image_table")[-1].passed
    assert checks["ten minutes"].line().startswith("INFO")  # the aim that gives way on two cores: shown, not failed
    # a chance level inside the cell's interval is not cleared
    cells = pd.read_csv(report / "cells.csv")
    auc = cells[(cells["schema"] == "image_bbox") & (cells["metric"] == "auc")].iloc[0]
    cells.loc[(cells["schema"] == "image_bbox") & (cells["metric"] == "chance"), "mean"] = auc["ci_low"] + 0.1
    cells.to_csv(report / "cells.csv", index=False)
    assert not {c.name: c for c in demo_checks(report, 300.0, 9, full="image_bbox")}[
        "stage_classification above chance"
    ].passed


def test_a_schema_searched_over_other_parameters_is_not_compared(planted_sweep):
    server, _ = planted_sweep
    runs = make_runs(tasks=("stage_classification",))
    searched = runs[runs["schema"] == "image_table"].assign(run_id=lambda r: r["run_id"] + "-lr2")
    comparisons = schema_comparisons(pd.concat([runs, searched], ignore_index=True), server.uri)
    # these runs logged no predictions: the seeds are the pairing unit
    assert {c["schema_a"] for c in comparisons} == {"image_bbox", "image_table_bbox"}
    assert {c["method"] for c in comparisons} == {"Wilcoxon signed-rank over seeds"}


def test_the_report_reads_whole_in_mlflow_in_a_real_browser(planted_sweep, tmp_path):
    """The report as a user opens it: MLflow's own UI, the parent run's Artifacts tab, ``report/summary.html`` (which
    the UI renders in a frame of its own), in headless Chromium: every figure loads, the per-task tables are on the
    page, no wider than the preview (a narrow one too), and the parent run's description points there;
    ``report/summary.md`` shows no figure as Markdown source and links to no missing page."""
    from playwright.sync_api import sync_playwright

    server, parent = planted_sweep
    write_report(server.uri, SWEEP, tmp_path, parent, cohort="demo", n_resamples=200)
    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser_path, "Chromium is installed by the README's set-up and .ci/run"
    experiment = MlflowClient(server.uri).get_run(parent).info.experiment_id
    url = f"{server.uri}/#/experiments/{experiment}/runs/{parent}/artifacts/report/summary.html"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url, wait_until="load")
            report = _frame_showing(page, "img[alt=radar]")
            images = report.evaluate("Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth])")
            headings = report.evaluate("Array.from(document.querySelectorAll('h3')).map(h => h.textContent)")
            tables = report.evaluate("document.querySelectorAll('table').length")
            wide = report.evaluate(WIDTHS)
            page.set_viewport_size({"width": 1024, "height": 900})  # a smaller window: a preview of about 400 px
            report.wait_for_function(f"document.documentElement.clientWidth < {wide[1]}")
            narrow = report.evaluate(WIDTHS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url.replace("summary.html", "summary.md"), wait_until="load")
            page.get_by_text("Tables per task (all metrics)", exact=True).first.wait_for(timeout=60_000)
            markdown = page.evaluate("document.body.innerText")
            hrefs = page.evaluate("Array.from(document.querySelectorAll('a')).map(a => a.getAttribute('href'))")
        finally:
            browser.close()
    assert {alt for alt, _, _ in images} >= {"radar", "intervals"}
    broken = [alt for alt, complete, width in images if not complete or width == 0]
    assert not broken, f"figures that did not load: {broken}"
    assert any("stage" in h for h in headings), headings  # the per-task table, inline instead of a dead link
    assert tables >= 3  # headline, significance, the task's own
    assert wide[0] <= wide[1] and narrow[0] <= narrow[1], (wide, narrow)  # no table makes the page scroll sideways
    # summary.md as MLflow renders it: no figure as its Markdown source, no link to a missing page
    assert "](" not in markdown and "figures/radar.png" in markdown
    assert not [href for href in hrefs if href and not href.startswith(("#", "http"))], hrefs
    description = MlflowClient(server.uri).get_run(parent).data.tags["mlflow.note.content"]
    assert "report/summary.html" in description and "| stage_classification |" in description


def test_the_printed_runs_link_opens_the_sweeps_trials_with_their_headline_columns_in_a_real_browser(planted_sweep):
    """The link a sweep prints, opened in MLflow's own UI in headless Chromium: MLflow's default runs table shows the
    parent run alone and no metric; the sweep's shared view lists its nine trials by name, without the parent, under
    the headline columns."""
    from playwright.sync_api import sync_playwright

    server, parent = planted_sweep
    client = MlflowClient(server.uri)
    experiment = client.get_run(parent).info.experiment_id
    view = share_trials_view(client, experiment, SWEEP)
    trials = sorted(f"trial-{schema}-{seed}" for schema in SKILL for seed in range(3))
    texts = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        try:
            for name, url in (("plain", runs_table_url(server.uri, experiment)),
                              ("view", runs_table_url(server.uri, experiment, view))):  # fmt: skip
                page = browser.new_page(viewport={"width": 1600, "height": 900})
                page.goto(url, wait_until="load")
                marker = trials[0] if name == "view" else SWEEP
                page.get_by_text(marker, exact=True).first.wait_for(timeout=60_000)
                texts[name] = page.evaluate("document.body.innerText")
        finally:
            browser.close()
    assert "best_val_primary" not in texts["plain"] and trials[0] not in texts["plain"]  # what the link fixes
    lines = texts["view"].splitlines()
    assert [line for line in lines if line.startswith("trial-")] == trials  # every trial, by name
    assert SWEEP not in lines  # not the parent
    for column in ("task", "schema", "seed", "best_val_primary", "test_chance"):
        assert column in lines, column
    assert "Sort: Run Name" in lines


WIDTHS = "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
"""A page's width and its preview's: wider than the preview, it scrolls sideways."""


def _frame_showing(page, selector: str, timeout_s: float = 60.0):
    """The frame of the page (the UI renders an HTML artifact in a frame of its own) in which ``selector`` matches."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for frame in page.frames:
            with contextlib.suppress(Exception):  # a frame may go away while the UI renders
                if frame.evaluate(f"document.querySelectorAll({selector!r}).length") > 0:
                    return frame
        time.sleep(0.5)
    raise AssertionError(f"MLflow's UI showed no {selector} within {timeout_s:.0f} s")


def test_lesion_qa_sits_beside_ct_bench_labelled_as_another_dataset():
    related = load_related()
    # every number the CSV holds is one the related papers print (spot checks against their text)
    ct_bench = related[related["paper"] == "CT-Bench"].set_index(["model", "schema"])["value"]
    assert ct_bench[("BiomedCLIP fine-tuned", "image_bbox")] == 62.0 and ct_bench[("Random", "image_only")] == 25.0
    gi = related[related["paper"] != "CT-Bench"].set_index(["task", "model", "split"])["value"]
    assert gi[("endoscopy_cls", "this paper's model", "test (unseen)")] == 88.63
    cells = pd.DataFrame(
        [
            {"task": "lesion_qa.img2txt.matched", "schema": "image_only", "metric": "accuracy", "mean": 30.0},
            {"task": "lesion_qa.img2txt.matched", "schema": "image_bbox", "metric": "accuracy", "mean": 50.0},
            {"task": "lesion_qa.ct2txt.matched", "schema": "image_only", "metric": "accuracy", "mean": 40.0},
            {"task": "lesion_qa.ct2txt.matched", "schema": "image_bbox", "metric": "accuracy", "mean": 20.0},
            {"task": "vqa", "schema": "image_only", "metric": "accuracy", "mean": 99.0},
        ]
    )
    markdown = beside_related_markdown(cells, related)
    assert "never comparable with ours" in markdown.splitlines()[0]
    assert "| ours (mean over img2txt.matched, ct2txt.matched) | 35.0 | 35.0 |  |" in markdown  # 99 (VQA) stays out
    assert "| Gemini (CT-Bench) | 31.2 | 36.1 |  |" in markdown
    assert "the text says 41.00" in markdown  # the paper's own inconsistency travels with its number
    assert beside_related_markdown(cells[cells["task"] == "vqa"], related) is None


def test_endoscopy_sits_beside_the_upper_gi_paper_on_unseen_patients_labelled_as_another_dataset():
    from gx_ray.analysis.reference import beside_endoscopy_markdown

    related = load_related()
    cells = pd.DataFrame(
        [
            {"task": "endoscopy.cls", "schema": "image_only", "metric": "accuracy", "mean": 60.0},
            {"task": "endoscopy.cls", "schema": "image_table", "metric": "accuracy", "mean": 70.0},
            {"task": "endoscopy.rec", "schema": "image_only", "metric": "accuracy", "mean": 40.0},
            {"task": "endoscopy.cap", "schema": "image_only", "metric": "rouge_l", "mean": 30.0},
            {"task": "vqa", "schema": "image_only", "metric": "accuracy", "mean": 99.0},
        ]
    )
    markdown = beside_endoscopy_markdown(cells, related)
    assert "never comparable with ours" in markdown.splitlines()[0] and "unseen patients" in markdown.splitlines()[0]
    assert "|  | CLS | REC | note |" in markdown  # only the families the sweep ran and the paper reports (not CAP)
    assert "| ours (mean over schemas) | 65.0 | 40.0 |  |" in markdown
    assert "| this paper's model | 88.6 | 37.4 |" in markdown and "| ColonGPT | 83.2 | 56.2 |" in markdown
    assert "91.4" not in markdown  # the paper's validation split holds training patients: not shown
    assert beside_endoscopy_markdown(cells[cells["task"] == "vqa"], related) is None


def test_a_runs_inputs_are_said_in_words_from_its_params_as_mlflow_keeps_them():
    from gx_ray.modalities.schemas import PRESETS
    from gx_ray.train.config import TrialConfig

    def logged(schema) -> dict:  # the params a trial logs, as MLflow returns them: every value a string
        config = TrialConfig.from_flat({"task": "stage_classification", "schema": schema})
        return {k: str(v) for k, v in config.to_flat().items()}

    assert inputs_of(logged("image_only")) == "CT (4 phases)"
    assert inputs_of(logged("image_table_bbox")) == (
        "CT (4 phases), lab table as text, boxes as outlines drawn into the CT (tumour, lymph nodes, stomach)"
    )
    custom = {**PRESETS["image_only"].describe(), "phases": ["venous"], "endoscopy": True}
    custom["reports"] = ["endoscopy_report"]
    assert inputs_of(logged(custom)) == "CT (1 phase), endoscopy image, reports: endoscopy_report"


QA_SKILL = {("random", "image_only"): 0.6, ("appearance", "image_only"): 0.3,
            ("random", "image_bbox"): 0.9, ("appearance", "image_bbox"): 0.6}  # fmt: skip
"""Planted chance of answering a lesion QA question right: the box helps, appearance distractors are harder."""


QA_PATIENTS = 200
"""Each seed's correct answers are drawn apart (a patient x seed interaction, no patient effect), which the two-level
interval carries at its seed level with 2 degrees of freedom: 80 patients left the planted 25-point gaps short of
significance after Holm."""


def _qa_records(kind: str, schema: str, seed: int, skill: float | None = None) -> list[dict]:
    rng = np.random.default_rng([seed, len(kind), len(schema)])
    right = rng.random(QA_PATIENTS) < (QA_SKILL[(kind, schema)] if skill is None else skill)
    return [
        {"case_id": f"P{i:03d}", "prediction": "A" if ok else "B", "target": "A", "correct": bool(ok)}
        for i, ok in enumerate(right)
    ]


@pytest.mark.parametrize("planted", [True, False])
def test_distractor_kinds_are_compared_paired_and_the_ct_bench_check_reads_them(tmp_path, planted):
    """A lesion QA sweep on a real MLflow server: with the planted gaps the report finds appearance distractors
    harder than random ones under both schemas and the box helpful, and the ct-bench check passes; with none
    planted (every trial the same skill) it finds nothing and the check fails."""
    from gx_ray.sweep.validate import ct_bench_checks

    sweep = f"qa-{planted}"
    with LocalMlflowServer(tmp_path / "mlflow") as server:
        client = MlflowClient(server.uri)
        parent = parent_run(client, "gx-ray", sweep, {"space": "ct_bench"})
        for kind, schema in QA_SKILL:
            for seed in range(3):
                params = {"task": "lesion_qa", "task_options.family": "img2txt", "task_options.distractors": kind,
                          "schema": schema, "seed": seed, "model.vision": "resnet10_3d", "model.text": "bert_tiny",
                          "model.fusion": "concat"}  # fmt: skip
                tags = {"task": "lesion_qa", "schema": schema, "seed": str(seed)}
                run_id = child_run(
                    client, parent, f"{kind}-{schema}-{seed}", f"t-{kind}-{schema}-{seed}", tags, params
                ).run_id
                records = _qa_records(kind, schema, seed, skill=None if planted else 0.6)
                accuracy = 100.0 * np.mean([r["correct"] for r in records])
                log_metrics(client, run_id, {"test_accuracy": accuracy, "best_val_primary": accuracy}, step=0)
                log_metrics(client, run_id, {"test_chance": 25.0, "test_questions": float(len(records))}, step=0)
                client.log_dict(run_id, records, "predictions/test.json")
                client.set_terminated(run_id, "FINISHED")
        report = write_report(server.uri, sweep, tmp_path, None, n_resamples=400)
    kinds = pd.read_csv(report.folder / "distractors.csv")
    assert set(kinds["schema"]) == {"image_only", "image_bbox"} and set(kinds["schema_a"]) == {"appearance"}
    assert (kinds["task"] == "lesion_qa.img2txt").all()
    assert (kinds["method"] == "two-level bootstrap: patients × seeds").all()
    results = ct_bench_checks(report.folder)
    checks = {c.name: c.passed for c in results if not c.information}
    assert [c.name for c in results if c.information] == ["random distractors are easier (image_only)"]
    if planted:
        assert (kinds["diff"] < -15).all() and (kinds["ci_high"] < 0).all() and kinds["significant"].all()
        assert checks == {"the box helps Img2txt": True, "random distractors are easier (image_bbox)": True}
        summary = (report.folder / "summary.md").read_text("utf-8")
        assert "## Distractor kinds: each against random ones" in summary
        # CT-Bench's overall figure: every family and seed pooled per condition, with Wilson's interval (scipy's)
        from scipy.stats import binomtest

        for schema in ("image_only", "image_bbox"):
            right = sum(
                sum(r["correct"] for r in _qa_records(kind, schema, seed)) for kind in ("random", "appearance")
                for seed in range(3)
            )  # fmt: skip
            asked = 2 * 3 * QA_PATIENTS  # two distractor kinds, three seeds
            interval = binomtest(right, asked).proportion_ci(method="wilson")
            low, high = 100 * interval.low, 100 * interval.high
            row = f"| {schema} | {right} / {asked} | {100 * right / asked:.1f} [{low:.1f}, {high:.1f}] |"
            assert row in summary, row
    else:
        assert not kinds["significant"].any() and not any(checks.values())


def test_jackknife_pseudo_values_are_each_patients_share_of_the_metric():
    """For a mean of cases each patient's pseudo-value is its own value; for AUC their mean is the AUC (the planner
    resamples them as per-patient differences)."""
    from gx_ray.analysis.cases import case_scorer
    from gx_ray.analysis.plan import pseudo_values

    records = _records("image_table", 0, patients=40)
    ids = [r["case_id"] for r in records]
    accuracy = pseudo_values(case_scorer("stage_classification", records, "accuracy"), ids)
    right = [100.0 * (r["prediction"] == r["target"]) for r in records]
    assert accuracy == pytest.approx(right, abs=1e-9)
    auc_scorer = case_scorer("stage_classification", records, "auc")
    auc = pseudo_values(auc_scorer, ids)
    assert auc.mean() == pytest.approx(auc_scorer.score(np.arange(len(ids))), rel=0.02)


def test_a_cross_validated_pilots_differences_are_each_folds_pseudo_values_side_by_side():
    """A cross-validated seed's fold models each score their own fold: the planner's differences are the folds'
    pseudo-values laid side by side, the same patients in the same columns for every seed, so their mean over a seed
    weighs each fold's difference by its patients, as the report's out-of-fold score does."""
    from gx_ray.analysis.cases import case_scorer
    from gx_ray.analysis.plan import pilot_differences, pseudo_values

    def fold_scorers(schema: str, seed: int) -> list:
        records = _records(schema, seed, patients=50)
        return [case_scorer("stage_classification", part, "accuracy") for part in (records[:20], records[20:])]

    arm = [fold_scorers("image_table", seed) for seed in range(3)]
    base = [fold_scorers("image_only", seed) for seed in range(3)]
    differences = pilot_differences(arm, base)
    assert differences.shape == (3, 50)
    for seed in range(3):
        for k, columns in ((0, slice(0, 20)), (1, slice(20, 50))):
            ids = sorted(arm[seed][k].case_ids)
            expected = pseudo_values(arm[seed][k], ids) - pseudo_values(base[seed][k], ids)
            assert differences[seed, columns] == pytest.approx(expected)
        folds = [arm[seed][k].score(np.arange(n)) - base[seed][k].score(np.arange(n)) for k, n in ((0, 20), (1, 30))]
        assert differences[seed].mean() == pytest.approx((20 * folds[0] + 30 * folds[1]) / 50)


def test_a_study_is_planned_from_the_pilots_predictions(planted_sweep, tmp_path, capsys):
    """``python jobs/plan.py --pilot``: every comparison of the pilot planned on its own per-patient differences;
    power grows with patients and seeds, a large effect finds a design and a tiny one none; the summary, the plan's
    data and a power curve per comparison on disk."""
    import json

    from jobs.plan import main

    server, _ = planted_sweep
    argv = ["--pilot", SWEEP, "--mlflow-uri", server.uri, "--output", str(tmp_path), "--seeds", "3,5", "--patients",
            "30,60", "--studies", "400"]  # fmt: skip
    assert main([*argv, "--effect", "30"]) == 0
    assert "smallest design at 80 %" in capsys.readouterr().out
    planned = json.loads((tmp_path / "plan" / "plan.json").read_text(encoding="utf-8"))
    assert {p["schema_a"] for p in planned} == {"image_table", "image_bbox"}
    for plan in planned:
        power = {(d["seeds"], d["patients"]): d["power"] for d in plan["designs"]}
        slack = 3 * max(d["mc_error"] for d in plan["designs"])
        assert power[(3, 60)] >= power[(3, 30)] - slack and power[(5, 60)] >= power[(3, 60)] - slack
        assert plan["smallest"] is not None and plan["pilot_seeds"] == 3 and plan["pilot_patients"] == 60
        assert (tmp_path / "plan" / plan["figure"]).is_file()
    assert main([*argv, "--effect", "0.01"]) == 0
    tiny = json.loads((tmp_path / "plan" / "plan.json").read_text(encoding="utf-8"))
    assert all(p["smallest"] is None for p in tiny)
    assert "none of the designs tried" in (tmp_path / "plan" / "summary.md").read_text(encoding="utf-8")
    assert main([*argv, "--effect", "pilot"]) == 0  # each comparison at the difference its own pilot saw
    seen = json.loads((tmp_path / "plan" / "plan.json").read_text(encoding="utf-8"))
    assert all(p["effect"] == p["observed"] for p in seen) and len({p["effect"] for p in seen}) == 2
    assert "the difference its pilot observed" in (tmp_path / "plan" / "summary.md").read_text(encoding="utf-8")


def test_the_significance_table_fits_a_preview_with_its_method_said_once_under_it():
    """The table was 10 columns wide, its method repeated in every row: the page needed sideways scrolling in
    MLflow's preview. The method is now a note under the table, the smallest detectable difference a short header,
    and the page's cells wrap."""
    from gx_ray.analysis.report import _markdown_to_html, _significance_markdown

    row = {"task": "vqa", "metric": "accuracy", "schema_a": "image_table", "diff": 1.0, "ci_low": -0.5, "ci_high": 2.5}
    row |= {"p_value": 0.2, "p_holm": 0.4, "significant": False, "n_resamples": 999, "mde": 3.0}
    table = pd.DataFrame([row | {"method": "two-level bootstrap: patients × seeds"}] * 2)
    text = _significance_markdown(table, "image_only")
    header = text.splitlines()[0]
    assert "method" not in header and "smallest detectable" not in header and header.count("|") == 10
    assert text.count("two-level bootstrap: patients × seeds") == 1 and "\n\nMethod: two-level bootstrap" in text
    assert "overflow-wrap:anywhere" in _markdown_to_html(text, Path("."))


def test_a_smallest_detectable_difference_without_a_number_is_said_in_words():
    """A comparison whose scores do not vary, or whose model gave one answer for all, shows why in the MDE column of
    the summary and of the appendix's sample size, not 0.00 or a number that describes nothing."""
    from gx_ray.analysis.appendix import _sample_size
    from gx_ray.analysis.report import _significance_markdown

    row = {"task": "lesion_detection", "metric": "ap_50", "schema_a": "image_table", "diff": 0.0, "ci_low": 0.0}
    row |= {"ci_high": 0.0, "p_value": 1.0, "p_holm": 1.0, "significant": False, "n_resamples": 999, "n_cases": 64}
    row |= {"n_seeds": 3, "method": "two-level bootstrap: patients × seeds"}
    table = pd.DataFrame([
        row | {"mde": np.nan, "mde_note": "undefined: no variation"},
        row | {"task": "report_generation", "mde": np.nan, "mde_note": "degenerate: one answer for all"},
        row | {"task": "vqa", "mde": 7.4, "mde_note": np.nan},
    ])  # fmt: skip
    text = _significance_markdown(table, "image_only")
    assert "| undefined: no variation |" in text and "| degenerate: one answer for all |" in text
    assert text.count("| undefined: no variation |\n") == 1 and "| 7.40 |" in text
    runs = pd.DataFrame({"split": ["test"] * 3, "run_id": ["a", "b", "c"], "seed": [0, 1, 2]})
    sizes = _sample_size(runs, table)
    assert "| lesion_detection | image_table | 64 | 3 | undefined: no variation |" in sizes
    assert "degenerate: one answer for all" in sizes and "| 7.40 |" in sizes


def test_a_declared_familys_replicates_mde_holm_floor_and_words_are_its_own():
    """Where the space declared a primary family, each comparison is bootstrapped with its own family's replicates
    and smallest detectable difference, its Holm p's floor is its family's, and the text above the table (and the
    appendix's sample size) says which family a row is in; undeclared, no such words."""
    from scipy.stats import norm

    from gx_ray.analysis.appendix import _sample_size
    from gx_ray.analysis.cases import BootstrapJob, CaseScorer
    from gx_ray.analysis.report import _family_bootstraps, _significance_markdown

    cases, rng = [f"p{i}" for i in range(12)], np.random.default_rng(0)

    def arm(shift: float) -> list[CaseScorer]:
        values = [rng.normal(shift, 1, 12) for _ in range(2)]
        return [CaseScorer(cases, lambda idx, v=v: float(v[idx].mean())) for v in values]

    small, large = _family_bootstraps([BootstrapJob([arm(1.0), arm(0.0)], family=m) for m in (1, 30)], 1000)
    assert small["n_resamples"] == 1000 and large["n_resamples"] == 2399  # family_resamples: 4 x 30 / 0.05 - 1
    for m, result in ((1, small), (30, large)):
        z = norm.ppf(1 - 0.05 / (2 * m)) + norm.ppf(0.8)
        assert result["mde"] == pytest.approx(z * np.hypot(result["se_patients"], result["se_seeds"]))
    row = {"task": "vqa", "metric": "accuracy", "diff": 5.0, "ci_low": 2.0, "ci_high": 8.0, "p_value": 2 / 1001}
    row |= {"significant": True, "n_resamples": 1000, "mde": 3.0, "method": "bootstrap", "n_cases": 64, "n_seeds": 5}
    primary = [row | {"task": t, "schema_a": "image_table", "family": "primary", "p_holm": 4 / 1001} for t in "ab"]
    others = [row | {"schema_a": s, "family": "exploratory", "p_holm": 6 / 1001} for s in ("s1", "s2", "s3")]
    text = _significance_markdown(pd.DataFrame(primary + others), "image_only")
    assert text.count("| ≤ 0.0040 (floor of 1,000 replicates) |") == 2  # 2 x 2/1001, not 5 x: "≤ 0.0100"
    assert text.count("| ≤ 0.0060 (floor of 1,000 replicates) |") == 3
    words = text.split("\n|")[0]
    assert "declared in the space" in words and "`analysis.primary`" in words
    assert "image_table against image_only" in words
    assert "(2 rows)" in words and "every other row (3)" in words
    undeclared = pd.DataFrame([r | {"family": "all"} for r in primary + others])
    assert _significance_markdown(undeclared, "image_only") == _significance_markdown(
        undeclared.drop(columns="family"), "image_only"
    )
    assert "declared" not in _significance_markdown(undeclared, "image_only")
    runs = pd.DataFrame({"split": ["test"] * 5, "run_id": list("abcde"), "seed": range(5)})
    assert "| a | image_table (primary) | 64 | 5 | 3.00 |" in _sample_size(runs, pd.DataFrame(primary + others))
