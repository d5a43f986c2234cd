"""Benchmark figures as data files named by their conditions, as timm keeps ``results/benchmark-*.csv``.

Each run of ``jobs/benchmark.py COMMAND`` writes ``benchmarks/results/benchmark-COMMAND-<conditions>-<machine>.csv``
(``--results DIR`` elsewhere): one row per figure, ``quantity,value``, its first rows saying what ran where (the
command line, the date, the commit, the machine and its card). A newer run under the same conditions replaces the
file; git keeps the older ones. ``docs/benchmarks.md`` quotes these files.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """The card the figures were measured on (``nvidia-h200``, ``2xnvidia-h200``), else the CPU cores (``cpu2``)."""
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            card = torch.cuda.get_device_name(0).removeprefix("NVIDIA ").split(" ")[0]
            return f"{count}x" * (count > 1) + "nvidia-" + slug(card)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return f"cpu{os.cpu_count()}"


def slug(value: Any) -> str:
    """A condition as a file-name part: ``4,64,128,128`` → ``4x64x128x128``, ``True`` → ``on``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        value = "x".join(map(str, value))
    return re.sub(r"[^a-z0-9.]+", "-", str(value).lower()).strip("-") or "none"


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested results (dataclasses, mappings, lists) as ``{dotted.key: scalar}``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, list | tuple) and any(isinstance(v, Mapping | list | tuple) for v in value):
        items = enumerate(value)
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in items:
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def write_results(command: str, conditions: Mapping[str, Any], figures: Any, folder: Path | None = None) -> Path:
    """Write ``figures`` (any nesting) as ``folder/benchmark-COMMAND-<conditions>-<machine>.csv``; returns the path."""
    where = machine()
    name = "-".join(["benchmark", command, *(slug(v) for v in conditions.values() if v is not None), where])
    path = Path(folder or RESULTS_DIR) / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    about = {
        "command": " ".join(["python jobs/benchmark.py", *sys.argv[1:]]) if sys.argv[1:] else command,
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "machine": where,
        "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        **{f"condition.{key}": value for key, value in conditions.items()},
    }
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["quantity", "value"])
        for key, value in {**about, **flatten(figures)}.items():
            writer.writerow([key, _text(value)])
    return path


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def _commit() -> str:
    """The checkout's commit (``GX_RAY_COMMIT`` where the checkout travels without its history, as to a GPU machine)."""
    if os.environ.get("GX_RAY_COMMIT"):
        return os.environ["GX_RAY_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS_DIR.parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def read_results(path: Path) -> dict[str, str]:
    """A results file as ``{quantity: value}`` (strings, as written)."""
    with Path(path).open(newline="", encoding="utf-8") as file:
        return {row["quantity"]: row["value"] for row in csv.DictReader(file)}
