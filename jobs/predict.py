"""Predict with a registered gx-ray model on a new cohort: per-case outputs and, where the cohort has labels, an
external evaluation beside the model's own test.

python jobs/predict.py --model models:/gx-ray-stage_classification@champion --sweep outputs/sweeps/SWEEP \
    --data /data/hospital_b --out outputs/predictions/hospital_b
python jobs/predict.py --model models:/gx-ray-stage_classification@champion --mlflow-uri http://mlflow:5000 ...
python jobs/predict.py --model outputs/sweeps/SWEEP/finalized/stage_classification/model --data cohort.csv --out OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gx_ray.deploy.predict import PredictOptions, predict_cohort
from gx_ray.runtime import tolerant_console
from gx_ray.schema import CaseError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="models:/NAME@ALIAS, or a model folder finalize wrote")
    parser.add_argument("--data", required=True, help="raw cases (release or paper layout, or a manifest CSV), or a "
                        "prepare_data output")  # fmt: skip
    parser.add_argument("--out", required=True, type=Path, help="where the predictions and the evaluation go")
    parser.add_argument("--mlflow-uri", help="the MLflow server holding the model (for a models:/ URI)")
    parser.add_argument("--sweep", help="the sweep's output folder, whose own MLflow store holds the model")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", help="cuda, cuda:1, cpu; default: a GPU where there is one")
    return parser


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    args = build_parser().parse_args(argv)
    options = PredictOptions(**vars(args))  # its flags are the options' fields
    try:
        result = predict_cohort(options)
    except (FileNotFoundError, ValueError, CaseError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
