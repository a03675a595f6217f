"""Model recipes and transforms that `graphckpt.measure` loads in its child
process, for tests/test_measure.py."""

import os

import keras
from keras import layers

BUILDS = 0  # builds in this process; a fresh process starts again at 0


def chain(depth=16, width=128):
    """A Dense chain whose name records how many builds this process ran."""
    global BUILDS
    BUILDS += 1
    inp = keras.Input((width,))
    x = inp
    for _ in range(depth):
        x = layers.Dense(width, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(2)(x), name=f"chain_build{BUILDS}_pid{os.getpid()}")


def big_outputs(depth=16, width=1024, repeat=8):
    """A Dense chain whose weightless head outputs far more than any layer
    keeps: each value repeated `repeat` times (8 MiB of outputs at batch
    256, against 1 MiB per Dense output)."""
    inp = keras.Input((width,))
    x = inp
    for _ in range(depth):
        x = layers.Dense(width, activation="tanh")(x)
    x = layers.UpSampling1D(repeat)(layers.Reshape((width, 1))(x))
    return keras.Model(inp, layers.Flatten()(x), name="big_outputs")


def wide_input(width=65536):
    """A batch far larger than anything its step allocates: one Dense(1)
    on `width` features (64 MiB of inputs at batch 256, a 256 KiB weight)."""
    inp = keras.Input((width,))
    return keras.Model(inp, layers.Dense(1)(inp), name="wide_input")


def broken(message="boom"):
    raise ValueError(message)


def crashes():
    os._exit(3)  # the child dies without writing a result


def not_a_model(build):
    return "not a model"


def halves(build, keep=1):
    """A method: the first `keep` Dense layers of the built chain only."""
    model = build()
    x = model.inputs[0]
    y = x
    for layer in model.layers[1 : 1 + keep]:
        y = layer(y)
    return keras.Model(x, y, name="halved")
