"""Packaging facts a release depends on, read from the source tree."""

import ast
import os
from importlib.metadata import version

import pytest

import graphckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_one_version_source():
    project = _pyproject()
    assert "version" not in project["project"], "the version lives in graphckpt.__version__ only"
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "graphckpt.__version__"}
    # setuptools reads the attribute without importing: it must be a literal.
    with open(os.path.join(ROOT, "graphckpt", "__init__.py")) as f:
        tree = ast.parse(f.read())
    literals = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "__version__" for t in node.targets)
        and isinstance(node.value, ast.Constant)
    ]
    assert literals == [graphckpt.__version__]
    assert version("graphckpt") == graphckpt.__version__


def test_typed_package_and_license_ship():
    project = _pyproject()
    assert os.path.isfile(os.path.join(ROOT, "graphckpt", "py.typed"))
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["graphckpt"]
    assert project["project"]["license"] == "Apache-2.0"
    for name in project["project"]["license-files"]:
        assert os.path.isfile(os.path.join(ROOT, name))


def test_public_api_type_hints_resolve():
    import typing

    for name in ("checkpoint_model", "plan", "estimate", "is_checkpointed", "uncheckpoint", "register_layer_rule"):
        hints = typing.get_type_hints(getattr(graphckpt, name))
        assert "return" in hints, name


@pytest.mark.parametrize(
    "first",
    [
        "from graphckpt.estimator.peak import node_costs",
        "import graphckpt.planner",
    ],
)
def test_public_functions_outlive_submodule_imports(first):
    """`graphckpt.plan` and `graphckpt.estimate` are functions, and no
    submodule has their names (the planner is `graphckpt.planner`, the
    estimator `graphckpt.estimator.peak`): importing those first (before
    anything loads the API) leaves the functions callable."""
    import subprocess
    import sys

    code = (
        f"{first}\n"
        "import graphckpt\n"
        "assert callable(graphckpt.plan), graphckpt.plan\n"
        "assert callable(graphckpt.estimate), graphckpt.estimate\n"
        "from graphckpt.planner import Plan\n"
        "assert graphckpt.Plan is Plan\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_import_graphckpt_plays_no_import_tricks():
    """A plain package: a plain module object, and no import hook left on
    `sys.meta_path` (the lazy names are a module `__getattr__`, PEP 562)."""
    import subprocess
    import sys

    code = (
        "import sys, types\n"
        "def hooks():\n"
        "    return [f for f in sys.meta_path if type(f).__module__.startswith('graphckpt')]\n"
        "import graphckpt\n"
        "assert type(graphckpt) is types.ModuleType, type(graphckpt)\n"
        "assert not hooks(), hooks()\n"
        "graphckpt.plan\n"
        "assert not hooks() and type(graphckpt) is types.ModuleType\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _make_dry_run(target):
    """The commands `make -n -B target` would run (all of them, as on a fresh clone)."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    # --no-print-directory: under `make test` (CI) this is a sub-make, which
    # would print "Entering/Leaving directory" lines around the commands.
    proc = subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", target], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_make_demo_installs_keras_and_one_backend_only():
    """`make demo` used to install the `test` and `bench` extras (3.9 GB:
    TensorFlow, JAX, torch, keras-hub, ...) for one demo on one backend."""
    lines = _make_dry_run("demo")
    installs = [line for line in lines if " pip install " in line and "--upgrade pip" not in line]
    assert installs == [line for line in installs if '-e ".[jax]"' in line] and len(installs) == 1, installs
    assert lines[-1].endswith("KERAS_BACKEND=jax .venv/bin/graphckpt demo")
    # The demo's backend is an extra of its own, as README's install lines say.
    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["jax"] == ["jax>=0.4.36"]


def test_make_test_still_installs_everything_the_tests_need():
    lines = _make_dry_run("test")
    assert any('pip install -q -e ".[test,bench]" -c constraints-ci.txt' in line for line in lines)
    test_extra = " ".join(_pyproject()["project"]["optional-dependencies"]["test"])
    for needed in ("tensorflow", "jax", "torch", "keras-hub", "pytest", "ruff"):
        assert needed in test_extra


def test_readme_shows_an_install_line_and_its_size_for_each_backend():
    import re

    readme = open(os.path.join(ROOT, "README.md")).read()
    for extra in ("tensorflow", "jax", "torch"):
        assert extra in _pyproject()["project"]["optional-dependencies"]
        line = next((line for line in readme.splitlines() if f'pip install ".[{extra}]"' in line), None)
        assert line is not None, extra
        assert re.search(r"[0-9.]+ GB", line), line


def test_metadata_names_its_authors_and_bounds_its_dependencies():
    project = _pyproject()["project"]
    assert project["authors"] and all(a.get("name") for a in project["authors"])
    for requirement in project["dependencies"]:
        assert ">=" in requirement, f"{requirement}: no lower bound"
