"""Known-answer checks of the whole pipeline: sweeps on demo cohorts whose answer is planted in the data.

``demo``: the README's main command as a new user runs it. Every modality shows the true stage
(:class:`~gx_ray.data.demo.findings.SignalStrength` 1.0), so each input adds information. Checked, in the project's
order: (1) on every task the full-input schema's 95 % interval over seeds clears chance, (2) image + table + boxes
beats image only significantly (paired over seeds and test patients, Holm) on at least two tasks, (3) the command
takes at most ten minutes; on two cores the third gives way (docs/explanation/demo-cohort.md: 57 min) and is shown
(INFO), not checked. The models must learn it: nothing here is fitted to the answer.

``ct-bench``: CT-Bench's two findings on a demo cohort whose drawn box outlines what the description states: Img2txt
with the box beats it without, and, with the box, random distractors are answered more often than appearance-based
ones (interval clear of zero); each paired on seeds and test patients. Without the box the models stay near chance,
where no distractor can be harder: shown (INFO), not checked.

``planted-signal``: two demo cohorts of the same patients, the stage only in the lab table (decoy images) and the
other way round; the stage-classification ablation (five seeds) must find image + table significantly better than
image only on the first, and no significant difference on the second.

``cv``: one 320-case cohort whose stage shows only in the lab table, the ablation on one split and 5-fold
cross-validated: the out-of-fold interval of image + table minus image only must find the gain and be narrower than
the single split's; the decoy boxes added to image + table must be shown equivalent within the margin (5 AUC); and
the planner, given the single split as pilot and the cross-validated effect, must recommend a design that finds the
gain on a new cohort.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gx_ray.analysis.plan import plan_study
from gx_ray.analysis.power import PowerSettings
from gx_ray.analysis.report import CELLS_FILE, CHANCE, open_sweep, out_of_fold, space_margins
from gx_ray.analysis.runs import headline_metric, higher_is_better, load_runs
from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.demo.findings import SignalStrength
from gx_ray.data.demo.phantom import PhantomConfig
from gx_ray.data.prepare import PrepareConfig, PrepareResult, prepare_data
from gx_ray.runtime import init_ray
from gx_ray.sweep.driver import SweepOptions, SweepResult, run_sweep

DEMO_BUDGET_S = 600.0
FULL, BASELINE = "image_table_bbox", "image_only"

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
        nan = dict.fromkeys(("diff", "ci_low", "ci_high", "p_value", "p_holm"), float("nan"))
        c = {"metric": "", "method": "", **nan, **self.comparison}
        expected = "a significant gain" if self.expected_significant else "no significant difference"
        return (
            f"{'PASS' if self.passed else 'FAIL'}  {self.cohort:<18} image_table - image_only {c['metric']} = "
            f"{c['diff']:+.1f} [{c['ci_low']:+.1f}, {c['ci_high']:+.1f}], p = {c['p_value']:.3g} "
            f"(Holm {c['p_holm']:.3g}; {c['method']}); expected {expected}"
        )


KNOWN_ANSWER_PHANTOM = PhantomConfig(tumour_enhancement_hu=0.0)
"""The tumour drawn as these checks' answers were set on: as bright as the wall it thickens. The main demo plants it
brighter so that a detector trained for minutes finds it; here that would hand the image alone what the checks plant
elsewhere (the stage in the lab table, the lesion's place in its box)."""


def planted_signal(output: Path, cases: int = 160, seed: int = 0, address: str | None = None) -> list[CohortCheck]:
    """Prepare both cohorts under ``output``, sweep each, and check what the reports conclude."""
    init_ray(address)
    checks = []
    for name, signal in COHORTS.items():
        data = prepare_data(
            "demo",
            Path(output) / name,
            PrepareConfig(),
            DemoConfig(cases=cases, seed=seed, signal=signal, phantom=KNOWN_ANSWER_PHANTOM),
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


@dataclass
class DemoCheck:
    name: str
    passed: bool
    detail: str
    information: bool = False
    """Shown beside the checks, never failing them (a comparison the known answer says nothing about)."""

    def line(self) -> str:
        verdict = "INFO" if self.information else "PASS" if self.passed else "FAIL"
        return f"{verdict}  {self.name:<36} {self.detail}"


def demo(output: Path, address: str | None = None) -> list[DemoCheck]:
    """Run the main command (default demo cohort and settings) under ``output`` and check what it shows."""
    result = run_sweep(SweepOptions(space="modality_ablation", output=Path(output), address=address))
    return demo_checks(result.output / "report", result.timings.get("total_seconds", float("nan")), result.finished)


def demo_checks(
    report: Path, seconds: float, trials: int, full: str = FULL, baseline: str = BASELINE
) -> list[DemoCheck]:
    """The demo's three checks on a sweep's report folder (``cells.csv``, ``significance.csv``) and wall time:
    ``full`` clears chance on every task and beats ``baseline`` significantly on two."""
    cells = pd.read_csv(report / CELLS_FILE)
    checks = []
    for task in cells["task"].unique():
        mine = cells[(cells["task"] == task) & (cells["schema"] == full)]
        metric = headline_metric(task)
        row, chance = mine[mine["metric"] == metric], mine[mine["metric"] == CHANCE]
        if row.empty or chance.empty:
            checks.append(DemoCheck(f"{task} above chance", False, f"no {full} {metric} or chance level"))
            continue
        row, level = row.iloc[0], float(chance.iloc[0]["mean"])
        clears = row["ci_low"] > level if higher_is_better(metric) else row["ci_high"] < level
        checks.append(
            DemoCheck(
                f"{task} above chance",
                bool(clears),  # a NaN interval (one seed) clears nothing
                f"{full} {metric} {row['mean']:.1f} [{row['ci_low']:.1f}, {row['ci_high']:.1f}] vs chance {level:.1f}",
            )
        )
    path = report / "significance.csv"
    empty = pd.DataFrame(columns=["task", "schema_a", "schema_b", "significant", "better"])
    table = pd.read_csv(path) if path.is_file() else empty  # no comparison could be made
    wins = table[(table["schema_a"] == full) & (table["schema_b"] == baseline)]
    won = sorted(wins.loc[wins["significant"].astype(bool) & (wins["better"] == full), "task"])
    checks.append(
        DemoCheck(
            f"{full} > {baseline}",
            len(won) >= 2,
            f"significant (Holm) on {len(won)} of {len(wins)} tasks: {', '.join(won) or 'none'}; 2 needed",
        )
    )
    within = seconds <= DEMO_BUDGET_S
    detail = f"{seconds / 60:.1f} min ({trials} trials)" + ("" if within else ", over ten: on two cores it gives way")
    checks.append(DemoCheck("ten minutes", within, detail, information=True))  # the aim that gives way: shown
    return checks


CT_BENCH_CASES = 320
"""48 test patients: the paired differences need them (160 cases left 24, and intervals of +-15 points)."""


def ct_bench(output: Path, cases: int = CT_BENCH_CASES, seed: int = 0, address: str | None = None) -> list[DemoCheck]:
    """Prepare a demo cohort under ``output``, run the ``ct_bench`` space's ``known_answer`` preset on it and check
    the report's two comparisons."""
    init_ray(address)
    data = prepare_data(
        "demo",
        Path(output) / "cohort",
        PrepareConfig(),
        DemoConfig(cases=cases, seed=seed, phantom=KNOWN_ANSWER_PHANTOM),
        address=address,
    )
    print(data.summary())
    result = run_sweep(
        SweepOptions(
            space="ct_bench",
            presets=("demo", "known_answer"),
            data=data.shard_dir,
            output=Path(output) / "sweeps",
            address=address,
        )
    )
    return ct_bench_checks(result.output / "report")


def ct_bench_checks(report: Path) -> list[DemoCheck]:
    """The ``ct-bench`` check on a report folder (``significance.csv``, ``distractors.csv``)."""
    checks = []
    box, family = "image_bbox", "lesion_qa.img2txt"
    path = report / "significance.csv"
    table = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=["task", "schema_a", "schema_b"])
    row = table[(table["task"] == f"{family}.random") & (table["schema_a"] == box) & (table["schema_b"] == BASELINE)]
    if row.empty:
        checks.append(DemoCheck("the box helps Img2txt", False, f"no {box} vs {BASELINE} comparison in {path}"))
    else:
        r = row.iloc[0]
        checks.append(
            DemoCheck(
                "the box helps Img2txt",
                bool(r["significant"]) and r["better"] == box,
                f"{box} - {BASELINE} accuracy {r['diff']:+.1f} [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}], "
                f"p_holm = {r['p_holm']:.3g} (random distractors)",
            )
        )
    path = report / "distractors.csv"
    kinds = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=["task", "schema_a"])
    rows = kinds[(kinds["task"] == family) & (kinds["schema_a"] == "appearance")]
    if not (rows["schema"] == box).any():
        checks.append(DemoCheck("random distractors are easier", False, f"no {box} appearance vs random in {path}"))
    # the known answer is where the box carries the lesion's signal; without it the demo's models stay near chance,
    # where no kind of distractor can be harder: that row is shown, not checked
    for _, r in rows.iterrows():
        checks.append(
            DemoCheck(
                f"random distractors are easier ({r['schema']})",
                bool(r["ci_high"] < 0),
                f"appearance - random accuracy {r['diff']:+.1f} [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}], "
                f"p_holm = {r['p_holm']:.3g}",
                information=r["schema"] != box,
            )
        )
    return checks


CV_SIGNAL = SignalStrength(image=0.0, table=1.0, endoscopy=0.0, text=0.0)
"""The stage shows only in the lab table: the CT, its boxes and the endoscopy show a decoy stage (null inputs)."""
CV_SEEDS, CV_PATIENTS = (3, 5), (24, 48, 96)
"""The designs the planner may recommend: seeds per arm (the ``three_seeds`` preset, or ``planted``'s five) and test
patients (the confirming cohort keeps as many training and validation patients as the pilot's and adds that many)."""
TABLE, NULL = "image_table", "image_table_bbox"


CV_CASES = 320
"""272 patients cross-validated: at 160 (136) the decoy boxes' interval, -1.3 [-6.4, +3.6] AUC, was too wide for the
margin of 5; at 320, -1.0 [-2.3, +0.2]. Showing equivalence takes more patients than finding a difference."""


def cross_validation(output: Path, cases: int = CV_CASES, seed: int = 0, address: str | None = None) -> list[DemoCheck]:
    """The ``cv`` check of the module docstring: the cross-validated gain, the null input's equivalence and the
    planned design's confirmation."""
    init_ray(address)
    output = Path(output)
    data = _cv_cohort(output / "cohort", cases, seed, address)
    presets = ("demo", "planted", "null_input")
    sweeps = {}
    # five seeds, as the demo: a seed level with three has t = 4.30 and leaves a null input's interval too wide to
    # show anything (-1.0 [-13.0, +10.3] AUC against a margin of 5, three seeds and 136 patients)
    for name, extra in (("single_split", ()), ("cross_validated", ("cv",))):
        sweeps[name] = run_sweep(
            SweepOptions(
                "modality_ablation", output / "sweeps" / name, data.shard_dir, address=address, presets=presets + extra
            )
        )
    single = _comparison(sweeps["single_split"].output / "report" / "significance.csv", TABLE, BASELINE)
    oof = _comparison(sweeps["cross_validated"].output / "report" / "out_of_fold_significance.csv", TABLE, BASELINE)
    checks = []
    if single is None or oof is None:
        missing = "single split" if single is None else "out-of-fold"
        return [DemoCheck("cv finds the table's gain", False, f"no {TABLE} vs {BASELINE} comparison ({missing})")]
    ratio = (oof["ci_high"] - oof["ci_low"]) / (single["ci_high"] - single["ci_low"])
    found = bool(oof["significant"]) and oof["better"] == TABLE
    checks.append(
        DemoCheck(
            "cv finds the table's gain",
            found and ratio < 1,
            f"{TABLE} - {BASELINE} AUC out-of-fold {_interval(oof)} ({int(oof['n_cases'])} patients) against the "
            f"single split's {_interval(single)} ({int(single['n_cases'])}): width ratio {ratio:.2f}",
        )
    )
    # the null input: the report compares with image only; "the boxes do not matter" is a comparison with image + table
    with open_sweep(str(sweeps["cross_validated"].output)) as store:
        runs = load_runs(store.uri, store.sweep_id)
        margins = space_margins(store.uri, store.parent.info.run_id)
        _, comparisons = out_of_fold(runs[runs["status"] == "FINISHED"], store.uri, TABLE, margins=margins)
    margin = margins["stage_classification"] if isinstance(margins, dict) else margins
    null = next((c for c in comparisons if c["schema_a"] == NULL), None)
    checks.append(
        DemoCheck(
            "a null input is shown equivalent",
            null is not None and str(null.get("equivalence", "")).startswith("equivalent"),
            "no comparison" if null is None
            else f"{NULL} - {TABLE} AUC out-of-fold {_interval(null)}: {null.get('equivalence')} (margin ±{margin:g})",
        )
    )  # fmt: skip
    others = data.rows["train"] + data.rows["val"]
    checks.append(_planned_design_detects(output, sweeps["single_split"], oof["diff"], others, seed, address))
    return checks


def _cv_cohort(folder: Path, cases: int, seed: int, address: str | None, test: int | None = None) -> PrepareResult:
    """The ``cv`` check's cohort; ``test`` patients beside ``cases - test`` others, where given (the confirmation)."""
    fractions = PrepareConfig().fractions
    if test is not None:  # the default validation share of the others, then the test patients
        val = fractions[1] * (cases - test) / cases
        fractions = (1.0 - val - test / cases, val, test / cases)
    config = DemoConfig(cases=cases, seed=seed, signal=CV_SIGNAL, phantom=KNOWN_ANSWER_PHANTOM)
    data = prepare_data("demo", folder, PrepareConfig(fractions=fractions), config, address=address)
    print(f"{folder.name}: {data.summary()}")
    return data


def _planned_design_detects(
    output: Path, pilot: SweepResult, effect: float, others: int, seed: int, address: str | None
) -> DemoCheck:
    """Plan from the single split for ``effect`` (the cross-validated difference), run the smallest design that
    reaches 80 % on a new cohort (another seed: other patients; ``others`` training and validation ones, as the
    pilot's) and check that its report finds the gain."""
    name = "the planned design detects it"
    with open_sweep(str(pilot.output)) as store:
        settings = PowerSettings(seeds=CV_SEEDS, patients=CV_PATIENTS)
        planned = plan_study(store.uri, store.sweep_id, effect, output, settings)
    mine = next((p.plan for p in planned.comparisons if p.schema_a == TABLE), None)
    if mine is None or mine.smallest is None:
        return DemoCheck(name, False, f"no design of {CV_SEEDS} seeds x {CV_PATIENTS} patients reaches 80 % for "
                         f"{effect:+.1f} AUC")  # fmt: skip
    seeds, patients = mine.smallest.seeds, mine.smallest.patients
    data = _cv_cohort(output / "confirmation_cohort", others + patients, seed + 1, address, test=patients)
    presets = ("demo", "planted", "null_input") + (("three_seeds",) if seeds == 3 else ())
    result = run_sweep(
        SweepOptions(
            "modality_ablation", output / "sweeps" / "planned", data.shard_dir, address=address, presets=presets
        )
    )
    row = _comparison(result.output / "report" / "significance.csv", TABLE, BASELINE)
    detail = (
        f"planned for {effect:+.1f} AUC: {seeds} seeds x {patients} test patients (power "
        f"{100 * mine.smallest.power:.0f} %); run on {data.rows['test']} new test patients: "
    )
    if row is None:
        return DemoCheck(name, False, detail + f"no {TABLE} vs {BASELINE} comparison")
    detected = bool(row["significant"]) and row["better"] == TABLE
    return DemoCheck(name, detected, detail + f"{_interval(row)}, Holm p = {row['p_holm']:.3g}")


def _comparison(path: Path, schema_a: str, schema_b: str) -> dict | None:
    if not path.is_file():
        return None
    table = pd.read_csv(path)
    row = table[(table["schema_a"] == schema_a) & (table["schema_b"] == schema_b)]
    return row.iloc[0].to_dict() if len(row) else None


def _interval(row: dict) -> str:
    return f"{row['diff']:+.1f} [{row['ci_low']:+.1f}, {row['ci_high']:+.1f}]"
