"""PyTorch: a training step leaves no recomputed activation in a reference
cycle, so memory follows reference counting, not Python's cyclic GC.

torch's non-reentrant checkpoint stops each recompute early by raising an
exception; Keras's traceback filtering kept that exception's frames, and the
recomputed activations in them, alive in reference cycles after the step
(graphckpt/runtime/remat_torch.py `torch_remat` turns the early stop off for its own
calls). What cycles may still hold is the segments' *inputs*: Keras's tree
functions on PyTorch keep a copy of every structure they walk in a cycle (a
baseline model's `Add` inputs alike), and a sub-model call walks its inputs.
"""

import gc

import keras
import numpy as np
import pytest

import graphckpt
from graphckpt.runtime.segment import Segment
from tests.helpers import BACKEND

pytestmark = [
    pytest.mark.backends,
    pytest.mark.skipif(BACKEND != "torch", reason="torch's checkpoint and Keras's torch tree functions only"),
]

WIDTH, DEPTH, BATCH = 64, 12, 32


def _chain():
    inp = keras.Input((WIDTH,))
    x = inp
    for _ in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="tanh")(x)
    return keras.Model(inp, keras.layers.Dense(1)(x))


def _storage(t):
    return t.untyped_storage().data_ptr()


def _cycle_only_tensors(step):
    """Runs `step()` with the cyclic GC off; returns the tensors that only
    unreachable reference cycles held afterwards."""
    import torch

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()
        gc.enable()


def test_no_recomputed_activation_is_left_in_a_reference_cycle(monkeypatch):
    ck = graphckpt.checkpoint_model(_chain())
    segments = [layer for layer in ck.layers if isinstance(layer, Segment)]
    assert len(segments) >= 2
    ck.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype("float32")
    y = rng.standard_normal((BATCH, 1)).astype("float32")
    ck.train_on_batch(x, y)  # warm-up: builds the optimizer and the train function

    boundaries = set()
    call = Segment.call

    def recording_call(self, inputs, training=None, mask=None):
        boundaries.update(_storage(t) for t in inputs)
        return call(self, inputs, training=training, mask=mask)

    monkeypatch.setattr(Segment, "call", recording_call)
    calls_before = [s.forward_calls for s in segments]
    garbage = _cycle_only_tensors(lambda: ck.train_on_batch(x, y))

    # The step did recompute: each segment's function ran in the forward
    # pass and again in the backward pass.
    assert [s.forward_calls - n for s, n in zip(segments, calls_before)] == [2] * len(segments)
    activations = [t for t in garbage if tuple(t.shape) == (BATCH, WIDTH)]
    interior = [t for t in activations if _storage(t) not in boundaries]
    assert interior == [], f"{len(interior)} recomputed activations left in reference cycles"
