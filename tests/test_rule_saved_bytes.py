"""Each registered layer rule against what the backend really keeps for
that layer's backward pass (`tests/layer_probes.py`: saved tensors on
PyTorch, vjp residuals on JAX, the gradient graph's reads on TensorFlow;
exact counts, not allocator readings).

The rules follow TensorFlow's gradient functions; the other backends keep
a little more or less for some layers. A rule passes within
`TOLERANCE` (a share of the call's in+out bytes plus a share of the
measured bytes, per example): tight on TensorFlow. Where a
backend keeps something else entirely, the probe is in `KNOWN`, with the
reason; a known deviation must still be one (strict), so the list cannot
go stale.
"""

import keras
import numpy as np
import pytest

from graphckpt.estimator import keras_rules, rules
from tests import layer_probes

pytestmark = pytest.mark.backends

# backend -> (x in+out bytes, x measured): tight where the rules come from.
TOLERANCE = {"tensorflow": (0.2, 0.2), "jax": (0.35, 0.25), "torch": (0.35, 0.25)}

# backend -> probe -> why its estimate is not within the tolerance there.
_LINEAR = "linear in its input: nothing kept (TensorFlow's gradient reads the input)"
_ONE_OPERAND = "keeps the random factor only (TensorFlow's Mul gradient reads both operands)"
_FULL_MASK = "keeps its mask broadcast to the input's full shape (TensorFlow: the mask's own shape)"
KNOWN = {
    "tensorflow": {},
    "jax": {
        "AdditiveAttention": "keeps tanh's output and 1 - tanh^2, both T x S x dim (TensorFlow: the output)",
        "ELU": "where(x > 0, x, expm1(x)) keeps the mask, x and expm1(x) (TensorFlow's EluGrad: the output)",
        "SpatialDropout1D": _FULL_MASK,
        "SpatialDropout2D": _FULL_MASK,
        "SpatialDropout3D": _FULL_MASK,
        "Masking": _FULL_MASK,
        "Resizing": _LINEAR,
        "Normalization": _LINEAR,
        "AlphaDropout": _ONE_OPERAND,
        "GaussianDropout": _ONE_OPERAND,
        "op.gelu": "jax.nn.gelu (erf form) keeps 5 input-sized buffers (TensorFlow's composed gelu: 3)",
    },
    "torch": {
        "LSTM": "Keras's step loop on torch keeps 7 step-sized buffers a step (TensorFlow's while loop: 10)",
        "SimpleRNN": "Keras's step loop on torch keeps 1 step-sized buffer a step (TensorFlow's while loop: 4)",
        "ConvLSTM2D": "Keras's step loop on torch keeps 15 step-sized buffers a step (TensorFlow's while loop: 10)",
        "ConvLSTM3D": "Keras's step loop on torch keeps 16 step-sized buffers a step (TensorFlow's while loop: 10)",
        "LayerNormalization": "torch's fused layer_norm keeps the input and per-row statistics only",
        "Activation": "torch's fused gelu keeps its input only (TensorFlow's composed gelu: 3 buffers)",
        "AveragePooling1D": "torch's avg_pool keeps its input (TensorFlow's AvgPoolGrad: the shape only)",
        "AveragePooling2D": "torch's avg_pool keeps its input (TensorFlow's AvgPoolGrad: the shape only)",
        "AveragePooling3D": "torch's avg_pool keeps its input (TensorFlow's AvgPoolGrad: the shape only)",
        "Resizing": _LINEAR,
        "Normalization": _LINEAR,
        "AlphaDropout": _ONE_OPERAND,
        "GaussianDropout": _ONE_OPERAND,
        "op.gelu": "torch's fused gelu keeps its input only (TensorFlow's composed gelu: 3 buffers)",
    },
}

PROBES = layer_probes.probes()


def _deviation(name):
    spec = PROBES[name]
    measured = layer_probes.measured_per_example(spec, np.random.default_rng(0))
    estimated, io = layer_probes.estimated_per_example(spec)
    return measured, estimated, io


@pytest.mark.parametrize("name", sorted(PROBES))
def test_rule_is_within_tolerance_of_what_the_backend_keeps(name):
    measured, estimated, io = _deviation(name)
    backend = keras.backend.backend()
    if measured is None:
        # Measured by the allocator instead: benchmarks/rule_probes.py.
        pytest.skip(f"{backend} keeps {name}'s tensors in a while loop's TensorLists, of no static size")
    of_io, of_measured = TOLERANCE[backend]
    within = abs(estimated - measured) <= of_io * io + of_measured * measured
    detail = f"{name} on {backend}: estimated {estimated:.0f} bytes per example, measured {measured:.0f} (in+out {io})"
    reason = KNOWN[backend].get(name)
    if reason is None:
        assert within, detail
    else:
        assert not within, f"{detail}: now within tolerance; remove it from KNOWN ({reason})"


def test_every_registered_keras_class_is_probed():
    import graphckpt.estimator.peak  # noqa: F401  (registers Keras's rules)

    probed = {type(spec[1]()) for spec in PROBES.values()}
    registered = {cls for cls in rules._REGISTRY if cls.__module__.startswith("keras.")}
    missing = {cls.__name__ for cls in registered - probed} - {"InputLayer"}
    assert not missing, f"registered rules without a probe in tests/layer_probes.py: {sorted(missing)}"
    assert keras_rules.find_rule(keras.layers.Dense) is not None
