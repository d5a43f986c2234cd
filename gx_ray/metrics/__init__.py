"""Metric functions shared by the tasks and by analysis, each checked against a reference implementation.

Every function takes plain arrays or lists (shapes in its docstring) and returns ``dict[str, float]`` keyed by
the metric names of the paper's tables (the ``metric`` column of the paper-results reference CSV), on the paper's
percent scale; ranks are plain ranks. Heavy dependencies (scipy.stats, MONAI, pycocotools, nltk, transformers) are
imported on first use.
"""

from gx_ray.metrics.classification import CLASSIFICATION_METRICS, classification_metrics
from gx_ray.metrics.detection import DETECTION_METRICS, detection_metrics, detection_metrics_axial
from gx_ray.metrics.mcq import MCQ_METRICS, mcq_metrics, parse_choice, wilson_interval
from gx_ray.metrics.retrieval import RETRIEVAL_METRICS, retrieval_metrics
from gx_ray.metrics.text import FAST_TEXT_METRICS, TEXT_METRICS, text_generation_metrics, tokenize

__all__ = [
    "CLASSIFICATION_METRICS",
    "DETECTION_METRICS",
    "FAST_TEXT_METRICS",
    "MCQ_METRICS",
    "RETRIEVAL_METRICS",
    "TEXT_METRICS",
    "classification_metrics",
    "detection_metrics",
    "detection_metrics_axial",
    "mcq_metrics",
    "parse_choice",
    "retrieval_metrics",
    "text_generation_metrics",
    "tokenize",
    "wilson_interval",
]
