"""What a sweep must find unchanged to be resumed: its space (everything that decides its trials) and its cohort.

A sweep records both in ``OUTPUT/<sweep id>/inputs.json`` when it starts. ``--resume`` compares them with what it is
given now and refuses a difference, naming it: a resumed sweep that silently ran another space's trials (a new
sweep id after an edit) or ignored an edit (the same id) would mix two experiments under one parent run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from gx_ray import storage
from gx_ray.data.fingerprint import differences, read_fingerprint
from gx_ray.data.shards import MANIFEST_FILE
from gx_ray.sweep.spaces import SearchSpace

INPUTS_FILE = "inputs.json"


class ResumeError(ValueError):
    """``--resume`` cannot continue: nothing to resume, or the space or cohort changed since the sweep started."""


def sweep_inputs(space: SearchSpace, shards: str, study: dict[str, str] | None = None) -> dict[str, Any]:
    """The space as it decides trials (not its description or time budget: a resumed sweep gets a budget anew), the
    SHA-256 of the cohort's shard manifest (which itself holds every shard's SHA-256 and the fingerprint's) and the
    cohort's fingerprint, so that a changed cohort is refused naming what changed in it; and an Optuna search's study
    where one was named (``--study``, ``--study-name``): resumed against another, it would ask another study."""
    manifest = storage.join(shards, MANIFEST_FILE)
    present = storage.is_file(manifest)
    return {
        "space": {
            "name": space.name,
            "presets": list(space.presets_applied),
            "fixed": space.fixed,
            "grid": space.grid,
            "sample": space.sample,
            "overrides": space.overrides,
            "searcher": space.searcher,
            "scheduler": space.scheduler,
            "metric": space.metric,
            "samples": space.samples,
            "resources": space.resource_keys(),
            **({space.scheduler: space.scheduler_options} if space.scheduler_options else {}),
            **({"cv": space.cv} if space.cv else {}),
            **({"exclude": space.exclude} if space.exclude else {}),
        },
        "data": storage.normalize(shards),
        "manifest_sha256": hashlib.sha256(storage.read_bytes(manifest)).hexdigest() if present else None,
        "fingerprint": read_fingerprint(shards, json.loads(storage.read_bytes(manifest))) if present else None,
        **({"study": study} if study else {}),
    }


def record_inputs(output: Path, inputs: dict[str, Any]) -> None:
    """Written once, when the sweep starts (a resumed sweep keeps the first record)."""
    path = Path(output) / INPUTS_FILE
    if not path.is_file():
        path.write_text(json.dumps(inputs, indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")


def check_resumable(output_root: Path, sweep_id: str, inputs: dict[str, Any]) -> None:
    """Raise :class:`ResumeError` unless ``OUTPUT/<sweep_id>`` holds a sweep started from these very inputs."""
    recorded_path = Path(output_root) / sweep_id / INPUTS_FILE
    if recorded_path.is_file():
        changes = differences(_load(recorded_path), inputs)
        if changes:
            raise ResumeError(
                f"--resume: {recorded_path.parent} was started from other inputs; changed since: "
                + "; ".join(changes)
                + ". Restore them to resume, or start a new sweep without --resume."
            )
        return
    name = inputs["space"]["name"]
    started = sorted(
        (p for p in Path(output_root).glob(f"*/{INPUTS_FILE}") if _load(p).get("space", {}).get("name") == name),
        key=lambda p: p.stat().st_mtime,
    )
    if not started:
        raise ResumeError(f"--resume: no sweep of space {name!r} under {output_root}; run it without --resume")
    latest = started[-1]
    changes = differences(_load(latest), inputs)
    raise ResumeError(
        f"--resume: the sweep of space {name!r} under {latest.parent} was started from other inputs; changed since: "
        + "; ".join(changes or ["its id"])
        + ". Restore them to resume it, or start a new sweep without --resume."
    )


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
