"""MedEvalKit's scoring of free-text answers as a cascade: rules first, then similarity, then (optionally) an LLM judge.

A generative model (a VLM) is asked with MedEvalKit's prompts (:func:`question_prompt`, :data:`REPORT_PROMPT`) and
answers in words; each answer is scored by the first stage that can decide it:

1. **rule**: an MCQ answer that is exactly one option's text, else names exactly one option letter
   (:func:`~gx_ray.metrics.mcq.named_options`, with the options' own texts blanked out: "C. difficile colitis" is not
   option C); naming two is a parse failure. A close- or open-ended answer is right when its :func:`final_answer`
   equals the reference, both normalised; a yes/no question when the answer says the reference's word and not the
   other (MedEvalKit's ``judge_judgement``, on whole words). Close-ended answers are decided here, as MedEvalKit
   does: no similarity, so "lymph node metastasis" is not "no lymph node metastasis";
2. **similarity**: an MCQ answer naming no letter takes the option whose tokens it says most of (MMMU's fallback:
   at least :data:`MIN_SIMILARITY`, then token F1; a tie is a parse failure);
3. **judge**: an open-ended answer the rules did not match, when a judge (any ``ask(prompt) -> reply``, backends in
   :mod:`gx_ray.models.judge`) is given: MedEvalKit's :data:`JUDGE_PROMPT`, ``<judge>0</judge>`` for correct, and a
   reply with no single verdict names none. Verdicts are cached, so a rerun asks nothing twice. Without a judge
   such an answer is wrong (MedEvalKit's exact match).

:func:`cascade_metrics` reports accuracy, the parse-failure rate apart from it, the share each stage decided, and,
where the judge also saw answers the rules decided (``audit``), how often the two agree.
docs/reference/answer-scoring.md says where this departs from MedEvalKit, and why.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gx_ray.metrics.mcq import named_options, parse_choice

QUESTION_TYPES = ("mcq", "close", "open")
MIN_SIMILARITY = 0.5
"""An MCQ answer that says less than this share of its best option's tokens names no option."""
JUDGE_PROMPT_VERSION = 1
JUDGE_PROMPT = (
    "You are a medical expert grading an answer.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Model answer: {answer}\n"
    "Judge whether the model answer is correct. A similar meaning or another valid interpretation counts as correct. "
    "Think inside <think></think>, then give your verdict inside <judge></judge>: 0 if the answer is correct, 1 if it "
    "is not."
)
"""MedEvalKit's judge prompt (its Table 24), version :data:`JUDGE_PROMPT_VERSION`: change one, bump the other."""
_JUDGE_TAG = re.compile(r"<judge>(.*?)</judge>", re.IGNORECASE | re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_ANSWER_CUE = re.compile(
    r"\*\*answer\*\*|\b(?:final\s+)?answer\s*(?:is\b\s*:?|:)|\bfinal\s+answer\b|答案\s*[:：]", re.IGNORECASE
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
CASCADE_METRICS = ("accuracy", "parse_failure_rate", "decided_by_rule", "decided_by_similarity", "decided_by_judge")


REPORT_PROMPT = (
    "You are a helpful assistant. Please generate a report for the given images, including both findings and "
    "impressions. Return the report in the following format: Findings: {} Impression: {}."
)


def question_prompt(kind: str, question: str, options: Sequence[str] = ()) -> str:
    """MedEvalKit's prompt for a question of type ``kind`` (its Figure 8; the image tokens and the model's chat
    template are the model's to add): MCQ with lettered options, close-ended (a word or phrase), open-ended."""
    if kind not in QUESTION_TYPES:
        raise ValueError(f"unknown question type {kind!r}; valid: {', '.join(QUESTION_TYPES)}")
    if kind == "mcq":
        if not options:
            raise ValueError("a multiple-choice prompt needs its options")
        listed = " ".join(f"{string.ascii_uppercase[i]}. {option}" for i, option in enumerate(options))
        return (
            f"Question: {question} Options: {listed} Answer with the option's letter from the given choices directly."
        )
    if kind == "close":
        return f"{question} Answer the question using a single word or phrase."
    return f"{question} Answer the question concisely."


def normalise(text: str | None) -> str:
    """Lower case, no punctuation, no articles, single spaces (MMMU's and SQuAD's answer normalisation)."""
    text = (text or "").lower()
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(answer: str | None, reference: str | None) -> float:
    """SQuAD's token F1 of two normalised texts, in [0, 1]."""
    a, r = normalise(answer).split(), normalise(reference).split()
    common = sum((Counter(a) & Counter(r)).values())
    if not a or not r or not common:
        return float(a == r)
    precision, recall = common / len(a), common / len(r)
    return 2 * precision * recall / (precision + recall)


def option_recall(answer: str | None, option: str) -> float:
    """The share of an option's (normalised) tokens that the answer contains, in [0, 1]."""
    said, wanted = Counter(normalise(answer).split()), Counter(normalise(option).split())
    return sum((said & wanted).values()) / max(1, sum(wanted.values()))


@dataclass(frozen=True)
class Scored:
    """One answer's verdict: ``correct`` (None: it could not be read), the ``stage`` that decided it, the option it
    chose (MCQ), and the judge's verdict where the judge was asked (also when auditing a rule's decision)."""

    correct: bool | None
    stage: str
    choice: int | None = None
    judge: bool | None = None


class JudgeCache:
    """Judge verdicts by (prompt version, question, reference, answer), kept in a JSON file when given a path."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self.verdicts: dict[str, bool | None] = {}
        if self.path and self.path.is_file():
            self.verdicts = json.loads(self.path.read_text(encoding="utf-8"))

    @staticmethod
    def key(question: str, reference: str, answer: str) -> str:
        return json.dumps([JUDGE_PROMPT_VERSION, question, reference, answer], ensure_ascii=False)

    def get(self, question: str, reference: str, answer: str, ask: Callable[[str], str]) -> bool | None:
        """The cached verdict, else the judge's (``ask(prompt) -> reply``), cached; None: the reply named none."""
        key = self.key(question, reference, answer)
        if key not in self.verdicts:
            reply = ask(JUDGE_PROMPT.format(question=question, reference=reference, answer=answer))
            self.verdicts[key] = parse_verdict(reply)
            if self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.write_text(json.dumps(self.verdicts, ensure_ascii=False, indent=0), encoding="utf-8")
        return self.verdicts[key]


def parse_verdict(reply: str | None) -> bool | None:
    """True for ``<judge>0</judge>`` (correct, MedEvalKit's convention), False for 1; None when the reply has no
    verdict, or tags that disagree or hold anything but 0 or 1 (empty tags, an echo of the prompt's, are skipped)."""
    verdicts = {tag.strip() for tag in _JUDGE_TAG.findall(reply or "")} - {""}
    return verdicts == {"0"} if verdicts in ({"0"}, {"1"}) else None


def final_answer(text: str | None) -> str:
    """The part of a free-text answer that MedEvalKit compares (its ``parse_response``): the last ``\\boxed{}``,
    else the ``<answer>`` tags' content, else what follows the last "answer is", "answer:", "final answer" or
    "答案:"; the whole text when that leaves nothing."""
    text = text or ""
    if boxed := _BOXED.findall(text):
        return boxed[-1]
    if tagged := _ANSWER_TAG.findall(text):
        return " ".join(tagged)
    rest = _ANSWER_CUE.split(text)[-1]
    return rest if normalise(rest) else text


def score_answer(
    kind: str,
    answer: str | None,
    reference: str,
    question: str = "",
    options: Sequence[str] = (),
    judge: Callable[[str], str] | None = None,
    cache: JudgeCache | None = None,
    audit: bool = False,
) -> Scored:
    """Score one answer of question type ``kind`` (``mcq``: ``reference`` is the right option's letter or text and
    ``options`` the option texts; ``close``; ``open``). ``audit``: also ask the judge about an open or close-ended
    answer the rules decided, for the judge-vs-rule agreement."""
    if kind not in QUESTION_TYPES:
        raise ValueError(f"unknown question type {kind!r}; valid: {', '.join(QUESTION_TYPES)}")
    if kind == "mcq":
        return _score_choice(answer, reference, options)
    cache = cache if cache is not None else JudgeCache()

    def ask_judge() -> bool | None:
        return cache.get(question, reference, answer or "", judge) if judge else None

    said, wanted = normalise(final_answer(answer)), normalise(reference)
    if kind == "close" and wanted in ("yes", "no"):  # MedEvalKit: one of yes/no, the reference's (here: as words)
        matched = {"yes", "no"}.intersection(said.split()) == {wanted}
    else:
        matched = said == wanted
    if not matched and kind == "open" and judge is not None:
        verdict = ask_judge()
        return Scored(verdict, "judge" if verdict is not None else "unparsed", judge=verdict)
    return Scored(matched, "rule", judge=ask_judge() if audit else None)


def _score_choice(answer: str | None, reference: str, options: Sequence[str]) -> Scored:
    right = _option_index(reference, options)
    choice, stage = _exact_option(answer, options), "rule"
    if choice is None:
        named = named_options(_without_option_texts(answer or "", options), len(options))
        if len(named) > 1:
            return Scored(None, "unparsed")  # "A or B": not guessed at, not left to the similarity
        choice = next(iter(named), None)
    if choice is None and options and normalise(answer):
        # how much of each option the answer says (then how closely): "a Borrmann IV lesion" names option IV, not I
        similarity = [(option_recall(answer, option), token_f1(answer, option)) for option in options]
        best = max(range(len(options)), key=lambda i: similarity[i])
        if similarity[best][0] >= MIN_SIMILARITY and similarity.count(similarity[best]) == 1:
            choice, stage = best, "similarity"
    if choice is None:
        return Scored(None, "unparsed")
    return Scored(choice == right, stage, choice)


def _exact_option(text: str | None, options: Sequence[str]) -> int | None:
    """The option whose normalised text the whole text is, if exactly one is (before any letter is read from it)."""
    matches = [i for i, option in enumerate(options) if normalise(option) and normalise(option) == normalise(text)]
    return matches[0] if len(matches) == 1 else None


def _without_option_texts(answer: str, options: Sequence[str]) -> str:
    """The answer with every option's text that it quotes blanked out, longest first: the letters in an option's
    text ("C. difficile colitis", "stage I") are not the answer naming an option."""
    for option in sorted(options, key=len, reverse=True):
        if option.strip():
            pattern = r"(?<!\w)" + r"\s+".join(map(re.escape, option.split())) + r"(?!\w)"
            answer = re.sub(pattern, " ", answer, flags=re.IGNORECASE)
    return answer


def _option_index(reference: str, options: Sequence[str]) -> int:
    index = _exact_option(reference, options)
    if index is None:
        index = parse_choice(reference, len(options))
    if index is None:
        raise ValueError(f"the reference {reference!r} is neither an option letter nor exactly one of {list(options)}")
    return index


def cascade_metrics(scored: Sequence[Scored]) -> dict[str, float]:
    """Accuracy (%; an unreadable answer counts as wrong), the parse-failure rate (%), the share of answers each stage
    decided (%), and the judge's agreement with the rules (%) over the answers both decided (NaN when none)."""
    total = len(scored)
    if not total:
        return dict.fromkeys((*CASCADE_METRICS, "judge_rule_agreement"), math.nan)
    stages = Counter(s.stage for s in scored)
    both = [s for s in scored if s.stage in ("rule", "similarity") and s.judge is not None and s.correct is not None]
    return {
        "accuracy": 100.0 * sum(bool(s.correct) for s in scored) / total,
        "parse_failure_rate": 100.0 * stages["unparsed"] / total,
        **{f"decided_by_{stage}": 100.0 * stages[stage] / total for stage in ("rule", "similarity", "judge")},
        "judge_rule_agreement": 100.0 * sum(s.judge == s.correct for s in both) / len(both) if both else math.nan,
    }
