"""A recomputed segment's forward pass keeps nothing for backward, so it must
not hold its interior either: each layer output is dropped once the last
layer reading it has run (graphckpt/keras_compat.py
`run_freeing_dead_tensors`).

Keras's own functional walk keeps every intermediate until the call returns.
On an eager backend that held a whole segment at once in its forward pass:
on PyTorch one segment over a 32 x Dense(1024) chain peaked at +33 MiB, its
whole interior, where it now peaks at +3.9 MiB (benchmarks/archive/forward_walk.py).
"""

import weakref

import keras
import numpy as np
import pytest

import graphckpt
from graphckpt import keras_compat
from graphckpt.runtime.segment import Segment
from tests import models
from tests.helpers import BACKEND, to_numpy

pytestmark = pytest.mark.backends

DEPTH, WIDTH, BATCH = 8, 16, 4


def _chain():
    return models.chain(depth=DEPTH, width=WIDTH)


class _AliveAtEachCall:
    """Patches `Dense.call`: at each call, counts the earlier calls' outputs
    still alive (by weak reference), then records this call's output."""

    def __init__(self, monkeypatch):
        self.outputs, self.alive = [], []
        call = keras.layers.Dense.call

        def counting_call(layer, inputs, *args, **kwargs):
            self.alive.append(sum(ref() is not None for ref in self.outputs))
            out = call(layer, inputs, *args, **kwargs)
            self.outputs.append(weakref.ref(out))
            return out

        monkeypatch.setattr(keras.layers.Dense, "call", counting_call)


@pytest.mark.skipif(BACKEND == "jax", reason="JAX traces a segment: its values are tracers, which the trace holds")
def test_a_segment_forward_pass_drops_each_layer_output_after_its_last_reader(monkeypatch):
    ck = graphckpt.checkpoint_model(_chain(), segments=1)
    (segment,) = [layer for layer in ck.layers if isinstance(layer, Segment)]
    x = np.random.default_rng(0).standard_normal((BATCH, WIDTH)).astype("float32")
    expected = to_numpy(ck(x, training=False))
    counter = _AliveAtEachCall(monkeypatch)

    out = ck(x, training=True)  # one segment, recomputed: its forward keeps nothing

    assert segment.forward_calls == 1
    assert len(counter.alive) == DEPTH + 1
    # At each call only its own input (the previous call's output) is alive;
    # Keras's walk would have kept all of them: 0, 1, 2, ..., DEPTH.
    assert max(counter.alive) <= 1, counter.alive
    np.testing.assert_array_equal(to_numpy(out), expected)


def test_the_sub_model_is_left_as_it_was():
    ck = graphckpt.checkpoint_model(_chain(), segments=2)
    sub = [layer for layer in ck.layers if isinstance(layer, Segment)][0].model
    with keras_compat.freeing_dead_tensors(sub):
        assert "_run_through_graph" in vars(sub)
    assert "_run_through_graph" not in vars(sub)
    x = np.ones((BATCH, WIDTH), "float32")
    ck(x, training=True)
    assert "_run_through_graph" not in vars(sub)


def test_a_layer_read_twice_keeps_its_output_until_the_second_reader():
    """A residual block: `h` is read by the second Dense and by the Add. The
    walk may drop it only after the Add, the last reader; the result is
    Keras's own walk's."""
    inp = keras.Input((WIDTH,))
    h = keras.layers.Dense(WIDTH, activation="relu")(inp)
    y = keras.layers.Dense(WIDTH)(h)
    out = keras.layers.Add()([h, y])
    out = keras.layers.Dense(WIDTH)(keras.layers.Dense(WIDTH)(out))
    model = keras.Model(inp, [out, h])
    x = np.random.default_rng(1).standard_normal((BATCH, WIDTH)).astype("float32")
    expected = [to_numpy(t) for t in model(x)]
    with keras_compat.freeing_dead_tensors(model):
        got = [to_numpy(t) for t in model(x)]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
