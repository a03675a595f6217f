"""Reference model families for the benchmarks, each built in code.

Every builder returns a fresh, built functional `keras.Model` and takes only
JSON-friendly keyword arguments, so `graphckpt.measure` can rebuild it in a
child process from `"benchmarks/families.py:<name>"`.
"""

import keras
from keras import layers


def dense_chain(depth=64, width=1024, dropout_every=0, rate=0.1, activation="tanh"):
    """`depth` x Dense(width, tanh), a Dropout after every `dropout_every`-th."""
    inp = keras.Input((width,), name="x")
    x = inp
    for i in range(depth):
        x = layers.Dense(width, activation=activation)(x)
        if dropout_every and (i + 1) % dropout_every == 0:
            x = layers.Dropout(rate)(x)
    return keras.Model(inp, layers.Dense(10)(x), name=f"dense_chain_{depth}")
