"""The model zoo: every `keras.applications` constructor, built with
`weights=None` at a small input, checkpointed and compared with the original.

`check(name)` is the whole check; `tests/test_zoo.py` runs it (a few fast
models in CI, all of them with `-m slow`), and `benchmarks/zoo_table.py` runs
it for every model and writes the table in `docs/zoo.md`.
"""

import dataclasses
import time

import keras
import numpy as np
from keras import layers

import graphckpt
from tests.helpers import compare_inference, compare_step

# The smallest input each family documents (the `min_size` its constructor
# enforces with weights=None); 32x32 for all the others.
MIN_SIZE = {"InceptionV3": 75, "InceptionResNetV2": 75, "Xception": 71}

# VGG's top (Flatten, then 4096 units) needs the default 224x224 input:
# checked without the top, pooled.
NO_TOP = {"VGG16", "VGG19"}

ALL = sorted(name for name in dir(keras.applications) if name[0].isupper() and callable(getattr(keras.applications, name)))

# ConvNeXt normalizes with LayerNormalization, which keeps its gradients
# well scaled: it compares exactly in float32, and float64 copies of its
# larger sizes' weights would not fit in this machine's memory.
DTYPE = {"ConvNeXtBase": "float32", "ConvNeXtLarge": "float32", "ConvNeXtXLarge": "float32"}

# Fast enough for CI (seconds each at 32x32, batch 2): issue 2's three, and
# a MobileNet.
CI = ("ResNet50V2", "DenseNet121", "EfficientNetB0", "MobileNetV3Small")


def input_size(name):
    return MIN_SIZE.get(name, 32)


def build(name):
    """The application `name` with random weights at its small input size."""
    size = input_size(name)
    kwargs = dict(weights=None, input_shape=(size, size, 3))
    if name in NO_TOP:
        kwargs.update(include_top=False, pooling="avg")
    else:
        kwargs.update(classes=10)
    return getattr(keras.applications, name)(**kwargs)


@dataclasses.dataclass
class Result:
    name: str
    dtype: str
    input_size: int
    layer_calls: int
    segments: int
    max_grad_diff: float
    seconds: float


def check(name, batch=2, graph=False, dtype=None, atol=1e-5, rtol=1e-6):
    """Builds `name`, checkpoints it with the default plan and asserts equal
    outputs (inference) and equal loss, outputs, gradients and state after a
    training step. Returns a `Result`; raises on a mismatch.

    It runs in float64 unless `DTYPE` says otherwise. At these small inputs,
    BatchNormalization normalizes over a handful of values in the last
    stages, so gradients reach 1e8 and float32 round-off, which the
    recompute's other summation order changes, shows at 1e-5 of that scale
    (ResNet50V2). In float64 that noise is 1e-14 of it, and any real
    difference (another dropout mask, statistics updated twice) stands out
    by many orders of magnitude.
    """
    dtype = dtype or DTYPE.get(name, "float64")
    start = time.perf_counter()
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        model = build(name)
    finally:
        keras.config.set_dtype_policy(previous)
    plan = graphckpt.plan(model)
    ck = graphckpt.checkpoint_model(model)
    assert isinstance(ck, graphckpt.CheckpointedModel)
    size = input_size(name)
    x = np.random.default_rng(0).normal(size=(batch, size, size, 3)).astype("float32")
    compare_inference(model, ck, x, atol=atol)
    worst = compare_step(model, ck, x, compiled=graph, atol=atol, rtol=rtol)
    return Result(
        name=name,
        dtype=dtype,
        input_size=size,
        layer_calls=plan.num_layer_calls,
        segments=len(plan.segments),
        max_grad_diff=worst,
        seconds=time.perf_counter() - start,
    )


class CallableOnce(layers.Layer):
    """A layer that refuses a second call, so it cannot be shared, and
    graphckpt cannot replay it into a segment: the one kind of functional
    model the rewrite cannot handle (see `cannot_be_rewritten`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.symbolic_calls = 0

    def call(self, x):
        return x * 2.0

    def compute_output_spec(self, x):
        self.symbolic_calls += 1
        if self.symbolic_calls > 1:
            raise RuntimeError("this layer can only be called once")
        return keras.KerasTensor(x.shape, x.dtype)


def cannot_be_rewritten(depth=8):
    """A Dense chain with a `CallableOnce` layer named 'call_me_once' near
    the end, so the rewrite fails after many calls were replayed."""
    inp = keras.Input((8,))
    x = inp
    for _ in range(depth):
        x = layers.Dense(8, activation="tanh")(x)
    x = CallableOnce(name="call_me_once")(x)
    return keras.Model(inp, layers.Dense(1)(x))
