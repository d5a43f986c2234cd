"""The built-in demo cohort: procedural Gastric-X cases written in the release layout, one Ray task per case.

Each case is drawn from its own seed (``[seed, index, modality]``), so case ``k`` is the same whether the
cohort has 10 cases or 1000, and changing how one modality is rendered leaves the others' draws alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import ray
import SimpleITK as sitk

from gx_ray.data.demo.clinical import sample_clinical
from gx_ray.data.demo.endoscopy import endoscopic_lesion, render_endoscopy_with_mask
from gx_ray.data.demo.findings import Findings, SignalStrength, sample_findings, sample_staging
from gx_ray.data.demo.phantom import PhantomConfig, make_from_template, make_phantom
from gx_ray.data.demo.text import CURVATURE_EN, ENDO_LESION, LOCATION_EN, make_reports, make_vqa
from gx_ray.data.endoscopy_annotations import FILE as ANNOTATION_FILE
from gx_ray.data.endoscopy_annotations import FORMAT as ANNOTATION_FORMAT
from gx_ray.data.endoscopy_annotations import annotation_entry, write_annotations
from gx_ray.data.layouts import LAYOUTS, WRITERS, CaseContent
from gx_ray.data.parallel import ordered_results
from gx_ray.data.volumes import load_volume

COHORT_FILE = "demo_cohort.json"
_STREAMS = ("staging", "findings", "imaging", "clinical", "text", "vqa", "endoscopy")


@dataclass(frozen=True)
class DemoConfig:
    cases: int = 48
    seed: int = 0
    signal: SignalStrength = field(default_factory=SignalStrength)
    phantom: PhantomConfig = field(default_factory=PhantomConfig)
    layout: str = "release"
    dicom: bool = False
    """Write CT phases as DICOM series folders instead of NIfTI files."""
    template_ct: Path | None = None
    template_labels: Path | None = None
    """Build every case on this real CT and its TotalSegmentator labels instead of the phantom."""
    endoscopy_size: int = 256
    vqa_per_case: int = 8
    missing_rate: float = 0.05

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; valid: {', '.join(LAYOUTS)}")
        if (self.template_ct is None) != (self.template_labels is None):
            raise ValueError("--template and --template-labels go together")
        if self.cases < 1:
            raise ValueError(f"a demo cohort needs at least one case, got {self.cases}")


def case_id_of(index: int) -> str:
    return f"GXD{index:05d}"


def case_streams(config: DemoConfig, index: int) -> dict[str, np.random.Generator]:
    """Case ``index``'s random streams, one per part: the same draws whatever the cohort's size."""
    return {name: np.random.default_rng([config.seed, index, k]) for k, name in enumerate(_STREAMS)}


def case_findings(config: DemoConfig, index: int) -> Findings:
    """Case ``index``'s patient (its stage and findings) without rendering it: who the patient is, cheaply."""
    rng = case_streams(config, index)
    return sample_findings(rng["findings"], case_id_of(index), sample_staging(rng["staging"]), config.signal)


def generate_case(config: DemoConfig, index: int) -> CaseContent:
    """Case ``index`` of the cohort, in memory."""
    rng = case_streams(config, index)
    case_id = case_id_of(index)
    findings = case_findings(config, index)
    staging = findings.staging
    if config.template_ct is not None:
        ct = load_volume(config.template_ct, case_id, "template")
        labels = load_volume(config.template_labels, case_id, "template labels")
        imaging = make_from_template(rng["imaging"], findings, ct, labels, config.phantom)
    else:
        imaging = make_phantom(rng["imaging"], findings, config.phantom)
    labs = sample_clinical(rng["clinical"], findings, config.missing_rate)
    frame, mask = render_endoscopy_with_mask(rng["endoscopy"], findings, config.endoscopy_size)
    meta = {
        "patient_id": case_id,
        "sex": findings.sex,
        "age": findings.age,
        "ground_truth": {
            "findings": json.loads(json.dumps(asdict(findings), default=str)),
            "phase_offsets": imaging.phase_offsets,
            "signal": asdict(config.signal),
        },
    }
    return CaseContent(
        case_id=case_id,
        phases=imaging.phases,
        organ_masks=imaging.organ_masks,
        tumour_masks=imaging.tumour_masks,
        boxes=imaging.boxes,
        staging=staging,
        labs=labs,
        reports=make_reports(rng["text"], findings),
        vqa=make_vqa(rng["vqa"], findings, config.vqa_per_case),
        endoscopy=frame,
        endoscopy_annotation=frame_annotation(case_id, findings, mask),
        meta=meta,
    )


def frame_annotation(case_id: str, findings: Findings, mask: np.ndarray) -> dict:
    """The frame's annotation (:mod:`gx_ray.data.endoscopy_annotations`): the lesion's site, its box (the painted
    lesion's extent inside the field of view) and region class (early or advanced cancer, by the endoscopy T), and a
    caption in the endoscopy report's words, all from the record the frame was drawn from."""
    lesion = endoscopic_lesion(findings)
    ys, xs = np.nonzero(mask)
    boxes = [[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]] if len(ys) else []
    region = "early gastric cancer" if lesion.early else "advanced gastric cancer"
    where = f"On the {CURVATURE_EN[lesion.curvature]} of the {LOCATION_EN[lesion.location]} there is"
    caption = f"{where} {ENDO_LESION[lesion.gross_type][0].format(size=lesion.size_mm, short=lesion.short_mm)}"
    return annotation_entry(case_id, mask.shape[::-1], lesion.location, boxes, [region] * len(boxes), caption)


@ray.remote(num_cpus=1)
def _write_case_task(root: Path, config: DemoConfig, index: int) -> dict:
    sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(1)  # one core per task; Ray runs the others
    content = generate_case(config, index)
    WRITERS[config.layout](root, content, dicom=config.dicom)
    return content.endoscopy_annotation


def generate_cohort(root: Path, config: DemoConfig = DemoConfig()) -> list[str]:
    """Write the demo cohort under ``root``; reuses a complete cohort written earlier with the same config."""
    root = Path(root)
    stamp = root / COHORT_FILE
    wanted = json.dumps({**asdict(config), "endoscopy_annotations": ANNOTATION_FORMAT}, default=str, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == wanted:
        return [case_id_of(i) for i in range(config.cases)]
    root.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    submit = partial(_write_case_task.remote, root, config)
    frames = list(ordered_results(submit, range(config.cases), config.cases, "demo cohort"))
    write_annotations(root / ANNOTATION_FILE, frames)
    stamp.write_text(wanted)  # written last: its presence means the cohort is complete
    return [frame["case_id"] for frame in frames]
