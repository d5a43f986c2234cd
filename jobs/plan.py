"""Plan a study from a pilot sweep: the seeds and test patients a comparison needs for 80 % power
(docs/how-to/plan-a-study.md).

python jobs/plan.py --pilot outputs/sweeps/<sweep id> --effect 2                  # each task's headline metric
python jobs/plan.py --pilot outputs/sweeps/<sweep id> --effect 2 --metric auc     # one metric
python jobs/plan.py --pilot outputs/sweeps/<sweep id> --effect pilot              # each difference the pilot saw
python jobs/plan.py --pilot <sweep id> --mlflow-uri http://mlflow.internal:5000 --effect 2 --seeds 3,5,10,20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gx_ray.analysis.plan import plan_study
from gx_ray.analysis.power import PowerSettings
from gx_ray.analysis.report import open_sweep
from gx_ray.runtime import tolerant_console


def numbers(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(","))


def effect_size(text: str) -> float | None:
    return None if text == "pilot" else float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pilot", required=True, help="the pilot sweep: its output folder, or its id with --mlflow-uri"
    )
    parser.add_argument("--effect", required=True, type=effect_size,
                        help="the difference to detect, in the metric's units; 'pilot': each comparison's own pilot "
                        "difference")  # fmt: skip
    parser.add_argument("--metric", help="the metric compared (default: each task's headline metric)")
    parser.add_argument("--baseline", default="image_only", help="the schema every other is compared with")
    parser.add_argument("--seeds", type=numbers, default=(3, 5, 10), help="seeds per arm to try (default 3,5,10)")
    parser.add_argument("--patients", type=numbers, default=(64, 128, 255), help="test patients to try")
    parser.add_argument("--comparisons", type=int, help="the Holm family's size (default: the pilot's comparisons; "
                        "each its own family's where the pilot's space declared analysis.primary)")  # fmt: skip
    parser.add_argument("--studies", type=int, default=2000, help="simulated studies per design")
    parser.add_argument("--mlflow-uri", help="the MLflow server of a sweep named by its id")
    parser.add_argument("--output", type=Path, help="where plan/ goes for a sweep named by its id")
    return parser


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    args = build_parser().parse_args(argv)
    with open_sweep(args.pilot, args.mlflow_uri, args.output) as store:
        settings = PowerSettings(seeds=args.seeds, patients=args.patients, studies=args.studies)
        result = plan_study(store.uri, store.sweep_id, args.effect, store.folder, settings, args.metric, args.baseline,
                            args.comparisons)  # fmt: skip
    summary = result.folder / "summary.md"
    print(summary.read_text(encoding="utf-8").split("\n## ")[0])
    print(f"plan: {summary} (power curves beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
