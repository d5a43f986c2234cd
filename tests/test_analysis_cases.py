"""Rescoring a trial on resampled test patients: on all patients it gives the task's own metric, and pairing aligns
two trials on the same patients."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gx_ray.analysis.cases import (
    NO_VARIATION,
    ONE_ANSWER,
    BootstrapJob,
    CaseScorer,
    bootstrap_job,
    case_scorer,
    one_answer,
)
from gx_ray.metrics.classification import classification_metrics
from gx_ray.metrics.detection import detection_metrics
from gx_ray.metrics.retrieval import retrieval_metrics
from gx_ray.metrics.text import text_generation_metrics
from gx_ray.schema import STAGE_GROUPS

RNG = np.random.default_rng(0)


def _stage_records(n: int = 24) -> list[dict]:
    labels = np.arange(n) % 4
    logits = RNG.normal(size=(n, 4)) + 2.0 * np.eye(4)[labels]
    probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return [
        {"case_id": f"c{i:02d}", "prediction": "I", "target": STAGE_GROUPS[labels[i]], "probabilities": p.tolist()}
        for i, p in enumerate(probabilities)
    ] + [{"case_id": "unlabelled", "prediction": "I", "target": None, "probabilities": [0.25] * 4}]


def test_stage_scorer_on_every_patient_is_the_task_metric():
    records = _stage_records()
    scorer = case_scorer("stage_classification", records, "auc")
    known = records[:-1]
    expected = classification_metrics(
        np.array([r["probabilities"] for r in known]), np.array([STAGE_GROUPS.index(r["target"]) for r in known])
    )["auc"]
    assert "unlabelled" not in scorer.case_ids
    assert scorer.score(np.arange(len(scorer.case_ids))) == pytest.approx(expected)
    # a resample holding one class has no AUC: NaN, which the bootstrap drops
    assert np.isnan(scorer.score(np.zeros(5, dtype=int)))


def test_vqa_accuracy_pools_every_question_of_a_resampled_patient():
    records = [
        {"case_id": "a", "question": "q1", "category": "lesion", "prediction": "yes", "target": "yes"},
        {"case_id": "a", "question": "q2", "category": "staging", "prediction": "T2", "target": "T3"},
        {"case_id": "b", "question": "q1", "category": "lesion", "prediction": "no", "target": "no"},
    ]
    scorer = case_scorer("vqa", records, "accuracy")
    assert scorer.case_ids == ["a", "b"]
    assert scorer.score(np.array([0, 1])) == pytest.approx(200 / 3)
    assert scorer.score(np.array([1, 1])) == pytest.approx(100.0)
    assert case_scorer("vqa", records, "accuracy_staging").score(np.array([0])) == pytest.approx(0.0)
    assert case_scorer("vqa", records, "auc") is None  # answers carry no probabilities


def test_report_scorer_agrees_with_the_corpus_metric():
    references = ["a 3 cm ulcerated mass in the gastric antrum", "thickened wall of the lesser curvature", "no mass"]
    generated = ["a 3 cm mass in the antrum", "thickened gastric wall", "a small mass"]
    records = [
        {"case_id": f"r{i}", "prediction": g, "target": r}
        for i, (g, r) in enumerate(zip(generated, references, strict=True))
    ]
    for metric in ("rouge_l", "bleu_4"):
        scorer = case_scorer("report_generation", records, metric)
        expected = text_generation_metrics(generated, references, "en", [metric])[metric]
        assert scorer.score(np.arange(3)) == pytest.approx(expected)


def test_retrieval_ranks_resampled_queries_against_the_whole_gallery():
    image = RNG.normal(size=(12, 8))
    text = image + RNG.normal(scale=1.0, size=(12, 8))
    records = [
        {"case_id": f"r{i}", "image_embedding": image[i].tolist(), "text_embedding": text[i].tolist()}
        for i in range(12)
    ]
    for metric, similarity in (
        ("image_to_text_recall_at_5", image @ text.T),
        ("text_to_image_mean_rank", text @ image.T),
    ):
        scorer = case_scorer("retrieval", records, metric)
        name = metric.split("_to_")[1].split("_", 1)[1]
        assert scorer.score(np.arange(12)) == pytest.approx(retrieval_metrics(similarity)[name])
        # a query drawn twice counts twice; the gallery stays all twelve items
        one = retrieval_metrics(similarity[[3, 3]], np.eye(12, dtype=bool)[[3, 3]])[name]
        assert scorer.score(np.array([3, 3])) == pytest.approx(one)


def test_detection_scorer_agrees_with_the_metric():
    records, predictions, targets = [], [], []
    for i in range(6):
        target = np.array([4, 10, 10, 12, 30, 30]) + i
        box = target + np.array([0, 1, 0, 0, 1, 0]) * (i % 3) * 4
        records.append({"case_id": f"d{i}", "prediction": {"boxes": [box.tolist()], "scores": [0.9 - i / 10]},
                        "target": target.tolist()})  # fmt: skip
        predictions.append({"boxes": box[None].astype(float), "scores": np.array([0.9 - i / 10])})
        targets.append({"boxes": target[None].astype(float)})
    scorer = case_scorer("lesion_detection", records, "ap_50")
    assert scorer.score(np.arange(6)) == pytest.approx(detection_metrics(predictions, targets)["ap_50"])


def test_aligned_pairs_two_trials_on_the_same_patients():
    records = _stage_records()
    shuffled = [records[i] for i in RNG.permutation(len(records))]
    first, second = (
        case_scorer("stage_classification", records, "auc"),
        case_scorer("stage_classification", shuffled, "auc"),
    )
    common = sorted(first.case_ids)
    draw = RNG.integers(0, len(common), size=len(common))
    assert first.aligned(common)(draw) == pytest.approx(second.aligned(common)(draw))


@pytest.mark.parametrize("metric", ["ap_50", "ap_75", "map_50_95", "f1_50", "loc_acc_50"])
def test_detection_scorer_matches_once_and_agrees_on_random_resamples(metric):
    """The scorer matches every case once and re-accumulates per resample: on 40 random resamples (repeats
    included) of random cases it gives what matching the resampled cases afresh gives."""
    rng = np.random.default_rng(3)
    records, predictions, targets = [], [], []
    for i in range(12):
        target = np.concatenate([rng.integers(0, 20, 3), rng.integers(24, 40, 3)]).astype(float)
        boxes = target + rng.normal(0, 3, (int(rng.integers(0, 4)), 6))
        scores = rng.random(len(boxes))
        records.append({"case_id": f"d{i}", "prediction": {"boxes": boxes.tolist(), "scores": scores.tolist()},
                        "target": target.tolist()})  # fmt: skip
        predictions.append({"boxes": boxes.reshape(-1, 6), "scores": scores})
        targets.append({"boxes": target[None]})
    scorer = case_scorer("lesion_detection", records, metric)
    for _ in range(40):
        indices = rng.integers(0, 12, 12)
        expected = detection_metrics([predictions[i] for i in indices], [targets[i] for i in indices])[metric]
        assert scorer.score(indices) == pytest.approx(expected, nan_ok=True)


def test_stage_records_with_nan_probabilities_are_refused_not_scored_as_nan():
    records = [
        {"case_id": f"c{i}", "probabilities": [0.25, 0.25, 0.25, 0.25], "target": STAGE_GROUPS[i % 4]} for i in range(6)
    ]
    records[3]["probabilities"] = [float("nan"), 0.5, 0.25, 0.25]
    with pytest.raises(ValueError, match=r"probabilities\[3, 0\] is nan"):
        case_scorer("stage_classification", records, "auc")


def test_one_answer_for_all_is_told_from_the_predictions():
    """One report for every patient, one stage for every patient, one answer to each VQA question for every patient:
    degenerate. Two reports, or two answers to one question, are not; a question asked of one patient cannot tell."""
    references = ["a 3 cm ulcerated mass in the antrum", "thickened wall", "no mass seen", "a mass of the body"]
    same = [{"case_id": f"r{i}", "prediction": "a mass in the stomach", "target": r} for i, r in enumerate(references)]
    assert case_scorer("report_generation", same, "rouge_l").one_answer
    varied = [dict(r, prediction=r["target"]) for r in same]
    assert not case_scorer("report_generation", varied, "rouge_l").one_answer
    assert case_scorer("stage_classification", _stage_records(), "auc").one_answer  # "I" for everyone
    questions = [
        {"case_id": c, "question": q, "category": "lesion", "prediction": a, "target": "yes"}
        for c in ("a", "b", "c") for q, a in (("q1", "yes"), ("q2", "T2"))
    ]  # fmt: skip
    assert case_scorer("vqa", questions, "accuracy").one_answer
    questions[0]["prediction"] = "no"
    assert not case_scorer("vqa", questions, "accuracy").one_answer
    assert not one_answer([{"case_id": "a", "prediction": "x"}]) and not one_answer([{"case_id": "a"}] * 2)


def _job(arm_a, arm_b) -> BootstrapJob:
    return BootstrapJob(arms=[arm_a, arm_b], family=3)


def test_smallest_detectable_says_why_it_is_undefined_instead_of_a_number():
    """Every patient's AP 0 in both arms: the difference never varies and its "smallest detectable" would read 0.00.
    A report model writing one report for all: ROUGE-L still varies with the references (the number read 0.27). Both
    rows get NaN and the words; a model that varies gets its number."""
    zeros = [CaseScorer([f"p{i}" for i in range(30)], lambda idx: 0.0 * len(idx)) for _ in range(3)]
    flat = bootstrap_job(_job(zeros, zeros), 400)
    assert math.isnan(flat["mde"]) and flat["mde_note"] == NO_VARIATION == "undefined: no variation"
    rng = np.random.default_rng(3)
    references = [" ".join(rng.choice(["mass", "wall", "antrum", "ulcer", "node"], 6)) for _ in range(30)]
    one = [{"case_id": f"p{i}", "prediction": "a mass in the antrum", "target": r} for i, r in enumerate(references)]
    learnt = [[dict(r, prediction=" ".join(rng.permutation(r["target"].split()))) for r in one] for _ in range(3)]
    degenerate = [case_scorer("report_generation", one, "rouge_l")] * 3
    trained = [case_scorer("report_generation", records, "rouge_l") for records in learnt]
    row = bootstrap_job(_job(trained, degenerate), 400)
    assert row["se_patients"] > 0 and math.isnan(row["mde"]) and row["mde_note"] == ONE_ANSWER
    assert ONE_ANSWER == "degenerate: one answer for all"
    fine = bootstrap_job(_job(trained, trained[::-1]), 400)
    assert fine["mde"] > 0 and "mde_note" not in fine
