"""Multiple-choice scoring: accuracy with a Wilson 95 % interval, and a parse-failure rate kept apart from it.

CT-Bench reports each task's accuracy with a binomial 95 % interval (chance with four options: 25 %). The interval is
Wilson's score interval (``scipy.stats.binomtest(...).proportion_ci(method="wilson")``), which stays inside [0, 1]
and keeps its coverage at the small counts of a per-task, per-condition cell, where the normal approximation
does not.

A model that answers in free text (a VLM) may name no option at all: :func:`parse_choice` reads the option letter,
and an answer it cannot read counts as wrong *and* as a parse failure, reported beside the accuracy, so that a
format failure (CT-Bench's fine-tuned RadFM scoring 0.0 everywhere) is not mistaken for not knowing.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence

MCQ_METRICS: tuple[str, ...] = ("accuracy", "accuracy_ci_low", "accuracy_ci_high", "parse_failure_rate")


def wilson_interval(correct: int, total: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for ``correct`` of ``total`` as proportions; (nan, nan) when ``total`` is 0."""
    if not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total, got {correct} of {total}")
    if total == 0:
        return math.nan, math.nan
    from scipy.stats import binomtest  # on first use, as the package's other heavy imports

    interval = binomtest(correct, total).proportion_ci(confidence_level=confidence, method="wilson")
    return float(interval.low), float(interval.high)


def option_letter(index: int) -> str:
    return string.ascii_uppercase[index]


_LETTER = r"([A-Z])"
_PATTERNS = (
    re.compile(rf"^\s*\(?{_LETTER}\)?\s*(?:[.:)\]]|$)", re.IGNORECASE),  # "B", "(B)", "B.", "B) ...", "B: ..."
    re.compile(rf"\b(?:answer|option|choice)\s*(?:is|:)?\s*\(?{_LETTER}\)?(?![A-Za-z])", re.IGNORECASE),
)


def parse_choice(text: str | None, options: int = 4) -> int | None:
    """The option index a free-text answer names ("B", "(B)", "B. a 3 cm mass", "The answer is C"), or None when
    it names none of the first ``options`` letters (or names a letter beyond them)."""
    if text is None:
        return None
    for pattern in _PATTERNS:
        match = pattern.search(text)
        if match:
            index = string.ascii_uppercase.index(match.group(1).upper())
            return index if index < options else None
    return None


def mcq_metrics(chosen: Sequence[int | None], answers: Sequence[int], confidence: float = 0.95) -> dict[str, float]:
    """Accuracy (%) with its Wilson interval (%) and the parse-failure rate (%): ``chosen[i]`` is the option picked
    for question ``i`` (None: the answer named no option), ``answers[i]`` the right one. NaN for no questions."""
    if len(chosen) != len(answers):
        raise ValueError(f"{len(chosen)} choices for {len(answers)} questions")
    total = len(answers)
    correct = sum(1 for c, a in zip(chosen, answers, strict=True) if c is not None and c == a)
    low, high = wilson_interval(correct, total, confidence)
    failures = sum(1 for c in chosen if c is None)
    return {
        "accuracy": 100.0 * correct / total if total else math.nan,
        "accuracy_ci_low": 100.0 * low,
        "accuracy_ci_high": 100.0 * high,
        "parse_failure_rate": 100.0 * failures / total if total else math.nan,
    }
