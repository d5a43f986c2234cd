"""The registered model's card, in the sections of a model card (Mitchell et al., FAccT 2019; Hugging Face's
template) as Markdown that MLflow's registry page renders: intended and out-of-scope use, training data, evaluation
(the test figure beside chance, the naive best validation score beside its selection-corrected estimate), a warning
when the model is degenerate, limitations, preprocessing, the configurations compared and where the model came from.

Built from plain dicts (finalize's choice, test and bundle info), so a card can be written and checked without a
sweep. :func:`fitted` cuts a card at a section boundary to what a store keeps (a version's description: 5,000
characters in MLflow's SQL schema).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from gx_ray.analysis.runs import higher_is_better

DESCRIPTION_LIMIT = 5000
"""MLflow's SQL stores keep a model version's description in 5,000 characters (a run tag in 8,000)."""
SMOKE_PRESET = "smoke"
METHODS = {
    "bbc-cv": "BBC-CV (Tsamardinos et al., 2018) over every configuration's out-of-fold predictions",
    "select-then-score": "a bootstrap over the validation patients of choosing the best and scoring it",
}


def _number(value: Any, digits: int = 2) -> str:
    return "—" if value is None or not math.isfinite(float(value)) else f"{float(value):.{digits}f}"


def answers_given(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """How many distinct answers the test predictions gave (the most frequent, its count, of how many records and
    patients); None where a prediction is not one answer (boxes, embeddings)."""
    given = [r.get("prediction") for r in records]
    if not given or not all(isinstance(a, str | int) for a in given):
        return None
    (most, count), *_ = Counter(given).most_common(1)
    patients = len({str(r.get("case_id")) for r in records})
    return {"distinct": len(set(given)), "most": most, "count": count, "records": len(given), "patients": patients}


def degenerate(test: dict[str, Any]) -> list[str]:
    """Why the tested model tells nothing, in sentences: one answer for every test patient, or a test interval
    that does not clear chance (empty: neither)."""
    said = []
    answers = test.get("answers")
    if answers and answers["distinct"] == 1 and answers["records"] > 1:
        what = str(answers["most"])
        what = what if len(what) <= 40 else what[:37] + "..."
        whom = (f"all {answers['records']} test patients" if answers["records"] == answers["patients"]
                else f"all {answers['records']} test questions of {answers['patients']} patients")  # fmt: skip
        said.append(f"It gave one answer ({what}) for {whom}: it does not tell them apart.")
    chance, value = test.get("chance"), test.get("value")
    if chance is None or value is None or not math.isfinite(value) or not math.isfinite(chance):
        return said
    higher = higher_is_better(test["metric"])
    low, high = test.get("low"), test.get("high")
    has_interval = low is not None and high is not None and math.isfinite(low) and math.isfinite(high)
    bound = (low if higher else high) if has_interval else value  # the interval's end nearest chance
    if (bound <= chance) if higher else (bound >= chance):
        interval = f" [{low:.2f}, {high:.2f}]" if has_interval else ""
        said.append(f"Its test {test['metric']} {value:.2f}{interval} does not clear chance ({chance:.2f}): no "
                    "better than chance.")  # fmt: skip
    return said


def _title(choice: dict[str, Any], test: dict[str, Any], info: dict[str, Any], sources: list[dict]) -> list[str]:
    # the configuration below the heading: MLflow's registry page draws a wrapped heading's lines over each other
    lines = [f"# gx-ray {choice['label']}", "", f"**Configuration:** {choice['description']}", ""]
    if warnings := degenerate(test):
        lines += ["> **Warning: a degenerate model.** " + " ".join(warnings), ""]
    chance = f" against chance {_number(test.get('chance'))}" if test.get("chance") is not None else ""
    members = f"{len(sources)} member{'s' if len(sources) > 1 else ''}"
    lines += [
        f"From sweep `{info['sweep_id']}`: validation {choice['metric']} {_number(choice['score'])} over "
        f"{choice['repeats']} seed{'s' if choice['repeats'] > 1 else ''}; {choice['final_model']} ({members}); "
        f"test {test['metric']} {_number(test.get('value'))}{_interval(test)}{chance}.",
        "",
    ]
    return lines


def _interval(test: dict[str, Any]) -> str:
    low, high = test.get("low"), test.get("high")
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return ""
    return f" (95 % CI {low:.2f} to {high:.2f})"


def _intended_use(choice: dict[str, Any], info: dict[str, Any]) -> list[str]:
    synthetic = info.get("cohort", {}).get("synthetic")
    return [
        "## Intended use",
        "",
        f"Research on the Gastric-X benchmark: {choice['label']} from the inputs of its schema, to compare input "
        "schemas, models and training recipes and to reproduce this sweep's answer. **For research use only. Not a "
        "medical device**: not validated clinically, cleared or approved by any regulator.",
        "",
        "### Out-of-scope use",
        "",
        "- Any decision about a patient's diagnosis, staging or treatment.",
        "- Patients unlike the training cohort (other scanners, protocols, hospitals or populations); `predict` flags "
        "a case outside the training patients' ranges below, and still predicts it.",
        *(["- Any conclusion about real patients: it learnt from synthetic ones."] if synthetic else []),
        "",
    ]


def _training_data(choice: dict[str, Any], info: dict[str, Any]) -> list[str]:
    cohort = info.get("cohort", {})
    if cohort.get("synthetic"):
        where = "The built-in demo cohort: synthetic patients drawn by gx-ray's generator, no real patient's data."
    else:
        where = f"Cohort `{cohort.get('name') or 'unnamed'}`: real patients, prepared by `prepare_data`."
    presets = cohort.get("presets") or []
    lines = ["## Training data", "", where + (f" Sweep presets: {', '.join(presets)}." if presets else ""), ""]
    patients = cohort.get("patients") or {}
    if patients:
        folds = " (partitioned into the cross-validation folds)" if choice.get("cross_validated") else ""
        lines += [
            "| split | patients | used for |",
            "| --- | --- | --- |",
            f"| train | {patients.get('train', '—')} | training{folds} |",
            f"| validation | {patients.get('val', '—')} | choosing the configuration{folds}; the refit trains on it |",
            f"| test | {patients.get('test', '—')} | the test below, once |",
            "",
        ]
    lines += [f"Final model: {choice['final_model']}.", ""]
    lines += _ranges(info.get("training_fingerprint"))
    if cohort.get("manifest_sha256"):
        lines += [f"Cohort: shard manifest SHA-256 `{cohort['manifest_sha256'][:16]}`, fingerprint SHA-256 "
                  f"`{(cohort.get('fingerprint_sha256') or '—')[:16]}`.", ""]  # fmt: skip
    return lines


def _ranges(ranges: dict[str, Any] | None) -> list[str]:
    """The training patients' fingerprint ranges as a table (what ``predict`` checks a new case against)."""
    if not ranges:
        return []
    rows = []
    if spacing := ranges.get("spacing_zyx_mm"):
        rows += [f"| acquired spacing {axis} (mm) | {low:g} | {high:g} |"
                 for axis, low, high in zip("zyx", spacing["min"], spacing["max"], strict=True)]  # fmt: skip
    rows += [f"| {phase} mean inside the stomach (HU) | {v['min']:g} | {v['max']:g} |"
             for phase, v in ranges.get("intensity_mean_hu", {}).items()]  # fmt: skip
    return [f"Training patients' ranges ({ranges.get('cases', '?')} cases):", "",
            "| fingerprint | min | max |", "| --- | --- | --- |", *rows, ""]  # fmt: skip


def _evaluation(choice: dict[str, Any], test: dict[str, Any]) -> list[str]:
    lines = [
        "## Evaluation",
        "",
        "The held-out test split, scored once by the final model from its stored predictions (full precision), with "
        "a 95 % percentile bootstrap over patients; chance: the primary metric of a predictor that never looks at the "
        "patient.",
        "",
        "| metric | test | 95 % CI | chance | patients |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, score in {test["metric"]: test, **(test.get("metrics") or {}), test["metric"]: test}.items():
        chance = _number(test.get("chance")) if name == test["metric"] else "—"
        ci = f"{_number(score.get('low'))} to {_number(score.get('high'))}" if score.get("low") is not None else "—"
        lines.append(f"| {name} | {_number(score.get('value'))} | {ci} | {chance} | {score.get('cases', '—')} |")
    lines += ["", *_selection(choice), ""]
    return lines


def _selection(choice: dict[str, Any]) -> list[str]:
    """The choice, the naive best validation score and its selection-corrected estimate, in sentences."""
    ranked = choice.get("ranked") or []
    lines = [
        f"**The choice.** {len(ranked)} configuration{'s' if len(ranked) != 1 else ''} compared. Rule: "
        f"{choice['rule']}. The chosen one's validation {choice['metric']}: {_number(choice['score'])}."
    ]
    if one_se := choice.get("one_se"):
        lines[0] += " " + one_se_sentence(one_se)
    selection = choice.get("selection") or {}
    if "corrected" not in selection:
        return [*lines, "", f"**Selection.** {selection.get('note', 'no selection-corrected estimate')}."]
    same = selection.get("indistinguishable") or []
    lines += [
        "",
        f"**Selection.** The best validation {choice['metric']}, {_number(selection['naive'])}, is the largest of "
        f"{selection['configurations']} noisy estimates{_best_here(choice, selection)}, so optimistic (the "
        f"winner's curse). Corrected for that "
        f"selection by {METHODS.get(selection['method'], selection['method'])}: **{_number(selection['corrected'])}** "
        f"(95 % CI {_number(selection['low'])} to {_number(selection['high'])}; {selection['patients']} validation "
        f"patients, {selection['resamples']} resamples): what to expect of the chosen configuration on new patients. "
        f"Indistinguishable from the best (paired over the same patients): {len(same)} of "
        f"{selection['configurations']} ({'; '.join(same) if len(same) <= 5 else 'see the table below'}).",
    ]
    if one_se:
        lines[-1] += " (The estimate is of choosing the best; the one-SE choice trades less than its noise for cost.)"
    return lines


def _best_here(choice: dict[str, Any], selection: dict[str, Any]) -> str:
    """Whose the naive best is, where that is not the chosen configuration (the one-SE rule chose another, or the
    stored validation predictions rank another first)."""
    return "" if selection.get("chosen") in (None, choice["description"]) else f" ({selection['chosen']}'s)"


def one_se_sentence(one_se: dict[str, Any]) -> str:
    """Why the one-standard-error rule chose what it chose."""
    return (
        f"One-standard-error rule: the cheapest configuration (mean trial time) whose mean is within one SE of the "
        f"best's: {one_se['chosen']} ({_number(one_se['score'])}, {one_se['seconds']:.0f} s) against the best, "
        f"{one_se['best']} ({_number(one_se['best_score'])}, {one_se['best_seconds']:.0f} s); SE "
        f"{_number(one_se['se'])} ({one_se['se_from']})."
    )


def _limitations(choice: dict[str, Any], test: dict[str, Any], info: dict[str, Any]) -> list[str]:
    cohort = info.get("cohort", {})
    said = degenerate(test)
    if cohort.get("synthetic"):
        said.append("Trained and tested on synthetic patients: its figures say how much of the generator's planted "
                    "signal the pipeline recovers, nothing about real patients.")  # fmt: skip
    if SMOKE_PRESET in (cohort.get("presets") or []):
        said.append("Trained under the smoke preset (one seed, one epoch of a few steps): a check that the pipeline "
                    "runs, not a model to use.")  # fmt: skip
    if test.get("low") is not None and math.isfinite(test.get("high") or math.nan):
        said.append(f"{test.get('cases')} test patients: the test interval is {test['high'] - test['low']:.1f} "
                    "points wide.")  # fmt: skip
    said += [
        "Tested on patients of the training cohort and its preparation (an internal test): expect less on another "
        "hospital's patients; `predict` evaluates a labelled cohort beside this test.",
        "The naive best validation score is optimistic; the selection-corrected estimate, where given, is not.",
    ]
    return ["## Limitations", "", *[f"- {s}" for s in said], ""]


def _preprocessing(info: dict[str, Any]) -> list[str]:
    inputs = info.get("inputs", {})
    rows = [(k, v) for k, v in (inputs.get("preprocess") or {}).items()]
    rows += [("CT tensor (phases, z, y, x)", inputs.get("ct_shape")),
             ("endoscopy image (channels, height, width)", inputs.get("endoscopy_shape")),
             ("lab variables", len(inputs.get("lab_names") or []))]  # fmt: skip
    cells = [f"| {k} | {', '.join(map(str, v)) if isinstance(v, list | tuple) else v} |" for k, v in rows]
    return ["## Preprocessing", "", "A new cohort is prepared with these settings (`predict` does so itself).", "",
            "| setting | value |", "| --- | --- |", *cells, ""]  # fmt: skip


def _configurations(choice: dict[str, Any]) -> list[str]:
    same = set((choice.get("selection") or {}).get("indistinguishable") or [])
    lines = ["## Configurations compared", "",
             "| rank | configuration | validation mean | sd | seeds | mean trial s | indistinguishable |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for i, row in enumerate(choice.get("ranked", [])[:10], 1):
        mark = " (chosen)" if row["description"] == choice["description"] else " (tie)" if row["tied"] else ""
        same_as_best = "yes" if row["description"] in same else ""
        lines.append(f"| {i} | {row['description']}{mark} | {_number(row['score'])} | {_number(row['sd'])} | "
                     f"{row['repeats']} | {_number(row['seconds'], 0)} | {same_as_best} |")  # fmt: skip
    return [*lines, ""]


def _provenance(info: dict[str, Any], sources: list[dict[str, Any]]) -> list[str]:
    lines = ["## Provenance", "", f"Sweep `{info['sweep_id']}`.", "", "| member | run | trial | seed | fold |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for i, s in enumerate(sources):
        fold = "—" if s.get("fold") is None else s["fold"]
        lines.append(f"| {i} | `{s.get('run_id', '')}` | {s.get('trial', 'refit')} | {s.get('seed', '—')} | {fold} |")
    return [*lines, ""]


def model_card(choice: dict[str, Any], test: dict[str, Any], info: dict[str, Any], sources: list[dict]) -> str:
    """The card in Markdown, its sections in the order a reader needs them (a cut card keeps the first)."""
    sections = [
        _title(choice, test, info, sources), _intended_use(choice, info), _training_data(choice, info),
        _evaluation(choice, test), _limitations(choice, test, info), _preprocessing(info), _configurations(choice),
        _provenance(info, sources),
    ]  # fmt: skip
    return "\n".join(line for section in sections for line in section).rstrip() + "\n"


def fitted(card: str, limit: int = DESCRIPTION_LIMIT) -> str:
    """``card`` whole where it fits in ``limit`` characters, else its first sections and a line naming the rest's
    place (the source run's ``model_card.md``)."""
    if len(card) <= limit:
        return card
    note = "\n*The rest of this card is the source run's artifact `model_card.md`.*\n"
    kept = card[: limit - len(note)]
    cut = kept.rfind("\n## ")
    return (kept[:cut] if cut > 0 else kept).rstrip() + "\n" + note
