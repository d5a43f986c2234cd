"""Multiple-choice scoring: Wilson intervals against the closed form and their coverage, option parsing, accuracy."""

from __future__ import annotations

import math
import string

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


# --------------------------------------------------------------------------------------------------------------
# parse_choice on generated answers: two options named, the article "a", Unicode letters

PARSE_CASES = 400
LETTERS = "ABCDEF"
TWO_OPTIONS = [
    "{x} or {y}", "{x} and {y}", "{x}, {y}", "{x}/{y}", "either {x} or {y}", "The answer is {x} or {y}.",
    "The answer is {x} or {y}", "Both {x} and {y} are correct.", "Options {x} and {y}", "Option {x} or option {y}.",
    "{x} or maybe {y}", "I would say {x}, or possibly {y}.", "{x} and {y} are both plausible",
    "It is between {x} and {y}.", "{x}–{y}", "{x} (or {y})", "The correct answer is {x}, or perhaps {y}, I think",
    "{x} & {y}", "{x} vs {y}", "{x}; {y}", "Answer: {x}, {y}", "{x}. Or {y}.", "Could be {x} or {y}, hard to say.",
    "{x}, {y} or {z}", "{x}, {y}, and {z}", "{x} is likely, but {y} is also possible.", "Not sure: {x} or {y}?",
    "either {x}\nor {y}", "{x}\n{y}", "{x} seems right, {y} too", "Answer: {x}\nFinal answer: {y}",
]  # fmt: skip
ONE_OPTION_TWICE = [
    "{x}. {x} is correct", "The answer is {x}. {x} is correct.", "{x}, definitely {x}", "{x} ({x})", "{x} or {x}",
    "Answer: {x}\nFinal answer: {x}", "Option {x}, i.e. {x}",
]  # fmt: skip
NOISE = ["", "There is a mass in the antrum. ", "I think ", "A careful look helps. ", "Hmm, a hard case: "]


def _render_letter(rng: np.random.Generator, letter: str) -> str:
    """One way a model writes an option letter: either case, bracketed, with ")", in bold, quoted or full width."""
    forms = ["{L}", "{l}", "({L})", "({l})", "{L})", "{l})", "[{L}]", "**{L}**", "'{l}'", '"{L}"', "{W}", "（{W}）"]
    form = str(rng.choice(forms))
    return form.format(L=letter, l=letter.lower(), W=chr(ord(letter) - ord("A") + ord("Ａ")))


def test_an_answer_naming_two_options_names_none_and_one_named_twice_is_that_one():
    for case in range(PARSE_CASES):
        rng = np.random.default_rng([30, case])
        options = int(rng.integers(3, 7))
        x, y, z = (str(letter) for letter in rng.choice(list(LETTERS[:options]), 3, replace=False))
        noise = str(rng.choice(NOISE))
        letters = {"x": _render_letter(rng, x), "y": _render_letter(rng, y), "z": _render_letter(rng, z)}
        two = noise + str(rng.choice(TWO_OPTIONS)).format(**letters)
        assert parse_choice(two, options) is None, (case, two)
        twice = noise + str(rng.choice(ONE_OPTION_TWICE)).format(x=letters["x"])
        assert parse_choice(twice, options) == LETTERS.index(x), (case, twice)


ARTICLE_SENTENCES = [
    "The answer is a {np}.", "There is a {np} in the {site}.", "A {np} is seen in the {site}.", "It looks like a {np}.",
    "I think it is a {np}", "Answer: a {np}", "a {np}", "Most likely a {np} of the {site}", "The answer is a {np}",
    "A {np}.", "The answer is: a {np} in the {site}",
]  # fmt: skip
NOUN_PHRASES = ["lesion", "3 cm mass", "thickened wall", "large ulcer", "Borrmann type lesion", "polyp", "CT finding"]
SITES = ["antrum", "body", "cardia", "fundus", "lesser curvature"]
MARKED = ["({l})", "{L}", "{l}.", "option {l}", "{L})", "{l}"]  # the last as the text's end
LETTER_A = [
    "a", "A", "(a)", "a)", "a.", "option a", "The answer is a", "answer: a", "The answer is (a).", "A is correct",
    "The answer is A based on the wall", "I choose A for this case",  # "A" capitalised inside a sentence
]  # fmt: skip


def test_the_article_a_is_no_option_and_a_marked_letter_still_is():
    for case in range(PARSE_CASES):
        rng = np.random.default_rng([31, case])
        sentence = str(rng.choice(ARTICLE_SENTENCES)).format(np=rng.choice(NOUN_PHRASES), site=rng.choice(SITES))
        assert parse_choice(sentence, 4) is None, (case, sentence)
        letter = str(rng.choice(list("ABCD")))
        marked = str(rng.choice(MARKED)).format(L=letter, l=letter.lower())
        for text in (f"{sentence} Answer: {marked}", f"{marked.rstrip('.')}. {sentence}"):
            assert parse_choice(text, 4) == "ABCD".index(letter), (case, text)
        assert parse_choice(str(rng.choice(LETTER_A)), 4) == 0


def _unicode_letters() -> list[str]:
    """Every character outside ASCII that NFKC-normalises, case-folds, or upper- or lower-cases into an ASCII letter
    (the Kelvin sign, the long s, full-width, circled and mathematical letters, ...), and 400 other letters."""
    import sys
    import unicodedata

    lookalikes, others = [], []
    for code in range(0x80, sys.maxunicode + 1):
        char = chr(code)
        if not unicodedata.category(char).startswith("L") and not unicodedata.normalize("NFKC", char).isalpha():
            continue
        forms = {unicodedata.normalize("NFKC", char), char.casefold(), char.lower(), char.upper()}
        (lookalikes if any(f.isascii() and f.isalpha() for f in forms) else others).append(char)
    rng = np.random.default_rng(32)
    return lookalikes + [str(c) for c in rng.choice(others, 400, replace=False)]


def test_unicode_letters_read_as_their_nfkc_letter_or_as_no_option_and_never_raise():
    import unicodedata

    letters = _unicode_letters()
    assert "\u212a" in letters and "\u017f" in letters and "Ｂ" in letters and len(letters) > 1000
    templates = ["{c}", "({c})", "The answer is {c}.", "Answer: {c}", "option {c}", "{c})"]
    for i, char in enumerate(letters):
        options = 4 + i % 20  # up to 23 options: letters beyond D matter too
        text = templates[i % len(templates)].format(c=char)
        normal = unicodedata.normalize("NFKC", char).strip("()")
        # NFKC (see parse_choice): the letter it stands for when that is one ASCII letter; any other is no option
        ascii_letter = len(normal) == 1 and normal in string.ascii_letters
        expected = string.ascii_uppercase.index(normal.upper()) if ascii_letter else None
        assert parse_choice(text, options) == (expected if expected is not None and expected < options else None), (
            hex(ord(char)),
            text,
        )


def test_long_answers_are_read_in_linear_time():
    """Whitespace runs after a letter once made the end-of-line rule backtrack quadratically (5 s for 5,000 spaces)."""
    import time

    started = time.perf_counter()
    for text in ("a" + " " * 50_000 + "x", ("a " + " " * 100) * 500, "There is a mass. " * 3000 + "Answer: (b)"):
        parse_choice(text, 4)
    assert time.perf_counter() - started < 1.0
