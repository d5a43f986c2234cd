"""The registered model's card (``gx_ray/deploy/card.py``) from hand-made finalize dicts: its sections, the test figure
beside chance, the naive and selection-corrected estimates, the degenerate-model warnings, the preprocessing and the
training patients' ranges as tables, and a card cut to what the registry keeps."""

from __future__ import annotations

import copy
import re

from markdown_it import MarkdownIt

from gx_ray.deploy.card import answers_given, degenerate, fitted, model_card

CHOICE = {
    "label": "stage_classification", "metric": "auc", "description": "schema=image_table",
    "rule": "best mean validation score over seeds; ties within 0.05 by trial time", "score": 77.04, "repeats": 3,
    "final_model": "refitted on training + validation patients", "select": "best", "cross_validated": False,
    "ranked": [
        {"description": "schema=image_table", "score": 77.04, "sd": 1.5, "repeats": 3, "folds": 0, "seconds": 40.0,
         "tied": True},
        {"description": "schema=image_only", "score": 75.9, "sd": 2.1, "repeats": 3, "folds": 0, "seconds": 30.0,
         "tied": False},
    ],
    "selection": {"method": "select-then-score", "chosen": "schema=image_table", "naive": 78.31, "corrected": 72.46,
                  "low": 61.2, "high": 82.7, "indistinguishable": ["schema=image_table", "schema=image_only"],
                  "standard_errors": [4.1, 4.3], "patients": 24, "configurations": 2, "resamples": 1000},
}  # fmt: skip
TEST = {"metric": "auc", "value": 80.8731, "low": 72.21, "high": 87.34, "cases": 48, "chance": 50.0,
        "metrics": {"auc": {"metric": "auc", "value": 80.8731, "low": 72.21, "high": 87.34, "cases": 48},
                    "accuracy": {"metric": "accuracy", "value": 52.1, "low": 37.5, "high": 66.7, "cases": 48}},
        "answers": {"distinct": 3, "most": "II", "count": 20, "records": 48, "patients": 48}}  # fmt: skip
INFO = {
    "sweep_id": "modality_ablation-demo-b7a76a10",
    "inputs": {"preprocess": {"spacing_zyx_mm": [6.0, 4.5, 4.5], "hu_window": [-100.0, 300.0], "histogram_match": True},
               "ct_shape": [4, 32, 64, 64], "endoscopy_shape": [3, 32, 32], "lab_names": ["age", "cea"]},
    "training_fingerprint": {"cases": 136, "spacing_zyx_mm": {"min": [2.0, 0.6, 0.6], "max": [5.0, 0.9, 0.9]},
                             "intensity_mean_hu": {"venous": {"min": 30.1, "max": 80.2}}},
    "cohort": {"name": "demo", "synthetic": True, "presets": ["demo"],
               "patients": {"train": 112, "val": 24, "test": 48},
               "manifest_sha256": "a" * 64, "fingerprint_sha256": "b" * 64},
}  # fmt: skip
SOURCES = [{"run_id": "abc123", "seed": 0, "fold": None}]


def _html(card: str) -> str:
    return MarkdownIt("commonmark").enable("table").render(card)


def _table_rows(card: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with ``header``."""
    lines = card.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_card_has_a_model_cards_sections_and_renders_its_tables_as_tables():
    card = model_card(CHOICE, TEST, INFO, SOURCES)
    headings = re.findall(r"^(#+ .+)$", card, flags=re.MULTILINE)
    for section in ("## Intended use", "### Out-of-scope use", "## Training data", "## Evaluation", "## Limitations",
                    "## Preprocessing", "## Configurations compared", "## Provenance"):  # fmt: skip
        assert section in headings
    assert "For research use only" in card and "Not a medical device" in card
    assert "synthetic patients" in card and "Warning" not in card  # a model that clears chance: no warning
    html = _html(card)
    assert html.count("<table>") == 6 and "<h2>Intended use</h2>" in html  # patients, ranges, test, prep, configs, ...
    assert _table_rows(card, "| split |") == [
        ["train", "112", "training"], ["validation", "24", "choosing the configuration; the refit trains on it"],
        ["test", "48", "the test below, once"],
    ]  # fmt: skip


def test_the_test_figure_sits_beside_chance_and_the_naive_best_beside_its_corrected_estimate():
    card = model_card(CHOICE, TEST, INFO, SOURCES)
    rows = {row[0]: row for row in _table_rows(card, "| metric | test |")}
    assert rows["auc"] == ["auc", "80.87", "72.21 to 87.34", "50.00", "48"]  # full precision, shown to 2 decimals
    assert rows["accuracy"][3] == "—"  # chance is the primary metric's
    evaluation = card.split("## Evaluation")[1].split("## Limitations")[0]
    assert "78.31" in evaluation and "**72.46**" in evaluation and "61.20 to 82.70" in evaluation
    assert "2 configurations compared" in evaluation and "select-then-score" not in evaluation  # the method in words
    assert "2 of 2" in evaluation and "schema=image_only" in evaluation  # the indistinguishable set, by label
    # older sweeps: the reason there is no estimate, instead of numbers
    older = {**CHOICE, "selection": {"note": "no selection-corrected estimate: the trials logged no validation "
                                             "predictions"}}  # fmt: skip
    assert "the trials logged no validation predictions" in model_card(older, TEST, INFO, SOURCES)


def test_the_preprocessing_and_the_training_ranges_are_tables_not_json():
    card = model_card(CHOICE, TEST, INFO, SOURCES)
    preprocessing = dict(_table_rows(card, "| setting | value |"))
    assert preprocessing["spacing_zyx_mm"] == "6.0, 4.5, 4.5" and preprocessing["histogram_match"] == "True"
    assert preprocessing["lab variables"] == "2" and "{" not in card.split("## Preprocessing")[1]
    ranges = {row[0]: row[1:] for row in _table_rows(card, "| fingerprint |")}
    assert ranges["acquired spacing z (mm)"] == ["2", "5"] and ranges["venous mean inside the stomach (HU)"] == [
        "30.1", "80.2"]  # fmt: skip


def test_a_model_that_gives_one_class_to_every_patient_or_sits_on_chance_is_flagged_degenerate():
    one_class = {**TEST, "answers": {"distinct": 1, "most": "II", "count": 64, "records": 64, "patients": 64}}
    (said,) = degenerate(one_class)
    assert "one answer (II) for all 64 test patients" in said
    on_chance = {**TEST, "value": 52.87, "low": 41.8, "high": 63.4}  # the smoke champion's
    (said,) = degenerate(on_chance)
    assert "does not clear chance (50.00)" in said and "no better than chance" in said
    card = model_card(CHOICE, {**one_class, "value": 52.87, "low": 41.8, "high": 63.4}, INFO, SOURCES)
    title = card.split("## Intended use")[0]
    assert "> **Warning: a degenerate model.**" in title and "one answer (II)" in title and "chance" in title
    assert degenerate(TEST) == [] and degenerate({**TEST, "chance": None}) == []
    # lower is better (a median rank): the interval's upper end must clear chance
    rank = {"metric": "image_to_text_median_rank", "value": 8.0, "low": 5.0, "high": 12.0, "chance": 10.0}
    assert degenerate(rank) and not degenerate({**rank, "high": 9.0})
    # no interval (one test patient): the figure itself against chance
    assert degenerate({**TEST, "value": 49.0, "low": float("nan"), "high": float("nan")})


def test_the_answers_given_count_distinct_predictions_and_skip_what_is_not_one_answer():
    records = [{"case_id": f"c{i}", "prediction": "II"} for i in range(5)]
    assert answers_given(records) == {"distinct": 1, "most": "II", "count": 5, "records": 5, "patients": 5}
    questions = [{"case_id": f"c{i // 2}", "prediction": "yes"} for i in range(6)]  # VQA: questions of patients
    assert (
        "all 6 test questions of 3 patients"
        in degenerate({"metric": "accuracy", "answers": answers_given(questions)})[0]
    )
    assert answers_given([{"case_id": "c", "prediction": {"boxes": [], "scores": []}}]) is None


def test_the_smoke_preset_and_a_real_cohort_are_said():
    smoke = copy.deepcopy(INFO)
    smoke["cohort"].update(presets=["demo", "smoke"])
    assert "smoke preset" in model_card(CHOICE, TEST, smoke, SOURCES).split("## Limitations")[1]
    real = copy.deepcopy(INFO)
    real["cohort"].update(name="hospital_a", synthetic=False)
    card = model_card(CHOICE, TEST, real, SOURCES)
    assert "`hospital_a`: real patients" in card and "synthetic" not in card


def test_a_card_longer_than_the_registry_keeps_is_cut_at_a_section_and_says_where_the_rest_is():
    card = model_card(CHOICE, TEST, INFO, SOURCES)
    assert fitted(card, len(card)) == card
    cut = fitted(card, 2500)
    assert len(cut) <= 2500 and cut.rstrip().endswith("`model_card.md`.*")
    kept = cut.split("\n*The rest")[0]
    assert card.startswith(kept.rstrip()) and re.search(r"\n## \w", card[len(kept.rstrip()) :])  # a section's end
    assert "## Intended use" in cut and "## Provenance" not in cut  # the first sections kept, the last cut
