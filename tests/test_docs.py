"""Every Python code block in README.md and docs/*.md runs, and every
relative link between the docs resolves.

The Python blocks of one file run in order, in one fresh interpreter (so a
block may use names from the blocks above it), in an empty working
directory. Shell blocks hold `make` targets and `graphckpt` commands: `make
test` is what CI itself runs, and the CLI commands are run by
tests/test_cli.py.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"```(\w+)[^\n]*\n(.*?)```", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(path):
    return [code for lang, code in FENCE.findall(path.read_text()) if lang == "python" and ">>>" not in code]


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path):
    script = "\n\n".join(python_blocks(path))
    env = dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow"), TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{path.name}:\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("#") or target.startswith("mailto:"):
            continue
        file_part = target.split("#")[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{path.name} links to missing files: {broken}"


def test_makefile_targets_named_in_readme_exist():
    makefile = (ROOT / "Makefile").read_text()
    readme = (ROOT / "README.md").read_text()
    for target in set(re.findall(r"^make (\w[\w-]*)", readme, re.M)):
        assert re.search(rf"^{target}:", makefile, re.M), f"make {target} is not a Makefile target"
    assert "graphckpt demo" in makefile


SOURCE_PATH = re.compile(r"\b((?:graphckpt|tests|benchmarks)/[\w/]+\.py)\b")


@pytest.mark.parametrize("path", DOCS + sorted((ROOT / "benchmarks").glob("*.md")), ids=lambda p: p.name)
def test_source_files_named_in_the_docs_exist(path):
    """A doc that names `graphckpt/x.py` (or a test, a benchmark) names a
    file that is there: modules move in refactors, the docs must follow."""
    named = set(SOURCE_PATH.findall(path.read_text()))
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


DOTTED = re.compile(r"`(graphckpt(?:\.[A-Za-z_]\w*)+)")


def _resolves(dotted):
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            found = getattr(found, part, None)
            if found is None:
                return False
        return True
    return False


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_graphckpt_names_in_the_docs_exist(path):
    """`graphckpt.remat.jax_remat` and the like, as the docs write them,
    name something there (a refactor moved `graphckpt.segment._remat`)."""
    named = set(DOTTED.findall(path.read_text()))
    assert sorted(n for n in named if not _resolves(n)) == []
