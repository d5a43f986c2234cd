"""Multiple-choice scoring: accuracy with a Wilson 95 % interval, and a parse-failure rate kept apart from it.

CT-Bench reports each task's accuracy with a binomial 95 % interval (chance with four options: 25 %); Wilson's
score interval stays inside [0, 1] and keeps its coverage at the small counts of a per-task cell, where the normal
approximation does not. A free-text answer (a VLM) that names no option or several (:func:`parse_choice`) counts as
wrong *and* as a parse failure, so that a format failure (CT-Bench's RadFM scoring 0.0 everywhere) is not mistaken
for not knowing.
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
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


# A letter stands alone when it touches no letter or digit of an alphabetic script (CJK may touch it: "答案是B"), and
# is not part of a hyphenated or dotted word ("B-cell", "X-ray", "e.g.", "C.2").
_WORD = "0-9A-Za-z\u00c0-\u1fff"
_LETTER = re.compile(rf"(?<![{_WORD}])(?<![{_WORD}][-'.])([A-Za-z])(?![{_WORD}])(?![-'.][{_WORD}])")
_TAG = re.compile(r"</?[A-Za-z][\w-]*>")  # <answer>B</answer>: a tag ends a line
# Where "a"/"A" and "I" are options, not the article and the pronoun. After the letter: a closing mark or quote, the
# end of its line, or a word that cannot follow an article ("a or b", "A is correct", "a, b", "A (or B)").
_MARKED_AFTER = re.compile(
    r"[)\]:.*`'\"\u2019\u201d]|[.!?,;:)\]}\s]*(?:\n|$)|\s*(?:\(\s*)?(?:[,/;&|+\u2013\u2014]|(?:and|or|nor|but|vs"
    r"|versus|is|are|was|were|seems|appears|looks|because|since|as|too|also|would|could|should|might|must)(?![\w-]))",
    re.IGNORECASE,
)
# Before it (in the last few characters): an opening bracket or quote, "option"/"choice", or another letter and a
# conjunction.
_MARKED_BEFORE = re.compile(
    rf"(?:[(\[{{]|(?<![{_WORD}])[*`'\"\u2018\u201c]|\b(?:option|choice)s?\s*(?:is|[:#-]|no\.?)?"
    rf"|(?<![{_WORD}])[A-Za-z][)\].]?\s*"
    r"(?:[,/;&|+\u2013\u2014]|,?\s*\b(?:and|or|nor|vs\.?|versus|plus)\b)\s*[(\[{]?)\s*$",
    re.IGNORECASE,
)
_SENTENCE_START = re.compile(r"(?:^|[.!?:;\n])[\s(\[{]*$")
_NEXT_WORD = re.compile(r"\s+([^\W\d_]+)")


def _english_word(text: str, letter: re.Match) -> bool:
    """Whether a standalone "a", "A", "i" or "I" is the article or the pronoun rather than an option."""
    start, end, window = letter.start(), letter.end(), max(0, letter.start() - 40)
    if _MARKED_AFTER.match(text, end) or _MARKED_BEFORE.search(text, window, start):
        return False
    if letter.group(1) == "A":  # the article is capitalised only to start a sentence, or in a text in capitals
        word = _NEXT_WORD.match(text, end)
        return bool(_SENTENCE_START.search(text, window, start)) or (word is not None and word.group(1).isupper())
    return True


def named_options(text: str | None, options: int = 4) -> set[int]:
    """The indices (0 for A) of the first ``options`` options that a free-text answer names.

    The text is NFKC-normalised first, so full-width and other compatibility forms read as the letters they stand
    for ("（Ｂ）" is (B), the Kelvin sign is K); any other non-ASCII letter is no option. A letter, in either case,
    names an option where it stands alone: touching no letter or digit ("B12", "T3"), not inside a hyphenated or
    dotted word ("B-cell", "e.g."). "A" and "I" are English words too (the article of "the answer is a lesion" and "A
    3 cm mass", the pronoun of "I think"), so they name an option only where marked as one: bracketed ("(a)"),
    followed by ")", "." or ":", last on their line, after "option" or "choice", joined to another letter ("a or b",
    "A, C"), followed by a verb ("A is correct"), or, for "A", capitalised inside a sentence ("the answer is A based
    on ..."); emphasis and quotes mark a letter as brackets do ("**a**", "'a'"). A letter beyond the options is none
    of them ("E" of four, the Roman numeral of "stage I"). Markup tags ("<answer>B</answer>") end a line.
    """
    if text is None:
        return set()
    text = _TAG.sub("\n", unicodedata.normalize("NFKC", text))
    named = set()
    for letter in _LETTER.finditer(text):
        index = string.ascii_uppercase.index(letter.group(1).upper())
        if index < options and not (letter.group(1) in "aAiI" and _english_word(text, letter)):
            named.add(index)
    return named


def parse_choice(text: str | None, options: int = 4) -> int | None:
    """The option index a free-text answer names ("B", "(b)", "B. a 3 cm mass", "The answer is C"), or None when it
    names none of the first ``options`` or more than one ("A or B"); the same letter named twice is one option. Which
    letters count as named: :func:`named_options`."""
    named = named_options(text, options)
    return next(iter(named)) if len(named) == 1 else None


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
