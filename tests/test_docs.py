"""The documentation's rules, checked: a short README, docs that describe the product and not how it was built, links
that resolve, the README's commands the ones CI runs, every trial config key documented, a valid CITATION.cff; and
the other way round, every script, flag, preset, config key, path, ``gx_ray.*`` name, tag and metric a page names
exists in the code.

Each check reports the file and line that breaks it. ``docs/lab/`` is the lab notebook: dated runs and history
belong there, so the word list skips it (its links are still checked).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import importlib
import importlib.util
import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import yaml

from tests.common import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
LAB = DOCS / "lab"
CI = ROOT / ".ci" / "run"
CONFIG_DOC = DOCS / "reference" / "config.md"
GETTING_STARTED = DOCS / "getting-started.md"
CFF_SCHEMA = Path(__file__).parent / "data" / "cff" / "schema-1.2.0.json.gz"

README_MAX_LINES = 150
SETUP = 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m gx_ray.metrics.wordnet_setup'
MAIN_JOB = "python jobs/sweep.py --space modality_ablation"
TESTS = "pytest"
MAIN_JOB_TIMES = ("68 min", "6.9 min")
"""The main job's measured time on 2 CPU cores and on a 16-core machine: stated alike wherever it is stated."""

FORBIDDEN: dict[str, str] = {
    r"\bsessions?\b": "a 'session' is how the project was built, not what it does",
    r"\blease[sd]?\b": "GPU machines' leases are the project's history",
    r"\bdevice time\b": "device time is the project's history",
    r"\bwork periods?\b": "numbered work periods are the project's history",
    r"\bloans?\b|\blent\b": "loans of GPU machines are the project's history",
    r"(?-i:DESIGN)\.md": "DESIGN.md is not in the repository (the architecture is docs/design.md)",
    r"\.\./shared|/work/shared": "shared/ is not part of the repository",
    r"(?<![\w.\-/])#\d+\b": "this project's issue numbers are its history (an upstream owner/repo#N is fine)",
    r"\bissues? \d+\b|\b(?:the|this|next|open) issue\b": "this project's issues are its history",
    r"\bthis change\b": "a before/after narrative belongs in docs/lab/",
    r"\b20\d\d-[01]\d-[0-3]\d\b": "dated runs belong in docs/lab/",
}
"""Pattern → why it may not appear in README.md or docs/ outside docs/lab/ (case-insensitive)."""
CODE_SPAN_EXEMPT = (r"(?<![\w.\-/])#\d+\b",)
"""Patterns not looked for inside `code spans`: a run name such as `stage img+tab+box s0 #15` holds a trial counter."""

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of a Markdown file, fenced code blocks left out."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def doc_files(include_lab: bool) -> list[Path]:
    files = [README, *sorted(DOCS.rglob("*.md"))]
    return [f for f in files if include_lab or LAB not in f.parents]


def rel(path: Path) -> str:
    """The path as a message names it: relative to the repository, or as given for a file outside it."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path):
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


# --- the README -----------------------------------------------------------------------------------------------------


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the detail to a page under docs/"
    )


def readme_quick_start() -> list[str]:
    """The commands of the README's first fenced block under '## Quick start', comments stripped."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)
    assert len(section) == 2, "README.md has no '## Quick start' section"
    block = re.search(r"```(?:bash)?\n(.*?)```", section[1], re.S)
    assert block, "README.md's quick start has no fenced block of commands"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.split("#", 1)[0].strip()]


def ci_commands() -> list[str]:
    """``.ci/run``'s commands, ``python -m pip install --quiet X`` read as ``pip install X``, ``python -m pytest`` as
    ``pytest``: the forms a reader types."""
    commands = []
    for line in CI.read_text(encoding="utf-8").splitlines():
        command = line.split(" #", 1)[0].strip()
        if not command or command.startswith("#"):
            continue
        command = re.sub(r"^python -m pip install (--quiet |-q )?", "pip install ", command)
        commands.append(re.sub(r"^python -m pytest\b", "pytest", command))
    return commands


def test_readme_commands_are_the_ones_ci_and_getting_started_use():
    assert readme_quick_start() == [SETUP, MAIN_JOB, TESTS], (
        f"README.md's quick start should be exactly the set-up, main job and test commands: {readme_quick_start()}"
    )
    ci = ci_commands()
    for part in [p.strip() for p in SETUP.split("&&")] + [TESTS]:
        assert part in ci, f"README.md's {part!r} is not what .ci/run runs ({CI}): {ci}"
    guide = GETTING_STARTED.read_text(encoding="utf-8")
    for command in (SETUP, MAIN_JOB):
        assert command in guide, f"{rel(GETTING_STARTED)} does not give the README's command {command!r}"
    space = MAIN_JOB.split("--space ", 1)[1].split()[0]
    assert (ROOT / "search_spaces" / f"{space}.yaml").is_file(), f"the main job's space {space!r} does not exist"


def test_main_job_time_is_stated_alike():
    for path in (README, GETTING_STARTED, DOCS / "benchmarks.md"):
        text = path.read_text(encoding="utf-8")
        for figure in MAIN_JOB_TIMES:
            assert figure in text, f"{rel(path)} does not state the main job's time {figure!r}"


# --- what the docs may say ------------------------------------------------------------------------------------------


def forbidden_words(path: Path) -> list[str]:
    found = []
    for number, line in prose_lines(path):
        without_code = CODE_SPAN.sub("", line)
        for pattern, why in FORBIDDEN.items():
            text = without_code if pattern in CODE_SPAN_EXEMPT else line
            match = re.search(pattern, text, re.IGNORECASE)
            if match:
                found.append(f"{rel(path)}:{number}: {match.group(0)!r}: {why}")
    return found


@pytest.mark.parametrize("path", doc_files(include_lab=False), ids=rel)
def test_docs_describe_the_product_not_its_history(path: Path):
    found = forbidden_words(path)
    assert not found, "\n".join(found)


def test_the_word_list_catches_what_it_names(tmp_path: Path):
    """Each pattern fires on a sentence written as the history was, and not on the product's own words."""
    caught = [
        "In the fifth session we measured",
        "the device lease gave a one-card host",
        "device time ran out",
        "work period 3",
        "a GPU machine was lent",
        "see DESIGN.md",
        "read ../shared/seeds",
        "fixed in #11",
        "the issue's figures",
        "before this change",
        "run on 2026-11-27",
    ]
    allowed = [
        "getmoto/moto#10055 answers malformed uploads",
        "Ray's release notes",
        "please resume",
        "the sweep's own server",
        "run names such as `stage img s0 #15`",
        "data.in_memory",
    ]
    page = tmp_path / "page.md"
    for sentence in caught:
        page.write_text(sentence + "\n", encoding="utf-8")
        assert forbidden_words(page), f"the word list misses {sentence!r}"
    for sentence in allowed:
        page.write_text(sentence + "\n", encoding="utf-8")
        assert not forbidden_words(page), f"the word list refuses {sentence!r}: {forbidden_words(page)}"


# --- links ----------------------------------------------------------------------------------------------------------


def broken_links(path: Path) -> list[str]:
    broken = []
    for number, line in prose_lines(path):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{rel(path)}:{number}: {target}"
            if not resolved.exists():
                broken.append(f"{where}: no such file")
                continue
            if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where}: no heading #{anchor} in {rel(resolved)}")
    return broken


@pytest.mark.parametrize("path", [*doc_files(include_lab=True), ROOT / "jobs" / "cluster" / "README.md"], ids=rel)
def test_relative_links_resolve(path: Path):
    broken = broken_links(path)
    assert not broken, "\n".join(broken)


def test_link_check_sees_a_missing_file_and_heading(tmp_path: Path):
    """The check itself: links to a missing file or a missing heading are reported with their line; links to a file,
    its heading, a heading of the page itself, a web address, and links inside code are not."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: here\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n[ok](other.md) [ok](other.md#a-code-heading-here) [ok](#page) [ok](https://example.org/x.md)\n"
        "[gone](no-such-page.md)\n"
        "[gone](other.md#no-such-heading)\n"
        "`[not a link](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    broken = broken_links(page)
    assert [b.split(": ", 2)[0].rsplit(":", 1)[1] for b in broken] == ["3", "4"], broken


def test_anchors_follow_githubs_rules():
    assert slug("Interruptions, faults and `--resume`") == "interruptions-faults-and---resume"
    assert slug("`vlm.*`: a vision-language model") == "vlm-a-vision-language-model"
    assert slug("The main command's aims") == "the-main-commands-aims"


# --- commands --------------------------------------------------------------------------------------------------------


def documented_commands() -> list[tuple[str, int, str, list[str]]]:
    """``(file, line, script, arguments)`` of every ``python jobs/<script>.py …`` in a fenced block of README.md and
    docs/ (outside docs/lab/): continuations joined, ``# comments`` and ``[optional parts]`` dropped."""
    found = []
    for path in doc_files(include_lab=False):
        lines, fenced = path.read_text(encoding="utf-8").splitlines(), False
        for number, line in enumerate(lines, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if not fenced or not line.lstrip().startswith("python jobs/"):
                continue
            command, follow = line, number
            while command.rstrip().endswith("\\"):
                command = command.rstrip()[:-1] + " " + lines[follow].split(" #", 1)[0]
                follow += 1
            command = re.sub(r"\[[^\]]*\]", " ", command.split(" #", 1)[0])
            script, *arguments = shlex.split(command)[1:]
            found.append((rel(path), number, Path(script).stem, arguments))
    return found


def load_script(name: str, folder: str = "jobs"):
    spec = importlib.util.spec_from_file_location(f"gx_docs_{name}", ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_documented_commands_parse(monkeypatch: pytest.MonkeyPatch):
    """Every command the docs show goes through its script's own argument parser (the work itself replaced by a
    recorder); a sweep's space and presets exist; a benchmark's or check's subcommand and options are the script's."""
    from gx_ray.sweep.spaces import available_presets

    commands = documented_commands()
    assert {script for *_, script, _ in commands} >= {"sweep", "prepare_data", "benchmark", "validate"}
    sweep, prepare = load_script("sweep"), load_script("prepare_data")
    seen: list = []
    done = SimpleNamespace(output=Path("sweep-id"), interrupted=False, finished=1, mlflow_error=None)
    monkeypatch.setattr(sweep, "run_sweep", lambda options: seen.append(options) or done)
    monkeypatch.setattr(prepare, "prepare_data", lambda *a: seen.append(a) or SimpleNamespace(summary=lambda: ""))
    for where, number, script, argv in commands:
        at = f"{where}:{number}: python jobs/{script}.py {shlex.join(argv)}"
        if script in ("sweep", "prepare_data"):
            try:
                status = (sweep if script == "sweep" else prepare).main(list(argv))
            except SystemExit as err:
                pytest.fail(f"{at}: refused by its parser (exit {err.code})")
            assert status == 0, at
            if script == "sweep":
                options = seen[-1]
                missing = set(options.presets) - set(available_presets(options.space))
                assert not missing, f"{at}: space {options.space!r} has no preset {sorted(missing)}"
            continue
        assert script in ("benchmark", "validate", "plan", "finalize", "predict"), f"{at}: an unknown script"
        try:
            load_script(script).build_parser().parse_args(list(argv))
        except SystemExit as err:
            pytest.fail(f"{at}: refused by its parser (exit {err.code})")


# --- the config reference and the citation --------------------------------------------------------------------------


def test_every_trial_config_key_is_documented():
    from gx_ray.train.config import valid_keys

    documented = set(re.findall(r"`([^`\s]+)`", CONFIG_DOC.read_text(encoding="utf-8")))
    missing = [key for key in valid_keys() if key not in documented]
    assert not missing, f"{rel(CONFIG_DOC)} does not document the trial config keys {missing}"


def load_cff(path: Path) -> dict:
    """CITATION.cff as the CFF schema reads it: YAML timestamps (``date-released``) kept as strings."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("tag:yaml.org,2002:timestamp", Loader.construct_yaml_str)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)


def test_citation_file_is_valid_cff():
    schema = json.loads(gzip.decompress(CFF_SCHEMA.read_bytes()))
    citation = load_cff(ROOT / "CITATION.cff")
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(citation), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"CITATION.cff: {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert version and citation["version"] == version.group(1), "CITATION.cff's version is not pyproject.toml's"
    paper = citation["references"][0]
    assert "2603.19516" in json.dumps(paper) and paper["title"].startswith("Gastric-X"), paper
    assert [a["family-names"] for a in paper["authors"]] == ["Lu", "Chen", "Yin", "Ba", "Zhang", "Li"]


def test_cff_schema_refuses_a_broken_citation():
    schema = json.loads(gzip.decompress(CFF_SCHEMA.read_bytes()))
    citation = load_cff(ROOT / "CITATION.cff")
    for broken in (
        {**citation, "cff-version": "1.2"},
        {k: v for k, v in citation.items() if k != "authors"},
        {**citation, "references": [{"title": "no type, no authors"}]},
    ):
        assert list(jsonschema.Draft7Validator(schema).iter_errors(broken)), broken


# --- what the pages name exists --------------------------------------------------------------------------------------

OTHER_TOOLS = {
    "--env-manager": "mlflow models serve's",
    "--dist": "pytest-xdist's, in tests/README.md",
    "--no-loadscope-reorder": "pytest-xdist's",
    "--host": "mlflow models serve's and optuna-dashboard's",
    "--port": "mlflow models serve's and optuna-dashboard's",
}
"""Flags of other tools' commands that pages name: not gx-ray's, so no parser of ours holds them."""
SECTIONS = ("schema", "model", "optimiser", "schedule", "data", "resources", "vlm", "views", "task_options", "cv",
            "pbt", "bohb", "budget", "analysis")  # fmt: skip
COMMAND = re.compile(r"python (?:-m (gx_ray(?:\.\w+)+)|((?:jobs|analysis)/\w+\.py))((?:\s+[^\s|;&]+)*)")
ROOTS = r"(?:gx_ray|jobs|docs|search_spaces|tests|analysis|benchmarks)/"
PATH = re.compile(rf"(?<![\w./<>-])({ROOTS}[^\s`'\"),:;]*)")
KEY = re.compile(rf"(?<![\w./<>-])((?:{'|'.join(SECTIONS)})(?:\.(?:\w+|\*|<\w+>))+)(?![\w/(-])")
DOTTED = re.compile(r"(?<![\w./<>-])((?:gx_ray|tests)(?:\.(?:\w+|\*|<\w+>))+)")
PRESET = re.compile(r"--preset[ =](?!name\b)(\w+)|`(\w+)` presets?\b|\bpresets? `(\w+)`")
METRIC = re.compile(r"^(?:val|test|best_val)_(\w+)$")


def script_flags(script: str) -> set[str]:
    """Every option of ``script``'s parser (``jobs/X.py``, ``analysis/report.py`` or ``gx_ray.M``) and of its
    subcommands: the parser its ``build_parser()`` returns, or the one its ``main`` builds, caught as it parses."""
    import argparse

    folder, _, name = script.removesuffix(".py").rpartition("/")
    module = importlib.import_module(script) if script.startswith("gx_ray") else load_script(name, folder)

    class Caught(Exception):
        pass

    def catch(parser, *args, **kwargs):
        raise Caught(parser)

    parsers, flags = [], set()
    if hasattr(module, "build_parser"):
        parsers.append(module.build_parser())
    else:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(argparse.ArgumentParser, "parse_args", catch)
            with pytest.raises(Caught) as caught:
                module.main([])
        parsers.append(caught.value.args[0])
    while parsers:
        for action in parsers.pop()._actions:
            flags |= set(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
                flags |= {f"command {name}" for name in action.choices}
    return flags


@functools.cache
def code_index() -> SimpleNamespace:
    """What the pages may name: each script's flags, the presets, config keys, task options, the string literals and
    class members of gx_ray/ (tags and metric names are literals there)."""
    from gx_ray.data.preprocess import _PRESETS
    from gx_ray.schema import TASKS
    from gx_ray.sweep.spaces import ANALYSIS_KEYS, CV_KEYS, SCHEDULER_OPTIONS, available_presets
    from gx_ray.tasks import task_class
    from gx_ray.train.config import RETIRED_KEYS, valid_keys

    scripts = ["analysis/report.py", "gx_ray.preemption", *(f"jobs/{p.name}" for p in (ROOT / "jobs").glob("*.py"))]
    flags = {script: script_flags(script) for script in scripts}
    presets = {p.stem: set(available_presets(str(p))) for p in (ROOT / "search_spaces").glob("*.yaml")}
    classes = [task_class(t) for t in TASKS]
    options = {f.name for c in classes if dataclasses.is_dataclass(c) for f in dataclasses.fields(c)}
    keys = {*valid_keys(), *RETIRED_KEYS, *(f"task_options.{o}" for o in options), *(f"cv.{k}" for k in CV_KEYS)}
    keys |= {f"analysis.{k}" for k in ANALYSIS_KEYS} | {"budget.samples", "budget.time_s"}
    keys |= {f"{s}.{k}" for s, o in SCHEDULER_OPTIONS.items() for k in o}
    literals, members = set(), {}
    for path in (ROOT / "gx_ray").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.add(node.value)
            elif isinstance(node, ast.ClassDef):
                body = [n.target if isinstance(n, ast.AnnAssign) else n for n in node.body]
                members.setdefault(node.name, set()).update(getattr(n, "name", getattr(n, "id", "")) for n in body)
    return SimpleNamespace(flags=flags, all_flags=set().union(*flags.values()), presets=presets,
                           prepare_presets=set(_PRESETS), keys=keys, literals=literals, members=members)  # fmt: skip


def python_name_exists(name: str) -> bool:
    """``gx_ray.x.y``: a module, or an attribute of the longest importable module before it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            fields = getattr(target, "__dataclass_fields__", {})
            if not hasattr(target, part) and part not in fields:
                return False
            target = getattr(target, part, None)
        return True
    return False


def composed(name: str) -> bool:
    """``name`` is a string literal of gx_ray/, or an f-string's literal head (``gx_ray.in_memory.``, ``val_``)
    followed by one: the names of the tags and metrics the code sets."""
    literals = code_index().literals
    return name in literals or any(
        len(head) > 2 and head[-1] in "._" and name.startswith(head) and composed(name[len(head) :])
        for head in literals
    )


def unknown_names(text: str, code: bool) -> list[str]:
    """What ``text`` (a code span or a fenced line, ``code``; else a prose line) names that the code does not hold."""
    index, found = code_index(), []
    for match in PRESET.finditer(text):
        name = next(filter(None, match.groups()))
        if name not in set().union(*index.presets.values(), index.prepare_presets):
            found.append(f"preset {name!r}: no space has it")
    if not code:
        return found
    for module, script, arguments in COMMAND.findall(text):
        script = script or module
        if script not in index.flags:
            found += [] if module and python_name_exists(module) else [f"{script}: no such script"]
            continue
        words = arguments.split(" ray ", 1)[0].split()
        found += [f"{script} has no option {w.split('=')[0]}" for w in words
                  if w.startswith("--") and w.split("=")[0] not in index.flags[script]]  # fmt: skip
        command = f"command {next((w for w in words if w[0] != '-'), '').rstrip('):,;.')}"  # where the script has them
        if any(f.startswith("command ") for f in index.flags[script]) and command not in index.flags[script]:
            found += [] if re.match(r"command ([<.…]|$)", command) else [f"{script} has no {command!r}"]
        pairs = list(zip(words, words[1:], strict=False))
        space = next((b for a, b in pairs if a == "--space"), None)
        for preset in (b for a, b in pairs if a == "--preset"):
            if script == "jobs/sweep.py" and space in index.presets and preset not in index.presets[space]:
                found.append(f"space {space!r} has no preset {preset!r}")
    if not COMMAND.search(text):
        found += [f"no script has the option {f}" for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", text)
                  if f not in index.all_flags and f not in OTHER_TOOLS]  # fmt: skip
    for path in PATH.findall(text):
        pattern = re.sub(r"\{([^,}]*)[^}]*\}", r"\1", re.sub(r"<[^>]*>|…|\.\.\.$", "*", path.rstrip(".")))
        if not list(ROOT.glob(pattern)) and not (ROOT / pattern).exists():
            found.append(f"{path}: no such path")
    for key in KEY.findall(text):
        wildcard = key.endswith(("*", ">")) and any(k.startswith(key.split(".")[0]) for k in index.keys)
        # a PBT trial logs its changed keys as metrics schedule.<key>
        if key not in index.keys and key.removeprefix("schedule.") not in index.keys and not wildcard:
            found.append(f"{key}: not a config key")
    for name in (re.sub(r"<\w+>", "*", n) for n in DOTTED.findall(text)):
        tag = composed(name) or (name.endswith("*") and any(s.startswith(name[:-1]) for s in index.literals))
        if not tag and not python_name_exists(name.removesuffix(".*")):
            found.append(f"{name}: neither a tag the code sets nor a Python name")
    span = text.strip()
    if re.fullmatch(r"[\w/]+\.py", span) and not any(ROOT.glob(f"**/{span}")):
        found.append(f"{span}: no such file")
    member = re.fullmatch(r"([A-Z]\w+)\.(\w+)\b.*", span)
    if member and member.group(1) in index.members and member.group(2) not in index.members[member.group(1)]:
        found.append(f"{span}: {member.group(1)} has no {member.group(2)}")
    metric = METRIC.match(span)
    if metric and not composed(span) and not composed(metric.group(1)):
        found.append(f"{span}: no metric of that name is logged")
    return found


def page_problems(path: Path) -> list[str]:
    """Every name a page gives, in prose, in `code` and in fenced blocks, that does not exist: each as file:line."""
    lines, fenced, problems, joined = path.read_text(encoding="utf-8").splitlines(), False, [], 0
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            fenced = not fenced
        if FENCE.match(line) or number <= joined:  # a fence, or a line joined to the command it continues
            continue
        while fenced and line.rstrip().endswith("\\") and number < len(lines):
            line, number = line.rstrip()[:-1] + " " + lines[number], number + 1
        joined = number
        texts = [(line, True)] if fenced else [(line, False), *((s[1:-1], True) for s in CODE_SPAN.findall(line))]
        problems += [f"{rel(path)}:{number}: {p}" for text, code in texts for p in unknown_names(text, code)]
    return problems


@pytest.mark.parametrize("path", [*doc_files(include_lab=False), ROOT / "tests" / "README.md"], ids=rel)
def test_what_the_pages_name_exists(path: Path):
    problems = page_problems(path)
    assert not problems, "\n".join(problems)


def test_what_the_spaces_comments_name_exists():
    """The search spaces explain themselves in comments, which name commands, keys, paths and presets as pages do."""
    problems = [
        f"{rel(path)}:{number}: {problem}"
        for path in sorted((ROOT / "search_spaces").glob("*.yaml"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for problem in unknown_names(line.partition("#")[2], code=True)
    ]
    assert not problems, "\n".join(problems)


def test_the_name_check_catches_what_does_not_exist(tmp_path: Path):
    """Each line of the fake page names one thing the code lacks, and is reported; the real names beside are not."""
    page = tmp_path / "page.md"
    caught = [
        "`python jobs/sweep.py --space fusion --no-such-flag`",
        "`python jobs/sweep.py --space fusion --preset slice`",
        "`python jobs/no_such_job.py`",
        "`python jobs/validate.py no-such-check`",
        "```\npython analysis/report.py --sweep X \\\n  --no-such-flag\n```",
        "set `--no-such-flag`",
        "the `no_such` preset",
        "`model.no_such_key: 1`",
        "`task_options.no_such_option`",
        "`gx_ray/no_such_module.py`",
        "`no_such_module.py`",
        "`gx_ray.sweep.spaces.no_such_function`",
        "the tag `gx_ray.no_such_tag_name`",
        "the tags `gx_ray.no_such_prefix.<package>`",
        "`val_no_such_metric_name`",
        "`Task.no_such_method`",
    ]
    for text in caught:
        page.write_text(text + "\n", encoding="utf-8")
        assert page_problems(page), f"the name check misses {text!r}"
    page.write_text(
        "`python jobs/sweep.py --space modality_ablation --preset slice --resume` the `cv` preset, `--share W`\n"
        "`model.text_kwargs` `schedule.optimiser.lr` `task_options.tnm_heads` `cv.folds` `gx_ray/sweep/driver.py`\n"
        "`gx_ray.sweep.spaces.load_space` `gx_ray.python` `gx_ray.version.<package>` `gx_ray.in_memory.train`\n"
        "`Task.combine` `val_auc` `test_primary` `best_val_primary` `mlflow models serve --env-manager local`\n",
        encoding="utf-8",
    )
    assert not page_problems(page), page_problems(page)
