"""Planner tests: pure planning over graphs stored as data, no Keras.

Nothing here (nor in the tests of this folder) imports Keras or a backend:
`pytest tests/planner` runs where no backend is installed.
"""

import os

_NESTED = "GRAPHCKPT_PLANNER_NESTED_RUN"
_RUNNER = "test_no_keras.py::test_planner_tests_pass_with_no_backend_importable"


def pytest_collection_modifyitems(config, items):
    """Each planner test runs once: where the run also holds
    `test_planner_tests_pass_with_no_backend_importable`, which runs them
    all in a process where Keras and every backend fail to import, they are
    left to that run (their failures show in its output). Run on their own
    (`pytest tests/planner/test_front.py`), they run here."""
    if os.environ.get(_NESTED) or not any(item.nodeid.endswith(_RUNNER) for item in items):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    inner = [i for i in items if str(i.path).startswith(here + os.sep) and not i.nodeid.endswith(_RUNNER)
             and "test_no_keras.py" not in i.nodeid]
    if inner:
        config.hook.pytest_deselected(items=inner)
        items[:] = [i for i in items if i not in inner]
