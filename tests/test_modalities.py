"""Modality schemas, leakage rules and the inputs built from a shard batch: what a model may see, and only that."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gx_ray.data.catalogue import describe_abnormal, load_catalogue
from gx_ray.modalities import (
    LEAKAGE_RULES,
    PRESETS,
    LeakageError,
    ModalitySchema,
    build_inputs,
    check_leakage,
    input_channels,
    resolve_schema,
    table_width,
)
from gx_ray.modalities.boxes import OVERLAY_OFFSETS
from gx_ray.modalities.build import IMAGENET_MEAN, IMAGENET_STD
from gx_ray.schema import BOX_LEVELS, PHASES, REPORT_KINDS, TASKS
from tests.common import first_shard_batch

SHAPE = (6, 10, 12)  # D, H, W
N_LABS = len(load_catalogue().numeric_inputs())
LAB_NAMES = [v.name for v in load_catalogue().numeric_inputs()]
# sample 0: CEA high, haemoglobin low, CA125 missing, labels of several words; sample 1: normal values only
SAMPLE_LABS = [
    {
        "cea": 12.4,
        "haemoglobin": 92.0,
        "ca19_9": 80.0,
        "wbc": 6.0,
        "ca125": None,
        "neutrophil_ratio": 81.0,
        "total_bilirubin": 30.0,
    },
    {"cea": 2.0, "haemoglobin": 140.0, "wbc": 6.0},
]


NC, VENOUS, DELAYED = (PHASES.index(p) for p in ("non_contrast", "venous", "delayed"))
TUMOUR, NODES, STOMACH = (BOX_LEVELS.index(v) for v in ("tumour", "lymph_nodes", "stomach"))


def synthetic_batch(seed: int = 0) -> dict:
    """Two samples shaped like BatchCollate's output, with boxes chosen to exercise the fallback rule."""
    rng = np.random.default_rng(seed)
    b = len(SAMPLE_LABS)
    ct = rng.normal(size=(b, len(PHASES), *SHAPE)).astype(np.float16)
    phase_present = np.ones((b, len(PHASES)), bool)
    phase_present[1, PHASES.index("arterial")] = False
    ct[~phase_present] = 0
    boxes = np.zeros((b, len(PHASES), len(BOX_LEVELS), 6), np.int32)
    # sample 0: every phase has its own tumour box (shifted per phase), the stomach only on venous, lymph nodes on
    # non-contrast and venous (different boxes): arterial and delayed must take the venous one
    for p in range(len(PHASES)):
        boxes[0, p, TUMOUR] = (1, 2 + p, 3, 5, 7 + p, 9)
    boxes[0, VENOUS, STOMACH] = (0, 0, 0, 6, 10, 12)
    boxes[0, NC, NODES] = (0, 5, 5, 3, 9, 11)
    boxes[0, VENOUS, NODES] = (3, 1, 6, 6, 5, 11)
    # sample 1: a lymph-node box on the delayed phase only, no tumour, no stomach
    boxes[1, DELAYED, NODES] = (2, 1, 1, 4, 4, 5)
    present = boxes[..., 3] > 0
    labs = np.full((b, N_LABS), np.nan, np.float32)
    for i, values in enumerate(SAMPLE_LABS):
        for name, value in values.items():
            labs[i, LAB_NAMES.index(name)] = math.nan if value is None else value
    descriptors = [describe_abnormal(load_catalogue().abnormal_findings(v)) for v in SAMPLE_LABS]
    endoscopy = rng.integers(0, 256, size=(b, 3, 8, 8), dtype=np.uint8)
    return {
        "case_id": ["a", "b"],
        "ct": torch.from_numpy(ct),
        "phase_present": torch.from_numpy(phase_present),
        "boxes": torch.from_numpy(boxes),
        "box_present": torch.from_numpy(present.reshape(b, -1)),
        "labs": torch.from_numpy(labs),
        "labs_missing": torch.from_numpy(np.isnan(labs)),
        "lab_abnormal": descriptors,
        "endoscopy": torch.from_numpy(endoscopy),
        "endoscopy_present": torch.tensor([True, False]),
        "ct_report": ["Thickened antral wall.", None],
        "endoscopy_report": ["Ulcerated mass.", "Normal mucosa."],
        "diagnosis_report": ["Stage IIIA.", "Stage I."],
    }


def hollow_rectangles(box, shape=SHAPE) -> np.ndarray:
    """The box's one-voxel rectangle outline on each slice it spans, by slicing (independent of the library)."""
    z0, y0, x0, z1, y1, x1 = box
    out = np.zeros(shape, bool)
    out[z0:z1, y0:y1, x0:x1] = True
    out[z0:z1, y0 + 1 : y1 - 1, x0 + 1 : x1 - 1] = False
    return out


def filled(box, shape=SHAPE) -> np.ndarray:
    z0, y0, x0, z1, y1, x1 = box
    out = np.zeros(shape, bool)
    out[z0:z1, y0:y1, x0:x1] = True
    return out


# --- schemas -----------------------------------------------------------------------------------------


def test_presets_are_the_papers_four_settings():
    assert list(PRESETS) == ["image_only", "image_table", "image_bbox", "image_table_bbox"]
    assert [(s.table, s.boxes) for s in PRESETS.values()] == [
        ("off", "off"),
        ("text", "off"),
        ("off", "overlay"),
        ("text", "overlay"),
    ]
    assert all(s.phases == PHASES and not s.endoscopy and not s.reports for s in PRESETS.values())
    assert resolve_schema("image_table") is PRESETS["image_table"]


def test_custom_schema_from_a_mapping():
    schema = resolve_schema({"phases": ["venous", "arterial"], "table": "numeric", "boxes": "channels"})
    assert schema.name == "custom" and schema.phases == ("venous", "arterial") and schema.table == "numeric"
    assert resolve_schema({"name": "v", "phases": "venous", "box_levels": "stomach"}).phases == ("venous",)
    assert resolve_schema(schema) is schema
    assert schema.variables() == tuple(LAB_NAMES)
    assert ModalitySchema("x", table_variables=("cea", "wbc")).variables() == ("wbc", "cea")  # catalogue order


@pytest.mark.parametrize(
    ("spec", "valid"),
    [
        ("image_table_boxes", "image_only"),
        ({"phases": ["portal"]}, "non_contrast"),
        ({"phases": []}, "at least one CT phase"),
        ({"phases": ["venous", "venous"]}, "more than once"),
        ({"table": "csv"}, "off, text, numeric"),
        ({"boxes": "mesh"}, "off, overlay, channels"),
        ({"box_levels": ["liver"]}, "tumour, lymph_nodes, stomach"),
        ({"reports": ["pathology_report"]}, "ct_report, endoscopy_report, diagnosis_report"),
        ({"table_variables": ["cea", "tumor_marker_x"]}, "cea"),
        ({"phase": ["venous"]}, "phases"),
    ],
)
def test_bad_schemas_name_the_valid_choices(spec, valid):
    with pytest.raises(ValueError, match="valid|at least|more than once") as err:
        resolve_schema(spec)
    assert valid in str(err.value)


# --- leakage rules -----------------------------------------------------------------------------------

LEAKING = [
    ("post_diagnosis_variables", {"table": "text", "table_variables": ["cea", "t_stage"]}, "vqa"),
    ("post_diagnosis_variables", {"table": "numeric", "table_variables": ["positive_lymph_nodes"]}, "retrieval"),
    ("post_diagnosis_variables", {"table": "text", "table_variables": ["hospital_id"]}, "stage_classification"),
    ("box_cues_in_detection", {"boxes": "overlay"}, "lesion_detection"),
    ("box_cues_in_detection", {"boxes": "channels", "box_levels": ["tumour"]}, "lesion_detection"),
    ("stage_in_reports", {"reports": ["diagnosis_report"]}, "stage_classification"),
    ("target_report", {"reports": ["ct_report"]}, "report_generation"),
    ("target_report", {"reports": ["ct_report"]}, "retrieval"),
    ("report_answers", {"reports": ["endoscopy_report"]}, "vqa"),
    ("reports_in_lesion_qa", {"reports": ["endoscopy_report"]}, "lesion_qa"),
    ("reports_in_endoscopy", {"reports": ["endoscopy_report"]}, "endoscopy"),
    ("box_gives_the_answer", {"boxes": "overlay"}, "lesion_qa", {"family": "img2size"}),
    ("box_gives_the_answer", {"boxes": "channels", "box_levels": ["tumour"]}, "lesion_qa", {"family": "img2size"}),
]


def test_every_rule_is_tested():
    assert {rule for rule, *_ in LEAKING} == {r.name for r in LEAKAGE_RULES}


@pytest.mark.parametrize(("rule", "spec", "task", "options"), [(*case, {})[:4] for case in LEAKING])
def test_each_leakage_rule_fires_with_its_name(rule, spec, task, options):
    with pytest.raises(LeakageError, match=rule) as err:
        check_leakage(resolve_schema(spec), task, options)
    assert err.value.rule == rule


def test_lesion_qa_sees_the_box_where_it_answers_nothing():
    for family in ("img2txt", "ct2txt", "img2attrib"):
        check_leakage(PRESETS["image_bbox"], "lesion_qa", {"family": family})
    check_leakage(PRESETS["image_only"], "lesion_qa", {"family": "img2size"})
    # a box cue without the tumour's outline shows nothing of the lesion's size
    check_leakage(resolve_schema({"boxes": "overlay", "box_levels": ["stomach"]}), "lesion_qa", {"family": "img2size"})


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_paper_presets_pass_where_they_should(preset, task):
    if task == "lesion_detection" and PRESETS[preset].boxes != "off":
        with pytest.raises(LeakageError, match="box_cues_in_detection"):
            check_leakage(PRESETS[preset], task)
    else:
        check_leakage(PRESETS[preset], task)


def test_non_tumour_box_cues_and_safe_reports_are_allowed():
    cues = resolve_schema({"boxes": "overlay", "box_levels": ["lymph_nodes", "stomach"]})
    check_leakage(cues, "lesion_detection")
    check_leakage(resolve_schema({"reports": ["ct_report", "endoscopy_report"]}), "stage_classification")
    check_leakage(resolve_schema({"reports": ["endoscopy_report"]}), "retrieval")
    # a post-diagnosis variable named while the table is off reaches no model
    check_leakage(resolve_schema({"table_variables": ["t_stage"]}), "vqa")
    with pytest.raises(ValueError, match="valid: vqa"):
        check_leakage(cues, "segmentation")


# --- channel and table sizes ---------------------------------------------------------------------------


def test_input_channels_and_table_width():
    assert [input_channels(s) for s in PRESETS.values()] == [4, 4, 4, 4]
    assert all(table_width(s) == 0 for s in PRESETS.values())
    channels = resolve_schema({"phases": ["venous"], "boxes": "channels", "box_levels": ["stomach", "tumour"]})
    assert input_channels(channels) == 3
    assert table_width(resolve_schema({"table": "numeric"})) == 2 * N_LABS
    assert table_width(resolve_schema({"table": "numeric", "table_variables": ["cea", "sex"]})) == 2  # sex: no number


# --- build_inputs: CT, boxes -------------------------------------------------------------------------


@pytest.mark.parametrize("preset", list(PRESETS))
def test_shapes_per_preset(preset):
    batch, schema = synthetic_batch(), PRESETS[preset]
    inputs = build_inputs(batch, schema)
    assert inputs.ct.shape == (2, input_channels(schema), *SHAPE) and inputs.ct.dtype == torch.float32
    assert inputs.phase_mask.shape == (2, 4) and inputs.phase_mask.dtype == torch.bool
    assert inputs.endoscopy is None and inputs.table is None
    assert (inputs.text is not None) == (schema.table == "text")
    assert inputs.batch_size == 2


def test_phase_subset_selects_the_right_channels_in_the_schemas_order():
    batch = synthetic_batch()
    inputs = build_inputs(batch, resolve_schema({"phases": ["delayed", "arterial"]}))
    expected = batch["ct"][:, [PHASES.index("delayed"), PHASES.index("arterial")]].float()
    assert torch.equal(inputs.ct, expected)
    assert inputs.phase_mask.tolist() == [[True, True], [True, False]]


def test_overlay_draws_outlines_only_with_a_value_per_level():
    batch = synthetic_batch()
    schema = resolve_schema({"boxes": "overlay"})
    inputs = build_inputs(batch, schema)
    plain = batch["ct"].float()
    boxes = batch["boxes"].numpy()
    venous = PHASES.index("venous")
    for c, phase in enumerate(PHASES):
        top = plain[0, c].max()
        tumour = hollow_rectangles(boxes[0, c, 0])  # each phase its own tumour box
        nodes = hollow_rectangles(boxes[0, c if phase == "non_contrast" else venous, 1])  # own box, else venous
        stomach = hollow_rectangles(boxes[0, venous, 2])  # only venous has one: the fallback
        changed = (inputs.ct[0, c] != plain[0, c]).numpy()
        assert np.array_equal(changed, tumour | nodes | stomach), phase
        values = inputs.ct[0, c].numpy()
        assert np.allclose(values[tumour], top + OVERLAY_OFFSETS["tumour"])  # the brighter level wins on crossings
        assert np.allclose(values[nodes & ~tumour], top + OVERLAY_OFFSETS["lymph_nodes"])
        assert np.allclose(values[stomach & ~tumour & ~nodes], top + OVERLAY_OFFSETS["stomach"])
        # the tumour box interior keeps its voxels
        interior = filled(boxes[0, c, 0]) & ~(tumour | nodes | stomach)
        assert interior.any() and torch.equal(inputs.ct[0, c][interior], plain[0, c][interior])
    # sample 1: the delayed lymph-node box is drawn on every present phase; the absent arterial phase stays zeros
    nodes = hollow_rectangles(boxes[1, PHASES.index("delayed"), 1])
    for c, phase in enumerate(PHASES):
        changed = (inputs.ct[1, c] != plain[1, c]).numpy()
        assert np.array_equal(changed, nodes if phase != "arterial" else np.zeros(SHAPE, bool)), phase
        assert inputs.ct[1, c].max() <= plain[1, c].max() + OVERLAY_OFFSETS["lymph_nodes"] + 1e-5


def test_overlay_without_the_tumour_level_leaves_the_tumour_undrawn():
    batch = synthetic_batch()
    inputs = build_inputs(batch, resolve_schema({"boxes": "overlay", "box_levels": ["stomach"]}))
    stomach = hollow_rectangles(batch["boxes"][0, PHASES.index("venous"), 2].numpy())
    changed = (inputs.ct[0] != batch["ct"][0].float()).numpy()
    assert all(np.array_equal(changed[c], stomach) for c in range(len(PHASES)))


def test_channels_mode_masks_equal_the_boxes():
    batch = synthetic_batch()
    schema = resolve_schema({"phases": ["venous"], "boxes": "channels"})
    inputs = build_inputs(batch, schema)
    assert inputs.ct.shape == (2, 1 + len(BOX_LEVELS), *SHAPE)
    assert torch.equal(inputs.ct[:, 0], batch["ct"][:, PHASES.index("venous")].float())
    masks, boxes = inputs.ct[:, 1:].numpy(), batch["boxes"].numpy()
    venous, delayed = PHASES.index("venous"), PHASES.index("delayed")
    assert set(np.unique(masks)) <= {0.0, 1.0}
    assert np.array_equal(masks[0, 0], filled(boxes[0, venous, 0]))  # the venous tumour box, not another phase's
    assert np.array_equal(masks[0, 2], filled(boxes[0, venous, 2]))
    assert np.array_equal(masks[0, 1], filled(boxes[0, venous, 1]))  # venous, not the non-contrast one
    assert np.array_equal(masks[1, 1], filled(boxes[1, delayed, 1]))  # no venous box: the delayed one
    assert not masks[1, 0].any() and not masks[1, 2].any()
    # the schema's level order decides the channel order
    reordered = build_inputs(
        batch, resolve_schema({"phases": ["venous"], "boxes": "channels", "box_levels": ["stomach", "tumour"]})
    )
    assert torch.equal(reordered.ct[:, 1:], inputs.ct[:, [3, 1]])


# --- build_inputs: text, table, endoscopy ---------------------------------------------------------------


def test_text_for_image_table_holds_exactly_the_abnormal_descriptors():
    batch = synthetic_batch()
    text = build_inputs(batch, PRESETS["image_table"]).text
    descriptors = batch["lab_abnormal"][0]
    assert [d.split(" ")[0] for d in descriptors] == ["Neutrophil", "Hemoglobin", "Total", "CEA", "CA19-9"]
    assert text == ["Abnormal findings: " + "; ".join(descriptors), "No abnormal laboratory findings."]
    assert build_inputs(batch, PRESETS["image_only"]).text is None


def test_text_keeps_only_the_schemas_variables():
    batch = synthetic_batch()
    only_cea = build_inputs(batch, resolve_schema({"table": "text", "table_variables": ["cea"]})).text
    assert only_cea[0] == "Abnormal findings: " + batch["lab_abnormal"][0][3]
    assert only_cea[0].startswith("Abnormal findings: CEA 12.4 ng/mL") and "CA19-9" not in only_cea[0]
    several_words = resolve_schema({"table": "text", "table_variables": ["neutrophil_ratio", "total_bilirubin"]})
    assert build_inputs(batch, several_words).text[0] == "Abnormal findings: " + "; ".join(
        batch["lab_abnormal"][0][::2][:2]
    )
    no_markers = build_inputs(batch, resolve_schema({"table": "text", "table_variables": ["wbc", "afp"]})).text
    assert no_markers == ["No abnormal laboratory findings."] * 2
    batch["lab_abnormal"][1] = ["Pathological stage IIIA 3, 2.0x above upper limit"]
    with pytest.raises(ValueError, match="names no catalogue variable"):
        build_inputs(batch, PRESETS["image_table"])


def test_input_reports_are_appended_by_kind():
    batch = synthetic_batch()
    text = build_inputs(batch, resolve_schema({"table": "text", "reports": ["ct_report", "endoscopy_report"]})).text
    assert text[0].split("\n") == [
        "Abnormal findings: " + "; ".join(batch["lab_abnormal"][0]),
        "CT report: Thickened antral wall.",
        "Endoscopy report: Ulcerated mass.",
    ]
    assert text[1].split("\n") == ["No abnormal laboratory findings.", "Endoscopy report: Normal mucosa."]
    reports_only = build_inputs(batch, resolve_schema({"reports": ["endoscopy_report"]})).text
    assert reports_only == ["Endoscopy report: Ulcerated mass.", "Endoscopy report: Normal mucosa."]


def test_numeric_table_matches_a_hand_computation_and_flags_missing_values():
    batch = synthetic_batch()
    variables = ["haemoglobin", "cea", "ca125", "age"]
    table = build_inputs(batch, resolve_schema({"table": "numeric", "table_variables": variables})).table
    assert table.shape == (2, 8) and table.dtype == torch.float32
    assert resolve_schema({"table_variables": variables}).variables() == ("age", "haemoglobin", "cea", "ca125")
    assert table[0, 2].item() == pytest.approx(math.log1p(12.4 / 5.0))
    # haemoglobin's range is sex-specific: the sex-neutral upper limit is the wider, male 175 g/L
    assert table[0, 1].item() == pytest.approx(math.log1p(92.0 / 175.0))
    assert table[:, 4:].tolist() == [[1, 0, 0, 1], [1, 0, 0, 1]]  # age and ca125 missing
    assert table[:, [0, 3]].eq(0).all()
    full = build_inputs(batch, resolve_schema({"table": "numeric"})).table
    assert full.shape == (2, 2 * N_LABS) and torch.isfinite(full).all()
    assert full[:, N_LABS:].sum(dim=1).tolist() == batch["labs_missing"].sum(dim=1).float().tolist()


def test_endoscopy_is_imagenet_normalised_and_zero_when_absent():
    batch = synthetic_batch()
    image = build_inputs(batch, resolve_schema({"endoscopy": True})).endoscopy
    rgb = batch["endoscopy"][0].float() / 255
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    assert torch.allclose(image[0], (rgb - mean) / std)
    assert image.shape == (2, 3, 8, 8) and image[1].eq(0).all()
    assert build_inputs(batch, PRESETS["image_only"]).endoscopy is None


# --- the real demo batch -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        *PRESETS,
        {"phases": ["venous", "delayed"], "endoscopy": True, "table": "numeric", "boxes": "channels"},
        {
            "table": "text",
            "reports": ["endoscopy_report"],
            "boxes": "overlay",
            "box_levels": ["lymph_nodes", "stomach"],
        },
    ],
)
def test_build_on_the_demo_batch(demo_prepared, spec):
    batch, schema = first_shard_batch(demo_prepared.shard_dir), resolve_schema(spec)
    inputs = build_inputs(batch, schema, device="cpu")
    b, shape = len(batch["case_id"]), tuple(batch["ct"].shape[2:])
    assert inputs.ct.shape == (b, input_channels(schema), *shape) and torch.isfinite(inputs.ct).all()
    assert inputs.ct.device.type == "cpu"
    if schema.table == "numeric":
        assert inputs.table.shape == (b, table_width(schema)) and torch.isfinite(inputs.table).all()
    if schema.table == "text":
        for text, descriptors in zip(inputs.text, batch["lab_abnormal"], strict=True):
            assert text.split("\n")[0] == "Abnormal findings: " + "; ".join(descriptors)  # all variables are inputs
    if schema.endoscopy:
        assert inputs.endoscopy.shape == batch["endoscopy"].shape
    if schema.boxes == "overlay":
        # the demo has tumour, node and stomach boxes: the overlay changes voxels, above the volume's range
        plain = batch["ct"][:, [PHASES.index(p) for p in schema.phases]].float()
        changed = inputs.ct != plain
        assert changed.any()
        above = inputs.ct > plain.amax(dim=(2, 3, 4), keepdim=True)
        assert torch.equal(changed, above)


def test_demo_text_keeps_only_the_schemas_variables(demo_prepared):
    batch = first_shard_batch(demo_prepared.shard_dir)
    schema = resolve_schema({"table": "text", "table_variables": ["albumin", "ca125"]})
    for text, descriptors in zip(build_inputs(batch, schema).text, batch["lab_abnormal"], strict=True):
        kept = [d for d in descriptors if d.startswith(("Albumin ", "CA125 "))]
        assert text == ("Abnormal findings: " + "; ".join(kept) if kept else "No abnormal laboratory findings.")


def test_report_kinds_have_titles():
    from gx_ray.modalities.build import REPORT_TITLES

    assert set(REPORT_TITLES) == set(REPORT_KINDS)
