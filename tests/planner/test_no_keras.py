"""The planner imports no Keras, and these tests run where none imports."""

import os
import subprocess
import sys

import pytest

PLANNER_MODULES = (
    "graphckpt.planner",
    "graphckpt.planner.data",
    "graphckpt.planner.memory",
    "graphckpt.planner.search",
    "graphckpt.planner.front",
    "graphckpt.planner.budget_search",
    "graphckpt.errors",
)
BACKENDS = ("keras", "tensorflow", "jax", "torch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NESTED = "GRAPHCKPT_PLANNER_NESTED_RUN"


def test_planner_modules_import_no_keras():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PLANNER_MODULES)
        + "import graphckpt\n"
        + "graphckpt.Plan, graphckpt.GraphckptError, graphckpt.InfeasibleBudgetError\n"
        + f"bad = sorted(m for m in {BACKENDS!r} if m in sys.modules)\n"
        + "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(bool(os.environ.get(NESTED)), reason="the nested run itself")
def test_planner_tests_pass_with_no_backend_importable(tmp_path):
    """`pytest tests/planner` with Keras and every backend made unimportable
    (a package of each name that raises ImportError, first on the path)."""
    for name in BACKENDS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked for this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), **{NESTED: "1"})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/planner"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout
