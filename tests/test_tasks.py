"""The five task modules: heads, losses, predictions and metric objects, on random features and demo batches.

A tiny stand-in encoder (real convolutions and embeddings over the real inputs, random weights) plays the
multimodal encoder, so these tests pin the tasks' own logic; the trainability test runs them with the real one.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.data.shards import read_split
from gx_ray.data.stream import split_rows
from gx_ray.metrics import (
    FAST_TEXT_METRICS,
    classification_metrics,
    detection_metrics,
    retrieval_metrics,
    text_generation_metrics,
)
from gx_ray.modalities import LeakageError, ModelInputs, build_inputs, input_channels, resolve_schema
from gx_ray.modalities.boxes import tumour_boxes
from gx_ray.models.encoded import Encoded
from gx_ray.models.text import offline_tokenizer
from gx_ray.schema import BOX_LEVELS, PHASES, STAGE_GROUPS, TASKS, VQA_CATEGORIES
from gx_ray.tasks import TASK_CLASSES, TaskModel, build_task, task_class
from gx_ray.tasks.lesion_detection import flatten_maps
from gx_ray.tasks.report_generation import IGNORE
from gx_ray.tasks.retrieval import info_nce
from gx_ray.tasks.vqa import UNKNOWN_ANSWER
from tests.common import ROOT, first_shard_batch

DIM = 16
DETECTION_SCHEMA = resolve_schema({"name": "detect", "boxes": "overlay", "box_levels": ["lymph_nodes", "stomach"]})


class TinyVision(nn.Module):
    """Two strided 3D convolutions: feature maps at strides 2 and 4, finest first."""

    def __init__(self, in_channels: int):
        super().__init__()
        self.channels = [8, 16]
        self.first = nn.Conv3d(in_channels, 8, 3, stride=2, padding=1)
        self.second = nn.Conv3d(8, 16, 3, stride=2, padding=1)

    def forward(self, ct: torch.Tensor) -> list[torch.Tensor]:
        first = F.relu(self.first(ct))
        return [first, F.relu(self.second(first))]


def select_inputs(inputs: ModelInputs, index: torch.Tensor) -> ModelInputs:
    """The rows ``index`` of every input (repeats allowed): one row per (case, question) pair."""

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index.to(t.device))

    text = None if inputs.text is None else [inputs.text[i] for i in index.tolist()]
    return ModelInputs(rows(inputs.ct), rows(inputs.phase_mask), rows(inputs.endoscopy), text, rows(inputs.table))


class TinyEncoder(nn.Module):
    """The multimodal encoder's interface (``dim``, ``tokenizer``, ``vision.channels``, ``encode_text``, forward
    with a query) over a few random-weight layers: tokens are the deepest map's voxels, then the query's words."""

    def __init__(self, in_channels: int, dim: int = DIM):
        super().__init__()
        self.dim = dim
        self.tokenizer = offline_tokenizer()
        self.vision = TinyVision(in_channels)
        self.project = nn.Linear(self.vision.channels[-1], dim)
        self.words = nn.Embedding(self.tokenizer.vocab_size, dim)

    def _words(self, texts: list[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.tokenizer([t or "" for t in texts], padding=True, return_tensors="pt")
        return self.words(batch.input_ids), batch.attention_mask.bool()

    def encode_text(self, texts: list[str | None]) -> torch.Tensor:
        tokens, mask = self._words(texts)
        return (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)

    def forward(
        self, inputs: ModelInputs, query: list[str] | None = None, case_index: torch.Tensor | None = None
    ) -> Encoded:
        if case_index is not None:  # one row per question, as the real encoder's repeated features
            inputs = select_inputs(inputs, case_index)
        maps = self.vision(inputs.ct)
        tokens = self.project(maps[-1].flatten(2).transpose(1, 2))
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool)
        image = tokens.mean(1)
        pooled = image
        if query is not None:
            words, word_mask = self._words(query)
            tokens, mask = torch.cat([tokens, words], 1), torch.cat([mask, word_mask], 1)
            pooled = pooled + self.encode_text(query)
        return Encoded(pooled=pooled, tokens=tokens, token_mask=mask, image=image, feature_maps=maps)


def random_inputs(batch_size: int, channels: int = 2, shape: tuple[int, int, int] = (8, 16, 16)) -> ModelInputs:
    generator = torch.Generator().manual_seed(batch_size)
    return ModelInputs(
        ct=torch.randn(batch_size, channels, *shape, generator=generator),
        phase_mask=torch.ones(batch_size, channels, dtype=torch.bool),
        text=[f"text {i}" for i in range(batch_size)],
        table=torch.randn(batch_size, 6, generator=generator),
    )


def random_encoded(batch_size: int, seed: int = 0) -> Encoded:
    generator = torch.Generator().manual_seed(seed)
    return Encoded(
        pooled=torch.randn(batch_size, DIM, generator=generator, requires_grad=True),
        tokens=torch.randn(batch_size, 5, DIM, generator=generator),
        token_mask=torch.ones(batch_size, 5, dtype=torch.bool),
        image=torch.randn(batch_size, DIM, generator=generator),
        feature_maps=[torch.randn(batch_size, 8, 4, 8, 8, generator=generator)],
    )


class FixedEncoder(nn.Module):
    """Hands back one given :class:`Encoded` whatever the inputs."""

    def __init__(self, encoded: Encoded):
        super().__init__()
        self.encoded, self.dim = encoded, encoded.pooled.shape[1]

    def forward(self, inputs: ModelInputs, query: list[str] | None = None) -> Encoded:
        return self.encoded


# --- demo data -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_batch(demo_prepared) -> dict:
    """The first training shard (4 cases) as one collated batch."""
    return first_shard_batch(demo_prepared.shard_dir)


@pytest.fixture(scope="module")
def train_rows(demo_prepared) -> list[dict]:
    return split_rows(demo_prepared.shard_dir, "train")


def task_model(name: str, train_rows: list[dict], schema_name: str = "image_only", **options) -> TaskModel:
    torch.manual_seed(0)
    schema = DETECTION_SCHEMA if name == "lesion_detection" else resolve_schema(schema_name)
    task = build_task(name, **options)
    task.prepare(train_rows)
    return TaskModel(task, TinyEncoder(input_channels(schema)), schema)


def without(batch: dict, keep: list[int]) -> dict:
    """The cases ``keep`` of a collated batch."""
    index = torch.tensor(keep)
    return {k: v.index_select(0, index) if torch.is_tensor(v) else [v[i] for i in keep] for k, v in batch.items()}


# --- registry and declarations -----------------------------------------------------------------------------


def test_unknown_task_names_every_valid_task():
    with pytest.raises(ValueError, match="unknown task 'segmentation'") as error:
        build_task("segmentation")
    assert all(name in str(error.value) for name in TASKS)


def test_unknown_option_names_the_valid_options():
    with pytest.raises(ValueError, match="tnm_heads"):
        build_task("stage_classification", tnm_head=True)


def test_every_task_declares_primary_metric_and_direction():
    assert tuple(TASK_CLASSES) == TASKS
    for name in TASKS:
        assert task_class(name).name == name and task_class(name).mode in ("max", "min")
    for name in TASKS:  # an empty evaluation gives NaN, under the primary metric's key too
        task = build_task(name)
        if name == "vqa":
            task.prepare([vqa_row("train", [("yes", "yes_no")])])
        empty = task.metric().compute()
        assert task.primary_metric in empty and all(math.isnan(v) for v in empty.values())


def test_task_model_refuses_a_leaking_schema(train_rows):
    task = build_task("lesion_detection")
    task.prepare(train_rows)
    schema = resolve_schema("image_bbox")  # gives the tumour box, which detection predicts
    with pytest.raises(LeakageError, match="box_cues_in_detection"):
        TaskModel(task, TinyEncoder(input_channels(schema)), schema)


def test_prepare_takes_training_rows_only(train_rows, demo_prepared):
    val_rows = split_rows(demo_prepared.shard_dir, "val")
    for name in ("vqa", "lesion_detection"):
        with pytest.raises(ValueError, match="training rows only"):
            build_task(name).prepare(train_rows + val_rows)


# --- stage classification ---------------------------------------------------------------------------------


def test_stage_head_shapes_and_tnm_heads():
    task = build_task("stage_classification", tnm_heads=True)
    head = task.build_head(DIM)
    logits = head(torch.randn(3, DIM))
    assert {k: tuple(v.shape) for k, v in logits.items()} == {"stage": (3, 4), "t": (3, 7), "n": (3, 5), "m": (3, 2)}
    assert set(build_task("stage_classification").build_head(DIM)(torch.randn(3, DIM))) == {"stage"}


def test_stage_loss_ignores_unlabelled_cases():
    task = build_task("stage_classification")
    encoded = random_encoded(4)
    head = task.build_head(DIM).eval()
    batch = {"stage_label": torch.tensor([2, -1, 0, -1]), "t": [None] * 4, "n": [None] * 4, "m": [None] * 4}
    outputs = task.forward(FixedEncoder(encoded), head, random_inputs(4), batch)
    loss = task.loss(outputs, batch)
    expected = F.cross_entropy(outputs["logits"]["stage"][[0, 2]], torch.tensor([2, 0]))
    assert torch.isfinite(loss) and torch.allclose(loss, expected)

    unlabelled = {**batch, "stage_label": torch.full((4,), -1)}
    nothing = task.loss(outputs, unlabelled)
    nothing.backward()  # still part of the graph
    assert nothing.item() == 0.0 and encoded.pooled.grad is not None


def test_stage_tnm_loss_adds_weighted_auxiliary_terms():
    task = build_task("stage_classification", tnm_heads=True, tnm_weight=0.5)
    head = task.build_head(DIM).eval()
    batch = {"stage_label": torch.tensor([1, 3]), "t": ["T3", None], "n": ["N1", "N3b"], "m": ["M0", "M1"]}
    outputs = task.forward(FixedEncoder(random_encoded(2)), head, random_inputs(2), batch)
    logits = outputs["logits"]
    expected = (
        F.cross_entropy(logits["stage"], torch.tensor([1, 3]))
        + 0.5 * F.cross_entropy(logits["t"][:1], torch.tensor([4]))  # T3; the unknown T is ignored
        + 0.5 * F.cross_entropy(logits["n"], torch.tensor([1, 4]))
        + 0.5 * F.cross_entropy(logits["m"], torch.tensor([0, 1]))
    )
    assert torch.allclose(task.loss(outputs, batch), expected)


def test_stage_metric_equals_classification_metrics_of_labelled_cases():
    task = build_task("stage_classification")
    rng = np.random.default_rng(0)
    metric = task.metric()
    probabilities, labels = [], []
    for _ in range(3):
        logits = torch.tensor(rng.normal(size=(5, 4)), dtype=torch.float32)
        label = torch.tensor(rng.integers(-1, 4, size=5))
        metric.update({"logits": {"stage": logits}}, {"stage_label": label})
        probabilities.append(logits.softmax(-1).numpy()[label.numpy() >= 0])
        labels.append(label.numpy()[label.numpy() >= 0])
    expected = classification_metrics(np.concatenate(probabilities), np.concatenate(labels))
    assert metric.compute() == pytest.approx(expected)


def test_stage_predictions_name_the_groups(demo_batch, train_rows):
    model = task_model("stage_classification", train_rows).eval()
    with torch.no_grad():
        outputs = model(demo_batch)
    records = model.task.predict(outputs, demo_batch)
    assert [r["case_id"] for r in records] == demo_batch["case_id"]
    for record, label in zip(records, demo_batch["stage_label"].tolist(), strict=True):
        assert record["prediction"] in STAGE_GROUPS
        assert record["target"] == (STAGE_GROUPS[label] if label >= 0 else None)
        assert sum(record["probabilities"]) == pytest.approx(1.0, abs=1e-3)


# --- VQA ----------------------------------------------------------------------------------------------


def vqa_row(split: str, answers: list[tuple[str, str]]) -> dict:
    """One row of ``split`` with a question for each ``(answer, category)``."""
    return {
        "split": split,
        "vqa": [{"question": f"q {a}?", "answer": a, "category": c} for a, c in answers],
    }


def test_vqa_vocabulary_comes_from_training_rows_only(train_rows, demo_prepared):
    task = build_task("vqa")
    task.prepare([vqa_row("train", [("yes", "yes_no"), ("antrum", "localization")])])
    assert task.answers == (UNKNOWN_ANSWER, "antrum", "yes")
    assert task.answer_index("antrum") == 1 and task.answer_index("cardia") == 0  # seen only elsewhere

    task.prepare(train_rows)
    train_answers = {item["answer"] for row in train_rows for item in row["vqa"]}
    val_answers = {item["answer"] for row in split_rows(demo_prepared.shard_dir, "val") for item in row["vqa"]}
    assert val_answers - train_answers, "the demo cohort's val split has answers unseen in training"
    assert set(task.answers[1:]) == train_answers
    assert all(task.answer_index(a) == 0 for a in val_answers - train_answers)
    assert all(task.answers[task.answer_index(a)] == a for a in train_answers)


def test_prepare_reads_ray_data_rows_as_arrow_rows(demo_prepared, train_rows, ray_cluster):
    """The training loop may hand over rows from Ray Data (NumPy arrays inside): same vocabulary, same anchors."""
    columns = ["split", "vqa", "boxes", "box_present"]
    ray_rows = read_split(demo_prepared.shard_dir, "train", columns=columns).take_all()
    for name in ("vqa", "lesion_detection"):
        from_arrow, from_ray = build_task(name), build_task(name)
        from_arrow.prepare(train_rows)
        from_ray.prepare(ray_rows)
        fitted = "answers" if name == "vqa" else "anchor_shapes"
        assert getattr(from_ray, fitted) == getattr(from_arrow, fitted)


def test_vqa_repeats_each_case_once_per_question(demo_batch, train_rows):
    model = task_model("vqa", train_rows, "image_table", max_questions_per_case=2).eval()
    with torch.no_grad():
        outputs = model(demo_batch)
    counts = [len(items) for items in demo_batch["vqa"]]
    assert outputs["case_index"].tolist() == [i for i, n in enumerate(counts) for _ in range(n)]  # eval: all
    assert outputs["logits"].shape == (sum(counts), len(model.task.answers) - 1)  # no logit for <unk>
    assert outputs["questions"] == [item["question"] for items in demo_batch["vqa"] for item in items]

    model.train()
    capped = model(demo_batch)
    assert np.bincount(capped["case_index"].numpy()).tolist() == [min(2, n) for n in counts]
    loss = model.task.loss(capped, demo_batch)
    assert torch.isfinite(loss) and loss.item() > 0

    inputs = build_inputs(demo_batch, model.schema)
    index = torch.tensor([2, 0, 2])
    chosen = select_inputs(inputs, index)
    assert torch.equal(chosen.ct, inputs.ct[[2, 0, 2]]) and chosen.text == [inputs.text[i] for i in (2, 0, 2)]


def test_vqa_unseen_answers_count_wrong_and_are_not_learnt():
    task = build_task("vqa")
    task.prepare([vqa_row("train", [("yes", "yes_no"), ("no", "yes_no"), ("antrum", "localization")])])
    logits = torch.tensor([[0.0, 0.0, 5.0], [5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])  # predicts yes, antrum, no
    outputs = {
        "logits": logits,
        "targets": torch.tensor([task.answer_index(a) for a in ("yes", "cardia", "no")]),
        "categories": ["yes_no", "localization", "yes_no"],
    }
    assert outputs["targets"].tolist() == [3, 0, 2]
    metric = task.metric()
    metric.update(outputs, {})
    result = metric.compute()
    # the unseen answer is wrong whatever the logits: 2 of 3 right
    assert result["accuracy"] == pytest.approx(200 / 3)
    assert result["accuracy_yes_no"] == 100.0 and result["accuracy_localization"] == 0.0
    assert math.isnan(result["accuracy_lesion"])
    assert set(result) >= {"precision", "f1", "auc", *(f"accuracy_{c}" for c in VQA_CATEGORIES)}
    probabilities = np.concatenate([np.zeros((3, 1)), logits.softmax(-1).numpy()], axis=1)
    expected = classification_metrics(probabilities, np.array([3, 0, 2]))
    assert {k: result[k] for k in expected} == pytest.approx(expected)
    # the loss leaves the unseen answer out
    loss = task.loss(outputs, {})
    assert torch.allclose(loss, F.cross_entropy(logits[[0, 2]], torch.tensor([2, 1])))


def test_vqa_needs_a_fitted_vocabulary():
    with pytest.raises(RuntimeError, match="prepare"):
        build_task("vqa").build_head(DIM)


# --- report generation --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report_model(train_rows) -> TaskModel:
    return task_model(
        "report_generation", train_rows, decoder_width=32, decoder_layers=1, max_report_tokens=24, max_new_tokens=6
    )


def test_report_loss_is_teacher_forced_and_skips_cases_without_report(report_model, demo_batch):
    report_model.train()
    outputs = report_model(demo_batch)
    assert outputs["logits"].shape[:2] == outputs["labels"].shape
    assert outputs["logits"].shape[2] == len(report_model.encoder.tokenizer)
    loss = report_model.task.loss(outputs, demo_batch)
    assert torch.isfinite(loss) and loss.item() > 0

    no_reports = {**demo_batch, "ct_report": [None] * len(demo_batch["case_id"])}
    nothing = report_model.task.loss(report_model(no_reports), no_reports)
    nothing.backward()
    assert nothing.item() == 0.0

    # a case whose report is missing changes nothing for the others
    partly = {**demo_batch, "ct_report": [None, *demo_batch["ct_report"][1:]]}
    report_model.eval()  # no dropout
    with torch.no_grad():
        both = report_model.task.loss(report_model(partly), partly)
        rest = report_model.task.loss(report_model(without(demo_batch, [1, 2, 3])), without(demo_batch, [1, 2, 3]))
    assert both.item() == pytest.approx(rest.item(), rel=1e-4)


def until_end(ids: list[int], end: int) -> list[int]:
    """The tokens after the start token and before the first end token."""
    ids = ids[1:]
    return ids[: ids.index(end)] if end in ids else ids


def test_report_decoding_returns_strings_greedy_equals_argmax(report_model, demo_batch):
    report_model.eval()
    with torch.no_grad():
        outputs = report_model(demo_batch)
        encoded = report_model.encoder(build_inputs(demo_batch, report_model.schema))
        head = report_model.head
        # greedy decoding by hand: repeatedly append the arg-max token
        tokens = torch.full((len(demo_batch["case_id"]), 1), head.tokenizer.cls_token_id)
        for _ in range(6):
            logits = head(tokens, torch.ones_like(tokens), encoded.tokens, encoded.token_mask)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], 1)
        beams = head.generate(encoded.tokens, encoded.token_mask, num_beams=3, max_new_tokens=6)
    by_hand = [head.tokenizer.decode(until_end(t.tolist(), head.tokenizer.sep_token_id)) for t in tokens]
    assert outputs["generated"] == by_hand
    assert all(isinstance(text, str) for text in beams) and len(beams) == len(by_hand)

    # the targets are the reports as the model is taught them: their first max_report_tokens tokens
    targets = report_model.task.target_texts(demo_batch["ct_report"])
    assert all(report.startswith(target) for report, target in zip(demo_batch["ct_report"], targets, strict=True))
    assert any(len(t) < len(r) for r, t in zip(demo_batch["ct_report"], targets, strict=True))  # some were cut
    records = report_model.task.predict(outputs, demo_batch)
    assert [r["target"] for r in records] == targets
    metric = report_model.task.metric()
    metric.update(outputs, demo_batch)
    expected = text_generation_metrics(outputs["generated"], targets, metrics=FAST_TEXT_METRICS)
    assert metric.compute() == pytest.approx(expected)


def test_the_report_decoder_reads_the_pooled_memory_at_every_step(train_rows, demo_batch):
    options = {"decoder_width": 32, "decoder_layers": 1, "max_report_tokens": 24, "max_new_tokens": 6,
               "pooled_memory": True}  # fmt: skip
    model = task_model("report_generation", train_rows, **options).eval()
    head = model.head
    with torch.no_grad():
        encoded = model.encoder(build_inputs(demo_batch, model.schema))
        memory, mask = encoded.tokens, encoded.token_mask
        start = torch.full((memory.shape[0], 1), head.tokenizer.cls_token_id)
        plain = head(start, torch.ones_like(start), memory, mask)[:, 0]
        # the pooled-memory path starts at zero (the decoder as without it); training makes it matter
        nn.init.normal_(head.condition.weight)
        first = head(start, torch.ones_like(start), memory, mask)[:, 0]
        assert not torch.allclose(first, plain, atol=1e-3)
        # each case gets its own memory's vector, at the first token already
        swapped = head(start, torch.ones_like(start), memory.flip(0), mask.flip(0))[:, 0]
        assert torch.allclose(swapped, first.flip(0), atol=1e-5) and not torch.allclose(swapped, first, atol=1e-3)
        # generation reads it too: greedy equals the arg-max by hand, and a case's beams are its own
        tokens = start
        for _ in range(6):
            logits = head(tokens, torch.ones_like(tokens), memory, mask)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], 1)
        by_hand = [head.tokenizer.decode(until_end(t.tolist(), head.tokenizer.sep_token_id)) for t in tokens]
        assert head.generate(memory, mask, num_beams=1, max_new_tokens=6) == by_hand
        beams = head.generate(memory, mask, num_beams=3, max_new_tokens=6)
        alone = [head.generate(memory[i : i + 1], mask[i : i + 1], num_beams=3, max_new_tokens=6)[0] for i in range(2)]
        assert beams[:2] == alone
        assert head._condition is None  # nothing left behind for a later call


def test_a_training_vocabulary_decoder_reads_and_writes_only_the_training_reports_tokens(train_rows, demo_batch):
    options = {"decoder_width": 32, "decoder_layers": 1, "max_report_tokens": 24, "max_new_tokens": 6}
    model = task_model("report_generation", train_rows, vocabulary="training", **options)
    head, tokenizer = model.head, model.encoder.tokenizer
    taught = tokenizer([r["ct_report"] for r in train_rows if r["ct_report"]], truncation=True, max_length=24)
    specials = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    kept = sorted(specials | {i for ids in taught["input_ids"] for i in ids})
    assert head.kept_tokens.tolist() == kept and len(kept) < len(tokenizer) // 50
    model.train()
    outputs = model(demo_batch)
    assert outputs["logits"].shape[2] == len(kept)  # one logit per kept token
    # the labels are the decoder's own ids of the same tokens; a token training never showed is [UNK]
    taught_ids = tokenizer(demo_batch["ct_report"], truncation=True, max_length=24, padding=True).input_ids
    labels = outputs["labels"]
    real = labels != IGNORE
    assert torch.equal(
        head.kept_tokens[labels[real]],
        torch.tensor([i if i in kept else tokenizer.unk_token_id for row in taught_ids for i in row])[real.flatten()],
    )
    unseen = next(i for i in range(len(tokenizer)) if i not in kept)
    assert head.to_own(torch.tensor([unseen, IGNORE])).tolist() == [kept.index(tokenizer.unk_token_id), IGNORE]
    # greedy decoding by hand, in the decoder's own ids mapped back to the tokenizer's
    model.eval()
    with torch.no_grad():
        generated = model(demo_batch)["generated"]
        encoded = model.encoder(build_inputs(demo_batch, model.schema))
        tokens = torch.full((len(demo_batch["case_id"]), 1), tokenizer.cls_token_id)
        for _ in range(6):
            logits = head(tokens, torch.ones_like(tokens), encoded.tokens, encoded.token_mask)
            tokens = torch.cat([tokens, head.kept_tokens[logits[:, -1].argmax(-1, keepdim=True)]], 1)
    assert generated == [tokenizer.decode(until_end(t.tolist(), tokenizer.sep_token_id)) for t in tokens]
    assert set(tokens.flatten().tolist()) <= set(kept)


def test_a_training_vocabulary_needs_the_small_decoder_and_training_reports():
    with pytest.raises(ValueError, match="vocabulary 'training' is for the small random decoder"):
        build_task("report_generation", vocabulary="training", decoder="minilm")
    with pytest.raises(ValueError, match="unknown report vocabulary 'words'"):
        build_task("report_generation", vocabulary="words")
    with pytest.raises(RuntimeError, match="call prepare"):
        build_task("report_generation", vocabulary="training").build_head(8, offline_tokenizer())


def test_report_full_metrics_option_asks_for_all_four():
    assert build_task("report_generation", full_metrics=True).metric().metrics == (
        "rouge_l",
        "bleu_4",
        "meteor",
        "bertscore_f1",
    )
    assert build_task("report_generation").metric().metrics == FAST_TEXT_METRICS


# --- retrieval ----------------------------------------------------------------------------------------


def test_retrieval_embeddings_are_unit_and_loss_is_symmetric_info_nce(demo_batch, train_rows):
    model = task_model("retrieval", train_rows, "image_table", embedding_dim=8).train()
    batch = {**demo_batch, "ct_report": [None, *demo_batch["ct_report"][1:]]}
    outputs = model(batch)
    assert outputs["image"].shape == outputs["text"].shape == (3, 8)  # the case without a report is left out
    assert outputs["case_ids"] == batch["case_id"][1:]
    assert torch.allclose(outputs["image"].norm(dim=-1), torch.ones(3))
    logits = outputs["scale"] * outputs["image"] @ outputs["text"].T
    expected = (F.cross_entropy(logits, torch.arange(3)) + F.cross_entropy(logits.T, torch.arange(3))) / 2
    assert torch.allclose(model.task.loss(outputs, batch), expected)
    assert outputs["scale"].item() == pytest.approx(1 / 0.07, rel=1e-4)


def test_retrieval_metric_equals_retrieval_metrics_on_gathered_embeddings():
    task = build_task("retrieval")
    rng = np.random.default_rng(3)
    metric = task.metric()
    images, texts = [], []
    for size in (4, 3, 5):
        image = F.normalize(torch.tensor(rng.normal(size=(size, 6)), dtype=torch.float32), dim=-1)
        text = F.normalize(image + 0.8 * torch.tensor(rng.normal(size=(size, 6)), dtype=torch.float32), dim=-1)
        metric.update({"image": image, "text": text}, {})
        images.append(image.numpy())
        texts.append(text.numpy())
    similarity = np.concatenate(images).astype(np.float64) @ np.concatenate(texts).astype(np.float64).T
    result = metric.compute()
    for direction, matrix in (("image_to_text", similarity), ("text_to_image", similarity.T)):
        expected = retrieval_metrics(matrix)
        assert {k: result[f"{direction}_{k}"] for k in expected} == pytest.approx(expected)


def test_info_nce_is_low_for_matched_pairs():
    image = F.normalize(torch.randn(6, 8), dim=-1)
    matched = info_nce(image, image, torch.tensor(50.0))
    shuffled = info_nce(image, image[torch.randperm(6)], torch.tensor(50.0))
    assert matched.item() < 0.1 < shuffled.item()


# --- lesion detection ---------------------------------------------------------------------------------


def test_detection_anchor_shapes_come_from_training_boxes(train_rows):
    task = build_task("lesion_detection")
    task.prepare(train_rows)
    sizes = []
    for row in train_rows:
        boxes, present = tumour_boxes(row["boxes"], row["box_present"])
        sizes += [b[3:] - b[:3] for b in boxes[present]]
    expected = np.maximum(np.quantile(np.array(sizes), (0.2, 0.5, 0.8), axis=0), 2.0)
    assert np.allclose(task.anchor_shapes, expected)
    with pytest.raises(RuntimeError, match="prepare"):
        build_task("lesion_detection").build_head(DIM, map_channels=[8])


def test_head_maps_are_flattened_in_monai_anchor_order(train_rows):
    """Logits line up with MONAI's anchors only if they are ordered as MONAI's own (private) reshape does."""
    model = task_model("lesion_detection", train_rows, head_channels=8)
    maps = torch.randn(2, 3 * 6, 2, 3, 4)
    assert torch.equal(flatten_maps([maps], 3), model.head._reshape_maps([maps]))


def test_tumour_boxes_are_the_venous_tumour_level():
    boxes = np.zeros((1, len(PHASES), len(BOX_LEVELS), 6), dtype=np.int32)
    present = np.zeros((1, len(PHASES) * len(BOX_LEVELS)), dtype=bool)
    phase, level = PHASES.index("venous"), BOX_LEVELS.index("tumour")
    boxes[0, phase, level] = (1, 2, 3, 4, 5, 6)
    present[0, phase * len(BOX_LEVELS) + level] = True
    chosen, has = tumour_boxes(boxes, present)
    assert chosen.tolist() == [[1, 2, 3, 4, 5, 6]] and has.tolist() == [True]


def test_detection_predictions_are_well_formed(demo_batch, train_rows):
    model = task_model("lesion_detection", train_rows, head_channels=8, feature_level=0, score_threshold=0.0)
    model.eval()
    with torch.no_grad():
        outputs = model(demo_batch)
    shape = demo_batch["ct"].shape[2:]
    assert len(outputs["detections"]) == len(demo_batch["case_id"])
    for detection in outputs["detections"]:
        boxes, scores = detection["boxes"], detection["scores"]
        assert boxes.ndim == 2 and boxes.shape[1] == 6 and len(boxes) == len(scores) > 0
        assert len(boxes) <= model.task.detections_per_case
        assert (boxes[:, 3:] > boxes[:, :3]).all() and (boxes[:, :3] >= 0).all()
        assert (boxes[:, 3:] <= np.array(shape)).all()
        assert ((scores >= 0) & (scores <= 1)).all() and (np.diff(scores) <= 0).all()
    records = model.task.predict(outputs, demo_batch)
    targets, present = tumour_boxes(demo_batch["boxes"], demo_batch["box_present"])
    assert [r["target"] is not None for r in records] == present.tolist()

    metric = model.task.metric()
    metric.update(outputs, demo_batch)
    keep = np.flatnonzero(present)  # cases without a tumour box are left out of the metric
    expected = detection_metrics(
        [outputs["detections"][i] for i in keep], [{"boxes": targets[i : i + 1]} for i in keep]
    )
    assert metric.compute() == pytest.approx(expected, nan_ok=True)


def test_detection_loss_comes_only_from_cases_with_a_tumour_box(demo_batch, train_rows):
    model = task_model("lesion_detection", train_rows, head_channels=8).train()
    _, present = tumour_boxes(demo_batch["boxes"], demo_batch["box_present"])
    assert present.any()
    loss = model.task.loss(model(demo_batch), demo_batch)
    assert torch.isfinite(loss) and loss.item() > 0

    unannotated = {**demo_batch, "box_present": torch.zeros_like(demo_batch["box_present"])}
    nothing = model.task.loss(model(unannotated), unannotated)
    nothing.backward()
    assert nothing.item() == 0.0


class _Features(nn.Module):
    """An encoder whose one feature map is given (``inputs.features``): what the detection head reads, and no more."""

    def forward(self, inputs):
        return Encoded(pooled=None, tokens=None, token_mask=None, image=None, feature_maps=[inputs.features])


@pytest.mark.parametrize("informative", [True, False])
def test_detection_learns_boxes_when_its_features_carry_them_and_not_otherwise(informative):
    """The head, MONAI's ATSS matcher, box coder, losses and box selection as the task wires them: given feature maps
    that are the tumour masks themselves (space-to-depth at the head's stride 4), 40 steps fit eight random boxes of
    3-7 voxels a side at IoU 0.5; given blank maps, every case gets the same boxes and AP50 stays low.

    A head of 16 channels fits sooner than one of 64, at half the seconds a step: seed 0 is at AP50 95 after 10 steps
    and 100 from 20 to 60; seeds 1-3 at 100 from step 25, seed 4 between 81 and 100 from step 20 (100 at 40); seed 5
    stops at 87.1 (one box of eight missed), as it does with 64 channels and 100 steps. Blank maps: 10-14 at 40."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    shape, stride, n = (16, 32, 32), 4, 8
    starts = np.stack([rng.integers(0, side - 8, n) for side in shape], 1)
    boxes = np.concatenate([starts, starts + rng.integers(3, 8, (n, 3))], 1).astype(np.float32)
    full = np.zeros((n, len(PHASES), len(BOX_LEVELS), 6), np.float32)
    present = np.zeros((n, len(PHASES), len(BOX_LEVELS)), bool)
    full[:, PHASES.index("venous"), BOX_LEVELS.index("tumour")] = boxes
    present[:, PHASES.index("venous"), BOX_LEVELS.index("tumour")] = True
    batch = {"boxes": torch.from_numpy(full), "box_present": torch.from_numpy(present)}
    rows = [{"boxes": full[i].ravel(), "box_present": present[i].ravel(), "split": "train"} for i in range(n)]
    task = build_task("lesion_detection", feature_level=0, head_channels=16)
    task.prepare(rows)
    head = task.build_head(1, None, map_channels=[stride**3])
    masks = torch.zeros(n, 1, *shape)
    for i, (z0, y0, x0, z1, y1, x1) in enumerate(boxes.astype(int)):
        masks[i, 0, z0:z1, y0:y1, x0:x1] = 1.0
    d, h, w = (side // stride for side in shape)
    cells = masks.view(n, 1, d, stride, h, stride, w, stride).permute(0, 1, 3, 5, 7, 2, 4, 6)
    features = cells.reshape(n, stride**3, d, h, w) if informative else torch.zeros(n, stride**3, d, h, w)
    inputs = type("Inputs", (), {"ct": masks, "features": features, "batch_size": n})()
    encoder, optimiser = _Features(), torch.optim.Adam(head.parameters(), 1e-3)
    for _ in range(40):
        loss = task.loss(task.forward(encoder, head.train(), inputs, batch), batch)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    metric = task.metric()
    with torch.no_grad():
        metric.update(task.forward(encoder, head.eval(), inputs, batch), batch)
    ap50 = metric.compute()["ap_50"]
    assert ap50 >= 90.0 if informative else ap50 <= 30.0, ap50


# --- metrics under DDP ----------------------------------------------------------------------------------

DDP_WORKER = """
import pickle, sys
import torch.distributed as dist

rank, world_size, init_file, job_file, out_file = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:]
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
with open(job_file, "rb") as f:
    metrics, batches = pickle.load(f)
for name, outputs, batch in batches:
    metrics[name].update(outputs, batch)
result = {name: metric.compute() for name, metric in metrics.items()}
with open(out_file, "wb") as f:
    pickle.dump(result, f)
dist.destroy_process_group()
"""


def fresh_metrics() -> dict:
    vqa = build_task("vqa")
    vqa.prepare([vqa_row("train", [("yes", "yes_no"), ("no", "yes_no"), ("antrum", "localization")])])
    return {"vqa": vqa.metric(), **{name: build_task(name).metric() for name in ("stage_classification", "retrieval")}}


def rank_batches(rank: int) -> list[tuple[str, dict, dict]]:
    """One rank's evaluation batches (task, outputs, batch), of other sizes on each rank."""
    rng = np.random.default_rng(10 + rank)
    batches = []
    for size in (3 + rank, 2):
        logits = torch.tensor(rng.normal(size=(size, 4)), dtype=torch.float32)
        labels = torch.tensor(rng.integers(-1, 4, size=size))
        batches.append(("stage_classification", {"logits": {"stage": logits}}, {"stage_label": labels}))
        image = F.normalize(torch.tensor(rng.normal(size=(size, 5)), dtype=torch.float32), dim=-1)
        text = F.normalize(image + torch.tensor(rng.normal(size=(size, 5)), dtype=torch.float32), dim=-1)
        batches.append(("retrieval", {"image": image, "text": text}, {}))
        vqa = {
            "logits": torch.tensor(rng.normal(size=(size, 3)), dtype=torch.float32),
            "targets": torch.tensor(rng.integers(0, 4, size=size)),
            "categories": list(rng.choice(["yes_no", "localization"], size=size)),
        }
        batches.append(("vqa", vqa, {}))
    return batches


def computed(batches: list[tuple[str, dict, dict]]) -> dict[str, dict[str, float]]:
    metrics = fresh_metrics()
    for name, outputs, batch in batches:
        metrics[name].update(outputs, batch)
    return {name: metric.compute() for name, metric in metrics.items()}


def test_metrics_gather_every_rank_under_ddp(tmp_path):
    """Two gloo processes, each with its own batches: both compute the metrics of the union."""
    world_size = 2
    workers = []
    for rank in range(world_size):
        job = tmp_path / f"job{rank}.pkl"
        job.write_bytes(pickle.dumps((fresh_metrics(), rank_batches(rank))))
        arguments = [str(rank), str(world_size), str(tmp_path / "init"), str(job), str(tmp_path / f"out{rank}.pkl")]
        workers.append(subprocess.Popen([sys.executable, "-c", DDP_WORKER, *arguments], cwd=ROOT))
    assert [w.wait(timeout=120) for w in workers] == [0] * world_size
    results = [pickle.loads((tmp_path / f"out{rank}.pkl").read_bytes()) for rank in range(world_size)]
    union = computed(rank_batches(0) + rank_batches(1))
    own = computed(rank_batches(0))
    for name in union:
        expected = pytest.approx(union[name], nan_ok=True)
        assert results[0][name] == expected and results[1][name] == expected
        assert results[0][name] != pytest.approx(own[name], nan_ok=True)  # not just the rank's own batches
