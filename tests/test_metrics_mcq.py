"""Multiple-choice scoring: Wilson intervals against the closed form and their coverage, option parsing, accuracy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gx_ray.metrics.mcq import mcq_metrics, option_letter, parse_choice, wilson_interval


def _wilson_closed_form(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson (1927): (p + z²/2n ± z √(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n), (centre + spread) / (1 + z * z / n)


def test_wilson_intervals_match_the_closed_form_on_many_counts():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 2000))
        k = int(rng.integers(0, n + 1))
        assert wilson_interval(k, n) == pytest.approx(_wilson_closed_form(k, n), abs=1e-9)
    assert all(math.isnan(v) for v in wilson_interval(0, 0))  # no questions, no interval
    with pytest.raises(ValueError, match="0 <= correct <= total"):
        wilson_interval(5, 4)


def test_wilson_intervals_cover_the_true_rate_about_95_percent_of_the_time():
    """At CT-Bench's cell sizes (50-200 questions), around chance and around a good model's accuracy."""
    rng = np.random.default_rng(1)
    for rate in (0.25, 0.6):
        for n in (50, 200):
            draws = rng.binomial(n, rate, 4000)
            covered = np.mean([lo <= rate <= hi for lo, hi in (wilson_interval(int(k), n) for k in draws)])
            assert 0.93 <= covered <= 0.975, (rate, n, covered)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("B", 1),
        ("(c)", 2),
        ("D. a 3 cm mass in the antrum", 3),
        ("A) thickened wall", 0),
        ("The answer is C.", 2),
        ("Answer: (B)", 1),
        ("option d", 3),
        ("E", None),  # a fifth letter with four options
        ("I think it is a mass", None),  # "I" and "a" are words, not options
        ("", None),
        (None, None),
    ],
)
def test_free_text_answers_name_their_option_or_none(text, expected):
    assert parse_choice(text, options=4) == expected


def test_accuracy_counts_unreadable_answers_as_wrong_and_reports_them_apart():
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        answers = rng.integers(0, 4, n).tolist()
        chosen = [None if rng.random() < 0.1 else int(c) for c in rng.integers(0, 4, n)]
        m = mcq_metrics(chosen, answers)
        correct = sum(c == a for c, a in zip(chosen, answers, strict=True))
        assert m["accuracy"] == pytest.approx(100 * correct / n)
        assert m["parse_failure_rate"] == pytest.approx(100 * chosen.count(None) / n)
        assert m["accuracy_ci_low"] <= m["accuracy"] <= m["accuracy_ci_high"]
    assert all(math.isnan(v) for v in mcq_metrics([], []).values())
    assert [option_letter(i) for i in range(4)] == ["A", "B", "C", "D"]
    with pytest.raises(ValueError, match="3 choices for 2 questions"):
        mcq_metrics([0, 1, 2], [0, 1])
