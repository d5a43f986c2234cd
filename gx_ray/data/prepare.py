"""Raw cases → Parquet shards, ``split.json`` and a QC report: Appendix-B preprocessing as Ray tasks.

The driver reads the cohort, assigns patient-level splits, preprocesses every case in a Ray task (one core
each), turns each result into a shard row inside the task, and writes the rows in a fixed order (split, then
case id), so the same input and settings give byte-identical shards. A case that fails is reported in the
QC report and left out; the rest of the cohort goes on, unless ``strict`` asks to stop at the first.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
from PIL import Image
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gx_ray import storage
from gx_ray.data import endoscopy_annotations
from gx_ray.data.catalogue import describe_abnormal, load_catalogue
from gx_ray.data.demo.cohort import COHORT_FILE, DemoConfig, generate_cohort
from gx_ray.data.fingerprint import case_fingerprint, cohort_fingerprint, write_fingerprint
from gx_ray.data.layouts import FLOAT32_MAX, read_cohort
from gx_ray.data.parallel import ordered_results
from gx_ray.data.preprocess import PreprocessConfig, PreprocessedCase, preprocess_case
from gx_ray.data.shards import MANIFEST_FILE, ShardWriter, TensorLayout, shard_schema, write_manifest
from gx_ray.data.splits import DEFAULT_FRACTIONS, SPLIT_FILE, SPLITS, assign_splits, write_split_file
from gx_ray.runtime import init_ray, nodes_without
from gx_ray.schema import BOX_LEVELS, PHASES, REPORT_KINDS, STAGE_GROUPS, Case, CaseError

SHARD_DIR = "shards"
QC_JSON, QC_MARKDOWN = "qc_report.json", "qc_report.md"


@dataclass(frozen=True)
class PrepareConfig:
    preprocess: PreprocessConfig = field(default_factory=lambda: PreprocessConfig.preset("demo"))
    fractions: tuple[float, float, float] = DEFAULT_FRACTIONS
    split_seed: int = 0
    endoscopy_size: int = 64
    rows_per_shard: int = 64
    row_group_rows: int = 8
    strict: bool = False
    endoscopy_annotations: str | None = None
    """The endoscopy annotation file (:mod:`gx_ray.data.endoscopy_annotations`); default: the cohort's own
    ``endoscopy_annotations.json`` where there is one."""


@dataclass
class PrepareResult:
    shard_dir: Path | str
    """A local folder, or the URI the shards were copied to."""
    rows: dict[str, int]
    excluded: list[dict[str, Any]]
    qc_report: Path | str
    seconds: float

    def summary(self) -> str:
        counts = ", ".join(f"{split} {self.rows[split]}" for split in SPLITS)
        reasons = Counter(e["reason"] for e in self.excluded)
        excluded = f"; excluded {len(self.excluded)} ({', '.join(f'{r} {n}' for r, n in reasons.items())})"
        return (
            f"prepared {sum(self.rows.values())} cases in {self.seconds:.0f} s: {counts}"
            f"{excluded if self.excluded else ''}\n  shards: {self.shard_dir}\n  QC report: {self.qc_report}"
        )


# --- one case → one shard row ------------------------------------------------------------------------


def _lab_vector(case: Case, names: list[str]) -> tuple[list[float], list[bool]]:
    """The numeric model inputs as float32 values and a missing mask.

    Missing (``None``, ``""``, absent, NaN) is NaN with its mask set; the layout readers have already refused
    infinite values and values beyond float32 naming their file, and a case built in memory is refused here.
    """
    values, missing = [], []
    for name in names:
        raw = case.labs.get(name)
        try:
            if isinstance(raw, bool):  # float(True) is 1.0: a flag is not a measurement
                raise TypeError("a boolean")
            value = float(raw) if raw not in (None, "") else math.nan
        except (TypeError, ValueError, OverflowError) as err:
            raise CaseError(
                case.case_id, None, name, f"lab value is not a finite number ({raw!r})", "malformed_annotation"
            ) from err
        if math.isinf(value) or abs(value) > FLOAT32_MAX:
            raise CaseError(
                case.case_id, None, name, f"lab value is not finite in float32 ({raw!r})", "malformed_annotation"
            )
        values.append(value)
        missing.append(math.isnan(value))
    return values, missing


def _lab_descriptors(case: Case) -> list[str]:
    sex = case.labs.get("sex")
    try:
        return describe_abnormal(load_catalogue().abnormal_findings(case.labs, str(sex) if sex else None))
    except ValueError as err:
        raise CaseError(case.case_id, None, "labs", str(err), "malformed_annotation") from err


def _box_array(pre: PreprocessedCase) -> tuple[list[int], list[bool]]:
    """Boxes as a (phase, level, 6) array; several boxes of one level on one phase become their hull."""
    boxes = np.zeros((len(PHASES), len(BOX_LEVELS), 6), dtype=np.int32)
    present = np.zeros((len(PHASES), len(BOX_LEVELS)), dtype=bool)
    for box in pre.boxes:
        p, lv = PHASES.index(box.phase), BOX_LEVELS.index(box.level)
        coords = np.asarray(box.zyx, dtype=np.int32)
        if present[p, lv]:
            coords = np.concatenate(
                [np.minimum(boxes[p, lv, :3], coords[:3]), np.maximum(boxes[p, lv, 3:], coords[3:])]
            )
        boxes[p, lv], present[p, lv] = coords, True
    return boxes.ravel().tolist(), present.ravel().tolist()


def _endoscopy_bytes(case: Case, size: int) -> bytes | None:
    if case.endoscopy is None:
        return None
    try:
        with Image.open(case.endoscopy) as image:
            rgb = np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
    except OSError as err:
        raise CaseError(case.case_id, case.endoscopy, "endoscopy", f"unreadable image: {err}") from err
    return np.ascontiguousarray(rgb.transpose(2, 0, 1)).tobytes()


def case_row(case: Case, split: str, config: PrepareConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Preprocess one case into a shard row, plus what the QC report keeps about it."""
    catalogue = load_catalogue()
    pre = preprocess_case(case, config.preprocess)
    lab_names = [v.name for v in catalogue.numeric_inputs()]
    labs, labs_missing = _lab_vector(case, lab_names)
    boxes, box_present = _box_array(pre)
    staging = case.staging
    group = staging.group if staging else None
    reports_en, reports_zh = case.reports.get("en", {}), case.reports.get("zh", {})
    endoscopy = _endoscopy_bytes(case, config.endoscopy_size)
    row = {
        "case_id": case.case_id,
        "patient_id": case.patient_id,
        "split": split,
        "ct": pre.volume.astype(np.float16, copy=False).tobytes(),
        "phase_present": list(pre.phase_present),
        "ct_hu_mean": list(pre.hu_mean),
        "ct_hu_std": list(pre.hu_std),
        "endoscopy": endoscopy,
        "endoscopy_present": endoscopy is not None,
        "labs": labs,
        "labs_missing": labs_missing,
        "lab_abnormal": _lab_descriptors(case),
        "boxes": boxes,
        "box_present": box_present,
        "t": staging.t if staging else None,
        "n": staging.n if staging else None,
        "m": staging.m if staging else None,
        "stage": staging.stage if staging else None,
        "stage_label": STAGE_GROUPS.index(group) if group else -1,
        **{kind: reports_en.get(kind) for kind in REPORT_KINDS},
        **{f"{kind}_zh": reports_zh.get(kind) for kind in REPORT_KINDS},
        "vqa": [asdict(v) for v in case.vqa.get("en", [])],
        "vqa_zh": [asdict(v) for v in case.vqa.get("zh", [])],
    }
    qc = {
        "registration": pre.registration,
        "anatomy": pre.anatomy,
        "warnings": pre.warnings,
        "crop_origin_zyx": list(pre.crop_origin_zyx),
        "fingerprint": case_fingerprint(pre, config.preprocess.spacing_zyx_mm, case.labs, catalogue.names),
        "demographics": {"age": case.labs.get("age"), "sex": case.labs.get("sex")},
    }
    return row, qc


@ray.remote(num_cpus=1)
def _case_row_task(case: Case, split: str, config: PrepareConfig) -> tuple[dict, dict] | CaseError:
    try:
        return case_row(case, split, config)
    except CaseError as err:
        return err
    except Exception as err:  # an unforeseen failure is still one case's failure, not the cohort's
        return CaseError(case.case_id, case.source, None, f"{type(err).__name__}: {err}", "preprocessing_failed")


# --- the whole cohort --------------------------------------------------------------------------------


def prepare_shards(
    source: Path, out: Path, config: PrepareConfig = PrepareConfig(), layout: str | None = None
) -> PrepareResult:
    """Preprocess every case under ``source`` into ``out/shards`` with ``split.json`` and a QC report."""
    start = time.time()
    source, out = Path(source), Path(out)
    shard_dir = out / SHARD_DIR
    cases, errors = read_cohort(source, layout, strict=config.strict)
    assignment = assign_splits(
        {c.patient_id: c.staging.group if c.staging else None for c in cases}, config.fractions, config.split_seed
    )
    order = sorted(cases, key=lambda c: (SPLITS.index(assignment[c.patient_id]), c.case_id))
    catalogue = load_catalogue()
    ct_shape = (len(PHASES), *config.preprocess.shape_zyx)
    layout_info = TensorLayout(
        ct_shape, (3, config.endoscopy_size, config.endoscopy_size), tuple(v.name for v in catalogue.numeric_inputs())
    )
    schema = shard_schema(ct_shape, config.endoscopy_size, list(layout_info.lab_names))
    writer = ShardWriter(shard_dir, schema, config.rows_per_shard, config.row_group_rows)
    qc_cases: dict[str, dict[str, Any]] = {}
    task = _case_row_task
    if missing := nodes_without(source):  # a cohort on one node's disk: preprocessed there, not failed elsewhere
        print(
            f"{source} is not on every Ray node (missing on {', '.join(missing)}): preprocessing runs on this node "
            "only; a cohort on a filesystem every node mounts is preprocessed by all of them",
            file=sys.stderr,
        )
        here = ray.get_runtime_context().get_node_id()
        task = _case_row_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
    results = ordered_results(
        lambda c: task.remote(c, assignment[c.patient_id], config), order, len(order), "preprocess"
    )
    for case, result in zip(order, results, strict=True):
        if isinstance(result, CaseError):
            if config.strict:
                raise result
            errors.append(result)
            continue
        row, qc_cases[case.case_id] = result
        writer.write(row)
    files = writer.close()
    excluded = [e.to_dict() for e in errors]
    excluded_patients = {c.patient_id: e.reason for c in cases for e in errors if e.case_id == c.case_id}
    excluded_patients.update({e.case_id: e.reason for e in errors if e.case_id not in {c.case_id for c in cases}})
    kept = {p: s for p, s in assignment.items() if p not in excluded_patients}
    write_split_file(shard_dir / SPLIT_FILE, kept, excluded_patients, config.fractions, config.split_seed)
    manifest_extra = {
        "source": str(source),
        "demo_cohort": (cohort_folder(source) / COHORT_FILE).exists(),  # synthetic: the analysis labels it so
        "preprocess": asdict(config.preprocess),
        "endoscopy_size": config.endoscopy_size,
        "split_file": SPLIT_FILE,
    }
    frames = _endoscopy_frames(source, config, qc_cases)
    if frames:
        endoscopy_annotations.write_prepared(shard_dir, frames)
        manifest_extra["endoscopy_annotations"] = {
            "file": endoscopy_annotations.FILE,
            "format": endoscopy_annotations.FORMAT,
            "frames": len(frames),
        }
    manifest_extra["fingerprint"] = write_fingerprint(
        shard_dir,
        cohort_fingerprint(
            {cid: qc["fingerprint"] for cid, qc in qc_cases.items()},
            {c.case_id: kept[c.patient_id] for c in cases if c.case_id in qc_cases},
            {c.case_id: c.staging.group if c.staging else None for c in cases if c.case_id in qc_cases},
            {cid: qc["demographics"] for cid, qc in qc_cases.items()},
            config.preprocess.spacing_zyx_mm,
            config.preprocess.shape_zyx,
            catalogue.names,
        ),
    )
    write_manifest(shard_dir, files, layout_info, manifest_extra)
    rows = {s: sum(f["rows"] for f in files if f["split"] == s) for s in SPLITS}
    qc_path = write_qc_report(
        out,
        source,
        len(cases) + len({e.case_id for e in errors} - {c.case_id for c in cases}),
        rows,
        excluded,
        qc_cases,
    )
    return PrepareResult(
        shard_dir=shard_dir, rows=rows, excluded=excluded, qc_report=qc_path, seconds=time.time() - start
    )


def cohort_folder(source: Path) -> Path:
    """The folder of a cohort's files beside its cases: the cohort's own, or a manifest CSV's."""
    return source.parent if source.is_file() else source


def _endoscopy_frames(
    source: Path, config: PrepareConfig, qc_cases: dict[str, dict[str, Any]]
) -> dict[str, endoscopy_annotations.FrameAnnotation]:
    """The included cases' valid frame annotations; a frame left out is a warning of its case (the case keeps every
    other modality), and an unusable file a warning on the console (the cohort is prepared without it)."""
    path = Path(config.endoscopy_annotations or cohort_folder(source) / endoscopy_annotations.FILE)
    if not path.is_file():
        if config.endoscopy_annotations:
            raise FileNotFoundError(f"endoscopy annotations {path}: no such file")
        return {}
    try:
        frames, problems = endoscopy_annotations.read_annotations(path)
    except endoscopy_annotations.AnnotationError as err:
        print(f"endoscopy annotations not used: {err}", file=sys.stderr)
        return {}
    for problem in problems:
        if problem.case_id in qc_cases:
            qc_cases[problem.case_id]["warnings"].append(f"endoscopy annotation left out: {problem}")
        else:
            print(f"endoscopy annotation left out: {problem}", file=sys.stderr)
    return {cid: frame for cid, frame in frames.items() if cid in qc_cases}


def write_qc_report(
    out: Path, source: Path, found: int, rows: dict[str, int], excluded: list[dict[str, Any]], cases: dict[str, dict]
) -> Path:
    """``qc_report.json`` (everything) and ``qc_report.md`` (what a person reads first)."""
    misalignment = {
        cid: {phase: reg.get("misalignment_mm") for phase, reg in qc["registration"].items()}
        for cid, qc in cases.items()
    }
    report = {
        "source": str(source),
        "cases_found": found,
        "included": sum(rows.values()),
        "rows_per_split": rows,
        "excluded": excluded,
        "excluded_by_reason": dict(Counter(e["reason"] for e in excluded)),
        "cases": cases,
    }
    (out / QC_JSON).write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    all_mm = [v for phases in misalignment.values() for v in phases.values() if v is not None]
    lines = [
        "# Quality control",
        "",
        f"Source: `{source}`. Cases found: {found}; included: {sum(rows.values())} "
        f"({', '.join(f'{s} {n}' for s, n in rows.items())}); excluded: {len(excluded)}.",
        "",
    ]
    if all_mm:
        lines += [
            f"Phase misalignment before registration (mm): median {np.median(all_mm):.1f}, max {np.max(all_mm):.1f}.",
            "",
        ]
    if excluded:
        lines += ["| case | reason | file | field | message |", "| --- | --- | --- | --- | --- |"]
        lines += [
            "| " + " | ".join(_cell(e[key]) for key in ("case_id", "reason", "file", "field", "message")) + " |"
            for e in excluded
        ]
    warned = {cid: len(qc["warnings"]) for cid, qc in cases.items() if qc["warnings"]}
    if warned:
        lines += [
            "",
            f"{sum(warned.values())} warnings in {len(warned)} included cases (boxes clipped to the crop, crop "
            f"fallbacks): see `{QC_JSON}`, `cases.<id>.warnings`.",
        ]
    (out / QC_MARKDOWN).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out / QC_JSON


def _cell(value: Any) -> str:
    """A Markdown table cell: a ``|`` or a line break in a message or a file name would break the table."""
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def prepare_data(
    source: str | Path,
    out: str | Path,
    config: PrepareConfig = PrepareConfig(),
    demo: DemoConfig | None = None,
    layout: str | None = None,
    address: str | None = None,
) -> PrepareResult:
    """``source`` = "demo" (generate the built-in cohort into ``out/raw`` first) or a folder of raw cases.

    ``out`` may be a URI every node of a cluster reaches (``s3://bucket/cohort``, :mod:`gx_ray.storage`): the shards
    are written to a local folder first (a Parquet writer appends; an object store takes whole files) and copied
    there, the manifest last, so a reader never sees a manifest without its shards."""
    init_ray(address)
    if (local := storage.local_path(out)) is not None:
        return _prepare(source, local, config, demo, layout)
    with tempfile.TemporaryDirectory(prefix="gx-prepare-") as staging:
        result = _prepare(source, Path(staging), config, demo, layout)
        destination = storage.normalize(out)
        shards = storage.join(destination, SHARD_DIR)
        storage.copy_tree(result.shard_dir, shards, skip=(MANIFEST_FILE,))
        storage.write_bytes(storage.join(shards, MANIFEST_FILE), (result.shard_dir / MANIFEST_FILE).read_bytes())
        for name in (QC_JSON, QC_MARKDOWN):
            storage.write_bytes(storage.join(destination, name), (Path(staging) / name).read_bytes())
    return replace(result, shard_dir=shards, qc_report=storage.join(destination, QC_JSON))


def _prepare(
    source: str | Path, out: Path, config: PrepareConfig, demo: DemoConfig | None, layout: str | None
) -> PrepareResult:
    if str(source) == "demo":
        demo = demo or DemoConfig()
        source = out / "raw"
        generate_cohort(source, demo)
        layout = demo.layout
    return prepare_shards(Path(source), out, config, layout)
