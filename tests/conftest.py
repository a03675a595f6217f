import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pathlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# tests/planner runs without Keras (a backend need not be installed there).
_PLANNER_TESTS = pathlib.Path(__file__).parent / "planner"


@pytest.fixture(autouse=True)
def _fresh_keras_state(request):
    """Each test starts from the same seeds and the float32 policy."""
    if _PLANNER_TESTS in pathlib.Path(str(request.fspath)).parents:
        yield
        return
    import keras

    keras.utils.set_random_seed(1234)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def installed():
    """The fit flag installed for the test, removed after it."""
    import graphckpt

    graphckpt.install()
    yield
    graphckpt.uninstall()
