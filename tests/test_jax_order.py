"""JAX: a segment's input gradients wait for its weight gradients when
those are the smaller (`graphckpt.remat._inputs_after_weights`), so that
XLA cannot keep a recomputed interior alive for weight gradients it puts
off (TensorFlow's path orders them with a control dependency)."""

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
