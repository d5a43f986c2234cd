"""Chance levels (:meth:`gx_ray.tasks.base.Task.chance_level`): what a predictor that never looks at the patient
scores, checked against simulations of that predictor on many random cohorts, and the report targets it shares
with the metric."""

from __future__ import annotations

import numpy as np
import pytest

from gx_ray.metrics import detection_metrics, retrieval_metrics, text_generation_metrics
from gx_ray.modalities.boxes import TARGET_LEVEL, TARGET_PHASE
from gx_ray.models.text import offline_tokenizer
from gx_ray.schema import BOX_LEVELS, PHASES, STAGE_GROUPS
from gx_ray.tasks import build_task

COHORTS = range(12)


@pytest.mark.parametrize("seed", COHORTS)
def test_stage_chance_is_50_whatever_the_stage_mix(seed):
    rng = np.random.default_rng(seed)
    mix = rng.dirichlet(np.ones(len(STAGE_GROUPS)))
    rows = [{"stage_label": int(rng.choice(len(STAGE_GROUPS), p=mix))} for _ in range(60)] + [{"stage_label": -1}]
    task = build_task("stage_classification")
    assert task.chance_level(rows[:40], rows[40:]) == pytest.approx(50.0)


@pytest.mark.parametrize("seed", COHORTS)
def test_retrieval_chance_is_the_mean_of_random_rankings(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 40))
    test = [{"ct_report": f"report {i}"} for i in range(n)] + [{"ct_report": None}]  # no report: not a query
    task = build_task("retrieval")
    chance = task.chance_level([], test)
    simulated = np.mean([retrieval_metrics(rng.random((n, n)))["recall_at_5"] for _ in range(4000)])
    assert chance == pytest.approx(100.0 * min(5, n) / n)
    assert chance == pytest.approx(simulated, abs=2.0)


def random_vqa_rows(rng: np.random.Generator, cases: int, split: str) -> list[dict]:
    """Questions with 1-4 possible answers each, some asked only in the test split."""
    answers = {f"q{k}": [f"a{k}.{j}" for j in range(1 + k % 4)] for k in range(8)}
    asked = list(answers) if split == "test" else list(answers)[:6]
    return [
        {
            "split": split,
            "vqa": [
                {"question": q, "answer": str(rng.choice(answers[q])), "category": "lesion"}
                for q in rng.choice(asked, size=3)
            ],
        }
        for _ in range(cases)
    ]


@pytest.mark.parametrize("seed", COHORTS)
def test_vqa_chance_is_the_accuracy_of_guessing_among_the_question_s_training_answers(seed):
    rng = np.random.default_rng(seed)
    train, test = random_vqa_rows(rng, 30, "train"), random_vqa_rows(rng, 20, "test")
    task = build_task("vqa")
    task.prepare(train)
    options = {}
    for row in train:
        for item in row["vqa"]:
            options.setdefault(item["question"], set()).add(item["answer"])
    everything = sorted(set().union(*options.values()))
    items = [item for row in test for item in row["vqa"]]
    hits = [rng.choice(sorted(options.get(item["question"], everything)), size=500) == item["answer"] for item in items]
    assert task.chance_level(train, test) == pytest.approx(100.0 * np.mean(hits), abs=1.5)


def box_row(box: list[float] | None) -> dict:
    boxes = np.zeros((len(PHASES), len(BOX_LEVELS), 6))
    present = np.zeros((len(PHASES), len(BOX_LEVELS)), dtype=bool)
    if box is not None:
        phase, level = PHASES.index(TARGET_PHASE), BOX_LEVELS.index(TARGET_LEVEL)
        boxes[phase, level], present[phase, level] = box, True
    return {"split": "train", "boxes": boxes.ravel().tolist(), "box_present": present.ravel().tolist()}


@pytest.mark.parametrize("seed", COHORTS)
def test_detection_chance_scores_the_median_training_box_on_every_test_case(seed):
    rng = np.random.default_rng(seed)

    def boxes(n: int) -> np.ndarray:
        start = rng.integers(0, 20, size=(n, 3))
        return np.concatenate([start, start + rng.integers(3, 9, size=(n, 3))], axis=1).astype(float)

    train, test = boxes(25), boxes(15)
    task = build_task("lesion_detection")
    chance = task.chance_level([box_row(list(b)) for b in train] + [box_row(None)], [box_row(list(b)) for b in test])
    median = {"boxes": np.median(train, axis=0)[None], "scores": np.ones(1)}
    expected = detection_metrics([median] * len(test), [{"boxes": b[None]} for b in test])["ap_50"]
    assert chance == pytest.approx(expected)
    # the same box in every case: the median is that box, found everywhere
    same = [box_row([4, 5, 6, 10, 12, 14])] * 5
    assert task.chance_level(same, same) == pytest.approx(100.0)


@pytest.fixture(scope="module")
def report_task():
    task = build_task("report_generation", max_report_tokens=12)
    task.tokenizer = offline_tokenizer()  # what build_head sets
    return task


def test_report_targets_are_the_taught_tokens_cut_in_the_original_text(report_task):
    long = "The Gastric Wall is thickened, measuring 12.5 mm; three enlarged perigastric nodes are seen nearby."
    short = "No lesion."
    cut, whole, none = report_task.target_texts([long, short, None])
    assert whole == short and none is None
    assert long.startswith(cut) and len(cut) < len(long)
    tokens = report_task.tokenizer(cut)["input_ids"]
    assert len(tokens) == report_task.max_report_tokens  # [CLS], ten tokens, [SEP]: the budget, no more
    assert cut == long[: len(cut)] and not cut.endswith(" ")


def test_report_chance_is_the_most_typical_training_report_written_for_everyone(report_task):
    """Brute force over the same seeded sample, on random cohorts: the chance level is the test score of the training
    report with the highest mean score against the sample, written for every test case."""
    from gx_ray.tasks.report_generation import TYPICAL_SAMPLE

    def rouge(generated: list[str], references: list[str]) -> float:
        return text_generation_metrics(generated, references, metrics=["rouge_l"])["rouge_l"]

    rng = np.random.default_rng(0)
    words = ["wall", "thick", "node", "liver", "antrum", "body", "mm", "no", "ascites", "seen"]
    for _ in range(3):
        reports = [" ".join(rng.choice(words, size=int(rng.integers(4, 10)))) for _ in range(50)]
        train = [{"split": "train", "ct_report": r} for r in reports[:40]]
        test = [{"split": "test", "ct_report": r} for r in reports[40:]] + [{"split": "test", "ct_report": None}]
        cut = report_task.target_texts(reports[:40])
        sample = [cut[i] for i in np.random.default_rng(0).choice(40, TYPICAL_SAMPLE, replace=False)]
        typical = max(sample, key=lambda c: rouge([c] * len(sample), sample))
        references = report_task.target_texts(reports[40:])
        assert report_task.chance_level(train, test) == pytest.approx(rouge([typical] * 10, references))
    identical = [{"split": "train", "ct_report": reports[0]}] * 3
    assert report_task.chance_level(identical, identical) == pytest.approx(100.0)
