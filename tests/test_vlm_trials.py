"""Trials through a vision-language model (``model.family: vlm``): the trial-config keys and what they
refuse, the CT views and prompt text a batch becomes, the scoring of written answers and option log-likelihoods, and
the ``vlm_lora`` smoke sweep end to end on the tiny LLaVA and PaliGemma models (``tests/vlm_fixtures.py``): real Ray,
a real MLflow server, LoRA training, generation, the cascade and the metrics logged."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from gx_ray.analysis.runs import load_runs
from gx_ray.metrics import classification_metrics
from gx_ray.metrics.cascade import question_prompt
from gx_ray.modalities import resolve_schema
from gx_ray.modalities.views import ViewsConfig
from gx_ray.models.lora import LoraSettings
from gx_ray.schema import PHASES
from gx_ray.train.config import TrialConfig

from .common import run_smoke_sweep
from .vlm_fixtures import FAMILIES, vlm_batch

ROOT = Path(__file__).resolve().parents[1]
VLM = {"model.family": "vlm", "vlm.name": "some/vlm"}


# --- trial config ------------------------------------------------------------------------------------------------


def test_vlm_keys_reach_the_trial_config_and_its_params_and_encoder_trials_keep_theirs():
    config = TrialConfig.from_flat(
        {**VLM, "task": "vqa", "schema": "image_table_bbox", "vlm.lora_rank": "16", "vlm.lora_targets": "q_proj,o_proj",
         "views.slices": 9, "views.mode": "mip", "views.window": [40, 350], "views.boxes": "prompt"}
    )  # fmt: skip
    lora = config.vlm.lora_settings()
    assert (lora.rank, lora.target_modules) == (16, ("q_proj", "o_proj"))
    recipe = config.views.recipe(config.schema)
    assert (recipe.slices, recipe.mode, recipe.window, recipe.boxes, recipe.centre) == (9, "mip", (40, 350), "prompt",
                                                                                       "lesion")  # fmt: skip
    assert recipe.phases == config.schema.phases
    flat = config.to_flat()
    assert flat["vlm.name"] == "some/vlm" and flat["views.slices"] == 9 and flat["model.family"] == "vlm"
    assert flat["vlm.packing"] is False and config.vlm.packing is False  # padded by default
    packed = TrialConfig.from_flat({**VLM, "task": "vqa", "vlm.packing": True})
    assert packed.vlm.packing is True and packed.to_flat()["vlm.packing"] is True
    encoder = TrialConfig.from_flat({"task": "vqa"}).to_flat()
    assert encoder["model.family"] == "encoder" and not any(k.startswith(("vlm.", "views.")) for k in encoder)
    # without a tumour box cue the views are centred on the stomach and show no box
    plain = ViewsConfig().recipe(resolve_schema("image_only"))
    assert (plain.centre, plain.boxes) == ("stomach", "off")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"task": "lesion_qa"}, "task 'lesion_qa' is not built for it"),
        ({"vlm.name": ""}, "vlm.name"),
        ({"schema.table": "numeric"}, "schema.table"),
        ({"schema": "image_bbox", "schema.boxes": "channels"}, "schema.boxes"),
        ({"schema.endoscopy": True}, "schema.endoscopy"),
        ({"views.centre": "lesion"}, "views.centre"),
        ({"views.boxes": "prompt"}, "views.boxes"),
        ({"model.family": "llm"}, "model.family"),
        ({"vlm.lora_rank": 0}, "LoRA rank"),
        ({"vlm.lora": False}, "nothing trains"),
        ({"vlm.packing": "yes"}, "vlm.packing = 'yes' is not valid: true or false"),
        ({"vlm.packing": 1}, "vlm.packing = 1 is not valid"),
    ],
    ids=["lesion-qa", "no-name", "numeric-table", "box-channels", "endoscopy", "lesion-centre-no-box",
         "box-prompt-no-box", "family", "rank", "nothing-trains", "packing-str", "packing-int"],
)  # fmt: skip
def test_a_vlm_trial_that_cannot_run_is_refused_naming_the_key(changes, named):
    with pytest.raises(ValueError) as info:
        TrialConfig.from_flat({**VLM, "task": "stage_classification", "schema": "image_only", **changes})
    assert named in str(info.value)


# --- views and prompt text ---------------------------------------------------------------------------------------


def test_a_batch_becomes_each_cases_views_and_prompt_text_as_the_recipe_and_schema_say():
    from gx_ray.tasks.vlm import case_views

    schema = resolve_schema("image_table_bbox")
    images, context = case_views(vlm_batch(), ViewsConfig(slices=5).recipe(schema), schema)
    assert [len(case) for case in images] == [len(PHASES) * 5] * 2  # every phase's five slices, phase after phase
    first, second = np.stack(images[0]), np.stack(images[1])
    red = (first[:, 0] == 1) & (first[:, 1] == 0) & (first[:, 2] == 0)
    # centred on the tumour's key slice (3): slices 1-5, of which the box (2-4) spans the middle three, in every phase
    assert red.any(axis=(1, 2)).tolist() == [False, True, True, True, False] * len(PHASES)
    assert not ((second[:, 0] == 1) & (second[:, 1] == 0)).any()  # the case without a tumour box: no box drawn
    delayed = slice(PHASES.index("delayed") * 5, PHASES.index("delayed") * 5 + 5)
    assert not first[delayed].transpose(1, 0, 2, 3)[:, ~red[delayed]].any()  # the absent phase: black but the box
    assert "CEA 12.4" in context[0] and context[1] == "No abnormal laboratory findings."

    box_in_prompt = ViewsConfig(boxes="prompt", mode="mip", slices=3, phase_layout="channels")
    three = resolve_schema({**schema.describe(), "phases": ["arterial", "venous", "delayed"]})
    images, context = case_views(vlm_batch(), box_in_prompt.recipe(three), three)
    assert [len(case) for case in images] == [1, 1]  # one RGB image: the three phases' MIPs
    assert "slices 2-4, rows 8-15, columns 8-15" in context[0] and "slices" not in context[1]


# --- scoring -----------------------------------------------------------------------------------------------------


def test_stage_answers_are_scored_by_the_cascade_and_the_option_likelihoods_give_the_auc():
    from gx_ray.tasks.vlm import STAGE_LETTERS, AnswerMetric, Item

    labels = [0, 1, 2, 3, 2]
    items = [Item(i, "q", STAGE_LETTERS[k], label=k) for i, k in enumerate(labels)]
    written = ["A", "stage II", "D", "the weather is fine", "C."]  # right, right by its text, wrong, unreadable, right
    scores = torch.log_softmax(torch.tensor(np.random.default_rng(1).normal(size=(5, 4)), dtype=torch.float32), -1)
    metric = AnswerMetric(stage=True)
    metric.update({"items": items[:3], "generated": written[:3], "option_scores": scores[:3]}, {})
    metric.update({"items": items[3:], "generated": written[3:], "option_scores": scores[3:]}, {})
    result = metric.compute()
    assert result["accuracy"] == pytest.approx(60.0) and result["parse_failure_rate"] == pytest.approx(20.0)
    reference = classification_metrics(scores.softmax(-1).numpy(), np.array(labels))
    assert result["auc"] == pytest.approx(reference["auc"]) and result["option_accuracy"] == reference["accuracy"]
    lone = AnswerMetric(stage=True)
    lone.update({"items": items[:1], "generated": written[:1], "option_scores": scores[:1]}, {})
    alone = lone.compute()
    assert math.isnan(alone["auc"])  # one stage: no AUC, and the run says so
    assert alone["option_accuracy"] == (100.0 if int(scores[0].argmax()) == labels[0] else 0.0)  # but an accuracy


def test_vqa_answers_are_scored_close_ended_with_the_accuracy_per_category():
    from gx_ray.tasks.vlm import AnswerMetric, Item

    items = [
        Item(0, question_prompt("close", "Is it?"), "yes", "Is it?", "yes_no"),
        Item(0, question_prompt("close", "Where?"), "lower third", "Where?", "localization"),
        Item(1, question_prompt("close", "Where?"), "upper third", "Where?", "localization"),
    ]
    metric = AnswerMetric()
    metric.update({"items": items, "generated": ["Yes.", "the lower third", "antrum"]}, {})
    result = metric.compute()
    assert result["accuracy"] == pytest.approx(200 / 3) and result["parse_failure_rate"] == 0.0
    assert result["accuracy_yes_no"] == 100.0 and result["accuracy_localization"] == 50.0


# --- the smoke sweep, end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_folders(tmp_path_factory) -> dict[str, str]:
    return {family: str(build(tmp_path_factory.mktemp(family))) for family, build in FAMILIES.items()}


# --- the models' weights, checked as the space loads ----------------------------------------------------------------

HUB_MODELS = ("Qwen/Qwen2-VL-2B-Instruct", "llava-hf/llava-interleave-qwen-0.5b-hf")  # the smoke preset's


def test_a_vlm_space_whose_hub_weights_are_not_here_is_refused_in_seconds_before_ray(tmp_path):
    """``python jobs/sweep.py --space vlm_lora --preset smoke`` offline with the weights not cached: each trial retried
    the hub for minutes (a six-trial sweep failed after 16). Refused as the space loads, naming every model and how to
    fetch it, before Ray or any output."""
    import subprocess
    import sys
    import time

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty cache
    env.pop("HF_HUB_CACHE", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "sweep.py"), "--space", "vlm_lora", "--preset", "smoke", "--output",
         str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    seconds = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-3000:]
    assert all(f"{name}: it is not in the Hugging Face cache" in done.stderr for name in HUB_MODELS), done.stderr
    assert "HF_HUB_OFFLINE" in done.stderr and "`hf download NAME`" in done.stderr and "vlm.name" in done.stderr
    assert not (tmp_path / "out").exists() and "Ray" not in done.stderr
    assert seconds < 60, f"{seconds:.0f} s"  # the interpreter's imports; the check itself asks nothing


def _as_cached(cache: Path, repo_id: str, folder: str) -> Path:
    """``folder`` where the Hugging Face cache keeps a downloaded ``repo_id`` (its layout: ``refs/main`` names the
    commit whose snapshot folder holds the files)."""
    import hashlib
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_vlm_weights_in_a_folder_or_in_the_cache_pass_offline_and_partial_ones_do_not(vlm_folders, tmp_path):
    """Offline (HF_HUB_OFFLINE=1, a cache of the test's own): a folder with weights and a hub name in the cache pass;
    a name not cached, a cached copy without its weights, a folder without them and a sharded copy missing a shard are
    refused, each named with why."""
    import shutil
    import subprocess
    import sys

    cache = tmp_path / "hub"
    _as_cached(cache, "gx-test/tiny-llava", vlm_folders["llava"])
    (_as_cached(cache, "gx-test/no-weights", vlm_folders["llava"]) / "model.safetensors").unlink()
    sharded = _as_cached(cache, "gx-test/sharded", vlm_folders["llava"])
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    bare = tmp_path / "bare"
    shutil.copytree(vlm_folders["paligemma"], bare, ignore=shutil.ignore_patterns("*.safetensors"))
    cases = {  # vlm.name of the smoke preset's grid → refused with (None: passes)
        (vlm_folders["llava"], vlm_folders["paligemma"]): None,
        ("gx-test/tiny-llava", vlm_folders["paligemma"]): None,
        ("gx-test/tiny-llava", "gx-test/not-here"): "gx-test/not-here: it is not in the Hugging Face cache",
        ("gx-test/no-weights",): "gx-test/no-weights: its copy in the Hugging Face cache has no weights",
        (str(bare),): f"{bare}: the folder has no weights",
        ("gx-test/sharded",): "has model.safetensors.index.json but not its shards model-00002-of-00002.safetensors",
    }
    document = yaml.safe_load((ROOT / "search_spaces" / "vlm_lora.yaml").read_text(encoding="utf-8"))
    spaces = []
    for i, names in enumerate(cases):
        document["presets"]["smoke"]["grid"]["vlm.name"] = list(names)
        spaces.append(tmp_path / f"space{i}.yaml")
        spaces[-1].write_text(yaml.safe_dump(document), encoding="utf-8")
    code = (
        "import json, sys\nfrom gx_ray.sweep.spaces import SpaceError, load_space\nfor path in sys.argv[1:]:\n"
        "    try:\n        load_space(path, ('smoke',)); print(json.dumps(None))\n"
        "    except SpaceError as err:\n        print(json.dumps(str(err)))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, *map(str, spaces)], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for (names, refused), said in zip(cases.items(), map(json.loads, done.stdout.splitlines()), strict=True):
        if refused is None:
            assert said is None, f"{names}: {said}"
        else:
            assert said is not None and refused in said and "vlm.name" in said, f"{names}: {said}"
            assert "hf download" in said and str(cache) in said, said


@pytest.mark.slow
def test_the_vlm_lora_smoke_sweep_trains_generates_and_scores_every_task_on_both_families(
    ray_cluster, demo_prepared, vlm_folders, tmp_path, mlflow_server
):
    """``python jobs/sweep.py --space vlm_lora --preset smoke`` with the space's models pointed at the tiny offline
    LLaVA and PaliGemma: every trial finishes; each task's generated answers reach MLflow scored (VQA: accuracy and the
    parse-failure rate; reports: ROUGE-L; stage: the cascade's accuracy and the option likelihoods' AUC); the LoRA
    adapters trained while every frozen weight kept its value."""
    document = yaml.safe_load((ROOT / "search_spaces" / "vlm_lora.yaml").read_text(encoding="utf-8"))
    document["presets"]["smoke"]["grid"]["vlm.name"] = sorted(vlm_folders.values())
    space = tmp_path / "vlm_lora.yaml"
    space.write_text(yaml.safe_dump(document), encoding="utf-8")
    with run_smoke_sweep(
        str(space), demo_prepared.shard_dir, tmp_path / "out", mlflow_server.uri, presets=("smoke",)
    ) as result:
        assert (result.finished, result.failed) == (6, 0)
        assert result.report is not None and "stage_classification" in result.report.read_text(encoding="utf-8")
        # the analysis tells the two models apart (its cells are per task, model and schema), not as encoder runs
        runs = load_runs(result.tracking_uri, result.sweep_id)
        assert set(runs["model"]) == {f"vlm:{folder}" for folder in vlm_folders.values()}
        client = MlflowClient(result.tracking_uri)
        runs = client.search_runs([result.experiment_id], f"tags.`gx_ray.sweep_id` = '{result.sweep_id}'")
        children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
        assert sorted((r.data.tags["task"], r.data.params["vlm.name"]) for r in children) == sorted(
            (task, folder)
            for task in ("vqa", "report_generation", "stage_classification")
            for folder in vlm_folders.values()
        )
        for run in children:
            metrics, task = run.data.metrics, run.data.tags["task"]
            assert run.info.status == "FINISHED" and run.data.params["model.family"] == "vlm"
            assert run.data.params["views.mode"] == "mip" and run.data.params["vlm.lora_rank"] == "4"
            if task == "report_generation":
                assert 0 <= metrics["test_rouge_l"] <= 100 and 0 <= metrics["val_rouge_l"] <= 100
            else:  # written answers through the cascade: every answer right, wrong or unreadable, never more
                for split in ("val", "test"):
                    accuracy, failures = metrics[f"{split}_accuracy"], metrics[f"{split}_parse_failure_rate"]
                    assert 0 <= accuracy <= 100 and 0 <= failures <= 100 and accuracy + failures <= 100
            if task == "stage_classification":  # the AUC, where the split has two stages (else NaN: said, not faked)
                assert "val_auc" in metrics and "test_auc" in metrics and "test_option_accuracy" in metrics
                assert math.isnan(metrics["test_auc"]) or 0 <= metrics["test_auc"] <= 100
                assert metrics["test_primary"] == metrics["test_auc"] or math.isnan(metrics["test_auc"])
            records = client.download_artifacts(
                run.info.run_id, "predictions/test.json", str(tmp_path / run.info.run_id)
            )
            predictions = json.loads(Path(records).read_text(encoding="utf-8"))
            assert predictions and all(isinstance(r["prediction"], str) for r in predictions)
    # each trial's checkpoint: the adapters only (the frozen weights are the model folder's), moved from their zero
    # start; tests/test_vlm.py checks that the frozen weights keep their values
    state_files = sorted((tmp_path / "out").rglob("state.pt"))
    assert len(state_files) >= 6
    for state_file in state_files:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        for weights in (state["model"], state["best"]["state"]):
            assert weights and all("lora_" in k for k in weights), state_file
            assert any(weights[k].abs().sum() > 0 for k in weights if "lora_B" in k), state_file


def test_a_packed_batch_teaches_what_the_padded_batch_teaches_with_the_same_loss_and_lora_gradients(vlm_folders):
    """``vlm.packing`` on the tiny LLaVA: a batch of three samples of different lengths, packed into one row without
    padding (position ids restarting at 0, no attention mask), gives the padded batch's mean loss over the same taught
    tokens and the same LoRA gradients (float32, eval mode: no dropout). The same row read as one sequence (with a
    cache, transformers does not look for packed samples) gives another loss: the comparison sees a leak."""
    from gx_ray.models.vlm import IGNORE, VisionLanguageModel

    vlm = VisionLanguageModel(
        vlm_folders["llava"], LoraSettings(rank=2, target_modules=("q_proj", "v_proj")), packing=True
    )
    torch.manual_seed(1)
    for name, parameter in vlm.trainable().items():  # B starts at zero: A's gradients would be zero on both sides
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)
    vlm.eval()
    rng = np.random.default_rng(0)
    images = [[rng.random((3, 32, 32)).astype(np.float32)] for _ in range(3)]
    questions = ["where?", "is the lesion in the lower third of the stomach or above it?", "stage?"]
    answers = ["the antrum", "no", "stage III, with nodes"]
    parameters = list(vlm.trainable().values())

    def taught(packed: bool):
        vlm.packing = packed
        inputs, labels = vlm._taught(images, questions, answers)
        loss = vlm.loss(images, questions, answers)
        return inputs, labels, loss, torch.autograd.grad(loss, parameters)

    padded, padded_labels, padded_loss, padded_grads = taught(False)
    packed, packed_labels, packed_loss, packed_grads = taught(True)
    lengths = padded["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) == 3 and (lengths < padded["input_ids"].shape[1]).any()  # padding to remove
    assert "attention_mask" not in packed and packed["input_ids"].shape == (1, int(lengths.sum()))
    starts = (packed["position_ids"][0] == 0).nonzero()[:, 0]
    assert starts.tolist() == [0, *lengths.cumsum(0)[:-1].tolist()]  # each sample from position 0
    assert (packed_labels[0, starts] == IGNORE).all()  # nothing predicted across a boundary
    taught_tokens = [padded["input_ids"][padded_labels != IGNORE], packed["input_ids"][packed_labels != IGNORE]]
    assert torch.equal(*taught_tokens)  # the very same tokens taught, in the same order
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    for ours, reference in zip(packed_grads, padded_grads, strict=True):
        assert reference.abs().sum() > 0
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    leaked = vlm.model(**{**packed, "use_cache": True}, labels=packed_labels).loss
    assert not torch.allclose(leaked, padded_loss, rtol=1e-3)


@pytest.mark.parametrize("family", ["paligemma", "qwen2_vl"])
def test_packing_is_refused_for_a_model_whose_attention_or_positions_a_packed_row_would_break(vlm_folders, family):
    """PaliGemma (prefix-LM attention through token_type_ids: the tiny model, loaded as a trial would) and Qwen2-VL
    (rotary positions from the images' grids: its config) are refused, naming the key and the model type."""
    from gx_ray.models.vlm import VisionLanguageModel, VLMConfig, check_packing

    if family == "paligemma":
        with pytest.raises(ValueError, match=r"vlm\.packing is not supported for model type 'paligemma'.*prefix-LM"):
            VisionLanguageModel.from_config(VLMConfig(name=vlm_folders[family], packing=True), torch.device("cpu"))
        VisionLanguageModel.from_config(VLMConfig(name=vlm_folders[family]), torch.device("cpu"))  # padded: fine
    else:
        from transformers import Qwen2VLConfig

        with pytest.raises(ValueError, match=r"vlm\.packing is not supported for model type 'qwen2_vl'.*mrope"):
            check_packing(Qwen2VLConfig())


def test_a_vlm_task_model_keeps_and_loads_what_trains_only(vlm_folders):
    """The task model's state is its trained parameters: loading it restores them exactly, and a state missing one
    or naming another parameter is refused."""
    from gx_ray.models.vlm import VisionLanguageModel
    from gx_ray.tasks import build_task
    from gx_ray.tasks.vlm import VisionLanguageTask, VisionLanguageTaskModel

    schema = resolve_schema("image_only")
    vlm = VisionLanguageModel(vlm_folders["llava"], LoraSettings(rank=2, target_modules=("q_proj", "v_proj")))
    model = VisionLanguageTaskModel(
        VisionLanguageTask(build_task("stage_classification")), vlm, ViewsConfig().recipe(schema), schema
    )
    state = model.state_dict()
    assert set(state) == {f"vlm.model.{n}" for n in vlm.trainable()} and len(state) == 4  # A and B, q and v
    changed = {k: v + 1 for k, v in state.items()}
    model.load_state_dict(changed)
    assert all(torch.equal(model.state_dict()[k], changed[k]) for k in state)
    with pytest.raises(RuntimeError, match="missing"):
        model.load_state_dict(dict(list(changed.items())[1:]))
    with pytest.raises(RuntimeError, match="unknown"):
        model.load_state_dict({**changed, "vlm.model.extra": torch.zeros(1)})


def test_a_vlm_trials_memory_plan_tells_models_and_views_apart():
    """The GPU plan (one measured step per distinct memory footprint) keys on what decides a VLM trial's memory."""
    from gx_ray.sweep.trial import gpu_plan_key

    def key(flat: dict) -> str:
        return gpu_plan_key(TrialConfig.from_flat(flat))

    base = {**VLM, "task": "vqa", "seed": 0, "data.effective_batch": 8}
    for change in ({"vlm.name": "other/vlm"}, {"vlm.lora_rank": 32}, {"views.slices": 9}, {"views.mode": "mip"}):
        assert key({**base, **change}) != key(base), change
    assert key({**base, "seed": 1}) == key(base)


# --- the paper's models (search_spaces/paper_models.yaml) -----------------------------------------------------------

PAPER_ADAPTATION = {  # vlm.name → (vlm.stack_views, vlm.plugin): the paper's CT adaptation of each
    "llava-hf/llava-1.5-7b-hf": (True, ""),
    "Salesforce/blip2-opt-2.7b": (True, ""),
    "models/llava-med-v1.5-swin3d": (False, "gx_ray.models.swin_vlm:Swin3dVLM"),
    "models/med-flamingo": (False, "gx_ray.models.flamingo:FlamingoVLM"),
    "models/medvint": (False, "gx_ray.models.medvint:MedVInTVLM"),
}


def test_the_paper_models_space_gives_each_model_the_papers_recipe_and_adaptation_on_every_task_and_schema():
    """Every cell of ``paper_models``: the paper's recipe (AdamW 5e-5, weight decay 0.01, 10 % warm-up, batch 32), each
    model's CT adaptation (LLaVA-1.5 and BLIP-2 stacked into one image, Med-Flamingo's interleaved slices through its
    plug-in), lesion detection without the tumour box it predicts; each model's preset runs that model alone, and the
    smoke preset runs the same four architectures as tiny models (``gx_ray.models.tiny_vlms``)."""
    from gx_ray.models.tiny_vlms import TINY_VLMS
    from gx_ray.sweep.spaces import available_presets, load_space

    space = load_space("paper_models", weights=False)
    assert len(space.cells()) == 5 * 4 * len(PAPER_ADAPTATION)
    for cell in space.cells():
        config = TrialConfig.from_flat(space.resolve(cell))
        stack, plugin = PAPER_ADAPTATION[cell["vlm.name"]]
        assert (config.vlm.stack_views, config.vlm.plugin) == (stack, plugin), cell
        o = config.optimiser
        assert (o.lr, o.weight_decay, config.schedule.warmup_fraction, config.data.effective_batch) == (
            5e-5, 0.01, 0.1, 32
        )  # fmt: skip
        assert config.task != "lesion_detection" or "tumour" not in config.schema.box_levels
    presets = [p for p in available_presets("paper_models") if p not in ("gpu", "smoke")]
    assert sorted({cell["vlm.name"] for p in presets for cell in load_space("paper_models", (p,), False).cells()}) == (
        sorted(PAPER_ADAPTATION)
    )
    smoke = load_space("paper_models", ("smoke",), weights=False)
    two_d = {"tiny:blip2-flan-t5", "tiny:llava-med"}  # BLIP-2's other language model, LLaVA-Med without its 3D Swin
    assert {c["vlm.name"] for c in smoke.cells()} == {f"tiny:{m}" for m in TINY_VLMS} - two_d
    assert {c["task"] for c in smoke.cells()} == {c["task"] for c in space.cells()}


def test_a_plug_in_models_folder_that_is_not_here_is_refused_before_ray_naming_it(tmp_path, monkeypatch):
    """gx-ray's plug-ins read their weights from a folder (``medvint.json`` and its parts): a space naming one that is
    not there is refused as it loads, naming the folder and the plug-in, not in every trial; once there, it loads."""
    from gx_ray.models.tiny_vlms import tiny_medvint
    from gx_ray.sweep.spaces import SpaceError, load_space

    monkeypatch.chdir(tmp_path)  # the space names models/medvint relative to where the command runs
    with pytest.raises(SpaceError, match=r"models/medvint \(the gx_ray.models.medvint:MedVInTVLM plug-in\): no such"):
        load_space("paper_models", ("medvint",))
    (tmp_path / "models").mkdir()
    tiny_medvint(tmp_path / "models" / "medvint")
    assert {c["vlm.name"] for c in load_space("paper_models", ("medvint",)).cells()} == {"models/medvint"}


@pytest.mark.slow
def test_the_paper_models_smoke_sweep_runs_each_model_and_sets_the_papers_number_for_it_beside(
    ray_cluster, demo_prepared, tmp_path, mlflow_server
):
    """``python jobs/sweep.py --space paper_models --preset smoke`` cut to retrieval and lesion detection under image
    only (the paper's setting for both): the five tiny models, built before Ray's trials ask for them, each finish
    both (retrieval through its head on the pooled states, detection as a written box, the Flamingo-style and
    MedVInT-style plug-ins among them); the report's retrieval rows put each model's cell beside the paper's number
    for that same model (the report written whole: its interval plot once failed on a mean outside its percentile
    interval)."""
    import pandas as pd

    from gx_ray.analysis.reference import load_reference

    document = yaml.safe_load((ROOT / "search_spaces" / "paper_models.yaml").read_text(encoding="utf-8"))
    smoke = document["presets"]["smoke"]["grid"]
    smoke.update(task=["retrieval", "lesion_detection"], schema=["image_only"])
    space = tmp_path / "paper_models.yaml"
    space.write_text(yaml.safe_dump(document), encoding="utf-8")
    with run_smoke_sweep(
        str(space), demo_prepared.shard_dir, tmp_path / "out", mlflow_server.uri, presets=("smoke",)
    ) as result:
        assert (result.finished, result.failed) == (10, 0)
        runs = load_runs(result.tracking_uri, result.sweep_id)
    tested = runs[runs["split"] == "test"]
    assert {(t, m) for t, m in zip(tested["task"], tested["model"], strict=True)} == {
        (task, f"vlm:{name}") for task in smoke["task"] for name in smoke["vlm.name"]
    }
    beside = pd.read_csv(next(result.report.parent.rglob("beside_paper.csv")))
    recall = beside[(beside["task"] == "retrieval") & (beside["metric"] == "image_to_text_recall_at_5")]
    paper = load_reference().query("task == 'retrieval' and metric == 'image_to_text_recall_at_5'")
    printed = dict(zip(paper["model"], paper["value"], strict=True))
    models = ("LLaVA-1.5-7B", "BLIP-2", "LLaVA-Med v1.5", "Med-Flamingo", "MedVInT")
    for name, model in zip(smoke["vlm.name"], models, strict=True):
        assert recall.set_index("model").at[f"vlm:{name}", "paper, same model"] == printed[model], name
