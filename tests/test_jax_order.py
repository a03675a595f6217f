"""JAX: what keeps XLA from holding buffers across segments.

- A segment's incoming cotangents are computed into buffers of their own
  before its backward pass (`graphckpt.runtime.remat_jax.jax_materialize`), so that XLA
  cannot recompute them inside the fusions that read them and keep the
  buffers they are made of alive across the segments before.
- In the forward pass a segment's seed states are tied to its inputs
  (`graphckpt.runtime.remat_jax._states_after_inputs`), so that its random draws are
  not made at the start of the step."""

import os
import sys

import numpy as np
import pytest

from tests.helpers import BACKEND

pytestmark = [
    pytest.mark.backends,
    pytest.mark.skipif(BACKEND != "jax", reason="JAX's custom_vjp remat (TensorFlow's: tests/test_tensorflow_only.py)"),
]


def test_values_are_unchanged_bit_for_bit_through_a_conditional():
    import jax
    import jax.numpy as jnp

    from graphckpt.runtime.remat_jax import jax_materialize

    x = jnp.array([-0.0, np.nan, np.inf, 1.5] * 4, jnp.float32)
    n = jnp.arange(3, dtype=jnp.int32)
    empty = jnp.zeros((0,), jnp.float32)
    out = jax.jit(jax_materialize)((x, n, empty))
    assert isinstance(out, tuple) and len(out) == 3
    assert np.asarray(out[0]).tobytes() == np.asarray(x).tobytes()  # -0.0, NaN and inf bit for bit
    assert out[1] is n or np.array_equal(out[1], n)
    primitives = {e.primitive.name for e in jax.make_jaxpr(jax_materialize)((x, n, empty)).eqns}
    assert "cond" in primitives
    # Nothing floating and non-empty: nothing to go through a conditional.
    assert "cond" not in {e.primitive.name for e in jax.make_jaxpr(jax_materialize)((n, empty)).eqns}


def test_off_the_cpu_the_arrays_are_returned_as_they_are(monkeypatch):
    """Measured on the CPU only; on a GPU a conditional costs a host
    synchronization, so none is made there."""
    import jax
    import jax.numpy as jnp

    from graphckpt.runtime.remat_jax import jax_materialize

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jnp.ones((4,), jnp.float32)
    assert "cond" not in {e.primitive.name for e in jax.make_jaxpr(jax_materialize)((x,)).eqns}


def _resnet_stage_temp():
    """XLA's buffer assignment for the jitted train step of the benchmarks'
    ResNet-style CNN's first stage (6 residual blocks at 64 x 64 x 32,
    batch 16), checkpointed with the default plan."""
    import graphckpt
    from graphckpt.measure.crosscheck import independent_peak

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import families

    model = graphckpt.checkpoint_model(families.resnet_cnn(size=64, channels=32, blocks_per_stage=6, stages=1), batch_size=16)
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64, 64, 3)).astype("float32")
    y = rng.standard_normal((16, 10)).astype("float32")
    model.train_on_batch(x, y)
    return independent_peak(model, x, y)["bytes"]


def test_a_residual_cnn_peaks_lower_with_materialized_cotangents(monkeypatch):
    """Without, the residual stream's gradient (ReLU masks, adds) was
    recomputed inside each segment's backward fusions from the buffers of
    every segment after it (JAX 0.10.2: 168.2 MiB without, 112.4 MiB with,
    2026-12-06; 104.4 MiB with at the default plan of least recompute)."""
    from graphckpt.runtime import remat_jax

    materialized = _resnet_stage_temp()
    monkeypatch.setattr(remat_jax, "jax_materialize", tuple)
    fused = _resnet_stage_temp()
    assert materialized < 0.85 * fused


def _depends_on(jaxpr, out, source):
    """Whether `out` is computed from `source` in a flat jaxpr."""
    from jax._src import core

    reached = {source}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, core.Literal) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return out in reached


def test_seed_states_are_tied_to_the_inputs_in_the_forward_pass():
    """`_states_after_inputs`: a seed state (integer) comes out computed
    from the segment's input, bit for bit; a weight (float) is not tied,
    since a select would copy it."""
    import jax
    import jax.numpy as jnp

    from graphckpt.runtime.remat_jax import _states_after_inputs

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
    from graphckpt.measure.crosscheck import independent_peak
    from graphckpt.runtime import remat_jax

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
    monkeypatch.setattr(remat_jax, "_states_after_inputs", lambda args, n_inputs: list(args))
    untied = temp()
    assert tied < 0.85 * untied
