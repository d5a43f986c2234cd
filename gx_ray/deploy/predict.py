"""A registered model on a new cohort: the same preprocessing as ``prepare_data``, batched prediction on the GPU it
finds (else the CPU), per-case outputs, and, where the cohort has labels, an external evaluation beside the model's
own test (the same metrics, each with a patient bootstrap interval).

``data`` is raw (a folder in the release or paper layout, NIfTI or DICOM, or a manifest CSV) or prepared (a
``prepare_data`` output, or its ``shards/``). A raw cohort is prepared into ``OUT/prepared`` with the model's own
preprocessing settings, every patient in one split (nothing is trained on it); a prepared one must have been
prepared with those settings. A case that fails quality control is listed in ``skipped.csv`` with its reason and
never predicted; a case whose fingerprint (acquired spacing, stomach intensity per phase) lies outside the training
patients' range is predicted and flagged (``outside_training``).

Outputs in ``OUT``: ``predictions.csv`` (a row per case), ``predictions.json`` (the task's full records),
``skipped.csv``, ``evaluation.json`` and ``evaluation.md`` (labelled cohorts).
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gx_ray import storage
from gx_ray.data.prepare import QC_JSON, SHARD_DIR, PrepareConfig, prepare_data
from gx_ray.data.shards import MANIFEST_FILE, read_manifest, read_shard, split_files
from gx_ray.data.splits import SPLITS
from gx_ray.deploy.bundle import Predictor, outside_training, preprocess_of
from gx_ray.deploy.finalize import score_records

ONE_SPLIT = (0.0, 0.0, 1.0)
"""A new cohort's patients all go to one split (``test``): nothing is trained on them."""


@dataclass(frozen=True)
class PredictOptions:
    model: str
    """``models:/NAME@ALIAS`` (or ``/VERSION``), a ``runs:/`` URI, a downloaded MLflow model or a bundle folder."""
    data: str
    out: Path
    mlflow_uri: str | None = None
    sweep: str | None = None
    """A sweep's output folder whose own MLflow store holds the model (served for the call)."""
    batch_size: int = 8
    device: str | None = None
    n_resamples: int = 1000


@dataclass
class PredictResult:
    out: Path
    predicted: int
    skipped: list[dict[str, Any]]
    flagged: int
    evaluation: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [
            f"predicted {self.predicted} cases in {self.seconds:.0f} s; skipped {len(self.skipped)}; "
            f"{self.flagged} outside the training patients' range",
            f"  {self.out / 'predictions.csv'}",
        ]
        for row in self.evaluation:
            lines.append(
                f"  {row['metric']}: external {_figure(row['external'])} against the model's own test "
                f"{_figure(row['internal'])}"
            )
        if self.skipped:
            lines.append(f"  skipped (reasons): {self.out / 'skipped.csv'}")
        return "\n".join(lines)


def _figure(score: dict[str, Any] | None) -> str:
    if not score or score.get("value") is None or not math.isfinite(score["value"]):
        return "n/a"
    interval = f" [{score['low']:.1f}, {score['high']:.1f}]" if score.get("low") is not None else ""
    return f"{score['value']:.1f}{interval} (n = {score['cases']})"


def bundle_folder(model: str, mlflow_uri: str | None, scratch: Path) -> Path:
    """The model's bundle on this machine: a local folder as it is, a model URI downloaded into ``scratch``."""
    local = Path(model)
    for candidate in (local, *sorted(local.glob("artifacts/*"))):  # a bundle, or a downloaded MLflow model
        if (candidate / "bundle.json").exists():
            return candidate
    if local.exists():
        raise FileNotFoundError(f"{model} is neither a gx-ray model folder nor a downloaded MLflow model")
    import mlflow

    if mlflow_uri:
        mlflow.set_tracking_uri(mlflow_uri)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=model, dst_path=str(scratch)))
    except mlflow.MlflowException as err:  # most often the wrong store: say where to look, not MLflow's traceback
        raise ValueError(f"{model} cannot be fetched from the MLflow registry at {mlflow.get_tracking_uri()} "
                         f"({str(err).split(chr(10))[0]}): finalize registers in the sweep's own store, give --sweep "
                         "SWEEP_FOLDER (or --mlflow-uri for the server it logged to)") from None  # fmt: skip
    found = sorted(folder.glob("artifacts/*/bundle.json"))
    if not found:
        raise FileNotFoundError(f"{model} is not a gx-ray model: no bundle among its artifacts")
    return found[0].parent


def prepared_cohort(data: str, predictor: Predictor, out: Path) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """The cohort's shards, its skipped cases and its per-case QC records: ``data`` itself when prepared (with the
    model's settings), else prepared into ``out/prepared``."""
    shards = next(
        (c for c in (data, storage.join(data, SHARD_DIR)) if storage.exists(storage.join(c, MANIFEST_FILE))), None
    )
    expected = preprocess_of(predictor.document)
    if shards is None:
        config = PrepareConfig(preprocess=expected, endoscopy_size=predictor.layout.endoscopy_shape[-1],
                               fractions=ONE_SPLIT)  # fmt: skip
        result = prepare_data(data, out / "prepared", config)
        shards, skipped = str(result.shard_dir), result.excluded
    else:
        manifest = read_manifest(shards)
        found = preprocess_of({"inputs": manifest})
        if found != expected:
            raise ValueError(
                f"{shards} was prepared with other settings than the model's ({_differences(found, expected)}): "
                "give its raw cases, which are prepared with the model's"
            )
        skipped = []
    qc_path = storage.join(shards.rstrip("/").rsplit("/", 1)[0], QC_JSON)
    qc = json.loads(storage.read_text(qc_path)) if storage.exists(qc_path) else {}
    return shards, skipped or qc.get("excluded", []), qc.get("cases", {})


def _differences(found: Any, expected: Any) -> str:
    return ", ".join(
        f"{name} {getattr(found, name)} against {getattr(expected, name)}"
        for name in expected.__dataclass_fields__
        if getattr(found, name) != getattr(expected, name)
    )


@contextmanager
def _registry(options: PredictOptions) -> Iterator[str | None]:
    """The MLflow server to fetch the model from: ``mlflow_uri``, or the sweep's own store served for the call."""
    if options.mlflow_uri or not options.sweep:
        yield options.mlflow_uri
        return
    from gx_ray.tracking.server import LocalMlflowServer

    store = Path(options.sweep) / "mlflow"
    if not (store / "mlflow.db").exists():
        raise FileNotFoundError(f"{options.sweep} has no MLflow store of its own (mlflow/mlflow.db): give --mlflow-uri")
    server = LocalMlflowServer(store).start()
    try:
        yield server.uri
    finally:
        server.stop()


def predict_cohort(options: PredictOptions) -> PredictResult:
    """Predict every case of ``options.data`` with ``options.model`` and write the outputs (module docstring)."""
    started = time.perf_counter()
    out = Path(options.out)
    with tempfile.TemporaryDirectory(prefix="gx-model-") as scratch, _registry(options) as uri:
        predictor = Predictor(bundle_folder(options.model, uri, Path(scratch)), options.device)
        out.mkdir(parents=True, exist_ok=True)  # once the model is found: a refused one leaves no empty folder
        shards, skipped, qc_cases = prepared_cohort(options.data, predictor, out)
        records: list[dict[str, Any]] = []
        for split in SPLITS:
            for path in split_files(shards, split):
                part = predictor.predict_table(read_shard(path), options.batch_size)
                records += [{**r, "split": split} for r in part]
    document = predictor.document
    ranges = document.get("training_fingerprint")
    flags = {
        r["case_id"]: outside_training(qc_cases[r["case_id"]]["fingerprint"], ranges)
        for r in records
        if "fingerprint" in qc_cases.get(r["case_id"], {})
    }
    _write_outputs(out, records, skipped, flags)
    evaluation = []
    if any(r.get("target") is not None for r in records):
        internal = document.get("test", {}).get("metrics", {})
        for metric in internal or [document["metric"]]:
            external = score_records(document["label"], records, metric, options.n_resamples)
            evaluation.append({"metric": metric, "external": external, "internal": internal.get(metric)})
        _write_evaluation(out, document, evaluation, options.data)
    flagged = sum(bool(f) for f in flags.values())
    seconds = time.perf_counter() - started
    return PredictResult(out=out, predicted=len(records), skipped=skipped, flagged=flagged, evaluation=evaluation,
                         seconds=seconds)  # fmt: skip


def _write_outputs(
    out: Path, records: list[dict[str, Any]], skipped: list[dict[str, Any]], flags: dict[str, list[str]]
) -> None:
    (out / "predictions.json").write_text(json.dumps(records, indent=1, default=str) + "\n", encoding="utf-8")
    columns = ["case_id", "split", "prediction", "target", "spread", "outside_training"]
    extra = sorted({k for r in records for k in r} - set(columns))
    with open(out / "predictions.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, [*columns, *extra])
        writer.writeheader()
        for record in records:
            row = {**record, "outside_training": "; ".join(flags.get(record["case_id"], []))}
            writer.writerow({k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in row.items()})
    with open(out / "skipped.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, ["case_id", "reason", "file", "field", "message"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(skipped)


def _write_evaluation(out: Path, document: dict[str, Any], evaluation: list[dict[str, Any]], data: str) -> None:
    (out / "evaluation.json").write_text(json.dumps(evaluation, indent=1, default=str) + "\n", encoding="utf-8")
    lines = [
        f"# External evaluation: {document['label']}",
        "",
        f"Model from sweep `{document['sweep_id']}` ({document['choice']['description']}), on `{data}`. "
        "Intervals: 95 % percentile bootstrap over patients.",
        "",
        "| metric | this cohort | the model's own test split |",
        "| --- | --- | --- |",
        *(f"| {row['metric']} | {_figure(row['external'])} | {_figure(row['internal'])} |" for row in evaluation),
    ]
    (out / "evaluation.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
