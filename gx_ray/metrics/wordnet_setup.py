"""Install the WordNet 3.0 corpus that nltk's METEOR needs, without relying on nltk's download server.

Usage: ``python -m gx_ray.metrics.wordnet_setup [--target DIR] [--source DIR]``

The first that works: nothing, when nltk already finds WordNet; Debian's ``wordnet-base`` (``apt-get`` installs
it when missing and we are root) from ``/usr/share/wordnet``, plus the two files nltk's reader opens that it lacks:
``lexnames`` (from its ``lexnames(5WN)`` man page) and an empty ``index.sense`` (METEOR never reads sense keys);
else ``nltk.download("wordnet")``. The corpus goes to ``<target>/corpora/wordnet``, by default in the first folder
on nltk's search path, so nltk finds it with no further setting.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

DEBIAN_WORDNET = Path("/usr/share/wordnet")
# The 45 lexicographer files of WordNet 3.0, numbered 00-44 in this order (lexnames(5WN)).
LEXICOGRAPHER_FILES = """
adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body noun.cognition
noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive noun.object
noun.person noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation noun.shape
noun.state noun.substance noun.time verb.body verb.change verb.cognition verb.communication verb.competition
verb.consumption verb.contact verb.creation verb.emotion verb.motion verb.perception verb.possession
verb.social verb.stative verb.weather adj.ppl
""".split()  # noqa: SIM905 (as the man page lists them)
SYNTACTIC_CATEGORY = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


def wordnet_available() -> bool:
    """Whether nltk can load the WordNet corpus as things stand."""
    from nltk.corpus import wordnet

    try:
        wordnet.ensure_loaded()
    except LookupError:
        return False
    return True


def lexnames_text() -> str:
    """The ``lexnames`` file: file number, lexicographer file name and syntactic category, tab separated."""
    return "".join(
        f"{number:02d}\t{name}\t{SYNTACTIC_CATEGORY[name.split('.')[0]]}\n"
        for number, name in enumerate(LEXICOGRAPHER_FILES)
    )


def install_from_debian(source: Path, target: Path) -> Path:
    """Copy Debian's WordNet database into an nltk data folder and add the files nltk's reader expects."""
    corpus = target / "corpora" / "wordnet"
    corpus.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file():
            shutil.copy2(path, corpus / path.name)
    if not (corpus / "lexnames").exists():
        (corpus / "lexnames").write_text(lexnames_text())
    (corpus / "index.sense").touch()
    return corpus


def default_target() -> Path:
    import nltk

    return Path(nltk.data.path[0])


def _apt_install_wordnet_base() -> None:
    """``apt-get install wordnet-base`` where that is possible (Debian or Ubuntu, as root); quietly nothing else."""
    if shutil.which("apt-get") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                   "wordnet-base"]):  # fmt: skip
        if subprocess.run(command, env=environment, capture_output=True, check=False).returncode != 0:
            return


def ensure_wordnet(target: Path | None = None, source: Path = DEBIAN_WORDNET) -> bool:
    """Make WordNet loadable by nltk; True on success."""
    import nltk

    if wordnet_available():
        return True
    target = target or default_target()
    if not (source / "data.noun").exists() and source == DEBIAN_WORDNET:
        _apt_install_wordnet_base()
    if (source / "data.noun").exists():
        install_from_debian(source, target)
    else:
        nltk.download("wordnet", download_dir=str(target), quiet=True)
    if str(target) not in nltk.data.path:
        nltk.data.path.insert(0, str(target))
    return wordnet_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=None, help="nltk data folder (default: nltk's first)")
    parser.add_argument("--source", type=Path, default=DEBIAN_WORDNET, help="a WordNet 3.0 database folder")
    args = parser.parse_args(argv)
    if ensure_wordnet(args.target, args.source):
        print("WordNet is available to nltk")
        return 0
    print(
        f"could not install WordNet: install Debian's wordnet-base (database in {DEBIAN_WORDNET}) or allow "
        "nltk.download('wordnet')",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
