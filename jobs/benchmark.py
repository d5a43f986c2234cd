"""Benchmarks: ``python jobs/benchmark.py --help`` lists the commands (``benchmarks/cli.py``; docs/benchmarks.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
# the benchmarks package sits beside gx_ray and is not installed with it: this process imports it from the checkout,
# and so do the workers of the local Ray cluster it starts (they inherit the environment)
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))

from benchmarks.cli import build_parser, main  # noqa: E402, F401 (build_parser: the docs test parses every command)

if __name__ == "__main__":
    sys.exit(main())
