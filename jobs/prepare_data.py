"""Prepare Gastric-X data for training: raw cases (or the built-in demo cohort) → Parquet shards + split + QC.

python jobs/prepare_data.py --source demo --cases 48 --out outputs/demo
python jobs/prepare_data.py --source /data/gastric-x --out /data/gastric-x-shards --preset paper
python jobs/prepare_data.py --source /data/my-cohort/cohort.csv --out /data/my-cohort-shards --preset paper
python jobs/prepare_data.py --source /shared/gastric-x --out s3://team/gx/cohort --preset paper --address auto
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.demo.findings import SignalStrength
from gx_ray.data.layouts import LAYOUTS
from gx_ray.data.manifest import ManifestError
from gx_ray.data.prepare import PrepareConfig, prepare_data
from gx_ray.data.preprocess import PreprocessConfig
from gx_ray.runtime import tolerant_console
from gx_ray.schema import CaseError


def _triple(kind: type):
    def parse(text: str) -> tuple:
        parts = [kind(p) for p in text.replace("x", ",").split(",")]
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"expected three comma-separated numbers (z,y,x), got {text!r}")
        return tuple(parts)

    return parse


def _signal(text: str) -> SignalStrength:
    try:
        return SignalStrength(**{k: float(v) for k, v in (item.split("=") for item in text.split(","))})
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"--signal takes e.g. image=0,table=1,endoscopy=0,text=0 ({err})") from err


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--source",
        default="demo",
        help="'demo', a folder of raw cases (release or paper layout) or a manifest .csv (docs/how-to/prepare-data.md)",
    )
    parser.add_argument(
        "--out", default="outputs/demo", help="output folder or s3://, gs:// URI (default: outputs/demo)"
    )
    parser.add_argument(
        "--layout", choices=LAYOUTS, help="layout of --source (detected if omitted); for demo: to write"
    )
    parser.add_argument("--preset", default="demo", help="preprocessing preset: demo, bench or paper (default demo)")
    parser.add_argument("--shape", type=_triple(int), help="crop shape D,H,W (overrides the preset)")
    parser.add_argument("--spacing", type=_triple(float), help="voxel spacing z,y,x in mm (overrides the preset)")
    parser.add_argument("--endoscopy-size", type=int, default=64, help="endoscopy image side in the shards")
    parser.add_argument(
        "--endoscopy-annotations",
        help="endoscopy frame annotations (site, boxes, region classes, caption: "
        "docs/how-to/lesion-qa-and-endoscopy.md); default: the cohort's own endoscopy_annotations.json if any",
    )
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--strict", action="store_true", help="stop at the first bad case instead of skipping it")
    parser.add_argument(
        "--address",
        help="a Ray cluster ('auto', host:port; 'local': this job's own); default: the one RAY_ADDRESS names or "
        "`ray start` runs here, else a local one",
    )
    demo = parser.add_argument_group("demo cohort (--source demo)")
    demo.add_argument("--cases", type=int, default=48)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--signal", type=_signal, default=SignalStrength(), help="e.g. image=0,table=1,endoscopy=0,text=0"
    )
    demo.add_argument("--template", type=Path, help="build the cases on this real CT instead of the phantom")
    demo.add_argument("--template-labels", type=Path, help="organ labels of --template (TotalSegmentator, 6 = stomach)")
    demo.add_argument("--dicom", action="store_true", help="write the CT phases as DICOM series")
    args = parser.parse_args(argv)

    try:
        preprocess = PreprocessConfig.preset(args.preset)
    except ValueError as err:
        parser.error(str(err))
    overrides = {k: v for k, v in (("shape_zyx", args.shape), ("spacing_zyx_mm", args.spacing)) if v}
    preprocess = PreprocessConfig(**{**preprocess.__dict__, **overrides})
    config = PrepareConfig(
        preprocess=preprocess,
        endoscopy_size=args.endoscopy_size,
        split_seed=args.split_seed,
        strict=args.strict,
        endoscopy_annotations=args.endoscopy_annotations,
    )
    demo_config = DemoConfig(
        cases=args.cases,
        seed=args.seed,
        signal=args.signal,
        layout=args.layout or "release",
        dicom=args.dicom,
        template_ct=args.template,
        template_labels=args.template_labels,
    )
    try:
        result = prepare_data(args.source, args.out, config, demo_config, args.layout, args.address)
    except (CaseError, ManifestError) as err:  # a bad case with --strict, or a manifest that cannot be read at all
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
