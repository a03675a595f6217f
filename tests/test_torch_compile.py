"""PyTorch under `compile(jit_compile=True)` (`torch.compile`): the fit flag
trains as plain `fit` does, Dropout included, once both draw their random
numbers from the same generator.

Dynamo does not trace graphckpt's segments into the compiled graph (a
checkpoint whose forward advances a seed generator is an "unsafe side
effect" for its checkpoint operator), so each segment runs as eager
PyTorch inside the compiled step. Inductor's compiled random ops use a
generator of their own, unless `torch._inductor.config.fallback_random` is
set: so with Dropout in a segment, the flagged run draws the masks eager
`fit` draws, and the plain compiled run other ones (docs/limitations.md).
"""

import keras
import numpy as np
import pytest
from keras import layers

from tests.helpers import BACKEND
from tests.test_fit_flag import segments_of

pytestmark = [
    pytest.mark.backends,
    pytest.mark.skipif(BACKEND != "torch", reason="torch.compile only"),
]


def _dropout_chain():
    keras.utils.set_random_seed(3)
    inp = keras.Input((8,))
    x = inp
    for i in range(6):
        x = layers.Dense(16, activation="tanh")(x)
        if i == 2:
            x = layers.Dropout(0.2)(x)
    return keras.Model(inp, layers.Dense(2)(x))


def _fit(jit_compile, **flag):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 2)).astype("float32")
    model = _dropout_chain()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=jit_compile)
    keras.utils.set_random_seed(11)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, **flag)
    return history.history["loss"], [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]


@pytest.fixture
def fallback_random():
    """Sets `torch._inductor.config.fallback_random` for one test."""
    import torch._inductor.config as inductor

    before = inductor.fallback_random

    def set_to(value):
        inductor.fallback_random = value

    yield set_to
    inductor.fallback_random = before


def _assert_same(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
    for u, v in zip(a[1], b[1]):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def _assert_differ(a, b):
    assert max(abs(u - v) for u, v in zip(a[0], b[0])) > 1e-3


def test_fit_flag_under_torch_compile_draws_as_eager_fit(installed, fallback_random):
    fallback_random(False)
    eager = _fit(jit_compile=False)
    plain = _fit(jit_compile=True)
    flagged = _fit(jit_compile=True, gradient_checkpointing=3)
    _assert_differ(plain, eager)  # inductor's own generator: other masks
    _assert_same(flagged, eager)  # the segments ran eagerly: eager's masks


def test_fit_flag_under_torch_compile_with_fallback_random_equals_plain_compiled_fit(installed, fallback_random):
    fallback_random(True)
    plain = _fit(jit_compile=True)
    flagged = _fit(jit_compile=True, gradient_checkpointing=3)
    _assert_same(flagged, plain)
    _assert_same(plain, _fit(jit_compile=False))


def test_segments_recompute_inside_the_compiled_step(installed, fallback_random):
    """Each segment's forward runs in Python twice a step, in the forward
    pass and again in the backward pass: traced into a compiled graph it
    would run once, when traced."""
    fallback_random(True)
    model = _dropout_chain()
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    x, y = np.ones((64, 8), "float32"), np.zeros((64, 2), "float32")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, gradient_checkpointing=3)
    steps = 2 * 64 // 16
    segments = segments_of(model)
    assert len(segments) == 3
    assert [s.forward_calls for s in segments] == [2 * steps] * 3
