"""Run a search space as a Ray Tune sweep, every trial logged to MLflow, with a summary at the end.

python jobs/sweep.py --space modality_ablation                 # demo cohort, local Ray, local MLflow
python jobs/sweep.py --space modality_ablation --preset smoke  # CI-sized
python jobs/sweep.py --space modality_ablation --preset gpu --data /data/gx --address auto
    --mlflow-uri http://mlflow.internal:5000                   # a GPU cluster
python jobs/sweep.py --space modality_ablation --preset gpu --address auto --data s3://team/gx/cohort
    --storage s3://team/gx/sweeps --mlflow-uri http://mlflow.internal:5000  # nodes that share no filesystem
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from gx_ray.data.shards import ShardIntegrityError
from gx_ray.runtime import tolerant_console
from gx_ray.storage import UnreachableStorageError
from gx_ray.sweep.budget import BudgetError
from gx_ray.sweep.driver import SweepOptions, run_sweep
from gx_ray.sweep.resume import ResumeError
from gx_ray.sweep.share import SweepAlreadyRunning, sweep_name, weight
from gx_ray.sweep.spaces import SpaceError
from gx_ray.tracking import UnreachableTrackingError

REFUSALS = (
    SpaceError,
    ResumeError,
    ShardIntegrityError,
    UnreachableTrackingError,
    UnreachableStorageError,
    FileExistsError,
    SweepAlreadyRunning,
    FileNotFoundError,
    BudgetError,
)
"""What the sweep refuses before its trials, said in one line (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    """The command's flags: each one is the :class:`SweepOptions` field of its name."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", required=True, help="a name in search_spaces/ or a YAML file")
    parser.add_argument(
        "--data", help="prepared data (prepare_data's --out): a path or s3://, gs:// URI; default: the demo cohort"
    )
    parser.add_argument("--output", type=Path, default=Path("outputs/sweeps"), help="default: outputs/sweeps")
    parser.add_argument(
        "--storage",
        help="Tune/Train state, checkpoints and a copy of the report where every node reaches them: a shared path or "
        "s3://, gs:// URI (default: under --output, one machine)",
    )
    parser.add_argument(
        "--address",
        help="a Ray cluster ('auto', host:port; 'local': this job's own); default: the one RAY_ADDRESS names or "
        "`ray start` runs here, else a local one",
    )
    parser.add_argument("--mlflow-uri", help="an MLflow server every node reaches; default: a local one")
    parser.add_argument("--preset", dest="presets", metavar="PRESET", action="append", default=[],
                        help="a preset of the space (repeatable): smoke, gpu, compiled")  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="continue an interrupted sweep with the same arguments")
    parser.add_argument("--max-concurrent", type=int, help="cap on trials running at once")
    parser.add_argument("--verify", action="store_true", help="check every shard's SHA-256 first (reads all data)")
    parser.add_argument(
        "--study",
        help="an Optuna search's study store every node reaches: postgresql://... or a journal file (default: a "
        "journal in the sweep's state); optuna-dashboard opens it",
    )
    parser.add_argument("--study-name", help="the study's name (default: the sweep id); two drivers may share one")
    parser.add_argument("--share", type=weight, nargs="?", const=1.0, metavar="W",
                        help="share the cluster's CPUs and GPUs with the other sweeps given --share, by weight W "
                        "(default 1)")  # fmt: skip
    parser.add_argument(
        "--name", type=sweep_name, help="appended to the sweep id: another sweep of the same space and cohort"
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--gpu-hours", type=float, help="a budget: its cost forecast first, a stop when spent (--resume continues it)"
    )
    budget.add_argument("--cpu-hours", type=float, help="the same budget in CPU-hours, for trials on CPUs")
    parser.add_argument(
        "--replay",
        help="train a schedule a PBT sweep of this space found again, as one trial: the number of an exploited trial "
        "(its gx_ray.trial tag) or a pbt_policy_*.txt file",
    )
    parser.add_argument(
        "--demo-cases", type=int, default=SweepOptions.demo_cases, help="size of the demo cohort (without --data)"
    )
    return parser


def parse_options(argv: list[str] | None) -> SweepOptions:
    """The command line as the sweep's options."""
    args = vars(build_parser().parse_args(argv))
    return SweepOptions(**{**args, "presets": tuple(args["presets"])})


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    options = parse_options(argv)
    try:
        result = run_sweep(options)
    except REFUSALS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # a signal before the trials started: nothing to resume yet
        print(f"\nstopped ({err or 'Ctrl-C'}) before any trial started", file=sys.stderr)
        return 130
    print(f"sweep.json: {result.output / 'sweep.json'}")
    if result.interrupted:
        again = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]) if a != "--resume")
        print(f"interrupted: resume with  python jobs/sweep.py {again} --resume", file=sys.stderr)
        return 130
    return 1 if result.finished == 0 or result.mlflow_error else 0


if __name__ == "__main__":
    sys.exit(main())
