"""JAX: the order `graphckpt.remat.jax_remat` gives XLA.

- A segment's input gradients wait for its weight gradients when those are
  the smaller (`_inputs_after_weights`), so that XLA cannot keep a
  recomputed interior alive for weight gradients it puts off (TensorFlow's
  path orders them with a control dependency).
- In the forward pass a segment's seed states are tied to its inputs
  (`_states_after_inputs`), so that its random draws are not made at the
  start of the step."""

import os
import sys

import numpy as np
import pytest

from tests.helpers import BACKEND

pytestmark = [
    pytest.mark.backends,
    pytest.mark.skipif(BACKEND != "jax", reason="JAX's custom_vjp remat (TensorFlow's: tests/test_tensorflow_only.py)"),
]


def _depends_on(jaxpr, out, source):
    """Whether `out` is computed from `source` in a flat jaxpr."""
    from jax._src import core

    reached = {source}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, core.Literal) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return out in reached


@pytest.mark.parametrize("weight_size, tied", [(3, True), (64, False)])
def test_input_gradients_are_tied_to_smaller_weight_gradients(weight_size, tied):
    import jax
    import jax.numpy as jnp

    from graphckpt.remat import _inputs_after_weights

    x = jnp.array([-0.0, np.nan, np.inf, 1.5] * 4, jnp.float32)  # 64 bytes
    w = jnp.full((weight_size,), 2.0, jnp.float32)
    closed = jax.make_jaxpr(lambda x, w: _inputs_after_weights([x], [w])[0])(x, w)
    assert _depends_on(closed.jaxpr, closed.jaxpr.outvars[0], closed.jaxpr.invars[1]) is tied
    out = np.asarray(_inputs_after_weights([x], [w])[0])
    assert out.tobytes() == np.asarray(x).tobytes()  # -0.0, NaN and inf bit for bit


def test_a_residual_cnn_peaks_lower_with_the_tie(monkeypatch):
    """The first stage of the benchmarks' ResNet-style CNN (6 residual
    blocks at 64 x 64 x 32, batch 16), XLA's buffer assignment for the
    jitted train step: with the tie its temporaries are smaller (144 against
    168 MiB, 2026-12-06, JAX 0.10.2)."""
    from graphckpt import remat
    from graphckpt.measure.crosscheck import independent_peak

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import families

    def temp():
        import graphckpt

        model = graphckpt.checkpoint_model(families.resnet_cnn(size=64, channels=32, blocks_per_stage=6, stages=1), batch_size=16)
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((16, 64, 64, 3)).astype("float32")
        y = rng.standard_normal((16, 10)).astype("float32")
        model.train_on_batch(x, y)
        return independent_peak(model, x, y)["bytes"]  # XLA's buffer assignment for the jitted train step

    tied = temp()
    monkeypatch.setattr(remat, "_inputs_after_weights", lambda inputs, weights: list(inputs))
    untied = temp()
    assert tied < 0.95 * untied


def test_seed_states_are_tied_to_the_inputs_in_the_forward_pass():
    """`_states_after_inputs`: a seed state (integer) comes out computed
    from the segment's input, bit for bit; a weight (float) is not tied,
    since a select would copy it."""
    import jax
    import jax.numpy as jnp

    from graphckpt.remat import _states_after_inputs

    x = jnp.array([-0.0, np.nan, 1.0], jnp.float32)
    seed = jnp.array([7, 2**31 - 1], jnp.uint32)
    w = jnp.ones((2, 2), jnp.float32)
    closed = jax.make_jaxpr(lambda *a: _states_after_inputs(a, 1))(x, seed, w)
    inputs, outs = closed.jaxpr.invars, closed.jaxpr.outvars
    assert _depends_on(closed.jaxpr, outs[1], inputs[0])  # the seed state waits for the input
    assert outs[2] is inputs[2]  # the weight passes untouched
    out = _states_after_inputs((x, seed, w), 1)
    assert np.asarray(out[1]).tobytes() == np.asarray(seed).tobytes()


def test_a_transformer_with_dropout_peaks_lower_with_tied_seed_states(monkeypatch):
    """The benchmarks' Transformer (6 blocks, seq 128, width 256, dropout
    0.1, batch 16), XLA's buffer assignment: 109.7 MiB with the forward
    pass's seed states tied to each segment's inputs, 145.1 MiB without
    (2026-12-06, JAX 0.10.2): untied, the threefry counters of every
    dropout were computed at the start of the step."""
    import graphckpt
    from graphckpt import remat
    from graphckpt.measure.crosscheck import independent_peak

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import families

    def temp():
        model = graphckpt.checkpoint_model(families.transformer(seq_len=128, dim=256, heads=4, ffn=1024, depth=6), batch_size=16)
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((16, 128, 256)).astype("float32")
        y = rng.standard_normal((16, 10)).astype("float32")
        model.train_on_batch(x, y)
        return independent_peak(model, x, y)["bytes"]

    tied = temp()
    monkeypatch.setattr(remat, "_states_after_inputs", lambda args, n_inputs: list(args))
    untied = temp()
    assert tied < 0.85 * untied

