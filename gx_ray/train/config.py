"""The trial config: one typed, validated object per trial; everything logged to MLflow as params comes from it.

Search spaces address its fields with dotted keys (``optimiser.lr``, ``model.vision``): :meth:`TrialConfig.from_flat`
reads a trial's flat mapping, :meth:`TrialConfig.to_flat` gives the same keys back for MLflow.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_type_hints

from gx_ray.data.stream import DataConfig
from gx_ray.modalities import ModalitySchema, check_leakage, resolve_schema
from gx_ray.modalities.views import ViewsConfig
from gx_ray.models.registry import ModelConfig
from gx_ray.models.vlm import VLMConfig, VLMPluginError, retrieval_problem
from gx_ray.schema import AUTO, PAPER_TASKS
from gx_ray.tasks import Task, task_class


@dataclass(frozen=True)
class OptimiserConfig:
    """AdamW; the paper: lr 5e-5, weight decay 0.01, the text encoder at twice the visual rate."""

    lr: float = 5e-5
    weight_decay: float = 0.01
    text_lr_multiplier: float = 2.0
    grad_clip: float = 1.0


@dataclass(frozen=True)
class ScheduleConfig:
    """Linear warm-up over ``warmup_fraction`` of the steps, then linear decay to zero (the paper)."""

    epochs: int = 10
    warmup_fraction: float = 0.1
    max_steps_per_epoch: int | None = None
    """Caps an epoch (smoke runs); None reads the whole training split."""
    checkpoint_every: int = 1
    """Epochs between the trial's checkpoints (its last epoch always checkpoints): a PBT perturbation interval or a
    BOHB rung between two checkpoints would restore an older state, and is refused before the sweep starts."""
    select: str = "best"
    """Which model scores the test split: ``best``, the epoch with the best validation score, or ``last``, the final
    epoch's (validation still runs and is logged every epoch). Picking the best of many epochs on a few validation
    patients picks their noise as well: ``last`` is for schedules that decay to zero on a small validation split."""


SELECTIONS = ("best", "last")
RETIRED_KEYS = {
    "data.batch_size": "data.batch_size is ambiguous (per forward pass or per optimiser step?) and no longer read: "
    "set data.effective_batch (samples per optimiser step over all ranks: the batch size papers report) and "
    "data.micro_batch (samples per rank per forward pass, or auto: the largest that fits the GPU)",
    "data.grad_accum": "data.grad_accum is no longer set by hand: it is data.effective_batch / (resources.workers x "
    "data.micro_batch)",
}


@dataclass(frozen=True)
class ResourcesConfig:
    workers: int = 1
    """Ray Train workers (DDP ranks); 1 runs the loop inside the Tune trial itself (no TorchTrainer start-up)."""
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | str = 0.0
    """GPUs per worker: 1, a fraction (0.25 packs four trials on a GPU), or ``auto``: a measured training step of
    the trial's model at its micro-batch decides how many trials share a GPU."""
    torch_trainer: bool = False
    """Run even a one-worker trial under a Ray Train ``TorchTrainer`` (several workers always do)."""


@dataclass(frozen=True)
class TrialConfig:
    task: str
    schema: ModalitySchema
    model: ModelConfig = field(default_factory=ModelConfig)
    optimiser: OptimiserConfig = field(default_factory=OptimiserConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    vlm: VLMConfig = field(default_factory=VLMConfig)
    """The vision-language model, read when ``model.family`` is ``vlm``."""
    views: ViewsConfig = field(default_factory=ViewsConfig)
    """How the CT becomes a VLM's 2D images, read when ``model.family`` is ``vlm``."""
    task_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    amp: str = "auto"
    """``auto``: bf16 autocast on GPU, none on CPU; ``bf16``; ``off``."""

    def __post_init__(self) -> None:
        task = task_class(self.task)  # a built-in, a plug-in's module:Class or entry point: errors name what is wrong
        if self.amp not in ("auto", "bf16", "off"):
            raise ValueError(f"unknown amp {self.amp!r}; valid: auto, bf16, off")
        check_leakage(self.schema, task, self.task_options)  # the class: a plug-in's declared rule too
        self._check_values()
        self._check_batch()
        if self.model.family == "vlm":
            self._check_vlm()

    def _check_vlm(self) -> None:
        """A VLM trial asks what a VLM can answer, from inputs it can be given: refused here, naming the key."""
        if self.task not in VLM_TASKS:
            raise ValueError(
                f"model.family vlm answers {', '.join(VLM_TASKS)}; task {self.task!r} is not built for it (use "
                "model.family: encoder)"
            )
        if not self.vlm.name:
            raise ValueError("model.family vlm needs vlm.name: a hub name or a local folder")
        if self.task == "retrieval" and (why := retrieval_problem(self.vlm.plugin)):
            raise VLMPluginError(why)
        unsupported = [
            (key, value)
            for key, value, given in (
                ("schema.endoscopy", self.schema.endoscopy, self.schema.endoscopy),
                ("schema.reports", list(self.schema.reports), self.schema.reports),
                ("schema.table", self.schema.table, self.schema.table == "numeric"),
                ("schema.boxes", self.schema.boxes, self.schema.boxes == "channels"),
            )
            if given
        ]
        if unsupported:
            key, value = unsupported[0]
            raise ValueError(
                f"{key} = {value!r} is not built for model.family vlm (it sees CT views, the tumour box drawn or in "
                "the prompt, and the lab table as text: schema.table text, schema.boxes overlay or off)"
            )
        self.views.recipe(self.schema)  # a view that would leak the withheld tumour box fails here

    def _check_values(self) -> None:
        """Numbers that would train on silently and report NaN (a negative learning rate) or fail late, after Ray
        has started (zero epochs, a fractional seed): refused here, naming the key."""
        o, s, d, r = self.optimiser, self.schedule, self.data, self.resources
        rules = [
            ("optimiser.lr", o.lr, _positive(o.lr)),
            ("optimiser.weight_decay", o.weight_decay, _finite(o.weight_decay) and o.weight_decay >= 0),
            ("optimiser.text_lr_multiplier", o.text_lr_multiplier, _positive(o.text_lr_multiplier)),
            ("optimiser.grad_clip", o.grad_clip, _positive(o.grad_clip)),
            ("schedule.epochs", s.epochs, _integer(s.epochs) and s.epochs >= 1),
            ("schedule.warmup_fraction", s.warmup_fraction, _finite(s.warmup_fraction) and 0 <= s.warmup_fraction < 1),
            (
                "schedule.max_steps_per_epoch",
                s.max_steps_per_epoch,
                s.max_steps_per_epoch is None or (_integer(s.max_steps_per_epoch) and s.max_steps_per_epoch >= 1),
            ),
            ("schedule.checkpoint_every", s.checkpoint_every, _integer(s.checkpoint_every) and s.checkpoint_every >= 1),
            ("schedule.select", s.select, s.select in SELECTIONS),
            ("seed", self.seed, _integer(self.seed) and self.seed >= 0),
            ("data.effective_batch", d.effective_batch, _integer(d.effective_batch) and d.effective_batch >= 1),
            ("data.eval_batch_size", d.eval_batch_size, d.eval_batch_size is None or _integer(d.eval_batch_size)
             and d.eval_batch_size >= 1),
            ("data.shuffle_buffer", d.shuffle_buffer, _integer(d.shuffle_buffer) and d.shuffle_buffer >= 0),
            ("data.read_concurrency", d.read_concurrency, _integer(d.read_concurrency) and d.read_concurrency >= 1),
            ("data.read_cpus", d.read_cpus, _finite(d.read_cpus) and d.read_cpus >= 0),
            ("data.in_memory", d.in_memory, isinstance(d.in_memory, bool) or d.in_memory == AUTO),
            ("data.fold", d.fold, d.fold is None or (_integer(d.fold) and d.fold >= 0)),
            ("resources.workers", r.workers, _integer(r.workers) and r.workers >= 1),
            ("resources.cpus_per_worker", r.cpus_per_worker, _positive(r.cpus_per_worker)),
        ]  # fmt: skip
        for key, value, valid in rules:
            if not valid:
                raise ValueError(f"{key} = {value!r} is not valid: {VALUE_RULES[key.split('.')[-1]]}")
        if d.fold is not None and task_class(self.task).attach_splits is not Task.attach_splits:
            raise ValueError(
                f"task {self.task} builds what it asks from each split's own patients: cross-validation (data.fold) "
                "is not built for it; use the cohort's train/val split"
            )

    def _check_batch(self) -> None:
        data, workers = self.data, self.resources.workers
        if data.effective_batch % workers:
            raise ValueError(
                f"data.effective_batch {data.effective_batch} must be a positive multiple of "
                f"resources.workers {workers}"
            )
        micro = data.micro_batch
        if micro != AUTO and (not isinstance(micro, int) or micro < 1 or data.per_rank_batch(workers) % micro):
            raise ValueError(
                f"data.micro_batch {micro!r} must be auto or a positive divisor of the per-rank batch "
                f"{data.per_rank_batch(workers)} (data.effective_batch {data.effective_batch} / {workers} workers)"
            )
        gpus = self.resources.gpus_per_worker
        if gpus != AUTO and (not isinstance(gpus, int | float) or gpus < 0):
            raise ValueError(f"resources.gpus_per_worker {gpus!r} must be auto, 0, a fraction or a whole number")
        if workers > 1 and gpus not in (0, 0.0) and gpus != 1 and (gpus == AUTO or gpus < 1):
            raise ValueError("a DDP trial (resources.workers > 1) takes whole GPUs: set resources.gpus_per_worker: 1")

    # --- flat dotted keys <-> nested config ---

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> TrialConfig:
        """Build from ``{"task": ..., "schema": "image_table" | {...}, "optimiser.lr": 1e-4, ...}``."""
        retired = [key for key in flat if key in RETIRED_KEYS]
        if retired:
            raise ValueError(RETIRED_KEYS[retired[0]])
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            section, _, name = key.partition(".")
            if name and section not in ("schema", "task_options"):
                nested.setdefault(section, {})[name] = value
            elif name:  # schema.table = "text" refines the chosen schema; task_options.x sets one option
                nested.setdefault(f"{section}.", {})[name] = value
            else:
                nested[key] = value
        unknown = set(nested) - {f.name for f in fields(cls)} - {"schema.", "task_options."}
        if unknown:
            raise ValueError(
                f"unknown trial config keys {sorted(unknown)}; valid sections: {', '.join(f.name for f in fields(cls))}"
            )
        schema = resolve_schema(nested.get("schema", "image_only"))
        if overrides := nested.pop("schema.", None):
            schema = resolve_schema({**schema.describe(), **overrides})
        nested["schema"] = schema
        nested["task_options"] = {**nested.get("task_options", {}), **nested.pop("task_options.", {})}
        hints = get_type_hints(cls)
        for f in fields(cls):
            if dataclasses.is_dataclass(hints[f.name]) and f.name != "schema" and isinstance(nested.get(f.name), dict):
                nested[f.name] = _build(hints[f.name], nested[f.name], f.name)
        return cls(**nested)

    def to_flat(self) -> dict[str, Any]:
        """Every setting under its dotted key (what MLflow records as params)."""
        flat: dict[str, Any] = {"task": self.task, "seed": self.seed, "amp": self.amp, "schema": self.schema.name}
        sections = ["schema", "model", "optimiser", "schedule", "data", "resources"]
        if self.model.family == "vlm":  # an encoder trial's params stay as they were: no unused vlm.* or views.*
            sections += ["vlm", "views"]
        for section in sections:
            for key, value in dataclasses.asdict(getattr(self, section)).items():
                flat[f"{section}.{key}"] = json.dumps(value) if isinstance(value, dict | list | tuple) else value
        flat.update({f"task_options.{k}": v for k, v in self.task_options.items()})
        return flat


VLM_TASKS: tuple[str, ...] = PAPER_TASKS
"""The tasks a vision-language model is asked (``model.family: vlm``), the paper's five: in words and answered by
generation (lesion detection's box too), but retrieval, through a head on the model's pooled states
(:mod:`gx_ray.tasks.vlm`)."""

VALUE_RULES = {
    "lr": "a positive finite number",
    "weight_decay": "a finite number >= 0",
    "text_lr_multiplier": "a positive finite number",
    "grad_clip": "a positive finite number",
    "epochs": "a whole number >= 1",
    "warmup_fraction": "a fraction in [0, 1)",
    "max_steps_per_epoch": "a whole number >= 1, or unset",
    "checkpoint_every": "a whole number of epochs >= 1",
    "select": "best or last",
    "seed": "a whole number >= 0",
    "effective_batch": "a whole number >= 1",
    "eval_batch_size": "a whole number >= 1, or unset",
    "shuffle_buffer": "a whole number >= 0",
    "read_concurrency": "a whole number >= 1",
    "read_cpus": "a finite number >= 0",
    "in_memory": "true, false or auto",
    "fold": "a fold number >= 0, or unset",
    "workers": "a whole number >= 1",
    "cpus_per_worker": "a positive finite number",
}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> bool:
    return _finite(value) and value > 0


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def valid_keys() -> list[str]:
    """Every dotted key a search space may set."""
    hints = get_type_hints(TrialConfig)
    keys = []
    for f in fields(TrialConfig):
        kind = ModalitySchema if f.name == "schema" else hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys += [f"{f.name}.{sub.name}" for sub in fields(kind)]
        keys.append(f.name)
    return keys + ["task_options.<option>"]


def _build(kind: type, values: dict[str, Any], section: str) -> Any:
    known = {f.name: f for f in fields(kind)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown {section} keys {unknown}; valid: {', '.join(sorted(known))}")
    hints = get_type_hints(kind)
    return kind(**{name: _convert(hints[name], value) for name, value in values.items()})


def _convert(hint: Any, value: Any) -> Any:
    """A YAML or MLflow value as the field's type: ``5e-5`` read as a string, ``1`` for a float, ``"8"`` for an int;
    ``auto`` kept where the field allows it."""
    kinds = get_args(hint) or (hint,)
    if isinstance(value, bool) or value is None or (value == AUTO and str in kinds):
        return value
    if isinstance(value, list):
        return tuple(value)
    for number in (int, float):
        if number in kinds and isinstance(value, str | int | float):
            try:
                converted = number(value)
            except ValueError:
                continue
            if number is float or converted == float(value):
                return converted
    return value
