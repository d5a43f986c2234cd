"""Known-answer checks of the whole pipeline: sweeps on demo cohorts whose answer is planted in the data.

``planted-signal``: two demo cohorts with the same patients. In the first the stage shows only in the lab
table (the CT and endoscopy show decoy stages); in the second the table shows decoys and the images the truth.
The same stage-classification ablation (image only vs image + table, five seeds) runs on both, and the report
must find image + table significantly better than image only on the first, and no significant difference on
the second.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.demo.findings import SignalStrength
from gx_ray.data.prepare import PrepareConfig, prepare_data
from gx_ray.runtime import init_ray
from gx_ray.sweep.driver import SweepOptions, run_sweep

COHORTS = {
    "table_only_signal": SignalStrength(image=0.0, table=1.0, endoscopy=0.0, text=0.0),
    "no_table_signal": SignalStrength(image=1.0, table=0.0, endoscopy=1.0, text=1.0),
}
EXPECTED = {"table_only_signal": True, "no_table_signal": False}
"""Whether image + table must beat image only significantly on the cohort."""


@dataclass
class CohortCheck:
    cohort: str
    comparison: dict
    expected_significant: bool

    @property
    def passed(self) -> bool:
        significant = bool(self.comparison.get("significant"))
        if self.expected_significant:
            return significant and self.comparison.get("better") == "image_table"
        return not significant

    def line(self) -> str:
        c = {
            "metric": "",
            "method": "",
            **{k: float("nan") for k in ("diff", "ci_low", "ci_high", "p_value", "p_holm")},
        }
        c.update(self.comparison)
        expected = "a significant gain" if self.expected_significant else "no significant difference"
        return (
            f"{'PASS' if self.passed else 'FAIL'}  {self.cohort:<18} image_table - image_only {c['metric']} = "
            f"{c['diff']:+.1f} [{c['ci_low']:+.1f}, {c['ci_high']:+.1f}], p = {c['p_value']:.3g} "
            f"(Holm {c['p_holm']:.3g}; {c['method']}); expected {expected}"
        )


def planted_signal(output: Path, cases: int = 160, seed: int = 0, address: str | None = None) -> list[CohortCheck]:
    """Prepare both cohorts under ``output``, sweep each, and check what the reports conclude."""
    init_ray(address)
    checks = []
    for name, signal in COHORTS.items():
        data = prepare_data(
            "demo",
            Path(output) / name,
            PrepareConfig(),
            DemoConfig(cases=cases, seed=seed, signal=signal),
            address=address,
        )
        print(f"{name}: {data.summary()}")
        result = run_sweep(
            SweepOptions(
                space="modality_ablation",
                presets=("demo", "planted"),
                data=data.shard_dir,
                output=Path(output) / "sweeps" / name,
                address=address,
            )
        )
        table = pd.read_csv(result.output / "report" / "significance.csv")
        row = table[(table["schema_a"] == "image_table") & (table["schema_b"] == "image_only")]
        comparison = row.iloc[0].to_dict() if len(row) else {}
        checks.append(CohortCheck(name, comparison, EXPECTED[name]))
    return checks
