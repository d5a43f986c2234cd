"""Register a sweep's answer: choose the task's configuration by validation, make its final model (a cross-validated
sweep's fold ensemble, else a refit on training + validation patients), test it once, register it in MLflow.

python jobs/finalize.py outputs/sweeps/modality_ablation-demo-b7a76a10 --task stage_classification
python jobs/finalize.py SWEEP --task lesion_detection --schema image_table_bbox --select last --refit
python jobs/finalize.py SWEEP --task stage_classification --select one_se
"""

from __future__ import annotations

import argparse
import sys

from gx_ray.deploy.finalize import SELECT, FinalizeOptions, finalize
from gx_ray.runtime import tolerant_console


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="a sweep's output folder (holding sweep.json), or its id with --mlflow-uri")
    parser.add_argument("--task", required=True, help="the task (or task label, e.g. lesion_qa.img2txt.matched)")
    parser.add_argument("--schema", help="choose among this modality schema's configurations only")
    parser.add_argument("--select", choices=SELECT, default="best", help="best: the best mean validation score (ties "
                        "by trial time); one_se: the cheapest configuration within one standard error of it; a "
                        "refit trains for the epochs its seeds validated best at, or with last its whole "
                        "schedule")  # fmt: skip
    parser.add_argument("--refit", action="store_true", help="one model on training + validation patients, also for a "
                        "cross-validated sweep (default there: the fold models as an ensemble)")  # fmt: skip
    parser.add_argument("--name", help="the registered model's name (default gx-ray-<task>)")
    parser.add_argument("--mlflow-uri", help="the MLflow server; default: the sweep's own")
    return parser


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    args = build_parser().parse_args(argv)
    options = FinalizeOptions(**{**vars(args), "refit": True if args.refit else None})  # its flags are its fields
    try:
        result = finalize(options)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
