"""Known-answer checks of the whole pipeline (data, sweep, report) on demo cohorts with a planted answer.

python jobs/validate.py demo                          # the main command learns on every task (about an hour on 2 cores)
python jobs/validate.py planted-signal                # two 160-case cohorts, 2 x 10 trials (about 15 min on 2 cores)
python jobs/validate.py planted-signal --cases 240    # more test patients, more power
python jobs/validate.py ct-bench                      # CT-Bench's findings on a 320-case cohort (about 20 min)
python jobs/validate.py coverage                      # bootstrap coverage and planned power, on simulated studies
python jobs/validate.py cv                            # CV, a null input's equivalence, the planner (about 31 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from gx_ray.analysis import simulation
from gx_ray.analysis.power import Design, PowerSettings
from gx_ray.runtime import tolerant_console
from gx_ray.sweep.validate import CT_BENCH_CASES, CV_CASES, cross_validation, ct_bench, demo, planted_signal

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
    bench.add_argument("--address", help=ADDRESS)
    main_command = checks.add_parser("demo", help="the main command's demo learns every task and finds inputs help")
    main_command.add_argument("--output", type=Path, default=Path("outputs/validate/demo"))
    main_command.add_argument("--address", help=ADDRESS)
    crossed = checks.add_parser("cv", help="cross-validation narrows the interval; equivalence; the planner's design")
    crossed.add_argument("--output", type=Path, default=Path("outputs/validate/cv"))
    crossed.add_argument("--cases", type=int, default=CV_CASES, help="the cohort's cases (15 %% are test patients)")
    crossed.add_argument("--seed", type=int, default=0, help="the demo cohort's seed (the confirming cohort: seed + 1)")
    crossed.add_argument("--address", help=ADDRESS)
    simulated = checks.add_parser(
        "coverage", help="two-level bootstrap coverage and planned power, on simulated studies"
    )
    simulated.add_argument("--studies", type=int, default=2000, help="simulated studies per coverage scenario")
    simulated.add_argument("--resamples", type=int, default=999, help="bootstrap replicates per simulated study")
    simulated.add_argument("--power-studies", type=int, default=1000, help="studies per power check")
    simulated.add_argument("--seed", type=int, default=0, help="the simulations' seed")
    simulated.add_argument("--only", choices=("coverage", "power"), help="run one of the two parts")
    simulated.add_argument("--metric", nargs="+", choices=simulation.METRICS, help="coverage of these metrics only")
    simulated.add_argument("--mix", nargs="+", choices=tuple(simulation.MIXES), help="coverage of these mixes only")
    simulated.add_argument(
        "--size", nargs="+", choices=[f"{n}x{s}" for n, s in COVERAGE_SIZES], help="these patients x seeds only"
    )
    return parser


COVERAGE_SIZES = ((64, 3), (64, 5), (255, 3), (255, 5))
"""(test patients, seeds): the demo's with 3 and 5 seeds, then Gastric-X's test split with 3 and 5 seeds."""
POWER_DESIGNS = (
    ("balanced", 64, 5, 1),
    ("balanced", 255, 5, 5),
    ("balanced", 255, 10, 1),
    ("seed-heavy", 255, 3, 1),
    ("seed-heavy", 255, 10, 1),
)
"""(variance mix, test patients, seeds, comparisons in the Holm family)."""
COVERAGE_FLOOR = 0.93
POWER_TOLERANCE = 0.05


def coverage_table(args: argparse.Namespace) -> bool:
    """Print the coverage of nominal 95 % intervals by seed level (of ``args``' metrics, mixes and sizes, default all);
    True when every two-level one covers >= 93 %."""
    passed, studies = True, args.studies
    print(f"Coverage of nominal 95 % intervals, {studies:,} simulated studies each, {args.resamples} replicates")
    print("(± Monte-Carlo SE; width: mean, two-level; se: mean standard error of each level; zero: share of studies")
    print(" whose seed level was 0)")
    print(
        f"{'metric':9}{'mix':18}{'patients':>9}{'seeds':>6}  {'target':11}{'two-level (t)':>15}"
        f"{'seeds resampled':>17}{'patients only':>15}{'width':>7}{'se patients':>12}{'se seeds':>9}{'zero':>6}"
    )
    sizes = [(n, s) for n, s in COVERAGE_SIZES if args.size is None or f"{n}x{s}" in args.size]
    for metric in args.metric or simulation.METRICS:
        for mix in args.mix or simulation.MIXES:
            for patients, seeds in sizes:
                model = dataclasses.replace(simulation.MIXES[mix], metric=metric)
                rows = simulation.coverage(model, patients, seeds, studies, args.resamples, seed=args.seed)
                for target in ("cell", "difference"):
                    got = {r["seed_level"]: r for r in rows if r["target"] == target}
                    cells = [f"{100 * r['coverage']:.1f} ± {100 * r['mc_error']:.1f}" for r in got.values()]
                    passed &= got["t"]["coverage"] >= COVERAGE_FLOOR
                    t = got["t"]
                    print(
                        f"{metric:9}{mix:18}{patients:>9}{seeds:>6}  {target:11}{cells[0]:>15}{cells[1]:>17}"
                        f"{cells[2]:>15}{t['width']:>7.1f}{t['se_patients']:>12.2f}{t['se_seeds']:>9.2f}"
                        f"{100 * t['seed_level_zero']:>5.1f}%"
                    )
    return passed


def power_table(studies: int, seed: int) -> bool:
    """Print the planner's power against power measured with the real bootstrap; True when all within 5 points."""
    passed = True
    print(f"Planned power against power measured with the two-level bootstrap ({studies:,} studies each)")
    for mix, patients, seeds, comparisons in POWER_DESIGNS:
        settings = PowerSettings(comparisons=comparisons, studies=studies, seed=seed)
        r = simulation.power_check(simulation.MIXES[mix], Design(seeds, patients), settings)
        passed &= abs(r.predicted - r.measured) <= POWER_TOLERANCE
        print(
            f"  accuracy {mix:11}{patients:>4} patients {seeds:>2} seeds, Holm over {comparisons}, effect "
            f"{r.effect:.2f}: predicted {100 * r.predicted:.1f} ± {100 * r.predicted_error:.1f}, "
            f"measured {100 * r.measured:.1f} ± {100 * r.measured_error:.1f}"
        )
    return passed


def coverage_check(args: argparse.Namespace) -> int:
    """The ``coverage`` check: 0 when every two-level interval covers >= 93 % and every planned power is within 5
    points of the measured one."""
    started, passed = time.perf_counter(), True
    if args.only != "power":
        passed &= coverage_table(args)
        print()
    if args.only != "coverage":
        passed &= power_table(args.power_studies, args.seed)
    print(f"\n{'passed' if passed else 'FAILED'} in {time.perf_counter() - started:.0f} s")
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    args = build_parser().parse_args(argv)
    if args.check == "coverage":
        return coverage_check(args)
    if args.check == "demo":
        results = demo(args.output, args.address)
    elif args.check == "cv":
        results = cross_validation(args.output, args.cases, args.seed, args.address)
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
