"""Search spaces: `search_spaces/<name>.yaml` → a validated :class:`SearchSpace` → a Ray Tune param space.

A space file is data::

    description: what the sweep answers
    fixed:    {dotted.key: value}                  # every trial
    grid:     {dotted.key: [values]}               # Tune's grid: every combination (seeds are an axis)
    exclude:  [{task: report_generation, seed: [5, 6]}]   # grid cells left out: each rule's values, all its axes
    sample:   {dotted.key: {type: loguniform, low: 1e-5, high: 1e-3}}   # Optuna samples these
    searcher: grid | random | optuna | bohb        # optuna: TPE, multi-objective when `metric` lists several
    scheduler: none | asha | pbt | bohb            # pbt: with searcher random; bohb: with searcher bohb
    pbt:      {interval: 2, quantile: 0.25, resample_probability: 0.25}   # gx_ray.sweep.schedulers
    bohb:     {reduction_factor: 3}
    metric:   primary | val_<metric> | [names]     # primary: per task its own; a list may add the costs
    budget:   {samples: 1, time_s: null}           # samples per grid cell (grid) or in total (optuna)
    resources: {workers: 1, cpus_per_worker: 1, gpus_per_worker: 0}
    overrides:                                     # settings that depend on others, applied to each trial
      - {when: {task: lesion_detection}, set: {schema.box_levels: [lymph_nodes, stomach]}}
    presets:  {demo: {...}, smoke: {...}}          # overlays of the keys above, merged in order; a preset's
                                                   # fixed keys win over the override rules before it

Keys are the dotted keys of :class:`~gx_ray.train.config.TrialConfig`. Every error names the file, the key and
the valid choices, and is raised before Ray starts.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gx_ray.data.folds import STRATA_COLUMNS, read_custom_folds
from gx_ray.models.vlm import check_weights
from gx_ray.schema import AUTO, TASKS
from gx_ray.sweep.objectives import objectives
from gx_ray.tasks import task_class
from gx_ray.train.config import TrialConfig, valid_keys

SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"
TOP_LEVEL_KEYS = (
    "description",
    "fixed",
    "grid",
    "exclude",
    "sample",
    "overrides",
    "searcher",
    "scheduler",
    "metric",
    "budget",
    "resources",
    "cv",
    "analysis",
    "pbt",
    "bohb",
    "presets",
)
CV_KEYS = ("folds", "stratify", "seed", "file")
"""``cv``: patient-level cross-validation over the training and validation patients (:mod:`gx_ray.data.folds`):
``folds`` (dealt, stratified by ``stratify``, default stage, with ``seed``) or ``file`` (a fold file of one's own,
gx-ray's or nnU-Net's ``splits_final.json``). With ``searcher: grid`` and no scheduler it adds the grid axis
``data.fold`` (each fold a trial); with any other searcher or a scheduler each trial trains its configuration on
every fold side by side and reports the folds' mean (:mod:`gx_ray.train.folds`), which the search optimises."""
ANALYSIS_KEYS = ("margin", "primary")
"""``analysis``: how the report reads the sweep; ``margin``: the equivalence margin in the primary metric's units,
one number or one per task, against which "removing input X does not hurt" is tested; ``primary``: the schemas whose
comparisons with the baseline are the confirmatory Holm family, declared before the results (the others are the
exploratory family, Holm-corrected alone)."""
SEARCHERS = ("grid", "random", "optuna", "bohb")
SCHEDULERS = ("none", "asha", "pbt", "bohb")
SCHEDULER_OPTIONS = {"pbt": {"interval": 2, "quantile": 0.25, "resample_probability": 0.25},
                     "bohb": {"reduction_factor": 3}}  # fmt: skip
"""The ``pbt`` and ``bohb`` sections and their defaults (:mod:`gx_ray.sweep.schedulers` reads them)."""
DISTRIBUTIONS = {
    "uniform": ("low", "high"),
    "loguniform": ("low", "high"),
    "int": ("low", "high"),
    "categorical": ("choices",),
}


class SpaceError(ValueError):
    def __init__(self, path: Path | str, key: str, message: str):
        self.path, self.key = path, key
        super().__init__(f"{path}: {key}: {message}")


@dataclass(frozen=True)
class SearchSpace:
    name: str
    path: Path
    description: str
    fixed: dict[str, Any]
    grid: dict[str, list[Any]]
    sample: dict[str, dict[str, Any]]
    searcher: str
    scheduler: str
    metric: str | list[str]
    samples: int
    time_s: float | None
    workers: int
    cpus_per_worker: float
    gpus_per_worker: float | str
    """GPUs per worker: a whole number, a fraction (trials packed on a GPU) or ``auto`` (packing measured)."""
    overrides: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    presets_applied: tuple[str, ...] = field(default_factory=tuple)
    cv: dict[str, Any] = field(default_factory=dict)
    """The ``cv`` section (empty: no cross-validation): folds, stratify, seed or file."""
    analysis: dict[str, Any] = field(default_factory=dict)
    """The ``analysis`` section: the equivalence margin(s) and the declared primary schemas."""
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    """The ``pbt`` or ``bohb`` section of the space's scheduler, its defaults filled in (empty for the others)."""
    exclude: list[dict[str, list[Any]]] = field(default_factory=list)
    """Grid cells left out: a cell matching every axis of a rule (its value among the rule's) is not run."""

    def resolve(self, chosen: dict[str, Any]) -> dict[str, Any]:
        """A trial's flat config: what the ``resources`` section says, the fixed values (which may refine it), the
        chosen grid/sampled values, then the matching overrides. Trials take their config from here alone
        (:meth:`gx_ray.sweep.trial.SweepContext.setting`)."""
        flat = {**self.resource_keys(), **self.fixed, **chosen}
        for rule in self.overrides:
            if all(flat.get(k) == v for k, v in rule["when"].items()):
                flat.update(rule["set"])
        return flat

    def resource_keys(self) -> dict[str, Any]:
        """What the space's ``resources`` section says, as trial config keys (a trial's ``fixed`` may refine them)."""
        return {
            "resources.workers": self.workers,
            "resources.cpus_per_worker": self.cpus_per_worker,
            "resources.gpus_per_worker": self.gpus_per_worker,
            "resources.use_gpu": self.gpus_per_worker != 0,
        }

    @property
    def folds_in_trial(self) -> int:
        """The folds each trial trains side by side (``cv`` with a searcher or scheduler); 0 where the folds are a
        grid axis or there is no ``cv``."""
        return int(self.cv["folds"]) if self.cv and "data.fold" not in self.grid else 0

    @property
    def multi_objective(self) -> bool:
        return isinstance(self.metric, list) and len(self.metric) > 1

    def cells(self) -> list[dict[str, Any]]:
        """Every grid combination (one dict of dotted key → value per cell) that no ``exclude`` rule leaves out."""
        keys = list(self.grid)
        cells = [dict(zip(keys, values, strict=True)) for values in itertools.product(*self.grid.values())]
        return [c for c in cells if not excluded(c, self.exclude)]

    def trial_count(self) -> int:
        return len(self.cells()) * self.samples if self.searcher in ("grid", "random") else self.samples


def excluded(cell: dict[str, Any], rules: list[dict[str, list[Any]]]) -> bool:
    """Whether an ``exclude`` rule matches ``cell``: each axis it names holds one of the rule's values."""
    return any(all(cell[k] in values for k, values in rule.items()) for rule in rules)


def space_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    path = SPACES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))
        raise SpaceError(name_or_path, "space", f"no such search space; valid: {', '.join(names)}")
    return path


def available_presets(name_or_path: str) -> tuple[str, ...]:
    document = yaml.safe_load(space_path(name_or_path).read_text(encoding="utf-8")) or {}
    return tuple((document.get("presets") or {}) if isinstance(document, dict) else ())


def load_space(name_or_path: str, presets: tuple[str, ...] = (), weights: bool = True) -> SearchSpace:
    """Read, overlay the presets (in order) and validate a space; every trial config is built once to check it, and
    (``weights``) the weights of every VLM its trials name are checked to be here or on the hub."""
    path = space_path(name_or_path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise SpaceError(path, "yaml", f"not valid YAML: {err}") from err
    if not isinstance(document, dict):
        raise SpaceError(path, "top level", "expected a mapping")
    _check_keys(path, "top level", document, TOP_LEVEL_KEYS)
    available = document.pop("presets", None) or {}
    axis_values = _axis_values([document, *available.values()])  # the file's, before a preset replaces an axis
    for preset in presets:
        if preset not in available:
            raise SpaceError(path, "presets", f"no preset {preset!r}; valid: {', '.join(available) or 'none'}")
        _check_keys(path, f"presets.{preset}", available[preset], TOP_LEVEL_KEYS)
        document = _overlay(document, available[preset])
    space = _parse(path, document, presets, axis_values)
    _validate_trials(space, weights)
    return space


def _overlay(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` (a preset) over ``base``: its mappings merged key by key, its lists in place of base's; what it
    fixes also wins over base's override rules (``smoke``'s one epoch over ``demo``'s longer report generation)."""
    merged = copy.deepcopy(base)
    fixed = overlay.get("fixed") if isinstance(overlay.get("fixed"), dict) else {}
    if fixed and "overrides" not in overlay:  # an overlay with rules of its own replaces base's
        for rule in merged.get("overrides") or []:
            if isinstance(rule, dict) and isinstance(rule.get("set"), dict):
                rule["set"] = {k: v for k, v in rule["set"].items() if k not in fixed}
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _axis_values(documents: list[Any]) -> dict[str, list[Any]]:
    """Each grid axis's values across a space file's documents (the file's and its presets'): a preset of fewer
    seeds may meet a rule about seeds another preset adds."""
    values: dict[str, list[Any]] = {}
    for document in documents:
        grid = document.get("grid") if isinstance(document, dict) else None
        for key, axis in (grid if isinstance(grid, dict) else {}).items():
            values.setdefault(key, []).extend(axis if isinstance(axis, list) else [])
    return values


def _exclude(
    path: Path, rules: Any, grid: dict[str, list[Any]], axis_values: dict[str, list[Any]], searcher: str
) -> list[dict[str, list[Any]]]:
    """The ``exclude`` rules, each axis's value(s) as a list: grid axes only, values the file gives that axis (a
    typo is an error, not a rule that leaves nothing out), and a cell left to run."""
    if rules and searcher != "grid":
        raise SpaceError(path, "exclude", f"leaves cells out of a grid: searcher grid, not {searcher}")
    if not isinstance(rules, list):
        raise SpaceError(path, "exclude", "expected a list of {grid axis: value or [values]}")
    parsed = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or not rule:
            raise SpaceError(path, f"exclude[{i}]", "expected a non-empty mapping of grid axes to values")
        parsed.append({})
        for key, value in rule.items():
            if key not in grid:
                raise SpaceError(path, f"exclude[{i}].{key}", f"not a grid axis; valid: {', '.join(grid) or 'none'}")
            parsed[-1][key] = value if isinstance(value, list) else [value]
            if unknown := [v for v in parsed[-1][key] if v not in axis_values.get(key, [])]:
                valid = ", ".join(map(str, dict.fromkeys(axis_values.get(key, []))))
                raise SpaceError(path, f"exclude[{i}].{key}", f"{unknown[0]!r} is no value of the axis; valid: {valid}")
    cells = itertools.product(*[[(k, v) for v in values] for k, values in grid.items()])
    if parsed and all(excluded(dict(c), parsed) for c in cells):
        raise SpaceError(path, "exclude", "leaves out every cell of the grid")
    return parsed


def _check_keys(path: Path, where: str, mapping: Any, valid: tuple[str, ...]) -> None:
    if not isinstance(mapping, dict):
        raise SpaceError(path, where, "expected a mapping")
    for key in mapping:
        if key not in valid:
            raise SpaceError(
                path, f"{where}.{key}" if where != "top level" else key, f"unknown key; valid: {', '.join(valid)}"
            )


def _check_config_key(path: Path, section: str, key: str) -> None:
    keys = valid_keys()
    if key not in keys and not key.startswith("task_options."):
        raise SpaceError(path, f"{section}.{key}", f"not a trial config key; valid: {', '.join(keys)}")


def _parse(path: Path, doc: dict[str, Any], presets: tuple[str, ...], axis_values: dict[str, list[Any]]) -> SearchSpace:
    """A space's document (its presets overlaid) as a :class:`SearchSpace`, each section checked in turn;
    ``axis_values``: each grid axis's values in the file, its presets' included (what ``exclude`` may name)."""
    fixed, grid, sample = _parameters(path, doc)
    searcher, scheduler, scheduler_options = _search_kind(path, doc, grid, sample)
    exclude = _exclude(path, doc.get("exclude") or [], grid, axis_values, searcher)
    if "task" not in fixed and "task" not in grid and "task" not in sample:
        raise SpaceError(
            path,
            "task",
            f"every space sets the task (fixed, grid or sample); valid: {', '.join(TASKS)}, or a plug-in task "
            "(module:Class, or an entry point of group gx_ray.tasks)",
        )
    overrides = _overrides(path, doc.get("overrides") or [])
    metric = doc.get("metric", "primary")
    try:  # every objective named and directed (gx_ray.sweep.objectives)
        objectives(metric, searcher, fixed.get("task"))
    except ValueError as err:
        raise SpaceError(path, "metric", str(err)) from err
    budget = doc.get("budget") or {}
    _check_keys(path, "budget", budget, ("samples", "time_s"))
    resources = doc.get("resources") or {}
    _check_keys(path, "resources", resources, ("workers", "cpus_per_worker", "gpus_per_worker"))
    if isinstance(metric, list) and len(metric) > 1 and scheduler != "none":
        raise SpaceError(
            path, "scheduler", "a multi-objective search takes no scheduler (each scheduler takes one metric)"
        )
    cv = _cv(path, doc.get("cv"), fixed, grid, sample)
    if cv and searcher == "grid" and scheduler == "none":  # every cell on every fold: a grid axis as any other
        grid = {**grid, "data.fold": list(range(cv["folds"]))}
    elif cv and (int(resources.get("workers", 1)) > 1 or "resources.workers" in {**grid, **sample}
                 or int(fixed.get("resources.workers", 1)) > 1):  # fmt: skip
        raise SpaceError(path, "cv", "a search over cross-validated configurations trains each trial's folds "
                         "side by side in one process: resources.workers must be 1")  # fmt: skip
    analysis = _analysis(path, doc.get("analysis") or {}, [*TASKS, *_plugin_names(fixed, grid, sample)])
    _primary(path, analysis.get("primary"), _values("schema", fixed, grid, sample))
    return SearchSpace(
        name=path.stem,
        path=path,
        description=str(doc.get("description", "")),
        fixed=fixed,
        grid=grid,
        sample=sample,
        searcher=searcher,
        scheduler=scheduler,
        metric=metric,
        samples=int(budget.get("samples", 1)),
        time_s=budget.get("time_s"),
        workers=int(resources.get("workers", 1)),
        cpus_per_worker=float(resources.get("cpus_per_worker", 1)),
        gpus_per_worker=_gpus(path, resources.get("gpus_per_worker", 0)),
        overrides=overrides,
        presets_applied=tuple(presets),
        cv=cv,
        analysis=analysis,
        scheduler_options=scheduler_options,
        exclude=exclude,
    )


def _parameters(path: Path, doc: dict[str, Any]) -> tuple[dict, dict, dict]:
    """The ``fixed``, ``grid`` and ``sample`` sections: trial config keys, grid axes that are lists, distributions
    with their parameters, and no key in two of them."""
    fixed, grid, sample = doc.get("fixed") or {}, doc.get("grid") or {}, doc.get("sample") or {}
    for section, mapping in (("fixed", fixed), ("grid", grid), ("sample", sample)):
        if not isinstance(mapping, dict):
            raise SpaceError(path, section, "expected a mapping of trial config keys")
        for key in mapping:
            _check_config_key(path, section, key)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpaceError(path, f"grid.{key}", "a grid axis is a non-empty list of values")
    for key, spec in sample.items():
        if not isinstance(spec, dict) or spec.get("type") not in DISTRIBUTIONS:
            raise SpaceError(path, f"sample.{key}", f"needs a type; valid: {', '.join(DISTRIBUTIONS)}")
        missing = [p for p in DISTRIBUTIONS[spec["type"]] if p not in spec]
        if missing:
            raise SpaceError(path, f"sample.{key}", f"a {spec['type']} distribution needs {', '.join(missing)}")
    overlap = (set(fixed) & set(grid)) | (set(fixed) & set(sample)) | (set(grid) & set(sample))
    if overlap:
        raise SpaceError(path, sorted(overlap)[0], "set in more than one of fixed, grid and sample")
    return fixed, grid, sample


def _search_kind(path: Path, doc: dict[str, Any], grid: dict, sample: dict) -> tuple[str, str, dict]:
    """The searcher, the scheduler and its options: known names, and the sections each takes."""
    searcher, scheduler = doc.get("searcher", "grid"), doc.get("scheduler", "none")
    if searcher not in SEARCHERS:
        raise SpaceError(path, "searcher", f"unknown searcher {searcher!r}; valid: {', '.join(SEARCHERS)}")
    if scheduler not in SCHEDULERS:
        raise SpaceError(path, "scheduler", f"unknown scheduler {scheduler!r}; valid: {', '.join(SCHEDULERS)}")
    if searcher == "grid" and sample:
        raise SpaceError(path, "sample", "sampled parameters need searcher: random, optuna or bohb")
    if searcher == "bohb" and grid:
        raise SpaceError(path, "grid", "searcher bohb takes no grid axes: put them in `sample` as categorical")
    options = _scheduler_options(path, doc, searcher, scheduler, sample)
    if searcher == "optuna" and grid:
        # OptunaSearch cannot take Tune's grid_search; factorial axes belong to a grid space
        raise SpaceError(path, "grid", "searcher optuna takes no grid axes: put them in `sample` as categorical")
    return searcher, scheduler, options


def _overrides(path: Path, overrides: Any) -> list[dict[str, dict[str, Any]]]:
    """The ``overrides`` rules: each a non-empty ``when`` and ``set`` of trial config keys."""
    if not isinstance(overrides, list):
        raise SpaceError(path, "overrides", "expected a list of {when: {...}, set: {...}}")
    for i, rule in enumerate(overrides):
        _check_keys(path, f"overrides[{i}]", rule, ("when", "set"))
        for part in ("when", "set"):
            if not isinstance(rule.get(part), dict) or not rule[part]:
                raise SpaceError(path, f"overrides[{i}].{part}", "expected a non-empty mapping of trial config keys")
            for key in rule[part]:
                _check_config_key(path, f"overrides[{i}].{part}", key)
    return overrides


def _analysis(path: Path, analysis: Any, tasks: list[str]) -> dict[str, Any]:
    """The ``analysis`` section: an equivalence margin, positive, one number or one per task of ``tasks`` (a
    plug-in's goes under its name, as its cells)."""
    _check_keys(path, "analysis", analysis, ANALYSIS_KEYS)
    margin = analysis.get("margin")
    margins = margin.values() if isinstance(margin, dict) else [margin]
    if margin is not None and not all(_number(m) and m > 0 for m in margins):
        raise SpaceError(
            path, "analysis.margin", f"{margin!r}: a positive number in the metric's units, or one per task"
        )
    if isinstance(margin, dict) and (unknown := sorted(set(margin) - set(tasks))):
        raise SpaceError(path, "analysis.margin", f"unknown task {unknown[0]!r}; valid: {', '.join(tasks)}")
    return analysis


def _primary(path: Path, primary: Any, schemas: list[Any]) -> None:
    """``analysis.primary``: a list of the schemas the space trains (by name; a mapping's ``name``, else custom)."""
    if primary is None:
        return
    names = list(dict.fromkeys(s.get("name", "custom") if isinstance(s, dict) else str(s) for s in schemas))
    if not isinstance(primary, list) or not primary or not all(isinstance(s, str) for s in primary):
        raise SpaceError(path, "analysis.primary", f"{primary!r}: a list of schema names; valid: {', '.join(names)}")
    if unknown := [s for s in primary if s not in names]:
        raise SpaceError(path, "analysis.primary", f"unknown schema {unknown[0]!r}; valid: {', '.join(names)}")


def _scheduler_options(path: Path, doc: dict[str, Any], searcher: str, scheduler: str, sample: dict) -> dict:
    """The ``pbt``/``bohb`` section of the space's scheduler, checked and completed; the pairs Tune can run."""
    if (searcher == "bohb") != (scheduler == "bohb"):
        raise SpaceError(
            path, "scheduler" if searcher == "bohb" else "searcher",
            "BOHB is a searcher and a scheduler together (TuneBOHB + HyperBandForBOHB): give searcher: bohb and "
            "scheduler: bohb",
        )  # fmt: skip
    if scheduler == "pbt" and searcher != "random":
        raise SpaceError(
            path, "searcher", f"scheduler pbt draws its first population from `sample` at random and then searches by "
            f"exploiting and mutating: give searcher: random (not {searcher})",
        )  # fmt: skip
    if scheduler in SCHEDULER_OPTIONS and not sample:
        raise SpaceError(path, "sample", f"scheduler {scheduler} searches the `sample` distributions: give some")
    for name in SCHEDULER_OPTIONS:
        if doc.get(name) is not None and name != scheduler:
            raise SpaceError(path, name, f"a {name} section needs scheduler: {name} (this space's: {scheduler})")
    if scheduler not in SCHEDULER_OPTIONS:
        return {}
    section = doc.get(scheduler) or {}
    _check_keys(path, scheduler, section, tuple(SCHEDULER_OPTIONS[scheduler]))
    options = {**SCHEDULER_OPTIONS[scheduler], **section}
    rules = {
        "interval": (lambda v: _whole(v) and v >= 1, "a whole number of epochs >= 1"),
        "quantile": (lambda v: _number(v) and 0 < v <= 0.5, "a fraction in (0, 0.5]"),
        "resample_probability": (lambda v: _number(v) and 0 <= v <= 1, "a probability in [0, 1]"),
        "reduction_factor": (lambda v: _whole(v) and v >= 2, "a whole number >= 2"),
    }
    for key, value in options.items():
        valid, what = rules[key]
        if not valid(value):
            raise SpaceError(path, f"{scheduler}.{key}", f"{value!r}: {what}")
    return options


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _plugin_names(fixed: dict, grid: dict, sample: dict) -> list[str]:
    """The names of the plug-in tasks a space runs (a reference that does not resolve is reported by the trial
    configs' check, naming the cell)."""
    names = []
    for value in _values("task", fixed, grid, sample):
        if isinstance(value, str) and value not in TASKS:
            with contextlib.suppress(ValueError):
                names.append(task_class(value).name)
    return names


def _values(key: str, fixed: dict, grid: dict, sample: dict) -> list[Any]:
    """Every value the space gives ``key``: its fixed value, its grid axis and its sampled choices."""
    values = [fixed[key]] if key in fixed else []
    return [*values, *(grid.get(key) or []), *((sample.get(key) or {}).get("choices") or [])]


def _cv(path: Path, cv: Any, fixed: dict, grid: dict, sample: dict) -> dict[str, Any]:
    """The ``cv`` section checked and completed (``folds`` from a ``file`` is read when the sweep starts)."""
    if not cv:
        return {}
    _check_keys(path, "cv", cv, CV_KEYS)
    if any("data.fold" in section or "data.folds_file" in section for section in (fixed, grid, sample)):
        raise SpaceError(path, "cv", "cv sets data.fold and data.folds_file itself: remove them from the space")
    if "file" in cv:
        if set(cv) - {"file"}:
            raise SpaceError(path, "cv", "a fold file decides the folds: give cv.file alone")
        try:  # the file's folds decide the grid axis
            folds = read_custom_folds(str(cv["file"]))
        except ValueError as err:
            raise SpaceError(path, "cv.file", str(err)) from err
        return {"file": str(cv["file"]), "folds": len(folds)}
    folds, stratify, seed = cv.get("folds", 5), cv.get("stratify", ["stage"]), cv.get("seed", 0)
    if not _whole(folds) or folds < 2:
        raise SpaceError(path, "cv.folds", f"{folds!r}: a whole number of folds >= 2")
    stratify = [stratify] if isinstance(stratify, str) else list(stratify)
    if unknown := sorted(set(stratify) - set(STRATA_COLUMNS)):
        raise SpaceError(path, "cv.stratify", f"unknown column {unknown[0]!r}; valid: {', '.join(STRATA_COLUMNS)}")
    if not _whole(seed):
        raise SpaceError(path, "cv.seed", f"{seed!r}: a whole number")
    return {"folds": folds, "stratify": stratify, "seed": seed}


def _gpus(path: Path, value: Any) -> float | str:
    if value == AUTO:
        return AUTO
    try:
        gpus = float(value)
    except (TypeError, ValueError):
        gpus = -1.0
    if gpus < 0 or (gpus > 1 and not gpus.is_integer()):
        valid = "auto, 0, a fraction up to 1, a whole number"
        raise SpaceError(path, "resources.gpus_per_worker", f"{value!r}: valid: {valid}")
    return gpus


def _validate_trials(space: SearchSpace, weights: bool = True) -> None:
    """Build the trial config of every grid cell (sampled keys at a valid value): bad names and leaks fail here. With
    ``weights``, those of every VLM a trial may load are checked too (:func:`~gx_ray.models.vlm.check_weights`), in
    seconds: a trial without them retries the hub for minutes."""
    probe = {key: _probe_value(spec) for key, spec in space.sample.items()}
    for cell in space.cells():
        flat = space.resolve({**probe, **cell})
        try:
            TrialConfig.from_flat(flat)
        except ValueError as err:
            where = ", ".join(f"{k}={v}" for k, v in cell.items()) or "fixed"
            raise SpaceError(space.path, where, str(err)) from err
    names, folders = _vlm_names(space, probe) if weights else (set(), {})
    problems = []  # every model whose weights are not here, said at once
    if absent := sorted(name for name in folders if not Path(name).is_dir()):
        named = "; ".join(f"{name} (the {folders[name]} plug-in)" for name in absent)
        why = "no such folder here; gx-ray's plug-ins read their weights from a folder of their settings and parts"
        problems.append(f'{named}: {why} (docs/how-to/vlm.md, "The paper\'s models")')
    try:
        if names:  # hub names only where a space has them: the check imports huggingface_hub
            check_weights(names)
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise SpaceError(space.path, "vlm.name", ". ".join(problems))


def _vlm_names(space: SearchSpace, probe: dict[str, Any]) -> tuple[set[str], dict[str, str]]:
    """``vlm.name`` of every trial whose model is a transformers VLM or a tiny model, and (name → plug-in) of those
    that gx-ray's own plug-ins read from a folder, over the grid and every choice Optuna may sample for the model's
    family, name and plug-in. A user's plug-in loads its own weights, unchecked."""
    sampled = [[(key, c) for c in space.sample[key]["choices"]] for key in ("model.family", "vlm.name", "vlm.plugin")
               if space.sample.get(key, {}).get("type") == "categorical"]  # fmt: skip
    names, folders = set(), {}
    for cell in space.cells():
        for choice in itertools.product(*sampled):
            flat = space.resolve({**probe, **cell, **dict(choice)})
            name, plugin = str(flat.get("vlm.name") or ""), str(flat.get("vlm.plugin") or "")
            if flat.get("model.family") != "vlm" or not name:
                continue
            if not plugin or name.startswith("tiny:"):
                names.add(name)  # a plug-in's tiny model is built here too, before the trials ask for it
            elif plugin.startswith("gx_ray.models."):
                folders[name] = plugin
    return names, folders


def _probe_value(spec: dict[str, Any]) -> Any:
    return spec["choices"][0] if spec["type"] == "categorical" else spec["low"]
