"""Text padded to a few fixed bucket lengths: the extra padding changes no feature of a real token, nor a loss."""

from __future__ import annotations

import random

import pytest
import torch

from gx_ray.models import text
from gx_ray.models.encoded import Encoded
from gx_ray.models.text import TEXT_BUCKETS, bert_tiny, bucket_length, offline_tokenizer, tokenize_bucketed
from gx_ray.tasks import build_task
from gx_ray.tasks.report_generation import IGNORE

WORDS = ("gastric", "wall", "thickening", "antrum", "curvature", "lymph", "node", "enhancement", "ulcer", "normal")


def random_texts(rng: random.Random, max_words: int = 120) -> list[str | None]:
    """A batch of 1-6 texts of 0 (or None) to ``max_words`` words, some lengths far apart."""
    return [
        None if rng.random() < 0.1 else " ".join(rng.choices(WORDS, k=rng.randint(0, max_words)))
        for _ in range(rng.randint(1, 6))
    ]


@pytest.mark.parametrize("max_length", [1, 5, 8, 16, 20, 64, 100, 256, 512, 600, 40_000])
def test_bucket_length_is_the_smallest_bucket_holding_the_longest_text_capped_at_max_length(max_length):
    for longest in range(0, max_length + 1, max(1, max_length // 2000)):
        length = bucket_length(longest, max_length)
        assert longest <= length <= max_length
        assert length in TEXT_BUCKETS or length == max_length
        assert not any(longest <= b < length for b in TEXT_BUCKETS)


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return bert_tiny(max_length=200).eval()


def test_bucketed_text_features_equal_per_batch_padded_ones(encoder):
    rng = random.Random(0)
    lengths = set()
    for _ in range(20):
        texts = random_texts(rng)
        with torch.no_grad():
            hidden, mask = encoder(texts)
            batch = encoder.tokenizer(
                [t or "" for t in texts], padding=True, truncation=True, max_length=200, return_tensors="pt"
            )
            reference = encoder.model(**batch).last_hidden_state
        length, real = hidden.shape[1], batch["attention_mask"].bool()
        lengths.add(length)
        assert length == bucket_length(real.shape[1], 200) and (length in TEXT_BUCKETS or length == 200)
        assert torch.equal(mask[:, : real.shape[1]], real) and not mask[:, real.shape[1] :].any()
        torch.testing.assert_close(hidden[:, : real.shape[1]][real], reference[real], atol=1e-5, rtol=0)
    assert len(lengths) > 1  # the batches did meet several buckets


@pytest.fixture(autouse=True)
def buckets_on_the_cpu(monkeypatch):
    """The buckets are for GPUs (attention plans per shape); here the CPU stands in for one."""
    monkeypatch.setattr(text, "BUCKET_DEVICES", ("cuda", "cpu"))


def test_the_cpu_pads_to_the_longest_text_only(monkeypatch):
    monkeypatch.setattr(text, "BUCKET_DEVICES", ("cuda",))
    tokens = tokenize_bucketed(offline_tokenizer(), ["gastric ulcer", "a"], 100, "cpu")
    assert tokens.input_ids.shape[1] == tokens.attention_mask.sum(1).max() < 16


def test_tokenize_bucketed_truncates_and_treats_none_as_empty():
    tokenizer = offline_tokenizer()
    tokens = tokenize_bucketed(tokenizer, [None, "ulcer " * 300], 40, "cpu")
    assert tokens.input_ids.shape == (2, 40) and tokens.attention_mask.sum(1).tolist() == [2, 40]
    assert tokens.input_ids[0, :2].tolist() == [tokenizer.cls_token_id, tokenizer.sep_token_id]


def test_report_loss_is_the_same_with_bucketed_and_per_batch_padding(encoder):
    torch.manual_seed(0)
    task = build_task("report_generation", decoder_width=32, decoder_layers=1, max_report_tokens=100, max_new_tokens=2)
    head = task.build_head(8, encoder.tokenizer).eval()  # no dropout
    rng = random.Random(1)
    for _ in range(5):
        references = random_texts(rng)
        references[0] = references[0] or "gastric ulcer"  # at least one report to learn from
        size = len(references)
        memory, memory_mask = torch.randn(size, 5, 8), torch.ones(size, 5, dtype=torch.bool)
        encoded = Encoded(torch.zeros(size, 8), memory, memory_mask, torch.zeros(size, 8), [])
        batch = {task.column: references}
        with torch.no_grad():
            outputs = task.forward(lambda inputs, encoded=encoded: encoded, head, None, batch)
            # the former per-batch padding, by hand
            tokens = encoder.tokenizer(
                [r or "" for r in references], padding=True, truncation=True, max_length=100, return_tensors="pt"
            )
            has_report = torch.tensor([bool(r) for r in references])
            labels = tokens.input_ids.masked_fill(~tokens.attention_mask.bool() | ~has_report[:, None], IGNORE)
            logits = head(tokens.input_ids, tokens.attention_mask, memory, memory_mask)
            reference = task.loss({"logits": logits, "labels": labels}, batch)
        assert outputs["labels"].shape[1] == bucket_length(labels.shape[1], 100)
        assert torch.equal(outputs["labels"][:, : labels.shape[1]], labels)
        assert (outputs["labels"][:, labels.shape[1] :] == IGNORE).all()
        assert task.loss(outputs, batch).item() == pytest.approx(reference.item(), abs=1e-5)


def test_cudnn_attention_is_off_for_a_trial_unless_asked_for(monkeypatch):
    """cuDNN plans each new attention shape once (seconds per trial on a GPU): trials turn it off, a user can opt in."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        monkeypatch.delenv(text.CUDNN_ATTENTION_ENV, raising=False)
        assert text.choose_attention_backends() is False
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv(text.CUDNN_ATTENTION_ENV, "1")
        assert text.choose_attention_backends() is True
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
