"""Write a sweep's report (the paper's tables, radar plot, seed statistics, significance) to OUTPUT/report/.

python analysis/report.py --sweep outputs/sweeps/modality_ablation-demo-b7a76a10
python analysis/report.py --sweep modality_ablation-b7a76a10 --mlflow-uri http://mlflow.internal:5000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gx_ray.analysis.report import report_sweep
from gx_ray.runtime import tolerant_console


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", required=True, help="a sweep's output folder (holding sweep.json), or its id")
    parser.add_argument("--mlflow-uri", help="the MLflow server; default: the sweep's own (sweep.json)")
    parser.add_argument("--output", type=Path, help="with a sweep id: where report/ goes (default outputs/sweeps/ID)")
    args = parser.parse_args(argv)
    try:
        report = report_sweep(args.sweep, args.mlflow_uri, args.output)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report: {report.folder / 'summary.md'} ({len(report.files)} files, {report.seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
