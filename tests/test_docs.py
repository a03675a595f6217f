"""Every Python code block in README.md and docs/*.md runs alone and prints
what the doc shows, the `graphckpt inspect` commands the docs show print
what they show, and every relative link between the docs resolves.

The Python blocks of one page run in order in one interpreter, each in a
fresh namespace and Keras session (a block that uses a name must define or
import it, as it would in a new file; layer names count from 0 again), in one empty working directory per page (a block may
read the `.keras` file an earlier block of the page saved, as the page
tells its reader to). What a block prints (stdout, stderr and warnings,
written `Category: message`) must be the text of the block right after it
when that block's info string is `text output`, and nothing otherwise.
Shell blocks hold `make` targets and `graphckpt` commands: `make test` is
what CI itself runs; `inspect` and `--help`, whose output is exact, are run
here on the page's own files at 80 columns (`measure` and `demo` print
timings: tests/test_cli.py runs them).
"""

import functools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"```(\w+)([^\n]*)\n(.*?)```", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

# Runs blocks (a JSON list of source strings) as the docstring says, and
# writes what each printed, or the error it raised, as JSON.
_RUNNER = """
import contextlib, io, json, sys, traceback, warnings
blocks = json.load(open(sys.argv[1]))
results = []
def show(message, category, filename, lineno, file=None, line=None):
    print(f"{category.__name__}: {message}", file=sys.stderr)
warnings.showwarning = show
for code in blocks:
    if "keras" in sys.modules:  # names (`dense_3`) count from 0 again, as in a new process
        sys.modules["keras"].backend.clear_session()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(code, "<doc block>", "exec"), {"__name__": "__main__"})
            error = None
        except BaseException:
            error = traceback.format_exc()
    results.append({"output": out.getvalue(), "error": error})
    if error:
        break
json.dump(results, open(sys.argv[2], "w"))
"""


def blocks_of(path):
    """`(language, info, code)` for each fenced block of `path`, in order."""
    return [(lang, info.strip(), code) for lang, info, code in FENCE.findall(path.read_text())]


def python_blocks(path):
    """`(code, expected output)` for each Python block `path` runs."""
    blocks = blocks_of(path)
    found = []
    for i, (lang, _, code) in enumerate(blocks):
        if lang != "python" or ">>>" in code:
            continue
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        shown = following[2] if following and following[:2] == ("text", "output") else ""
        found.append((code, shown))
    return found


def _env():
    env = dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow"), TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(COLUMNS="80", PYTHONUNBUFFERED="1")
    return env


@functools.cache
def _ran(path, workdir):
    """Runs `path`'s Python blocks in `workdir`; their results, in order."""
    blocks = python_blocks(path)
    source, results = pathlib.Path(workdir) / ".blocks.json", pathlib.Path(workdir) / ".results.json"
    source.write_text(json.dumps([code for code, _ in blocks]))
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, source.name, results.name],
        cwd=workdir, env=_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(results.read_text())


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    return {path: str(tmp_path_factory.mktemp(path.stem)) for path in DOCS}


def _lines(text):
    return [line.rstrip() for line in text.strip("\n").splitlines()]


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run_alone_and_print_what_is_shown(path, workdirs):
    blocks = python_blocks(path)
    for i, ((code, shown), result) in enumerate(zip(blocks, _ran(path, workdirs[path]))):
        first = code.strip().splitlines()[0]
        assert result["error"] is None, f"{path.name}, block {i + 1} ({first}):\n{result['error'][-3000:]}"
        assert _lines(result["output"]) == _lines(shown), f"{path.name}, block {i + 1} ({first}) printed:\n{result['output']}"
    assert len(_ran(path, workdirs[path])) == len(blocks)


def console_commands(path):
    """`(argv, shown output)` for each `$ graphckpt inspect ...` and `$
    graphckpt --help` of `path`'s console blocks."""
    found = []
    for lang, _, code in blocks_of(path):
        if lang != "console":
            continue
        for command in re.split(r"^\$ ", code, flags=re.M)[1:]:
            line, _, shown = command.partition("\n")
            argv = shlex.split(line)
            if argv[:2] in (["graphckpt", "inspect"], ["graphckpt", "--help"]):
                found.append((argv, shown))
    return found


@pytest.mark.parametrize("path", [p for p in DOCS if console_commands(p)], ids=lambda p: p.name)
def test_inspect_output_shown_is_the_output(path, workdirs):
    """Run on the files the page's Python blocks saved (a command on a file
    the page does not make, such as an error case's, is left to
    tests/test_cli.py)."""
    workdir = workdirs[path]
    if python_blocks(path):
        _ran(path, workdir)
    checked = 0
    for argv, shown in console_commands(path):
        if argv[1] == "inspect" and not (pathlib.Path(workdir) / argv[2]).exists():
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "graphckpt", *argv[1:]],
            cwd=workdir, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
        )
        assert _lines(proc.stdout) == _lines(shown), f"{path.name}: $ {shlex.join(argv)}\n{proc.stdout}"
        checked += 1
    assert checked, f"{path.name}: no command was run"


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


@pytest.mark.parametrize("path", DOCS + sorted((ROOT / "benchmarks").rglob("*.md")), ids=lambda p: p.name)
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
    """`graphckpt.runtime.remat_jax.jax_remat` and the like, as the docs write them,
    name something there (a refactor moved `graphckpt.runtime.segment._remat`)."""
    named = set(DOTTED.findall(path.read_text()))
    assert sorted(n for n in named if not _resolves(n)) == []
