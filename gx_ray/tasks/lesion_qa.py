"""CT-Bench-style lesion QA: four-option multiple-choice questions about each case's gastric lesion, asked on 2D views
of its CT with and without the box drawn in, scored by accuracy with Wilson 95 % intervals (chance: 25 %).

Families (``family``), after CT-Bench's tasks: ``img2txt`` (the key slice → which of four descriptions is its own),
``ct2txt`` (nine slices centred on the lesion → which description), ``img2size`` (the key slice → which of the four
:data:`SIZE_BUCKETS`), ``img2attrib`` (the key slice → an attribute: gross type, depth, enhancement, side),
``txt2bbox`` (the description → which of four boxes drawn on its key slice, one image per option) and ``txt2img``
(the description → which of four cases' key slices, read once a trial by
:func:`~gx_ray.tasks.lesion_neighbours.key_slice_views`).

**Material**, from the case's own row: the *description* is the CT report's sentences about the primary lesion
(:func:`lesion_description`); the *size* is the venous tumour box's long axis in mm (the box, not the report, so that
it matches what is drawn); the *attributes* are the case's VQA answers of :data:`ATTRIBUTE_CATEGORIES`.

**Distractors** (``distractors``; size and attribute options are their ontology's other values): ``random`` (three
other cases, uniformly), ``matched`` (the same size bucket first: CT-Bench finds random ones too easy), ``appearance``
(among the :data:`NEAREST` lesions most alike to an encoder trained on the training split,
:mod:`~gx_ray.tasks.lesion_neighbours`: CT-Bench's hard negatives). ``txt2bbox`` pastes three other cases' boxes,
chosen the same way, at free places of this key slice (inside the stomach's box where there is one); a case without
room for three is skipped with that reason.

**The split rule**: every option comes from the question's own split, so no distractor can be eliminated as one
memorised in training. Questions are a pure function of the rows, the family, the distractor kind and ``seed`` (each
case's draw is seeded by its id). A case without a venous tumour box, a description or four distinct candidates gets
a reason instead (:class:`QuestionSet`).

**Question files**: a sweep builds each recipe's questions once, before its trials, into a versioned file keyed by
the shard manifest's SHA-256 (:func:`write_question_file`); later sweeps on the cohort reuse it and ``--data`` stays
read-only. A file of another cohort, recipe or format is refused, naming what differs.

**Views** (:mod:`gx_ray.modalities.views`): the reference phase in HU, CT-Bench's soft-tissue window, centred on the
key slice; a tumour box cue draws the box's outline in red. A 2D MONAI ResNet reads the RGB slices stacked as
channels; options go through the encoder's text encoder; both are projected, L2-normalised and compared under a
learnt temperature, trained with cross-entropy over the four options (as CT-Bench fine-tunes BiomedCLIP).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gx_ray import storage
from gx_ray.data.shards import MANIFEST_FILE, check_format, hounsfield, read_manifest
from gx_ray.data.stream import split_rows
from gx_ray.metrics import MCQ_METRICS, mcq_metrics
from gx_ray.metrics.mcq import option_letter
from gx_ray.modalities import ModalitySchema, ModelInputs
from gx_ray.modalities.boxes import TARGET_PHASE, tumour_boxes
from gx_ray.modalities.views import box_option_views, lesion_view
from gx_ray.models.vision import Endoscopy2d
from gx_ray.schema import PHASES
from gx_ray.tasks.base import Batch, Outputs, Task, TaskMetric

FAMILIES: dict[str, int] = {"img2txt": 1, "ct2txt": 9, "img2size": 1, "img2attrib": 1, "txt2bbox": 1, "txt2img": 1}
"""Family → axial slices in its view (CT-Bench: one key slice, or nine for CT2txt)."""
IMAGE_OPTIONS = ("txt2bbox", "txt2img")
"""Families whose options are images (one view per option) and whose question is the description."""
DISTRACTORS: tuple[str, ...] = ("random", "matched", "appearance")
NEAREST = 8
"""Appearance distractors: three drawn among a case's eight nearest lesions (CT-Bench: top-k, then sampled)."""
OPTIONS = 4
SIZE_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("under 20 mm", 0.0, 20.0),
    ("20-40 mm", 20.0, 40.0),
    ("40-60 mm", 40.0, 60.0),
    ("over 60 mm", 60.0, math.inf),
)
ATTRIBUTE_CATEGORIES: tuple[str, ...] = ("lesion", "enhancement", "localization")
"""VQA categories whose answers describe the lesion (not staging, not yes/no)."""
_LESION_WORDS = re.compile(r"\b(lesion|tumou?r|mass|wall|mucosa|ulcer|thicken\w*|long axis|enhanc\w*)\b", re.IGNORECASE)
_OTHER_FINDINGS = re.compile(
    r"\b(lymph|liver|hepatic|ascites|kidney|renal|gallbladder|spleen|peritone\w*|impression)\b", re.IGNORECASE
)
PLACEMENT_TRIES = 200
"""Random places tried per localisation distractor before the stomach's box gives way to the whole slice."""
QUESTION_FORMAT = 2
"""Version of the question recipe: bump when the same rows would give other questions."""


def lesion_description(report: str | None) -> str | None:
    """The sentences of a CT report about the primary lesion: those naming the lesion, its wall or its enhancement,
    and no other finding (nodes, liver, ascites, incidental organs, the impression). None when there are none."""
    if not report:
        return None
    sentences = [s.strip() for s in re.split(r"(?<=\.)\s+", report) if s.strip()]
    kept = [s for s in sentences if _LESION_WORDS.search(s) and not _OTHER_FINDINGS.search(s)]
    return " ".join(kept) or None


def long_axis_mm(box: Sequence[float], spacing_zyx_mm: Sequence[float]) -> float:
    """The larger in-plane extent of a ``(z0, y0, x0, z1, y1, x1)`` box in mm (a RECIST-style long axis)."""
    return max((box[4] - box[1]) * spacing_zyx_mm[1], (box[5] - box[2]) * spacing_zyx_mm[2])


def size_bucket(mm: float) -> int:
    return next(i for i, (_, low, high) in enumerate(SIZE_BUCKETS) if low <= mm < high)


@dataclass(frozen=True)
class Question:
    case_id: str
    split: str
    family: str
    options: tuple[str, ...]
    answer: int
    prompt: str = ""
    """What is asked, shown to the text side: the attribute's question (img2attrib, with each option), the lesion's
    description (txt2bbox, txt2img: their options are images)."""
    option_cases: tuple[str | None, ...] = ()
    """The case each description option (or box option's size) was taken from (None for ontology values)."""
    option_boxes: tuple[tuple[int, ...], ...] = ()
    """``txt2bbox``: the option boxes ``(z0, y0, x0, z1, y1, x1)`` on the CT grid, in the options' order."""


@dataclass
class QuestionSet:
    """Every case's question (by case id) and, for each case without one, why."""

    recipe: dict[str, Any]
    questions: dict[str, Question] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": QUESTION_FORMAT,
            "recipe": self.recipe,
            "questions": [asdict(q) for q in self.questions.values()],
            "skipped": self.skipped,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuestionSet:
        questions = {}
        for q in data["questions"]:
            fields = {**q, "options": tuple(q["options"]), "option_cases": tuple(q["option_cases"])}
            fields["option_boxes"] = tuple(tuple(b) for b in q["option_boxes"])
            questions[q["case_id"]] = Question(**fields)
        return cls(dict(data["recipe"]), questions, dict(data["skipped"]))


def recipe_options(options: Mapping[str, Any]) -> tuple[str, str, int]:
    """``(family, distractors, seed)`` of a lesion QA trial's task options, the task's defaults where not given."""
    return (
        str(options.get("family", LesionQA.family)),
        str(options.get("distractors", LesionQA.distractors)),
        int(options.get("seed", LesionQA.seed)),
    )


def manifest_sha256(shards: str) -> str:
    """The SHA-256 of a prepared cohort's shard manifest: which cohort a question file belongs to."""
    return hashlib.sha256(storage.read_bytes(storage.join(shards, MANIFEST_FILE))).hexdigest()


def question_file(root: str, manifest_sha: str, family: str, distractors: str, seed: int) -> str:
    """Where a recipe's questions for a cohort live under ``root`` (a sweep's output or storage)."""
    name = f"{family}.{distractors}.seed{seed}.v{QUESTION_FORMAT}.json"
    return storage.join(root, "questions", manifest_sha[:16], name)


def write_question_file(shards: str, root: str, family: str, distractors: str, seed: int = 0) -> str:
    """Build a recipe's questions once for the cohort at ``shards`` and write them under ``root``; a file already
    there (an earlier sweep's: same cohort and recipe) is kept. Returns where."""
    sha = manifest_sha256(shards)
    location = question_file(root, sha, family, distractors, seed)
    if storage.exists(location):
        return location
    manifest = read_manifest(shards)
    rows = {split: split_rows(shards, split) for split in ("train", "val", "test")}
    spacing, shape = manifest["preprocess"]["spacing_zyx_mm"], manifest["ct_shape"][1:]
    neighbours = lesion_neighbours_of(rows, shards, seed) if distractors == "appearance" else None
    questions = build_questions(rows, family, distractors, spacing, seed, shape, neighbours)
    storage.write_text(location, json.dumps({**questions.to_dict(), "manifest_sha256": sha}, indent=1) + "\n")
    return location


def lesion_neighbours_of(rows: Mapping[str, Sequence[Mapping[str, Any]]], shards: str, seed: int) -> dict[str, list]:
    """Every case's nearest lesions of its split (:mod:`~gx_ray.tasks.lesion_neighbours`: an encoder trained on the
    training split's views and descriptions)."""
    from gx_ray.tasks.lesion_neighbours import appearance_neighbours  # trains an encoder: only when asked

    descriptions = {r["case_id"]: lesion_description(r.get("ct_report")) for part in rows.values() for r in part}
    return appearance_neighbours(shards, rows, {c: d for c, d in descriptions.items() if d}, seed)


def read_question_file(location: str, recipe: Mapping[str, Any], shards: str) -> QuestionSet:
    """A question file's questions, refused (naming the file and what differs) unless it is of this question format,
    this recipe and the cohort at ``shards``."""
    data = json.loads(storage.read_text(location))
    expected = {"format": QUESTION_FORMAT, "recipe": dict(recipe), "manifest_sha256": manifest_sha256(shards)}
    for key, value in expected.items():
        if data.get(key) != value:
            raise ValueError(f"question file {location}: its {key} is {data.get(key)!r}, this trial's {value!r}")
    return QuestionSet.from_dict(data)


def _case_rng(seed: int, case_id: str, family: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(case_id.encode()), zlib.crc32(family.encode())])


def build_questions(
    rows: Mapping[str, Sequence[Mapping[str, Any]]],
    family: str,
    distractors: str,
    spacing_zyx_mm: Sequence[float],
    seed: int = 0,
    shape_zyx: Sequence[int] | None = None,
    neighbours: Mapping[str, Sequence[str]] | None = None,
) -> QuestionSet:
    """The family's question for every case of every split (``rows``: split → shard rows without images), each
    from its own split's material only (see the module docstring). ``shape_zyx``, the CT grid, bounds ``txt2bbox``'s
    boxes; ``neighbours`` (case → cases of its split, nearest first) the ``appearance`` distractors."""
    if family not in FAMILIES:
        raise ValueError(f"unknown lesion QA family {family!r}; valid: {', '.join(FAMILIES)}")
    if distractors not in DISTRACTORS:
        raise ValueError(f"unknown distractor kind {distractors!r}; valid: {', '.join(DISTRACTORS)}")
    if family == "txt2bbox" and shape_zyx is None:
        raise ValueError("txt2bbox places its boxes on the CT grid: give shape_zyx")
    if distractors == "appearance" and neighbours is None:
        raise ValueError("appearance distractors need each case's nearest lesions (lesion_neighbours)")
    recipe = {"family": family, "distractors": distractors, "seed": seed, "options": OPTIONS}
    result = QuestionSet(recipe)
    # an attribute's options are its vocabulary: category names, the same for every split (no patient's material)
    vocabulary: dict[str, set[str]] = defaultdict(set)
    for row in (r for part in rows.values() for r in part):
        for item in row.get("vqa") or ():
            if item["category"] in ATTRIBUTE_CATEGORIES:
                vocabulary[item["question"]].add(item["answer"])
    for split, part in rows.items():
        material = {}
        for row in sorted(part, key=lambda r: r["case_id"]):
            boxes, present = tumour_boxes(row["boxes"], row["box_present"])
            if not present[0]:
                result.skipped[row["case_id"]] = f"no {TARGET_PHASE} tumour box"
                continue
            material[row["case_id"]] = {
                "description": lesion_description(row.get("ct_report")),
                "size": size_bucket(long_axis_mm(boxes[0], spacing_zyx_mm)),
                "attributes": [v for v in row.get("vqa") or () if v["category"] in ATTRIBUTE_CATEGORIES],
                "box": tuple(int(v) for v in boxes[0]),
                "stomach": _stomach_box(row),
            }
        ask = {
            "img2size": _size_question,
            "img2attrib": partial(_attribute_question, vocabulary=vocabulary),
            "txt2bbox": partial(_box_question, shape_zyx=shape_zyx),
            "txt2img": _image_question,
        }.get(family, _description_question)
        if family in ("img2txt", "ct2txt", *IMAGE_OPTIONS):
            ask = partial(ask, neighbours=neighbours or {})
        for case_id in material:
            rng = _case_rng(seed, case_id, family)
            question = ask(case_id, split, family, material, distractors, rng)
            if isinstance(question, str):
                result.skipped[case_id] = question
            else:
                result.questions[case_id] = question
    return result


def _shuffled(answer: str, others: list[str], rng: np.random.Generator) -> tuple[tuple[str, ...], int]:
    options = [answer, *others]
    order = rng.permutation(len(options))
    return tuple(options[i] for i in order), int(np.flatnonzero(order == 0)[0])


def _description_question(case_id, split, family, material, distractors, rng, neighbours) -> Question | str:
    own = material[case_id]
    if not own["description"]:
        return "no lesion description in the CT report"
    pool = sorted(c for c, m in material.items() if c != case_id and m["description"] not in (None, own["description"]))
    # one option per distinct text: two cases with the same description would make two right answers
    unique = list({material[c]["description"]: c for c in pool}.values())
    if len(unique) < OPTIONS - 1:
        return f"fewer than {OPTIONS} distinct descriptions in the {split} split"
    if distractors == "matched":  # same size bucket first, then the nearest buckets, ties broken at random
        distance = np.array([abs(material[c]["size"] - own["size"]) for c in unique], dtype=float)
        chosen = [unique[i] for i in np.lexsort((rng.random(len(unique)), distance))[: OPTIONS - 1]]
    elif distractors == "appearance":  # among the nearest lesions with a description of their own
        near: dict[str, str] = {}
        for other in neighbours.get(case_id, ()):
            text = material.get(other, {}).get("description")
            if text and text != own["description"] and text not in near:
                near[text] = other
            if len(near) == NEAREST:
                break
        if len(near) < OPTIONS - 1:
            return f"fewer than {OPTIONS - 1} neighbouring lesions with other descriptions in the {split} split"
        candidates = list(near.values())
        chosen = [candidates[i] for i in rng.choice(len(candidates), OPTIONS - 1, replace=False)]
    else:
        chosen = [unique[i] for i in rng.choice(len(unique), OPTIONS - 1, replace=False)]
    options, answer = _shuffled(own["description"], [material[c]["description"] for c in chosen], rng)
    cases = {material[c]["description"]: c for c in [case_id, *chosen]}
    return Question(case_id, split, family, options, answer, option_cases=tuple(cases[o] for o in options))


def _image_question(case_id, split, family, material, distractors, rng, neighbours) -> Question | str:
    """Txt2img: the description families' choice of cases, asked the other way round (options are their images)."""
    question = _description_question(case_id, split, family, material, distractors, rng, neighbours)
    if isinstance(question, str):
        return question
    options = tuple(f"the key slice of {c}" for c in question.option_cases)
    description = material[case_id]["description"]
    return Question(case_id, split, family, options, question.answer, description, question.option_cases)


def _stomach_box(row: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The venous stomach box of a shard row, or None."""
    boxes, present = tumour_boxes(row["boxes"], row["box_present"], "stomach")
    return tuple(int(v) for v in boxes[0]) if present[0] else None


def _overlaps(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two boxes' in-plane rectangles share a pixel."""
    return a[1] < b[4] and b[1] < a[4] and a[2] < b[5] and b[2] < a[5]


def _box_question(case_id, split, family, material, distractors, rng, shape_zyx, neighbours) -> Question | str:
    own = material[case_id]
    if not own["description"]:
        return "no lesion description in the CT report"
    pool = sorted(c for c in material if c != case_id)
    if len(pool) < OPTIONS - 1:
        return f"fewer than {OPTIONS} lesions in the {split} split"
    if distractors == "matched":  # sizes from the same bucket first, as the description distractors
        distance = np.array([abs(material[c]["size"] - own["size"]) for c in pool], dtype=float)
        order = [pool[i] for i in np.lexsort((rng.random(len(pool)), distance))]
    elif distractors == "appearance":  # the nearest lesions' boxes first, in a random order among them
        near = [c for c in neighbours.get(case_id, ()) if c in material]
        order = [near[i] for i in rng.permutation(min(NEAREST, len(near)))] + near[NEAREST:]
    else:
        order = [pool[i] for i in rng.permutation(len(pool))]
    _, height, width = (int(v) for v in shape_zyx)
    z0, z1 = own["box"][0], own["box"][3]
    placed: list[tuple[int, ...]] = [own["box"]]
    sources = [case_id]
    for other in order:  # the next source whose box fits somewhere free, until three are placed
        h, w = (
            material[other]["box"][4] - material[other]["box"][1],
            material[other]["box"][5] - material[other]["box"][2],
        )
        if not (0 < h <= height and 0 < w <= width):
            continue
        box = _place(rng, h, w, (height, width), own["stomach"], placed, z0, z1)
        if box is not None:
            placed.append(box)
            sources.append(other)
        if len(placed) == OPTIONS:
            break
    if len(placed) < OPTIONS:
        return f"no room for {OPTIONS - 1} non-overlapping boxes beside the lesion's on its key slice"
    order = rng.permutation(OPTIONS)
    boxes = tuple(placed[i] for i in order)
    options = tuple(f"box y {b[1]}-{b[4]}, x {b[2]}-{b[5]}" for b in boxes)
    return Question(
        case_id,
        split,
        family,
        options,
        int(np.flatnonzero(order == 0)[0]),
        own["description"],
        option_cases=tuple(sources[i] for i in order),
        option_boxes=boxes,
    )


def _place(rng, h, w, slice_shape, stomach, placed, z0, z1) -> tuple[int, ...] | None:
    """A free place for an ``h`` x ``w`` box: its centre inside the stomach's box where there is one (tried first),
    else anywhere on the slice; None when :data:`PLACEMENT_TRIES` draws of each find none."""
    height, width = slice_shape
    regions = [(stomach[1], stomach[2], stomach[4], stomach[5])] if stomach is not None else []
    for top, left, bottom, right in [*regions, (0, 0, height, width)]:
        for _ in range(PLACEMENT_TRIES):
            cy, cx = rng.integers(top, max(top + 1, bottom)), rng.integers(left, max(left + 1, right))
            y0 = int(np.clip(cy - h // 2, 0, height - h))
            x0 = int(np.clip(cx - w // 2, 0, width - w))
            box = (z0, y0, x0, z1, y0 + h, x0 + w)
            if not any(_overlaps(box, other) for other in placed):
                return box
    return None


def _size_question(case_id, split, family, material, distractors, rng) -> Question:
    names = tuple(name for name, _, _ in SIZE_BUCKETS)  # the ontology's order: options never move
    return Question(case_id, split, family, names, material[case_id]["size"], "How long is the lesion's long axis?")


def _attribute_question(case_id, split, family, material, distractors, rng, vocabulary) -> Question | str:
    items, values = material[case_id]["attributes"], vocabulary
    if not items:
        return "no attribute answer (lesion, enhancement or localisation VQA item)"
    askable = [item for item in items if len(values[item["question"]] - {item["answer"]}) >= OPTIONS - 1]
    if not askable:
        return f"none of its attributes takes {OPTIONS} values in the cohort"
    item = askable[int(rng.integers(len(askable)))]
    others = sorted(values[item["question"]] - {item["answer"]})
    chosen = [others[i] for i in rng.choice(len(others), OPTIONS - 1, replace=False)]
    options, answer = _shuffled(item["answer"], chosen, rng)
    return Question(case_id, split, family, options, answer, item["question"])


class LesionQAHead(nn.Module):
    """A 2D MONAI ResNet over the view's RGB slices stacked as channels, projections of both sides into one space,
    and the learnt temperature (as log 1/T)."""

    def __init__(self, dim: int, slices: int, depth: int, embedding_dim: int, view_kwargs: dict[str, Any]):
        super().__init__()
        self.view = Endoscopy2d(depth, in_channels=3 * slices, **view_kwargs)
        self.image = nn.Linear(self.view.dim, embedding_dim)
        self.text = nn.Linear(dim, embedding_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))


@dataclass
class LesionQA(Task):
    name = "lesion_qa"
    primary_metric = "accuracy"
    mode = "max"
    label_options = ("family", "distractors")

    family: str = "img2txt"
    distractors: str = "random"
    seed: int = 0
    """Seeds the questions (not the training: that is the trial's seed)."""
    view_depth: int = 18
    view_kwargs: dict[str, Any] = field(default_factory=dict)
    """MONAI ResNet arguments of the view encoder (``block_inplanes`` for a CPU-sized one)."""
    embedding_dim: int = 128
    questions_file: str | None = None
    """A question file of this recipe and cohort (:func:`write_question_file`; a sweep sets it: :meth:`sweep_inputs`);
    None: the questions are built from the rows."""
    questions: QuestionSet | None = field(default=None, init=False)
    shards: str | None = field(default=None, init=False)
    option_views: dict[str, np.ndarray] | None = field(default=None, init=False, repr=False)
    """``txt2img``: every case's key slice, read at the first step (the options are other cases' images)."""
    overlay: bool = field(default=False, init=False)
    phase: str = field(default=TARGET_PHASE, init=False)

    @classmethod
    def sweep_inputs(cls, options: Mapping[str, Any], shards: str, root: str) -> dict[str, Any]:
        """The recipe's question file for the cohort, built once before the trials (every trial of the recipe reads
        it; an earlier sweep's under the same ``root`` is reused), unless the space names one."""
        if options.get("questions_file"):
            return {}
        return {"questions_file": write_question_file(shards, root, *recipe_options(options))}

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown lesion QA family {self.family!r}; valid: {', '.join(FAMILIES)}")
        if self.distractors not in DISTRACTORS:
            raise ValueError(f"unknown distractor kind {self.distractors!r}; valid: {', '.join(DISTRACTORS)}")

    def attach_splits(
        self, rows: Mapping[str, Sequence[Mapping[str, Any]]], manifest: Mapping[str, Any], shards: str | None = None
    ) -> None:
        check_format(manifest, 2, "lesion QA's windowed views")
        self.shards = shards
        if self.questions_file:
            recipe = {"family": self.family, "distractors": self.distractors, "seed": self.seed, "options": OPTIONS}
            if shards is None:
                raise ValueError("a question file is checked against its cohort: attach_splits needs the shards")
            self.questions = read_question_file(self.questions_file, recipe, shards)
            return
        spacing, shape = manifest["preprocess"]["spacing_zyx_mm"], manifest["ct_shape"][1:]
        neighbours = None
        if self.distractors == "appearance":  # a sweep builds these once, in its question file
            if shards is None:
                raise ValueError("appearance distractors read the cases' views: attach_splits needs the shards")
            neighbours = lesion_neighbours_of(rows, shards, self.seed)
        self.questions = build_questions(rows, self.family, self.distractors, spacing, self.seed, shape, neighbours)

    def bind(self, schema: ModalitySchema) -> None:
        # a tumour box cue in any form is, on a 2D view, its drawn outline
        self.overlay = schema.boxes != "off" and "tumour" in schema.box_levels
        self.phase = TARGET_PHASE if TARGET_PHASE in schema.phases else schema.phases[0]

    def build_head(self, dim: int, tokenizer: Any = None, map_channels: Sequence[int] = ()) -> nn.Module:
        return LesionQAHead(dim, FAMILIES[self.family], self.view_depth, self.embedding_dim, self.view_kwargs)

    def _views(self, batch: Batch, asked: list[int], device: torch.device) -> torch.Tensor:
        if self.family == "txt2img":  # (n, options, 3, H, W): the option cases' own key slices
            if self.option_views is None:
                if self.shards is None:
                    raise RuntimeError("txt2img reads the option cases' slices: attach_splits needs the shards")
                from gx_ray.tasks.lesion_neighbours import key_slice_views

                self.option_views = key_slice_views(self.shards, overlay=self.overlay)
            questions = [self.questions.questions[batch["case_id"][i]] for i in asked]
            views = [np.stack([self.option_views[c] for c in q.option_cases]) for q in questions]
            return torch.from_numpy(np.stack(views)).float().to(device)
        phase = PHASES.index(self.phase)
        boxes, _ = tumour_boxes(batch["boxes"], batch["box_present"])
        # the asked cases' one phase leaves the device in one copy (one wait for the GPU a batch, not one a case)
        ct = batch["ct"][asked, phase].float().cpu().numpy()
        # (cases, D, H, W) with each case's statistics: hounsfield's per-channel rule, one case per channel
        hu = hounsfield(ct, batch["ct_hu_mean"][asked, phase].numpy(), batch["ct_hu_std"][asked, phase].numpy())
        views = []
        for volume, i in zip(hu, asked, strict=True):
            if self.family == "txt2bbox":  # (options, 3, H, W): one image per option box
                question = self.questions.questions[batch["case_id"][i]]
                views.append(torch.from_numpy(box_option_views(volume, boxes[i].astype(int), question.option_boxes)))
                continue
            view = lesion_view(volume, boxes[i].astype(int), FAMILIES[self.family], self.overlay)
            views.append(torch.from_numpy(view.reshape(-1, *view.shape[2:])))
        return torch.stack(views).to(device)

    def forward(self, encoder: nn.Module, head: nn.Module, inputs: ModelInputs, batch: Batch) -> Outputs:
        if self.questions is None:
            raise RuntimeError("lesion QA has no questions: call attach_splits(rows, manifest) first")
        asked = [i for i, c in enumerate(batch["case_id"]) if c in self.questions.questions]
        device = next(head.parameters()).device
        if not asked:
            return {"logits": head.logit_scale.new_zeros(0, OPTIONS) + head.logit_scale * 0, "asked": []}
        questions = [self.questions.questions[batch["case_id"][i]] for i in asked]
        views = self._views(batch, asked, device)
        if self.family in IMAGE_OPTIONS:  # the options are images, the description the text
            images = F.normalize(head.image(head.view(views.flatten(0, 1))), dim=-1).view(len(asked), OPTIONS, -1)
            text = F.normalize(head.text(encoder.encode_text([q.prompt for q in questions])), dim=-1)  # (n, E)
            logits = head.logit_scale.exp().clamp(max=100.0) * torch.einsum("nke,ne->nk", images, text)
            return {"logits": logits, "asked": questions}
        image = F.normalize(head.image(head.view(views)), dim=-1)  # (n, E)
        texts = [f"{q.prompt} {option}".strip() for q in questions for option in q.options]
        text = F.normalize(head.text(encoder.encode_text(texts)), dim=-1).view(len(asked), OPTIONS, -1)
        logits = head.logit_scale.exp().clamp(max=100.0) * torch.einsum("ne,nke->nk", image, text)
        return {"logits": logits, "asked": questions}

    def loss(self, outputs: Outputs, batch: Batch) -> torch.Tensor:
        logits = outputs["logits"]
        if not len(logits):
            return logits.sum() * 0.0
        answers = torch.tensor([q.answer for q in outputs["asked"]], device=logits.device)
        return F.cross_entropy(logits.float(), answers)

    def predict(self, outputs: Outputs, batch: Batch) -> list[dict[str, Any]]:
        chosen = outputs["logits"].argmax(1).tolist() if len(outputs["logits"]) else []
        return [
            {
                "case_id": q.case_id,
                "prediction": option_letter(c),
                "target": option_letter(q.answer),
                "correct": c == q.answer,
                "prompt": q.prompt,
                "options": list(q.options),
            }
            for q, c in zip(outputs["asked"], chosen, strict=True)
        ]

    def metric(self) -> TaskMetric:
        return LesionQAMetric()

    def documents(self) -> dict[str, Any]:
        """The questions asked, with their recipe and every skipped case's reason: logged with the trial."""
        return {"questions/questions.json": self.questions.to_dict()} if self.questions else {}

    def chance_level(self, train_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> float:
        """A uniform guess among the four options: 25 % whenever the test split has a question."""
        if self.questions is None or not any(r["case_id"] in self.questions.questions for r in test_rows):
            return float("nan")
        return 100.0 / OPTIONS


class LesionQAMetric(TaskMetric):
    """Accuracy with its Wilson interval over every question asked (:func:`gx_ray.metrics.mcq_metrics`)."""

    def update(self, outputs: Outputs, batch: Batch) -> None:
        if len(outputs["logits"]):
            self.add(chosen=outputs["logits"].argmax(1).tolist(), answers=[q.answer for q in outputs["asked"]])

    def summarise(self, state: dict[str, list[Any]]) -> dict[str, float]:
        chosen = [c for part in state.get("chosen", []) for c in part]
        answers = [a for part in state.get("answers", []) for a in part]
        if not answers:
            return dict.fromkeys((*MCQ_METRICS, "questions"), float("nan"))
        return {**mcq_metrics(chosen, answers), "questions": float(len(answers))}
