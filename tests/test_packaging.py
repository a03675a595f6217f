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
        "from graphckpt.estimate import node_costs",
        "import graphckpt.plan",
    ],
)
def test_public_functions_outlive_submodule_imports(first):
    """`graphckpt.plan` and `graphckpt.estimate` name both a submodule and
    a public function: importing the submodule first (before anything loads
    the API) must leave the functions callable."""
    import subprocess
    import sys

    code = (
        f"{first}\n"
        "import graphckpt\n"
        "assert callable(graphckpt.plan), graphckpt.plan\n"
        "assert callable(graphckpt.estimate), graphckpt.estimate\n"
        "from graphckpt.plan import Plan\n"
        "assert graphckpt.Plan is Plan\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
