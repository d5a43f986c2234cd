"""Appearance-based hard negatives for lesion QA (CT-Bench's first distractor kind): lesions that look alike, as an
encoder trained on the training split sees them.

A 2D MONAI ResNet-10 over each case's key-slice view (venous, soft-tissue window, no box) is trained CLIP-style on the
training split only, into the space of the lesion descriptions' frozen MiniLM embeddings: views it places close are
lesions whose descriptions a reader could confuse (the whole-volume retrieval encoder would rank CTs, not lesions).
A case's neighbours are the other cases of its own split, nearest first by cosine (:func:`nearest_neighbours`).
Everything is seeded; a sweep computes it once per cohort (:func:`~gx_ray.tasks.lesion_qa.write_question_file`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray.data.shards import BatchCollate, TensorLayout, hounsfield, open_shard, split_files
from gx_ray.modalities.boxes import TARGET_PHASE, tumour_boxes
from gx_ray.modalities.views import lesion_view
from gx_ray.schema import PHASES

ENCODER_EPOCHS = 30
ENCODER_WIDTHS = [16, 32, 64, 128]
BATCH = 32
TEMPERATURE = 0.07
VIEW_COLUMNS = ["case_id", "ct", "ct_hu_mean", "ct_hu_std", "boxes", "box_present"]


def key_slice_views(
    shards: str, splits: Sequence[str] = ("train", "val", "test"), overlay: bool = False
) -> dict[str, np.ndarray]:
    """Each case's key-slice view ``(3, H, W)`` float16 (cases without a venous tumour box have none; its own box
    drawn in with ``overlay``), read one row group at a time: only the slices are kept, never the volumes."""
    phase = PHASES.index(TARGET_PHASE)
    views: dict[str, np.ndarray] = {}
    for split in splits:
        for path in split_files(shards, split):
            shard = open_shard(path)
            collate = BatchCollate(TensorLayout.from_schema(shard.schema_arrow))
            for group in range(shard.num_row_groups):
                batch = collate(shard.read_row_group(group, columns=VIEW_COLUMNS))
                boxes, present = tumour_boxes(batch["boxes"], batch["box_present"])
                ct = batch["ct"][:, phase].float().numpy()
                hu = hounsfield(ct, batch["ct_hu_mean"][:, phase].numpy(), batch["ct_hu_std"][:, phase].numpy())
                for i in np.flatnonzero(present):
                    view = lesion_view(hu[i], boxes[i].astype(int), 1, overlay=overlay)[0]
                    views[batch["case_id"][i]] = view.astype(np.float16)
    return views


def lesion_embeddings(
    views: Mapping[str, np.ndarray],
    descriptions: Mapping[str, str],
    seed: int = 0,
    epochs: int = ENCODER_EPOCHS,
    device: str | torch.device = "cpu",
) -> dict[str, np.ndarray]:
    """Train the view encoder on the cases of ``descriptions`` (training cases only: their views against their
    descriptions), then embed every view of ``views``: case → unit vector."""
    from gx_ray.models.text import masked_mean, minilm
    from gx_ray.models.vision import Endoscopy2d

    taught = sorted(c for c in descriptions if c in views)
    if len(taught) < 2:
        raise ValueError(
            f"the view encoder needs at least two training cases with a view and a description, not {taught}"
        )
    torch.manual_seed(seed)
    text = minilm().to(device).eval()
    with torch.no_grad():
        targets = torch.cat(
            [F.normalize(masked_mean(*text([descriptions[c] for c in taught[i : i + BATCH]])), dim=-1)
             for i in range(0, len(taught), BATCH)]
        )  # fmt: skip
    encoder = Endoscopy2d(10, in_channels=3, block_inplanes=ENCODER_WIDTHS)
    model = nn.Sequential(encoder, nn.Linear(encoder.dim, targets.shape[1])).to(device)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = torch.from_numpy(np.stack([views[c] for c in taught])).float()
    rng = np.random.default_rng(seed)
    model.train()
    for _ in range(epochs):
        order = rng.permutation(len(taught))
        for start in range(0, len(order) - 1, BATCH):  # a batch of one has no other description to tell apart
            index = torch.from_numpy(order[start : start + BATCH])
            if len(index) < 2:
                continue
            image = F.normalize(model(images[index].to(device)), dim=-1)
            logits = image @ targets[index.to(device)].T / TEMPERATURE
            labels = torch.arange(len(index), device=device)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
            loss.backward()
            optimiser.step()
            optimiser.zero_grad()
    model.eval()
    cases = sorted(views)
    embedded = []
    with torch.no_grad():
        for start in range(0, len(cases), BATCH):
            chunk = torch.from_numpy(np.stack([views[c] for c in cases[start : start + BATCH]])).float().to(device)
            embedded.append(F.normalize(model(chunk), dim=-1).cpu().numpy())
    return dict(zip(cases, np.concatenate(embedded), strict=True))


def nearest_neighbours(embeddings: Mapping[str, np.ndarray], split_of: Mapping[str, str]) -> dict[str, list[str]]:
    """Per case, the other cases of its own split, most similar first (cosine similarity; ties by case id)."""
    result: dict[str, list[str]] = {}
    for split in sorted(set(split_of.values())):
        cases = sorted(c for c, s in split_of.items() if s == split and c in embeddings)
        if not cases:
            continue
        vectors = np.stack([embeddings[c] for c in cases]).astype(np.float64)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True).clip(min=1e-12)
        similarity = vectors @ vectors.T
        for i, case in enumerate(cases):
            order = sorted((j for j in range(len(cases)) if j != i), key=lambda j: (-similarity[i, j], cases[j]))
            result[case] = [cases[j] for j in order]
    return result


def appearance_neighbours(
    shards: str, rows: Mapping[str, Sequence[Mapping[str, Any]]], descriptions: Mapping[str, str], seed: int = 0
) -> dict[str, list[str]]:
    """The neighbours of every case with a view: the encoder trained on the training split's ``descriptions``
    (``rows``: split → rows without images, for the splits), then :func:`nearest_neighbours`."""
    views = key_slice_views(shards, tuple(rows))
    train = {r["case_id"] for r in rows.get("train", ())}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    embeddings = lesion_embeddings(views, {c: d for c, d in descriptions.items() if c in train}, seed, device=device)
    return nearest_neighbours(embeddings, {r["case_id"]: split for split, part in rows.items() for r in part})
