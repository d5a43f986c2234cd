"""Lesion QA: question building (no answer leak, distractor kinds, determinism, the split rule, every case accounted
for), its views under each schema, the shard-format guard and its metric."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from gx_ray.analysis.runs import load_runs
from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.prepare import prepare_data
from gx_ray.data.shards import BatchCollate, ShardFormatError, TensorLayout, read_manifest, split_files
from gx_ray.data.stream import split_rows
from gx_ray.modalities import PRESETS, LeakageError, resolve_schema
from gx_ray.modalities.boxes import tumour_boxes
from gx_ray.modalities.views import OVERLAY_COLOUR
from gx_ray.models import ModelConfig, build_encoder
from gx_ray.tasks import TaskModel, build_task
from gx_ray.tasks.lesion_qa import (
    QUESTION_FORMAT,
    SIZE_BUCKETS,
    QuestionSet,
    build_questions,
    lesion_description,
    long_axis_mm,
    manifest_sha256,
    question_file,
    read_question_file,
    size_bucket,
    write_question_file,
)
from gx_ray.train.config import TrialConfig
from tests.common import first_shard_batch, run_smoke_sweep, tiny_prepare

SPACING = (6.0, 4.5, 4.5)
SHAPE = (32, 64, 64)
REPORT = (
    "Plain CT of the upper abdomen. The wall of the gastric antrum is thickened, about 12 mm. The lesion measures "
    "about 35 mm in its long axis. 3 enlarged perigastric lymph nodes are seen. The liver shows no focal lesion. "
    "Impression: advanced gastric carcinoma."
)


def _box_row(case_id: str, split: str, size_voxels: int, report: str | None, vqa: list | None = None) -> dict:
    boxes = np.zeros((4, 3, 6), np.int32)
    present = np.zeros((4, 3), bool)
    boxes[2, 0] = [10, 20, 20, 14, 20 + size_voxels, 22]  # venous tumour: in-plane long axis size_voxels * 4.5 mm
    present[2, 0] = True
    return {
        "case_id": case_id,
        "split": split,
        "boxes": boxes.ravel().tolist(),
        "box_present": present.ravel().tolist(),
        "ct_report": report,
        "vqa": vqa or [],
    }


def described_rows(rng: np.random.Generator, sizes: dict[str, int]) -> dict[str, list[dict]]:
    """Random cases per split, each with its own description (a size and an attribute of its own)."""
    rows: dict[str, list[dict]] = {}
    for split, n in sizes.items():
        rows[split] = []
        for i in range(n):
            voxels = int(rng.integers(2, 18))
            gross = ["Borrmann I", "Borrmann II", "Borrmann III", "Borrmann IV", "0-IIc"][int(rng.integers(5))]
            report = f"The lesion measures about {voxels * 4.5:.1f} mm in its long axis, {gross}. No ascites."
            vqa = [{"question": "What is the gross type of the lesion?", "answer": gross, "category": "lesion"}]
            rows[split].append(_box_row(f"{split}{i:03d}", split, voxels, report, vqa))
    return rows


def test_the_description_keeps_the_lesion_sentences_only():
    assert lesion_description(REPORT) == (
        "The wall of the gastric antrum is thickened, about 12 mm. The lesion measures about 35 mm in its long axis."
    )
    assert lesion_description("The liver shows no focal lesion. No ascites.") is None
    assert lesion_description(None) is None


def test_sizes_fall_in_exactly_one_bucket():
    assert long_axis_mm([0, 0, 0, 3, 8, 2], SPACING) == 36.0
    for mm in np.random.default_rng(0).uniform(0, 200, 500):
        inside = [low <= mm < high for _, low, high in SIZE_BUCKETS]
        assert sum(inside) == 1 and inside[size_bucket(mm)]


@pytest.mark.parametrize("family", ["img2txt", "ct2txt", "img2size", "img2attrib", "txt2bbox", "txt2img"])
@pytest.mark.parametrize("distractors", ["random", "matched"])
def test_questions_keep_to_their_split_hide_the_answer_and_repeat_exactly(family, distractors):
    rng = np.random.default_rng(1)
    rows = described_rows(rng, {"train": 40, "val": 12, "test": 12})
    questions = build_questions(rows, family, distractors, SPACING, seed=3, shape_zyx=SHAPE)
    everyone = {r["case_id"] for split in rows.values() for r in split}
    assert set(questions.questions) | set(questions.skipped) == everyone  # nothing silently dropped
    assert not set(questions.questions) & set(questions.skipped)
    own = {r["case_id"]: r for split in rows.values() for r in split}
    for case_id, q in questions.questions.items():
        assert len(q.options) == 4 == len(set(q.options)) and 0 <= q.answer < 4
        if family in ("img2txt", "ct2txt"):
            assert q.options[q.answer] == lesion_description(own[case_id]["ct_report"])
            # the split rule: every option is some case of the question's own split
            assert all(own[c]["split"] == q.split for c in q.option_cases) and q.option_cases[q.answer] == case_id
        if family == "img2size":
            box, _ = tumour_boxes(own[case_id]["boxes"], own[case_id]["box_present"])
            assert q.options[q.answer] == SIZE_BUCKETS[size_bucket(long_axis_mm(box[0], SPACING))][0]
        if family == "img2attrib":
            assert q.options[q.answer] == own[case_id]["vqa"][0]["answer"]
        if (
            family == "txt2img"
        ):  # the description asks; the options are cases (their images), with distinct descriptions
            assert q.prompt == lesion_description(own[case_id]["ct_report"]) and q.option_cases[q.answer] == case_id
            assert all(own[c]["split"] == q.split for c in q.option_cases)
            assert len({lesion_description(own[c]["ct_report"]) for c in q.option_cases}) == 4
        if family == "txt2bbox":
            box = tuple(int(v) for v in tumour_boxes(own[case_id]["boxes"], own[case_id]["box_present"])[0][0])
            assert q.option_boxes[q.answer] == box and q.prompt == lesion_description(own[case_id]["ct_report"])
            assert all(own[c]["split"] == q.split for c in q.option_cases) and q.option_cases[q.answer] == case_id
            for i, (option, source) in enumerate(zip(q.option_boxes, q.option_cases, strict=True)):
                # on the lesion's key slice, inside the grid, the size of its source case's lesion
                assert option[0] == box[0] and option[3] == box[3]
                assert 0 <= option[1] < option[4] <= SHAPE[1] and 0 <= option[2] < option[5] <= SHAPE[2]
                src = tumour_boxes(own[source]["boxes"], own[source]["box_present"])[0][0]
                assert (option[4] - option[1], option[5] - option[2]) == (src[4] - src[1], src[5] - src[2])
                for j in range(i):  # no two options share a pixel of the slice
                    other = q.option_boxes[j]
                    assert not (
                        option[1] < other[4] and other[1] < option[4] and option[2] < other[5] and other[2] < option[5]
                    )
    # the right option's position carries nothing: spread over the four places (sizes keep the ontology's order)
    if family != "img2size":
        places = Counter(q.answer for q in questions.questions.values())
        assert len(places) == 4 and max(places.values()) < 0.5 * len(questions.questions)
    # the same rows in another order, the same questions; another seed, other draws
    shuffled = {split: list(reversed(r)) for split, r in rows.items()}
    again = build_questions(shuffled, family, distractors, SPACING, seed=3, shape_zyx=SHAPE)
    assert again.questions == questions.questions
    if family in ("img2txt", "ct2txt", "txt2bbox", "txt2img"):
        other = build_questions(rows, family, distractors, SPACING, seed=4, shape_zyx=SHAPE).questions
        assert any(other[c].options != q.options for c, q in questions.questions.items())


@pytest.mark.parametrize("family", ["img2txt", "txt2bbox"])
def test_matched_distractors_share_the_answers_size_more_often_than_random_ones(family):
    rows = described_rows(np.random.default_rng(2), {"train": 80})
    own = {r["case_id"]: r for r in rows["train"]}

    def same_bucket_share(kind: str) -> float:
        questions = build_questions(rows, family, kind, SPACING, shape_zyx=SHAPE).questions.values()
        same = []
        for q in questions:
            buckets = [
                size_bucket(long_axis_mm(tumour_boxes(own[c]["boxes"], own[c]["box_present"])[0][0], SPACING))
                for c in q.option_cases
            ]
            same += [b == buckets[q.answer] for i, b in enumerate(buckets) if i != q.answer]
        return float(np.mean(same))

    matched, random = same_bucket_share("matched"), same_bucket_share("random")
    assert matched > 0.9 and matched > random + 0.3, (matched, random)


def test_every_case_without_a_question_says_why():
    rows = {
        "train": [
            _box_row("a", "train", 5, REPORT),
            _box_row("b", "train", 6, "No focal lesion is seen in the liver."),
            {**_box_row("c", "train", 7, REPORT), "box_present": [False] * 12},
        ],
        "test": [_box_row("t", "test", 5, REPORT)],
    }
    skipped = build_questions(rows, "img2txt", "random", SPACING).skipped
    assert skipped == {
        "a": "fewer than 4 distinct descriptions in the train split",
        "b": "no lesion description in the CT report",
        "c": "no venous tumour box",
        "t": "fewer than 4 distinct descriptions in the test split",
    }
    attrib = build_questions(rows, "img2attrib", "random", SPACING).skipped
    assert attrib["a"] == "no attribute answer (lesion, enhancement or localisation VQA item)"
    with pytest.raises(ValueError, match="valid: img2txt, ct2txt, img2size, img2attrib, txt2bbox, txt2img"):
        build_questions(rows, "txt2video", "random", SPACING)
    with pytest.raises(ValueError, match="shape_zyx"):
        build_questions(rows, "txt2bbox", "random", SPACING)
    # a lesion that fills the slice leaves no room for three other boxes beside it
    big = described_rows(np.random.default_rng(5), {"train": 6})
    whole = np.asarray(big["train"][0]["boxes"]).reshape(4, 3, 6)
    whole[2, 0] = [10, 0, 0, 14, 64, 63]
    big["train"][0]["boxes"] = whole.ravel().tolist()
    skipped = build_questions(big, "txt2bbox", "random", SPACING, shape_zyx=SHAPE).skipped
    assert skipped == {"train000": "no room for 3 non-overlapping boxes beside the lesion's on its key slice"}


def test_localisation_distractors_are_placed_in_the_stomach_where_it_has_a_box():
    rows = described_rows(np.random.default_rng(3), {"train": 30})
    for row in rows["train"]:
        boxes, present = np.asarray(row["boxes"]).reshape(4, 3, 6), np.asarray(row["box_present"]).reshape(4, 3)
        boxes[2, 2], present[2, 2] = [4, 8, 24, 24, 56, 60], True  # venous stomach box
        row["boxes"], row["box_present"] = boxes.ravel().tolist(), present.ravel().tolist()
    questions = build_questions(rows, "txt2bbox", "random", SPACING, shape_zyx=SHAPE).questions.values()
    assert len(questions) == 30
    for q in questions:
        for i, b in enumerate(q.option_boxes):
            if i != q.answer:  # a distractor's centre (as drawn, before clipping to the slice) is in the stomach box
                cy, cx = (b[1] + b[4]) / 2, (b[2] + b[5]) / 2
                assert 8 - 1 <= cy <= 56 + 1 and 24 - 1 <= cx <= 60 + 1, (q.case_id, b)


@pytest.mark.parametrize("family", ["img2size", "txt2bbox"])
def test_families_the_box_answers_never_see_the_tumour_box(family):
    with pytest.raises(LeakageError, match="box_gives_the_answer"):
        TrialConfig.from_flat(
            {"task": "lesion_qa", "task_options.family": family, "schema": "image_bbox", "data.shards": "x"}
        )
    TrialConfig.from_flat(
        {"task": "lesion_qa", "task_options.family": "img2txt", "schema": "image_bbox", "data.shards": "x"}
    )


@pytest.fixture(scope="module")
def demo_batch_and_rows(demo_prepared):
    shards = demo_prepared.shard_dir
    return first_shard_batch(shards), split_rows(shards, "train"), read_manifest(shards)


def _model(schema_name: str, rows, manifest, family: str = "img2txt"):
    task = build_task("lesion_qa", family=family, view_depth=10, view_kwargs={"block_inplanes": [4, 8, 8, 8]})
    task.attach_splits({"train": rows}, manifest)
    encoder = build_encoder(
        ModelConfig(vision="resnet10_3d", text="bert_tiny", hidden=16, vision_kwargs={"block_inplanes": [4, 8, 8, 8]}),
        PRESETS[schema_name],
    )
    return task, TaskModel(task, encoder, PRESETS[schema_name])


def test_the_box_is_drawn_in_the_views_exactly_under_a_tumour_box_schema(demo_batch_and_rows):
    batch, rows, manifest = demo_batch_and_rows
    red = torch.tensor(OVERLAY_COLOUR)[:, None, None]
    for schema, drawn in (("image_only", False), ("image_table", False), ("image_bbox", True)):
        task, _ = _model(schema, rows, manifest)
        asked = [i for i, c in enumerate(batch["case_id"]) if c in task.questions.questions]
        views = task._views(batch, asked, torch.device("cpu"))  # (n, 3, H, W): one RGB key slice each
        assert views.shape[1] == 3 and views.min() >= 0 and views.max() <= 1
        is_red = (views == red).all(dim=1)
        assert bool(is_red.any(dim=(1, 2)).all()) == drawn and (drawn or not is_red.any()), schema
    no_stomach_box = resolve_schema({"boxes": "overlay", "box_levels": ["stomach"]})
    task = build_task("lesion_qa")
    task.bind(no_stomach_box)
    assert not task.overlay  # only the tumour's own box is the lesion's outline


def test_a_step_scores_four_options_and_the_metric_reads_them(demo_batch_and_rows):
    batch, rows, manifest = demo_batch_and_rows
    task, model = _model("image_bbox", rows, manifest)
    outputs = model(batch)
    asked = len(outputs["asked"])
    assert asked and outputs["logits"].shape == (asked, 4)
    loss = task.loss(outputs, batch)
    assert torch.isfinite(loss) and loss.requires_grad
    metric = task.metric()
    metric.update(outputs, batch)
    result = metric.compute()
    chosen = outputs["logits"].argmax(1).tolist()
    correct = sum(c == q.answer for c, q in zip(chosen, outputs["asked"], strict=True))
    assert result["accuracy"] == pytest.approx(100 * correct / asked) and result["questions"] == asked
    assert result["accuracy_ci_low"] <= result["accuracy"] <= result["accuracy_ci_high"]
    records = task.predict(outputs, batch)
    assert [r["correct"] for r in records] == [c == q.answer for c, q in zip(chosen, outputs["asked"], strict=True)]
    assert task.chance_level(rows, rows) == 25.0
    assert all(math.isnan(v) for v in task.metric().compute().values())


def test_shards_without_hu_statistics_are_refused(demo_batch_and_rows):
    _, rows, manifest = demo_batch_and_rows
    old = {**copy.deepcopy(manifest), "format_version": 1}
    with pytest.raises(ShardFormatError, match="format 1; lesion QA's windowed views needs format 2.*prepare_data"):
        build_task("lesion_qa").attach_splits({"train": rows}, old)


QA_CASES = 18


@pytest.fixture(scope="module")
def qa_cohort(ray_cluster, tmp_path_factory):
    """18 demo cases dealt 40/30/30: validation and test splits of about five, where four distinct descriptions can
    be asked (the session's ten-case cohort leaves two a split, too few for any question drawn from its own split).
    The paper's 70/15/15 needed 32 cases for such splits, and preparing each case is most of this fixture's time."""
    prepare = dataclasses.replace(tiny_prepare(), fractions=(0.4, 0.3, 0.3))
    return prepare_data("demo", tmp_path_factory.mktemp("qa_cohort"), prepare, DemoConfig(cases=QA_CASES, seed=3))


@pytest.mark.slow
def test_the_ct_bench_smoke_sweep_runs_end_to_end(qa_cohort, tmp_path, mlflow_server):
    """``python jobs/sweep.py --space ct_bench --preset smoke`` on a small demo cohort: every cell finishes, families
    stay apart in the summary and the report, and the test split is scored against 25 % chance with its interval."""
    with run_smoke_sweep("ct_bench", qa_cohort.shard_dir, tmp_path, mlflow_server.uri) as result:
        _check_ct_bench_smoke(result, tmp_path)


def _check_ct_bench_smoke(result, tmp_path: Path) -> None:
    assert (result.finished, result.failed) == (4, 0)
    cells = {(b["task"], b["schema"]) for b in result.best}
    families = ("lesion_qa.ct2txt.matched", "lesion_qa.img2attrib.matched")
    assert cells == {(f, s) for f in families for s in ("image_only", "image_bbox")}
    runs = load_runs(result.store_uri, result.sweep_id)
    attrib = runs[(runs["task"] == families[1]) & (runs["split"] == "test")].set_index(["schema", "metric"])["value"]
    for schema in ("image_only", "image_bbox"):
        assert attrib[(schema, "chance")] == 25.0 and 0 <= attrib[(schema, "accuracy")] <= 100
        low, high = attrib[(schema, "accuracy_ci_low")], attrib[(schema, "accuracy_ci_high")]
        assert low <= attrib[(schema, "accuracy")] <= high and attrib[(schema, "questions")] >= 4
    # the questions asked travel with each trial, with their recipe and every skipped case's reason
    run_id = runs[runs["task"] == families[1]]["run_id"].iloc[0]
    path = MlflowClient(result.store_uri).download_artifacts(run_id, "questions/questions.json", str(tmp_path))
    asked = json.loads(Path(path).read_text(encoding="utf-8"))
    assert asked["recipe"] == {"family": "img2attrib", "distractors": "matched", "seed": 0, "options": 4}
    assert len(asked["questions"]) + len(asked["skipped"]) == QA_CASES and asked["format"] == QUESTION_FORMAT
    # built once by the driver under the output, keyed by the cohort's manifest, and read by every trial of the recipe
    client = MlflowClient(result.store_uri)
    files = {client.get_run(r).data.params["task_options.questions_file"] for r in set(runs["run_id"])}
    written = sorted((result.output.parent / "questions").glob("*/*.json"))
    assert [p.name for p in written] == [f"{f}.matched.seed0.v{QUESTION_FORMAT}.json" for f in ("ct2txt", "img2attrib")]
    assert files == {str(p) for p in written}
    assert json.loads(written[1].read_text(encoding="utf-8"))["questions"] == asked["questions"]
    summary = result.report.read_text(encoding="utf-8")
    assert all(f"| {f} |" in summary for f in families)
    assert (result.report.parent / "tables" / f"table_{families[1]}.md").is_file()
    # CT-Bench's Figure 2: both conditions ran (summary.md names the figure by its path: MLflow's Markdown view
    # shows no relative image; summary.html embeds it)
    assert "`figures/box_effect.png`" in summary and (result.report.parent / "figures" / "box_effect.png").is_file()
    assert "### lesion_qa beside CT-Bench" in summary and "never comparable with ours" in summary


def test_txt2bbox_shows_one_image_per_option_with_only_that_box_drawn_and_trains(demo_batch_and_rows):
    batch, rows, manifest = demo_batch_and_rows
    task, model = _model("image_only", rows, manifest, family="txt2bbox")
    asked = [i for i, c in enumerate(batch["case_id"]) if c in task.questions.questions]
    assert asked
    views = task._views(batch, asked, torch.device("cpu"))  # (n, 4, 3, H, W)
    assert views.shape[:3] == (len(asked), 4, 3)
    red = (views == torch.tensor(OVERLAY_COLOUR)[:, None, None]).all(dim=2)  # (n, 4, H, W)
    for n, i in enumerate(asked):
        question = task.questions.questions[batch["case_id"][i]]
        for k, box in enumerate(question.option_boxes):
            ys, xs = torch.nonzero(red[n, k], as_tuple=True)
            # exactly this option's rectangle: its outline spans the box's rows and columns
            assert (ys.min(), ys.max() + 1, xs.min(), xs.max() + 1) == (box[1], box[4], box[2], box[5])
    outputs = model(batch)
    assert outputs["logits"].shape == (len(asked), 4)
    loss = task.loss(outputs, batch)
    loss.backward()
    assert torch.isfinite(loss) and any(
        p.grad is not None and p.grad.abs().sum() > 0 for p in model.head.view.parameters()
    )


def test_a_question_file_is_written_once_per_cohort_and_recipe_and_refused_for_another(demo_prepared, tmp_path):
    shards = str(demo_prepared.shard_dir)
    manifest = read_manifest(demo_prepared.shard_dir)
    rows = {s: split_rows(shards, s) for s in ("train", "val", "test")}
    location = write_question_file(shards, str(tmp_path), "img2txt", "random", seed=1)
    assert location == question_file(str(tmp_path), manifest_sha256(shards), "img2txt", "random", 1)
    recipe = {"family": "img2txt", "distractors": "random", "seed": 1, "options": 4}
    read = read_question_file(location, recipe, shards)
    built = build_questions(rows, "img2txt", "random", manifest["preprocess"]["spacing_zyx_mm"], 1)
    assert read.questions == built.questions and read.skipped == built.skipped and read.questions
    # a second sweep on the same cohort finds the file and keeps it as it is
    Path(location).write_text(Path(location).read_text("utf-8").replace('"format"', '"format" '), "utf-8")
    before = Path(location).read_text(encoding="utf-8")
    assert write_question_file(shards, str(tmp_path), "img2txt", "random", seed=1) == location
    assert Path(location).read_text(encoding="utf-8") == before
    with pytest.raises(ValueError, match="its recipe is .* this trial's"):
        read_question_file(location, {**recipe, "distractors": "matched"}, shards)
    other = tmp_path / "other"
    (other / "shards").mkdir(parents=True)
    (other / "shards" / "manifest.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="its manifest_sha256 is"):
        read_question_file(location, recipe, str(other / "shards"))
    # a lesion QA task given the file asks exactly its questions
    task = build_task("lesion_qa", family="img2txt", seed=1, questions_file=location)
    task.attach_splits(rows, manifest, shards)
    assert task.questions.questions == built.questions
    assert QuestionSet.from_dict(built.to_dict()).questions == built.questions


@pytest.mark.parametrize("seed", range(5))
def test_nearest_neighbours_rank_the_other_cases_of_the_split_by_cosine_similarity(seed):
    from gx_ray.tasks.lesion_neighbours import nearest_neighbours

    rng = np.random.default_rng(seed)
    cases = [f"c{i:02d}" for i in range(30)]
    embeddings = {c: rng.normal(size=8) for c in cases}
    split_of = {c: ("train", "val", "test")[i % 3] for i, c in enumerate(cases)}
    ranked = nearest_neighbours(embeddings, split_of)
    assert set(ranked) == set(cases)
    for case, neighbours in ranked.items():
        same = [c for c in cases if split_of[c] == split_of[case] and c != case]
        assert sorted(neighbours) == sorted(same)
        cosine = [
            embeddings[case] @ embeddings[c] / np.linalg.norm(embeddings[case]) / np.linalg.norm(embeddings[c])
            for c in neighbours
        ]
        assert cosine == sorted(cosine, reverse=True)


def test_appearance_distractors_are_drawn_among_the_nearest_lesions():
    rows = described_rows(np.random.default_rng(4), {"train": 40, "test": 20})
    rng = np.random.default_rng(0)
    neighbours = {}
    for part in rows.values():
        cases = [r["case_id"] for r in part]
        for case in cases:
            others = [c for c in cases if c != case]
            neighbours[case] = [others[i] for i in rng.permutation(len(others))]
    own = {r["case_id"]: lesion_description(r["ct_report"]) for part in rows.values() for r in part}
    for family in ("img2txt", "txt2bbox"):
        with pytest.raises(ValueError, match="nearest lesions"):
            build_questions(rows, family, "appearance", SPACING, shape_zyx=SHAPE)
        built = build_questions(rows, family, "appearance", SPACING, shape_zyx=SHAPE, neighbours=neighbours)
        assert len(built.questions) == 60
        again = build_questions(rows, family, "appearance", SPACING, shape_zyx=SHAPE, neighbours=neighbours)
        assert again.questions == built.questions
        for case, q in built.questions.items():
            # the nearest eight lesions whose descriptions differ from the answer's (and from each other)
            near: dict[str, str] = {}
            for other in neighbours[case]:
                if own[other] != own[case] and own[other] not in near:
                    near[own[other]] = other
            allowed = set(list(near.values())[:8]) if family == "img2txt" else set(neighbours[case][:8])
            distractors = {c for i, c in enumerate(q.option_cases) if i != q.answer}
            assert distractors <= allowed, (family, case)


def test_the_lesion_encoder_learns_from_training_descriptions_only(demo_prepared):
    from gx_ray.tasks.lesion_qa import lesion_neighbours_of

    shards = str(demo_prepared.shard_dir)
    rows = {s: split_rows(shards, s) for s in ("train", "val", "test")}
    first = lesion_neighbours_of(rows, shards, seed=0)
    assert set(first) == {r["case_id"] for part in rows.values() for r in part}
    assert lesion_neighbours_of(rows, shards, seed=0) == first  # seeded: the same neighbours again
    # another validation or test report changes nothing: those descriptions are never seen by the encoder
    unseen = copy.deepcopy(rows)
    for split in ("val", "test"):
        for row in unseen[split]:
            row["ct_report"] = "The lesion measures about 99 mm in its long axis, at the pylorus."
    assert lesion_neighbours_of(unseen, shards, seed=0) == first
    # while the training descriptions are what it learns: other ones, other neighbours
    taught = copy.deepcopy(rows)
    for i, row in enumerate(taught["train"]):
        row["ct_report"] = (
            f"The lesion measures about {10 + 7 * i} mm in its long axis, at the {('cardia', 'antrum')[i % 2]}."
        )
    assert lesion_neighbours_of(taught, shards, seed=0) != first


@pytest.mark.parametrize("schema", ["image_only", "image_bbox"])
def test_txt2img_shows_the_option_cases_own_key_slices(demo_prepared, schema):
    from gx_ray.tasks.lesion_neighbours import key_slice_views

    shards = str(demo_prepared.shard_dir)
    manifest = read_manifest(demo_prepared.shard_dir)
    rows = {s: split_rows(shards, s) for s in ("train", "val", "test")}
    task = build_task("lesion_qa", family="txt2img", view_depth=10, view_kwargs={"block_inplanes": [4, 8, 8, 8]})
    task.attach_splits(rows, manifest, shards)
    encoder = build_encoder(
        ModelConfig(vision="resnet10_3d", text="bert_tiny", hidden=16, vision_kwargs={"block_inplanes": [4, 8, 8, 8]}),
        PRESETS[schema],
    )
    model = TaskModel(task, encoder, PRESETS[schema])
    files = split_files(demo_prepared.shard_dir, "train")
    table = pa.concat_tables([pq.read_table(f) for f in files])
    batch = BatchCollate(TensorLayout.from_schema(table.schema))(table)
    asked = [i for i, c in enumerate(batch["case_id"]) if c in task.questions.questions]
    assert asked
    views = task._views(batch, asked, torch.device("cpu"))
    expected = key_slice_views(shards, overlay=schema == "image_bbox")
    for n, i in enumerate(asked):
        question = task.questions.questions[batch["case_id"][i]]
        for k, case in enumerate(question.option_cases):
            assert torch.equal(views[n, k], torch.from_numpy(expected[case]).float())
    red = (views == torch.tensor(OVERLAY_COLOUR)[:, None, None]).all(dim=2)
    assert bool(red.any()) == (schema == "image_bbox")  # each slice with its own lesion's outline, under a box cue
    outputs = model(batch)
    assert outputs["logits"].shape == (len(asked), 4) and torch.isfinite(task.loss(outputs, batch))
