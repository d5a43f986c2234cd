"""Report generation (Table 2b): a transformers text decoder writes the CT report from the fused features.

The decoder is a ``BertLMHeadModel`` with ``is_decoder=True`` and ``add_cross_attention=True`` (the BLIP/X2-VLM
recipe) that cross-attends to ``Encoded.tokens``, projected to the decoder's width when it differs. By default
it is a small random BERT over the encoder tokenizer's vocabulary; ``decoder="minilm"`` starts from the real
MiniLM weights instead (its cross-attention layers and LM head start at random). Training is teacher-forced
cross-entropy on the English CT report (the report that describes what the image shows); cases without one add
nothing. Evaluation decodes greedily (``num_beams=1``) or with beam search and scores the text with
:func:`gx_ray.metrics.text_generation_metrics`: ROUGE-L and BLEU-4 by default (cheap enough for every
validation epoch), also METEOR and BERTScore-F1 with ``full_metrics``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.metrics import FAST_TEXT_METRICS, TEXT_METRICS, text_generation_metrics
from gx_ray.modalities import ModelInputs
from gx_ray.modalities.schemas import REPORT_TARGETS
from gx_ray.tasks.base import Batch, Outputs, Task, TaskMetric, check_train_rows, report_column

if TYPE_CHECKING:  # transformers is imported where a decoder is built: reading the task's class (a driver) needs none
    from transformers import BertLMHeadModel

DECODERS: tuple[str, ...] = ("small", "minilm")
VOCABULARIES: tuple[str, ...] = ("tokenizer", "training")
IGNORE = -100
TYPICAL_SAMPLE = 32
"""Training reports the chance level's typical report is chosen among, and scored against (32 x 32 ROUGE-L pairs,
about 3 s on one core)."""
MEMORY_POSITIONS = 512
"""Memory tokens ``memory_positions`` gives a learnt position to; an encoder that gives more is refused."""


class ReportDecoder(nn.Module):
    """A BERT decoder with cross-attention over the encoder's tokens; ``generate`` writes reports.

    Reports are ``[CLS] tokens [SEP]``: ``[CLS]`` starts decoding and ``[SEP]`` ends it. With ``pooled_memory``,
    besides cross-attending to the memory, the decoder reads its (masked) mean, projected to the decoder's width and
    added to the token embeddings at every position (the image as an input of every step, as Show-and-Tell and prefix
    captioners feed it): on the demo, cross-attention alone, started at random, wrote nearly one template for every
    patient. The pooled path wrote more distinct reports but did not score higher (docs/lab/demo_log.md, "The image
    at every step").
    """

    def __init__(
        self,
        decoder: BertLMHeadModel,
        memory_dim: int,
        tokenizer: Any,
        kept_tokens: Sequence[int] | None = None,
        memory_positions: int = 0,
        pooled_memory: bool = False,
    ):
        super().__init__()
        width = decoder.config.hidden_size
        self.memory_projection = nn.Linear(memory_dim, width) if memory_dim != width else nn.Identity()
        self.memory_positions = nn.Embedding(memory_positions, width) if memory_positions else None
        if self.memory_positions is not None:
            nn.init.normal_(self.memory_positions.weight, std=decoder.config.initializer_range)
        self.condition = nn.Linear(memory_dim, width) if pooled_memory else None
        """The pooled memory → a vector added to every token's embedding (:meth:`conditioned`)."""
        self._condition: torch.Tensor | None = None
        if self.condition is not None:
            # zero at first: the decoder starts as it was (a random vector this size drowns the token embeddings)
            nn.init.zeros_(self.condition.weight)
            nn.init.zeros_(self.condition.bias)
            decoder.get_input_embeddings().register_forward_hook(self._add_condition)
        self.decoder = decoder
        self.tokenizer = tokenizer
        # with kept_tokens the decoder reads and writes only those tokenizer ids, as its own ids 0..K-1
        kept = torch.tensor(sorted(kept_tokens) if kept_tokens is not None else range(len(tokenizer)))
        own = torch.full((len(tokenizer),), int(torch.searchsorted(kept, tokenizer.unk_token_id)))
        own[kept] = torch.arange(len(kept))
        self.register_buffer("kept_tokens", kept, persistent=False)
        self.register_buffer("own_ids", own, persistent=False)
        """Tokenizer id → the decoder's id; an id outside ``kept_tokens`` becomes [UNK]'s."""

    def to_own(self, ids: torch.Tensor) -> torch.Tensor:
        """Tokenizer ids (and :data:`IGNORE`) as the decoder's ids."""
        return torch.where(ids == IGNORE, IGNORE, self.own_ids[ids.clamp(min=0)])

    def project_memory(self, memory: torch.Tensor) -> torch.Tensor:
        projected = self.memory_projection(memory)
        if self.memory_positions is not None:
            if memory.shape[1] > self.memory_positions.num_embeddings:
                raise ValueError(
                    f"report generation's memory_positions cover {self.memory_positions.num_embeddings} memory tokens; "
                    f"the encoder gave {memory.shape[1]}: set task_options.memory_positions false for this model"
                )
            projected = projected + self.memory_positions.weight[: memory.shape[1]]
        return projected

    @contextlib.contextmanager
    def conditioned(self, memory: torch.Tensor, memory_mask: torch.Tensor) -> Iterator[None]:
        """Within it, the decoder's token embeddings have the projected mean of ``memory`` added."""
        if self.condition is None:
            yield
            return
        weights = memory_mask.to(memory.dtype).unsqueeze(-1)
        self._condition = self.condition((memory * weights).sum(1) / weights.sum(1).clamp(min=1.0))
        try:
            yield
        finally:
            self._condition = None

    def _add_condition(self, module: nn.Module, args: Any, embeddings: torch.Tensor) -> torch.Tensor:
        if self._condition is None:
            return embeddings
        # beam search runs num_beams rows per case, each case's beams together
        repeats = embeddings.shape[0] // self._condition.shape[0]
        return embeddings + self._condition.repeat_interleave(repeats, 0).unsqueeze(1).to(embeddings.dtype)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor
    ) -> torch.Tensor:
        """(B, L, vocabulary) next-token logits."""
        with self.conditioned(memory, memory_mask):
            return self.decoder(
                input_ids=self.to_own(input_ids),
                attention_mask=attention_mask,
                encoder_hidden_states=self.project_memory(memory),
                encoder_attention_mask=memory_mask.long(),
                use_cache=False,
            ).logits

    def teach(
        self,
        texts: Sequence[str | None],
        max_tokens: int,
        memory: torch.Tensor,
        memory_mask: torch.Tensor,
        word_dropout: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced logits of ``texts`` (their first ``max_tokens`` tokens) and their labels in the decoder's
        ids; an empty text (None) is padding only: it teaches nothing. With ``word_dropout`` that share of the input
        tokens after [CLS] reads [UNK] (the labels stay): the decoder must lean on the memory, not the words before."""
        from gx_ray.models.text import tokenize_bucketed  # the models package imports MONAI: only when asked

        tokens = tokenize_bucketed(self.tokenizer, texts, max_tokens, memory.device)
        has_text = torch.tensor([bool(t) for t in texts], device=memory.device)
        labels = self.to_own(tokens.input_ids.masked_fill(~tokens.attention_mask.bool() | ~has_text[:, None], IGNORE))
        input_ids = tokens.input_ids
        if word_dropout > 0:
            dropped = torch.rand(input_ids.shape, device=input_ids.device) < word_dropout
            dropped[:, 0] = False
            input_ids = input_ids.masked_fill(dropped, self.tokenizer.unk_token_id)
        return self(input_ids, tokens.attention_mask, memory, memory_mask), labels

    @functools.cached_property
    def _cache_argument(self) -> str:
        """The decoder's name for its cache: ``cache`` from transformers 5.2x, ``past_key_values`` before (5.17
        refuses ``cache``; 5.24 warns on ``past_key_values``)."""
        return "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"

    @torch.no_grad()
    def generate(
        self, memory: torch.Tensor, memory_mask: torch.Tensor, num_beams: int = 1, max_new_tokens: int = 128
    ) -> list[str]:
        from transformers import DynamicCache, EncoderDecoderCache

        own = {name: int(self.own_ids[getattr(self.tokenizer, f"{name}_token_id")]) for name in ("cls", "sep", "pad")}
        start = torch.full((memory.shape[0], 1), own["cls"], device=memory.device)
        with self.conditioned(memory, memory_mask):
            tokens = self.decoder.generate(
                input_ids=start,
                attention_mask=torch.ones_like(start),
                encoder_hidden_states=self.project_memory(memory),
                encoder_attention_mask=memory_mask.long(),
                # BERT's cross-attention layers keep their keys in the cross-attention half of this cache; the
                # DynamicCache that generate() makes by default lacks it (transformers 5)
                **{self._cache_argument: EncoderDecoderCache(DynamicCache(), DynamicCache())},
                num_beams=num_beams,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=own["sep"],
                pad_token_id=own["pad"],
            )
        return self.tokenizer.batch_decode(self.kept_tokens[tokens], skip_special_tokens=True)


@dataclass
class ReportGeneration(Task):
    name = "report_generation"
    short_name = "report"
    primary_metric = "rouge_l"
    mode = "max"

    language: str = "en"
    decoder: str = "small"
    """``small``: random BERT of ``decoder_width``/``decoder_layers``/``decoder_heads``; ``minilm``: real weights."""
    decoder_width: int = 128
    decoder_layers: int = 2
    decoder_heads: int = 2
    max_report_tokens: int = 256
    """Teacher forcing sees at most this many tokens of a report (with [CLS] and [SEP])."""
    num_beams: int = 1
    """1 = greedy decoding."""
    max_new_tokens: int = 256
    word_dropout: float = 0.0
    """Training only: this share of the decoder's input tokens reads [UNK] (:meth:`ReportDecoder.teach`)."""
    label_smoothing: float = 0.0
    """Of the teacher-forced cross-entropy (training loss only)."""
    memory_positions: bool = False
    """Learnt position embeddings added to the memory tokens the decoder cross-attends to (where in the image)."""
    pooled_memory: bool = False
    """The memory's mean, projected, added to every input token's embedding besides cross-attention (the image as an
    input of every step). Its projection starts at zero; on a four-case set at learning rate 3e-3 it unsettled the
    loss (the trainability test), and on the five-seed demo it scored below the decoder without it: off by default
    and in the demo preset."""
    full_metrics: bool = False
    """All four metrics (METEOR needs WordNet, BERTScore runs MiniLM); otherwise ROUGE-L and BLEU-4."""
    vocabulary: str = "tokenizer"
    """The tokens the ``small`` decoder reads and writes: ``tokenizer`` (all of its ~30k) or ``training`` (those of
    the training reports' taught parts, and the special tokens: a few hundred on templated reports). A random decoder
    can learn no token that training never shows it; with ``training`` its output layer and softmax shrink a
    hundredfold, most of a CPU step's time."""

    def __post_init__(self) -> None:
        self.column = report_column(REPORT_TARGETS[self.name], self.language)
        if self.decoder not in DECODERS:
            raise ValueError(f"unknown report decoder {self.decoder!r}; valid: {', '.join(DECODERS)}")
        if self.vocabulary not in VOCABULARIES:
            raise ValueError(f"unknown report vocabulary {self.vocabulary!r}; valid: {', '.join(VOCABULARIES)}")
        if self.vocabulary == "training" and self.decoder != "small":
            raise ValueError(f"vocabulary 'training' is for the small random decoder; {self.decoder!r} keeps its own")
        self.training_reports: list[str] = []
        if self.num_beams < 1 or self.max_new_tokens < 1 or self.max_report_tokens < 2:
            raise ValueError("num_beams and max_new_tokens must be at least 1, max_report_tokens at least 2")
        if not 0.0 <= self.word_dropout < 1.0:
            raise ValueError(f"word_dropout must be in [0, 1), not {self.word_dropout}")

    def prepare(self, train_rows: Iterable[Mapping[str, Any]]) -> None:
        """With ``vocabulary="training"``, keep the training reports: the decoder's tokens are theirs."""
        if self.vocabulary == "training":
            rows = check_train_rows(train_rows, self.name)
            self.training_reports = [row[self.column] for row in rows if row[self.column]]
            if not self.training_reports:
                raise ValueError(f"no reports ({self.column}) in the {len(rows)} training rows")

    def build_head(self, dim: int, tokenizer: Any, map_channels: Sequence[int] = ()) -> nn.Module:
        self.tokenizer = tokenizer  # the targets are cut with it (target_texts), and the chance level's too
        if self.vocabulary == "training" and not self.training_reports:
            raise RuntimeError("the training reports' vocabulary is not fitted: call prepare(train_rows) first")
        config = DecoderConfig(
            decoder=self.decoder, width=self.decoder_width, layers=self.decoder_layers, heads=self.decoder_heads,
            max_positions=max(512, self.max_report_tokens, self.max_new_tokens + 1), max_tokens=self.max_report_tokens,
            memory_positions=MEMORY_POSITIONS if self.memory_positions else 0, pooled_memory=self.pooled_memory,
        )  # fmt: skip
        return build_decoder(tokenizer, dim, config, self.training_reports if self.vocabulary == "training" else None)

    def target_texts(self, reports: Sequence[str | None]) -> list[str | None]:
        """Each report as the model is taught to write it (:func:`cut_texts` at ``max_report_tokens``)."""
        if not hasattr(self, "tokenizer"):
            raise RuntimeError("the report targets need the tokenizer: call build_head first")
        return cut_texts(self.tokenizer, reports, self.max_report_tokens)

    def chance_level(self, train_rows: Sequence[dict], test_rows: Sequence[dict]) -> float:
        """The training split's most typical report written for every test case (targets cut as the model's): of up
        to :data:`TYPICAL_SAMPLE` training reports drawn with a fixed seed, the one with the highest mean score
        against them all. A writer who never looks at the patient but knows the training reports does this well; a
        model that writes one report for everyone scores about this. A random training report per case, the level
        before, is lower (ROUGE-L 44.0 against 44.8 on a 320-case demo cohort): the demo's model that wrote one
        report for all 64 test patients passed as above it."""
        train = self.target_texts([r[self.column] for r in train_rows if r[self.column]])
        test = self.target_texts([r[self.column] for r in test_rows if r[self.column]])
        if not train or not test:
            return float("nan")
        rng = np.random.default_rng(0)
        sample = [train[i] for i in rng.choice(len(train), min(len(train), TYPICAL_SAMPLE), replace=False)]
        metric = self.primary_metric

        def typicality(report: str) -> float:
            return text_generation_metrics([report] * len(sample), sample, self.language, [metric])[metric]

        typical = max(sample, key=typicality)
        return float(text_generation_metrics([typical] * len(test), test, self.language, [metric])[metric])

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        encoded = encoder(inputs)
        references = batch[self.column]
        logits, labels = head.teach(
            references,
            self.max_report_tokens,
            encoded.tokens,
            encoded.token_mask,
            self.word_dropout if head.training else 0.0,
        )
        outputs = {
            "logits": logits,
            "labels": labels,
            # what the metric scores (evaluation only): the reports as the model is taught them
            "references": references if head.training else self.target_texts(references),
        }
        if not head.training:
            outputs["generated"] = head.generate(
                encoded.tokens, encoded.token_mask, self.num_beams, self.max_new_tokens
            )
        return outputs

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        return teacher_forced_loss(outputs["logits"], outputs["labels"], self.label_smoothing)

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        if "generated" not in outputs:
            raise ValueError("report predictions need the model in eval mode (generation runs only there)")
        return [
            {"case_id": case_id, "prediction": generated, "target": reference}
            for case_id, generated, reference in zip(
                batch["case_id"], outputs["generated"], outputs["references"], strict=True
            )
        ]

    def metric(self) -> TaskMetric:
        return ReportMetric(self.language, TEXT_METRICS if self.full_metrics else FAST_TEXT_METRICS)


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """A :class:`ReportDecoder`'s build: the ``small`` random BERT of ``width``/``layers``/``heads`` or ``minilm``'s
    real weights, with positions for ``max_positions`` tokens; a taught text's first ``max_tokens``; learnt
    ``memory_positions`` (0: none) and ``pooled_memory`` as :class:`ReportDecoder` takes them."""

    decoder: str = "small"
    width: int = 128
    layers: int = 2
    heads: int = 2
    max_positions: int = 512
    max_tokens: int = 256
    memory_positions: int = 0
    pooled_memory: bool = False


def build_decoder(
    tokenizer: Any, memory_dim: int, config: DecoderConfig = DecoderConfig(), taught_texts: Sequence[str] | None = None
) -> ReportDecoder:
    """A :class:`ReportDecoder` over ``memory_dim``-wide memory. With ``taught_texts`` the small decoder keeps only the
    tokens of those texts (their first ``max_tokens``) and the special tokens: its output layer shrinks to them."""
    decoder = config.decoder
    if decoder not in DECODERS:
        raise ValueError(f"unknown report decoder {decoder!r}; valid: {', '.join(DECODERS)}")
    from transformers import BertConfig, BertLMHeadModel

    kept = None
    if taught_texts is not None:
        taught = tokenizer(list(taught_texts), truncation=True, max_length=config.max_tokens)["input_ids"]
        special = (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
        kept = sorted({*special, *(i for ids in taught for i in ids)})
    if decoder == "minilm":
        from gx_ray.models.text import minilm_path, quiet_loading  # the models package imports MONAI: only when asked

        quiet_loading()
        model = BertLMHeadModel.from_pretrained(
            str(minilm_path()), is_decoder=True, add_cross_attention=True, local_files_only=True
        )
        if model.config.vocab_size != len(tokenizer):
            raise ValueError(
                f"decoder 'minilm' has {model.config.vocab_size} tokens but the encoder's tokenizer "
                f"{len(tokenizer)}: use decoder='small' with this text encoder"
            )
    else:
        bert = BertConfig(
            vocab_size=len(kept) if kept is not None else len(tokenizer),
            hidden_size=config.width,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            intermediate_size=4 * config.width,
            max_position_embeddings=config.max_positions,
            is_decoder=True,
            add_cross_attention=True,
        )
        model = BertLMHeadModel(bert)
    return ReportDecoder(model, memory_dim, tokenizer, kept, config.memory_positions, config.pooled_memory)


def cut_texts(tokenizer: Any, texts: Sequence[str | None], max_tokens: int) -> list[str | None]:
    """Each text as a decoder is taught to write it: its first ``max_tokens`` tokens ([CLS] and [SEP] counted), cut in
    the original text where the last kept token ends. Scoring against words a model was never asked to write would
    measure the cut, not the model; at the reports' default 256 most are whole."""
    encoded = tokenizer([t or "" for t in texts], truncation=True, max_length=max_tokens, return_offsets_mapping=True)
    cut = []
    for text, offsets in zip(texts, encoded["offset_mapping"], strict=True):
        ends = [end for start, end in offsets if end > start]  # special tokens have empty spans
        cut.append(text[: ends[-1]] if text and ends else text)
    return cut


def teacher_forced_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts token t + 1; :data:`IGNORE` labels add nothing."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    if not (labels != IGNORE).any():
        return logits.sum() * 0.0
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, label_smoothing=label_smoothing
    )


class ReportMetric(TaskMetric):
    """Corpus text metrics of the generated reports against the references (cases without one left out)."""

    def __init__(self, language: str, metrics: Sequence[str]):
        super().__init__()
        self.language, self.metrics = language, tuple(metrics)

    def update(self, outputs: Outputs, batch: Batch) -> None:
        if "generated" not in outputs:
            raise ValueError("report metrics need the model in eval mode (generation runs only there)")
        pairs = [(g, r) for g, r in zip(outputs["generated"], outputs["references"], strict=True) if r]
        self.add(generated=[g for g, _ in pairs], references=[r for _, r in pairs])

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        generated = [text for texts in state.get("generated", []) for text in texts]
        references = [text for texts in state.get("references", []) for text in texts]
        if not references:
            return dict.fromkeys(self.metrics, float("nan"))
        return text_generation_metrics(generated, references, self.language, self.metrics)
