"""GPU plans kept across sweeps: a model setting's measured training step (micro-batch, peak memory) is reused by the
next sweep that asks for the same setting on the same kind of card with the same code, libraries and cohort, so a
repeated sweep starts its first trial without measuring again (one measured step per setting costs seconds each, and
a compiled model's costs its compilation).

A plan lives in ``$XDG_CACHE_HOME/gx-ray/gpu_plans`` (``~/.cache`` by default), one file per identity; deleting the
folder makes the next sweep measure afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gx-ray" / "gpu_plans"


def measured_plan(
    settings: Mapping[str, dict[str, Any]],
    measure: Callable[[dict[str, dict[str, Any]]], dict[str, dict[str, Any]]],
    identity: Mapping[str, Any],
    cache_dir: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Each setting's measurement: from the cache where this ``identity`` (the card kind, code and library versions,
    the cohort's manifest) measured it before, the rest by ``measure`` (given only those, keyed as ``settings``) and
    then kept. Entries read from the cache say so (``"cached": true``)."""
    folder = cache_dir or default_cache_dir()
    path = folder / f"{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]}.json"
    kept: dict[str, dict[str, Any]] = {}
    if path.is_file():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))["settings"]
        except (ValueError, KeyError, OSError):  # a damaged cache file costs a measurement, never the sweep
            kept = {}
    plan = {key: {**kept[key], "cached": True} for key in settings if key in kept}
    missing = {key: flat for key, flat in settings.items() if key not in kept}
    if missing:
        fresh = measure(missing)
        plan.update(fresh)
        kept.update(fresh)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")  # two sweeps at once: each write whole, last one wins
            temporary.write_text(json.dumps({"identity": identity, "settings": kept}, indent=1), encoding="utf-8")
            temporary.replace(path)
        except OSError:  # a read-only home: the sweep goes on, the next one measures again
            pass
    return {key: plan[key] for key in settings}
