"""Known-answer checks of the whole pipeline (data, sweep, report) on demo cohorts with a planted answer.

python jobs/validate.py demo                          # the main command learns on every task (about an hour on 2 cores)
python jobs/validate.py planted-signal                # two 160-case cohorts, 2 x 10 trials (about 15 min on 2 cores)
python jobs/validate.py planted-signal --cases 240    # more test patients, more power
python jobs/validate.py ct-bench                      # CT-Bench's findings on a 320-case cohort (about 20 min)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gx_ray.runtime import tolerant_console
from gx_ray.sweep.validate import CT_BENCH_CASES, ct_bench, demo, planted_signal

ADDRESS = "a Ray cluster to join (default: the one `ray start` runs here, else a local one; local: a new one)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checks = parser.add_subparsers(dest="check", required=True)
    planted = checks.add_parser("planted-signal", help="a stage signal only in the lab table, and none there")
    planted.add_argument("--output", type=Path, default=Path("outputs/validate/planted_signal"))
    planted.add_argument("--cases", type=int, default=160, help="cases per cohort (15 %% of them are test patients)")
    planted.add_argument("--seed", type=int, default=0, help="the demo cohorts' seed")
    planted.add_argument(
        "--address",
        help=ADDRESS,
    )
    bench = checks.add_parser("ct-bench", help="with the box beats without it; random distractors are easier")
    bench.add_argument("--output", type=Path, default=Path("outputs/validate/ct_bench"))
    bench.add_argument("--cases", type=int, default=CT_BENCH_CASES)
    bench.add_argument("--seed", type=int, default=0, help="the demo cohort's seed")
    bench.add_argument(
        "--address",
        help=ADDRESS,
    )
    main_command = checks.add_parser("demo", help="the main command's demo learns every task and finds inputs help")
    main_command.add_argument("--output", type=Path, default=Path("outputs/validate/demo"))
    main_command.add_argument(
        "--address",
        help=ADDRESS,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    args = build_parser().parse_args(argv)
    if args.check == "demo":
        results = demo(args.output, args.address)
    elif args.check == "ct-bench":
        results = ct_bench(args.output, args.cases, args.seed, args.address)
    else:
        results = planted_signal(args.output, args.cases, args.seed, args.address)
    print(f"\n{args.check} check:")
    for check in results:
        print("  " + check.line())
    return 0 if all(check.passed for check in results if not getattr(check, "information", False)) else 1


if __name__ == "__main__":
    sys.exit(main())
