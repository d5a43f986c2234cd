"""The GastroINST-style endoscopy tasks: the annotation file (and its bad input), the demo cohort's annotations
agreeing with its frames, REC's metrics against pycocotools and MONAI on random boxes, the task's samples, loss and
leakage rule, and the ``endoscopy`` smoke sweep end to end."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gx_ray.data import endoscopy_annotations as ea
from gx_ray.data.demo.cohort import DemoConfig, frame_annotation, generate_case
from gx_ray.data.demo.endoscopy import endoscopic_lesion
from gx_ray.data.demo.findings import sample_findings, sample_staging
from gx_ray.data.stream import split_rows
from gx_ray.modalities import PRESETS, LeakageError, ModalitySchema, check_leakage
from gx_ray.tasks import build_task
from gx_ray.tasks.endoscopy import rec_metrics
from tests.common import run_smoke_sweep, tiny_prepare


def _frame(case_id="A", **changes):
    entry = ea.annotation_entry(case_id, (200, 100), "antrum", [[20, 10, 120, 60]], ["early gastric cancer"], "x")
    return {**entry, **changes}


def test_an_annotation_file_is_read_with_boxes_as_fractions_of_the_frame(tmp_path):
    path = tmp_path / "a.json"
    ea.write_annotations(path, [_frame("A"), _frame("B", site="body", boxes=[], region_classes=[])])
    frames, problems = ea.read_annotations(path)
    assert problems == []
    assert frames["A"].boxes == ((0.1, 0.1, 0.6, 0.6),) and frames["A"].region_classes == ("early gastric cancer",)
    assert frames["B"].site == "body" and frames["B"].boxes == ()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"site": "colon"}, "site"),
        ({"boxes": [[120, 10, 20, 60]]}, "boxes[0]"),
        ({"boxes": [[20, 10, 220, 60]]}, "boxes[0]"),
        ({"boxes": [[20, 10, 120]]}, "boxes[0]"),
        ({"region_classes": ["tumour"]}, "region_classes[0]"),
        ({"region_classes": []}, "boxes"),
        ({"caption": " "}, "caption"),
        ({"width": 0}, "width"),
    ],
)
def test_a_bad_frame_is_left_out_naming_case_file_and_field_and_the_others_are_kept(tmp_path, changes, field):
    path = tmp_path / "a.json"
    ea.write_annotations(path, [_frame("GOOD"), _frame("BAD", **changes)])
    frames, problems = ea.read_annotations(path)
    assert list(frames) == ["GOOD"]
    (problem,) = problems
    assert (problem.case_id, problem.field) == ("BAD", field)
    assert str(path) in str(problem) and "BAD" in str(problem) and field in str(problem)


def test_a_file_that_is_no_annotation_file_is_refused_whole(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"frames": []}), encoding="utf-8")
    with pytest.raises(ea.AnnotationError, match="format"):
        ea.read_annotations(path)
    path.write_text("{", encoding="utf-8")
    with pytest.raises(ea.AnnotationError, match="JSON"):
        ea.read_annotations(path)


@pytest.mark.parametrize("index", range(12))
def test_the_demo_annotation_boxes_the_painted_lesion_and_tells_the_frames_own_story(index):
    rng = np.random.default_rng(index)
    findings = sample_findings(rng, f"C{index}", sample_staging(rng))
    mask = np.zeros((64, 80), bool)
    y, x = rng.integers(0, 50), rng.integers(0, 60)
    mask[y : y + 9, x : x + 13] = True
    entry = frame_annotation(f"C{index}", findings, mask)
    lesion = endoscopic_lesion(findings)
    assert entry["boxes"] == [[x, y, x + 13, y + 9]] and (entry["width"], entry["height"]) == (80, 64)
    assert entry["site"] == lesion.location
    assert entry["region_classes"] == ["early gastric cancer" if lesion.early else "advanced gastric cancer"]
    assert f"{lesion.size_mm} ×" in entry["caption"]


def test_a_demo_case_annotates_its_own_frame():
    """The annotation's box is the extent of the lesion painted on the very frame the case carries."""
    from gx_ray.data.demo.cohort import _STREAMS, case_id_of
    from gx_ray.data.demo.endoscopy import render_endoscopy_with_mask

    config = DemoConfig(cases=3, endoscopy_size=64)
    for index in range(3):
        case = generate_case(config, index)
        rng = {name: np.random.default_rng([config.seed, index, k]) for k, name in enumerate(_STREAMS)}
        findings = sample_findings(rng["findings"], case_id_of(index), sample_staging(rng["staging"]), config.signal)
        frame, mask = render_endoscopy_with_mask(rng["endoscopy"], findings, 64)
        assert np.array_equal(frame, case.endoscopy)
        ys, xs = np.nonzero(mask)
        assert case.endoscopy_annotation["boxes"] == [[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]]
        assert case.endoscopy_annotation["site"] == case.meta["ground_truth"]["findings"]["tumour_location"]


def test_preparation_keeps_the_valid_frames_beside_the_shards_and_warns_the_case_of_a_bad_one(demo_raw, tmp_path):
    from gx_ray.data.prepare import prepare_shards

    document = json.loads((demo_raw / ea.FILE).read_text(encoding="utf-8"))
    bad = document["frames"][0]["case_id"]
    document["frames"][0]["site"] = "colon"
    edited = tmp_path / "annotations.json"
    edited.write_text(json.dumps(document), encoding="utf-8")
    config = tiny_prepare()
    config = type(config)(**{**config.__dict__, "endoscopy_annotations": str(edited)})
    result = prepare_shards(demo_raw, tmp_path / "prepared", config)
    frames = ea.load_prepared(result.shard_dir)
    included = {r["case_id"] for split in ("train", "val", "test") for r in split_rows(result.shard_dir, split)}
    assert bad in included and bad not in frames and set(frames) == included - {bad}
    assert all(0 <= v <= 1 for f in frames.values() for box in f.boxes for v in box)
    qc = json.loads(result.qc_report.read_text(encoding="utf-8"))
    (warning,) = [w for w in qc["cases"][bad]["warnings"] if "endoscopy" in w]
    assert "'site'" in warning and str(edited) in warning


def _coco_map(predicted: np.ndarray, target: np.ndarray, scale: float = 1000.0) -> float:
    """COCO's own summary (stats[0], AP@[.5:.95]) for one scored box per image."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def anns(boxes, scored):
        out = []
        for i, (x0, y0, x1, y1) in enumerate((boxes * scale).tolist()):
            ann = {"image_id": i, "category_id": 1, "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0)}
            out.append({**ann, "iscrowd": 0, "id": i + 1, **({"score": 1.0} if scored else {})})
        return out

    images, cats = [{"id": i} for i in range(len(target))], [{"id": 1}]
    with contextlib.redirect_stdout(io.StringIO()):
        gt, dt = COCO(), COCO()
        gt.dataset = {"images": images, "categories": cats, "annotations": anns(target, False)}
        dt.dataset = {"images": images, "categories": cats, "annotations": anns(predicted, True)}
        gt.createIndex()
        dt.createIndex()
        evaluation = COCOeval(gt, dt, iouType="bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return 100 * evaluation.stats[0]


@pytest.mark.parametrize("seed", range(25))
def test_rec_metrics_agree_with_monai_iou_and_pycocotools_summary_on_random_boxes(seed):
    from monai.data.box_utils import box_iou

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    target = np.sort(rng.uniform(0, 1, (n, 2, 2)), axis=1).transpose(0, 2, 1).reshape(n, 4)[:, [0, 2, 1, 3]]
    target[:, 2:] = np.maximum(target[:, 2:], target[:, :2] + 0.02)
    jitter = rng.normal(0, rng.uniform(0.01, 0.2), (n, 4))
    predicted = np.clip(target + jitter, 0, 1)
    predicted[:, 2:] = np.maximum(predicted[:, 2:], predicted[:, :2] + 0.01)
    ours = rec_metrics(predicted, target)
    iou = np.diag(box_iou(torch.tensor(predicted), torch.tensor(target)).numpy())
    assert ours["accuracy"] == pytest.approx(100 * np.mean(iou >= 0.5))
    # MONAI computes in float32 and adds float32 eps to each union
    assert ours["mean_iou"] == pytest.approx(100 * iou.mean(), abs=1e-2)
    assert ours["map_50_95"] == pytest.approx(_coco_map(predicted, target), abs=1e-6)
    assert np.isnan(rec_metrics(np.zeros((0, 4)), np.zeros((0, 4)))["accuracy"])


@pytest.fixture(scope="module")
def endo_rows(demo_prepared):
    return {s: split_rows(demo_prepared.shard_dir, s) for s in ("train", "val", "test")}


@pytest.mark.parametrize("family", ["cls", "reg", "rec", "cap"])
def test_each_family_asks_every_annotated_frame_and_trains_on_it(demo_prepared, endo_rows, family):
    from gx_ray.data.shards import TensorLayout, read_manifest
    from gx_ray.data.stream import first_rows
    from gx_ray.models.registry import ModelConfig, build_encoder
    from gx_ray.tasks.base import TaskModel

    manifest = read_manifest(demo_prepared.shard_dir)
    task = build_task("endoscopy", family=family, view_depth=10, view_kwargs={"block_inplanes": [4, 8, 8, 8]})
    task.attach_splits(endo_rows, manifest, str(demo_prepared.shard_dir))
    assert set(task.frames) == {r["case_id"] for rows in endo_rows.values() for r in rows} and not task.skipped
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    batch = first_rows(demo_prepared.shard_dir, "train", 4, layout)
    model = TaskModel(
        task,
        build_encoder(
            ModelConfig(
                vision="resnet10_3d", text="bert_tiny", hidden=16, vision_kwargs={"block_inplanes": [4, 4, 4, 4]}
            ),
            PRESETS["image_only"],
        ),
        PRESETS["image_only"],
    )
    outputs = model(batch)
    loss = task.loss(outputs, batch)
    loss.backward()
    assert torch.isfinite(loss) and len(outputs["asked"]) == 4
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.head.view.parameters())
    if family == "cap":  # captions are written (and so scored) in evaluation only
        model.eval()
        with torch.no_grad():
            outputs = model(batch)
    records = task.predict(outputs, batch)
    assert [r["case_id"] for r in records] == outputs["asked"]
    metric = task.metric()
    metric.update(outputs, batch)
    assert 0 <= metric.compute()[task.primary_metric] <= 100
    chance = task.chance_level(endo_rows["train"], endo_rows["test"])
    assert 0 <= chance <= 100


def test_frames_without_annotation_or_box_are_skipped_with_a_reason(demo_prepared, endo_rows, monkeypatch):
    frames = ea.load_prepared(demo_prepared.shard_dir)
    first, second = sorted(frames)[:2]
    frames.pop(first)
    frames[second] = ea.FrameAnnotation(second, "body", (), (), "no lesion seen")
    monkeypatch.setattr("gx_ray.tasks.endoscopy.load_prepared", lambda shards: frames)
    for family, reasons in (("cls", {first}), ("rec", {first, second})):
        task = build_task("endoscopy", family=family)
        task.attach_splits(endo_rows, {}, "anywhere")
        assert set(task.skipped) == reasons and task.skipped[first] == "no endoscopy annotation"
        assert not reasons & set(task.frames)
    with pytest.raises(ValueError, match="endoscopy_annotations"):
        build_task("endoscopy").attach_splits(endo_rows, {}, None)


def test_no_report_is_an_endoscopy_input_and_families_are_checked():
    with pytest.raises(LeakageError, match="reports_in_endoscopy"):
        check_leakage(ModalitySchema("with_report", reports=("endoscopy_report",)), "endoscopy")
    check_leakage(PRESETS["image_only"], "endoscopy")
    with pytest.raises(ValueError, match="valid: cls, reg, rec, cap"):
        build_task("endoscopy", family="caption")


@pytest.mark.slow
def test_the_endoscopy_smoke_sweep_runs_end_to_end(demo_prepared, tmp_path, mlflow_server):
    """``python jobs/sweep.py --space endoscopy --preset smoke``: every family finishes, apart in the summary, scored
    against its chance level, with the frames it asked logged."""
    from mlflow.tracking import MlflowClient

    from gx_ray.analysis.runs import load_runs

    with run_smoke_sweep("endoscopy", demo_prepared.shard_dir, tmp_path, mlflow_server.uri) as result:
        assert (result.finished, result.failed) == (4, 0)
        assert {b["task"] for b in result.best} == {f"endoscopy.{f}" for f in ("cls", "reg", "rec", "cap")}
        assert {b["task"]: b["metric"] for b in result.best}["endoscopy.cap"] == "rouge_l"
        runs = load_runs(result.store_uri, result.sweep_id)
        test = runs[runs["split"] == "test"].set_index(["task", "metric"])["value"]
        for family in ("cls", "reg", "rec"):
            assert 0 <= test[(f"endoscopy.{family}", "accuracy")] <= 100
            assert 0 <= test[(f"endoscopy.{family}", "chance")] <= 100
        assert 0 <= test[("endoscopy.rec", "map_50_95")] <= 100
        assert 0 <= test[("endoscopy.cap", "rouge_l")] <= 100 and 0 < test[("endoscopy.cap", "chance")] <= 100
        run_id = runs[runs["task"] == "endoscopy.reg"]["run_id"].iloc[0]
        path = MlflowClient(result.store_uri).download_artifacts(run_id, "endoscopy/samples.json", str(tmp_path))
        logged = json.loads(Path(path).read_text(encoding="utf-8"))
        assert logged["family"] == "reg" and logged["asked"]


def test_reg_outlines_the_asked_region_and_nothing_else(demo_prepared, endo_rows):
    from gx_ray.data.shards import TensorLayout, read_manifest
    from gx_ray.data.stream import first_rows

    manifest = read_manifest(demo_prepared.shard_dir)
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    batch = first_rows(demo_prepared.shard_dir, "train", 4, layout)
    views = {}
    for family in ("cls", "reg"):
        task = build_task("endoscopy", family=family)
        task.attach_splits(endo_rows, manifest, str(demo_prepared.shard_dir))
        views[family] = task._frames(batch, [0, 1, 2, 3], torch.device("cpu"))
    size = views["cls"].shape[-1]
    for i, case in enumerate(batch["case_id"]):
        ys, xs = np.nonzero((views["cls"][i] != views["reg"][i]).any(0).numpy())
        x0, y0, x1, y1 = (round(v * size) for v in task.frames[case].boxes[0])
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (x0, y0, x1, y1)
        inner = (xs > x0) & (xs < x1 - 1) & (ys > y0) & (ys < y1 - 1)
        assert not inner.any()  # an outline, not a filled box


def test_captions_are_scored_by_rouge_l_and_their_decoder_writes_only_training_caption_tokens(demo_prepared, endo_rows):
    from gx_ray.tasks import primary_metric

    assert primary_metric("endoscopy.cap") == "rouge_l" and primary_metric("endoscopy.reg") == "accuracy"
    task = build_task("endoscopy", family="cap", caption_tokens=24, view_depth=10)
    assert task.primary_metric == "rouge_l" and build_task("endoscopy").primary_metric == "accuracy"
    task.attach_splits(endo_rows, {}, str(demo_prepared.shard_dir))
    train_cases = {r["case_id"] for r in endo_rows["train"]}
    assert sorted(task.training_captions) == sorted(task.frames[c].caption for c in train_cases)
    from transformers import AutoTokenizer

    from gx_ray.models.text import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    head = task.build_head(16, tokenizer)
    taught = tokenizer(task.training_captions, truncation=True, max_length=24)["input_ids"]
    assert set(head.caption.kept_tokens.tolist()) == {
        *(i for ids in taught for i in ids),
        tokenizer.unk_token_id,
        tokenizer.pad_token_id,
    }
    # the chance level: random training captions, cut as the targets are, scored against the test captions
    chance = task.chance_level(endo_rows["train"], endo_rows["test"])
    assert 0 < chance < 100


def test_a_caption_decoder_conditioned_on_the_frame_learns_to_write_each_frames_caption(demo_prepared, endo_rows):
    """Overfit four frames with different captions: greedy decoding must then give each frame its own caption, which
    it can only do by reading the frame (the decoder's one memory token)."""
    from gx_ray.data.shards import TensorLayout, read_manifest
    from gx_ray.data.stream import first_rows
    from gx_ray.models.registry import ModelConfig, build_encoder
    from gx_ray.tasks.base import TaskModel

    torch.manual_seed(0)
    manifest = read_manifest(demo_prepared.shard_dir)
    task = build_task(
        "endoscopy", family="cap", caption_tokens=12, max_new_tokens=12, view_depth=10,
        view_kwargs={"block_inplanes": [8, 8, 16, 16]}, decoder_width=32, decoder_layers=1,
    )  # fmt: skip
    task.attach_splits(endo_rows, manifest, str(demo_prepared.shard_dir))
    layout = TensorLayout(tuple(manifest["ct_shape"]), tuple(manifest["endoscopy_shape"]), tuple(manifest["lab_names"]))
    batch = first_rows(demo_prepared.shard_dir, "train", 4, layout)
    encoder = build_encoder(
        ModelConfig(vision="resnet10_3d", text="bert_tiny", hidden=16, vision_kwargs={"block_inplanes": [4, 4, 4, 4]}),
        PRESETS["image_only"],
    )
    model = TaskModel(task, encoder, PRESETS["image_only"])
    wanted = task.predict(model.eval()(batch), batch)
    assert len({r["target"] for r in wanted}) > 1, "the four frames need different captions"
    optimiser = torch.optim.AdamW(model.head.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        loss = task.loss(model(batch), batch)
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
    model.eval()
    with torch.no_grad():
        outputs = model(batch)
    records = task.predict(outputs, batch)
    # the tokenizer is uncased: the captions come back in lower case
    assert [r["prediction"] for r in records] == [r["target"].lower() for r in records], records
    metric = task.metric()
    metric.update(outputs, batch)
    assert metric.compute()["rouge_l"] == pytest.approx(100.0)
