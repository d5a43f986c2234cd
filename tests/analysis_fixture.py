"""A constructed tidy runs table (the contract of :mod:`gx_ray.analysis.runs`) with known effects, for tests."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gx_ray.analysis.runs import RUN_COLUMNS

TASK_METRICS = {
    "vqa": ("accuracy", "f1", "auc"),
    "report_generation": ("rouge_l", "bleu_4"),
    "retrieval": ("image_to_text_recall_at_5", "image_to_text_median_rank"),
    "stage_classification": ("auc", "f1"),
    "lesion_detection": ("ap_50", "map_50_95"),
}
SCHEMAS = ("image_only", "image_table", "image_bbox", "image_table_bbox")


def make_runs(
    effects: dict[str, float] | None = None,
    seeds: int = 3,
    noise: float = 0.5,
    tasks: tuple[str, ...] = tuple(TASK_METRICS),
    models: tuple[tuple[str, str, str], ...] = (("resnet10_3d", "bert_tiny", "concat"),),
    searched: dict[str, list] | None = None,
    rng_seed: int = 0,
) -> pd.DataFrame:
    """Every task x schema x model x seed as a finished trial; ``effects``: schema -> shift of every metric.

    A metric's test value is ``50 + effect + seed noise`` (ranks: ``20 - effect + noise``, lower is better); the
    validation value is the test value plus 1. ``searched``: parameter -> values, cycled over the trials.
    """
    effects = effects if effects is not None else {s: 2.0 * i for i, s in enumerate(SCHEMAS)}
    rng = np.random.default_rng(rng_seed)
    rows, trial = [], 0
    for task in tasks:
        for vision, text, fusion in models:
            for schema, effect in effects.items():
                for seed in range(seeds):
                    trial += 1
                    params = {k: v[trial % len(v)] for k, v in (searched or {}).items()}
                    for metric in TASK_METRICS[task]:
                        rank = metric.endswith(("median_rank", "mean_rank"))
                        test = (20.0 - effect if rank else 50.0 + effect) + rng.normal(0, noise)
                        for split, value in (("val", test + 1.0), ("test", test)):
                            rows.append(
                                {
                                    "sweep_id": "fixture",
                                    "run_id": f"run{trial:03d}",
                                    "trial": f"trial-{trial:03d}",
                                    "status": "FINISHED",
                                    "start_time": 1_700_000_000_000 + 1000 * trial,
                                    "task": task,
                                    "schema": schema,
                                    "model": f"{vision}+{text}",
                                    "vision": vision,
                                    "text": text,
                                    "fusion": fusion,
                                    "seed": seed,
                                    "split": split,
                                    "metric": metric,
                                    "value": float(value),
                                    **params,
                                }
                            )
    table = pd.DataFrame(rows, columns=[*RUN_COLUMNS, *(searched or {})])
    table.attrs["searched"] = list(searched or {})
    return table
