import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Each test starts from the same seeds and the float32 policy."""
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
