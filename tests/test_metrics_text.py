"""Report-generation metrics against independent implementations and hand-computed values.

References: torchmetrics' BLEU and ROUGE-L (ours are sacrebleu and rouge-score), rouge-score's and sacrebleu's
own tokenizers, Meteor 1.5 (the Java original shipped in pycocoevalcap) run with nltk's parameters and
matchers, and METEOR values worked out by hand. BERTScore's defining properties are tested here; its
agreement with the reference ``bert-score`` package is in test_metrics_bertscore.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest
from rouge_score.tokenize import tokenize as rouge_score_tokenize
from sacrebleu.tokenizers.tokenizer_zh import TokenizerZh
from torchmetrics.functional.text import bleu_score
from torchmetrics.functional.text.rouge import rouge_score as torchmetrics_rouge

from gx_ray.metrics import FAST_TEXT_METRICS, TEXT_METRICS, text_generation_metrics, tokenize
from gx_ray.metrics.text import load_bertscore_encoder

VOCABULARY = """
the a stomach gastric wall thickening thickened thick lesion tumor tumour mass large small lymph node nodes enlarged
antrum body fundus cardia invasion invades serosa no evidence of distant metastasis liver ascites irregular ulcer
ulcerated mucosa enhancement enhancing 3 cm ct
""".split()  # noqa: SIM905


def _report_pairs(seed: int, count: int = 40) -> tuple[list[str], list[str]]:
    """References from a small radiology vocabulary; predictions that keep part, substitute and reorder."""
    rng = np.random.default_rng(seed)
    references, predictions = [], []
    for _ in range(count):
        words = list(rng.choice(VOCABULARY, rng.integers(6, 16)))
        cut = int(rng.integers(0, len(words)))
        edited = words[:cut] + list(rng.choice(VOCABULARY, rng.integers(1, 5))) + words[cut + 2 :]
        if rng.random() < 0.3:
            rng.shuffle(edited)
        references.append(" ".join(words).capitalize() + ".")
        predictions.append(" ".join(edited).capitalize() + ", as seen.")
    return predictions, references


def test_tokenizer_is_rouge_scores_for_english_and_keeps_chinese():
    predictions, references = _report_pairs(0)
    for text in predictions + references + ["Wall: 3.5cm (T3-N1); no-METS!"]:
        assert tokenize(text) == rouge_score_tokenize(text, None)
    assert tokenize("胃窦部胃壁增厚，CT 提示 T3 期。") == TokenizerZh()("胃窦部胃壁增厚 ct 提示 t3 期").split()
    assert rouge_score_tokenize("胃壁增厚", None) == []  # why rouge-score's own tokenizer is not enough


def test_bleu_equals_torchmetrics():
    predictions, references = _report_pairs(1)
    ours = text_generation_metrics(predictions, references, metrics=("bleu_4",))["bleu_4"]
    joined = [" ".join(tokenize(t)) for t in predictions], [[" ".join(tokenize(t))] for t in references]
    assert ours > 5  # the comparison means something only when 4-grams match
    assert ours == pytest.approx(100 * float(bleu_score(*joined, n_gram=4)), abs=1e-4)


def test_bleu_chinese_equals_sacrebleu_zh_tokenization():
    from sacrebleu.metrics import BLEU

    predictions = ["胃窦部胃壁增厚，CT 提示 T3 期", "肝内未见转移灶", "胃体小弯侧溃疡"]
    references = ["胃窦胃壁明显增厚，CT 提示 T3 期", "肝脏未见明确转移", "胃体小弯侧见溃疡形成"]
    ours = text_generation_metrics(predictions, references, language="zh", metrics=("bleu_4",))["bleu_4"]
    strip = [str.maketrans("", "", "，。")]
    stock = BLEU(tokenize="zh", lowercase=True, smooth_method="none")
    expected = stock.corpus_score(
        [p.translate(*strip) for p in predictions], [[r.translate(*strip) for r in references]]
    )
    assert ours > 0 and ours == pytest.approx(expected.score, abs=1e-9)


def test_rouge_l_equals_torchmetrics_and_keeps_chinese():
    predictions, references = _report_pairs(2)
    ours = text_generation_metrics(predictions, references, metrics=("rouge_l",))["rouge_l"]
    # torchmetrics with its own normaliser and tokenizer: same definition (sentence-level LCS F1, averaged)
    expected = torchmetrics_rouge(predictions, references, rouge_keys="rougeL")["rougeL_fmeasure"]
    assert ours == pytest.approx(100 * float(expected), abs=1e-4)
    # LCS 胃壁增厚 (4 of 4 predicted, 4 of 6 reference characters): F = 2 * 1 * 2/3 / (1 + 2/3) = 0.8
    chinese = text_generation_metrics(["胃壁增厚"], ["胃壁明显增厚"], language="zh", metrics=("rouge_l",))
    assert chinese["rouge_l"] == pytest.approx(80.0)


@pytest.mark.parametrize(
    "prediction, reference, language, expected",
    [
        # 4 exact matches in 5 + 5 words: P = R = 0.8, Fmean = 10PR / (R + 9P) = 0.8; chunks "the" + "wall is
        # thick" = 2, penalty 0.5 * (2/4)^3 = 0.0625; score 0.8 * 0.9375 = 0.75
        ("The wall is thick today.", "The stomach wall is thick.", "en", 0.75),
        # "tumor" and "tumour" are WordNet synonyms, "thickened" and "thickening" share the Porter stem: P = R = 1,
        # one chunk of 2 matches, penalty 0.5 * (1/2)^3; score 0.9375. (nltk looks synonyms up by Porter stem, so
        # "tummy" -> "tummi" would find none: pairs here are their own stems.)
        ("Tumor thickened", "tumour thickening", "en", 0.9375),
        # Chinese, exact matches only: P = 1, R = 4/6, Fmean = 10PR / (R + 9P) = 20/29; chunks 胃壁 + 增厚 = 2 of 4
        # matches, penalty 0.0625; score 20/29 * 0.9375
        ("胃壁增厚", "胃壁明显增厚", "zh", 20 / 29 * 0.9375),
    ],
)
def test_meteor_hand_computed(prediction, reference, language, expected):
    result = text_generation_metrics([prediction], [reference], language=language, metrics=("meteor",))
    assert result["meteor"] == pytest.approx(100 * expected)


def _meteor_1_5(predictions: list[str], references: list[str], folder: Path) -> np.ndarray:
    """Segment scores of the Java Meteor 1.5 with nltk's parameters and matchers (no paraphrases, no weighting
    of function words), on the same tokens."""
    jar = Path(importlib.util.find_spec("pycocoevalcap.meteor.meteor").origin).with_name("meteor-1.5.jar")
    (folder / "hyp.txt").write_text("".join(" ".join(tokenize(t)) + "\n" for t in predictions))
    (folder / "ref.txt").write_text("".join(" ".join(tokenize(t)) + "\n" for t in references))
    settings = ["-l", "en", "-lower", "-m", "exact stem synonym", "-w", "1.0 1.0 1.0", "-p", "0.9 3.0 0.5 0.5", "-q"]
    run = subprocess.run(
        ["java", "-Xmx512m", "-jar", str(jar), str(folder / "hyp.txt"), str(folder / "ref.txt"), *settings],
        capture_output=True,
        encoding="utf-8",
        errors="replace",
        check=True,
        timeout=120,
    )
    return np.array([float(line) for line in run.stderr.split()])  # -q: segment scores on stderr


def test_meteor_agrees_with_meteor_1_5(tmp_path):
    """Same formula and matchers; they differ by design in three places: Meteor 1.5 stems with Snowball and
    looks synonyms up in its own WordNet export where nltk uses Porter and WordNet 3.0, it searches for the
    alignment with the fewest chunks where nltk aligns greedily, and it drops the fragmentation penalty
    when the whole hypothesis aligns as one chunk. So: most reports score identically, all correlate."""
    predictions, references = _report_pairs(3)
    java = _meteor_1_5(predictions, references, tmp_path)
    ours = np.array(
        [
            text_generation_metrics([p], [r], metrics=("meteor",))["meteor"] / 100
            for p, r in zip(predictions, references, strict=True)
        ]
    )
    assert len(java) == len(ours)
    assert np.corrcoef(java, ours)[0, 1] > 0.9
    assert np.mean(np.abs(java - ours) < 1e-6) >= 0.5
    assert np.mean(np.abs(java - ours)) < 0.05


def test_bertscore_properties():
    same = "Irregular thickening of the gastric antrum wall with serosal invasion."
    paraphrase = "The wall of the stomach antrum is irregularly thickened and invades the serosa."
    unrelated = "The patient's appointment was moved to next Tuesday afternoon."

    def f1(prediction, reference):
        return text_generation_metrics([prediction], [reference], metrics=("bertscore_f1",))["bertscore_f1"]

    assert f1(same, same) == pytest.approx(100.0, abs=1e-3)
    assert f1(same, unrelated) < f1(same, paraphrase) < f1(same, same)
    assert f1(same, paraphrase) == pytest.approx(f1(paraphrase, same), abs=1e-4)  # P and R swap, F1 stays
    corpus = text_generation_metrics([same, unrelated], [paraphrase, same], metrics=("bertscore_f1",))
    assert corpus["bertscore_f1"] == pytest.approx((f1(same, paraphrase) + f1(unrelated, same)) / 2, abs=1e-4)
    assert load_bertscore_encoder.cache_info().hits >= 5  # loaded once, reused by every later call


def test_metric_selection_and_all_metrics_in_percent():
    predictions, references = _report_pairs(4, count=3)
    fast = text_generation_metrics(predictions, references, metrics=FAST_TEXT_METRICS)
    assert list(fast) == list(FAST_TEXT_METRICS)
    everything = text_generation_metrics(predictions, references)
    assert list(everything) == list(TEXT_METRICS)
    assert all(0 < value < 100 for value in everything.values())
    assert text_generation_metrics(predictions, references) == everything  # deterministic
    with pytest.raises(ValueError, match="unknown text metrics"):
        text_generation_metrics(predictions, references, metrics=("cider",))
    with pytest.raises(ValueError, match="predictions but"):
        text_generation_metrics(predictions, references[:1])


def test_anything_but_two_equally_long_sequences_of_strings_is_refused_naming_the_argument():
    """A bare string would be scored character by character; bytes, a non-string item (None from a failed
    generation, a number, a nested list) or sequences of different lengths are refused with the argument named."""
    reports = [" ".join(VOCABULARY[:5]), " ".join(VOCABULARY[5:12]), "the wall is thick"]
    not_text = [None, 3, 2.5, b"wall", ["wall"], np.float64(1.0), {"report": "wall"}]
    for case in range(300):
        rng = np.random.default_rng([50, case])
        good = [str(rng.choice(reports)) for _ in range(int(rng.integers(1, 6)))]
        kind = str(rng.choice(["str", "bytes", "item", "container", "length"]))
        if kind == "str":
            bad, expected = " ".join(good), (TypeError, "a str")
        elif kind == "bytes":
            bad, expected = " ".join(good).encode(), (TypeError, "a bytes")
        elif kind == "item":
            at = int(rng.integers(0, len(good)))
            item = not_text[int(rng.integers(0, len(not_text)))]
            bad = (list if rng.random() < 0.5 else tuple)(good[:at] + [item] + good[at + 1 :])
            expected = (TypeError, rf"\[{at}\] must be a string; got a {type(item).__name__}")
        elif kind == "container":
            bad, expected = (set(good) if rng.random() < 0.5 else iter(good)), (TypeError, "sequence of strings")
        else:
            bad, expected = good + good[:1], (ValueError, "predictions but")
        predictions_bad = kind != "length" and rng.random() < 0.5
        arguments = (bad, good) if predictions_bad or kind == "length" else (good, bad)
        name = "predictions" if predictions_bad else "references"
        with pytest.raises(expected[0], match=expected[1]) as raised:
            text_generation_metrics(*arguments, metrics=("bleu_4",))
        if kind != "length":
            assert str(raised.value).startswith(name), (case, kind, str(raised.value))
    # lists, tuples and arrays of strings are all the same corpus
    as_list = text_generation_metrics(reports, reports[::-1], metrics=FAST_TEXT_METRICS)
    assert text_generation_metrics(tuple(reports), np.array(reports[::-1]), metrics=FAST_TEXT_METRICS) == as_list
