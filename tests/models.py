"""Small functional models of every DAG shape the core must handle."""

import keras
from keras import layers


def chain(depth=12, width=16, dropout=0.0, bn=False):
    inp = keras.Input((width,), name="x")
    x = inp
    for i in range(depth):
        x = layers.Dense(width, activation="tanh")(x)
        if dropout and i % 3 == 2:
            x = layers.Dropout(dropout)(x)
        if bn and i % 4 == 3:
            x = layers.BatchNormalization()(x)
    return keras.Model(inp, layers.Dense(2)(x), name="chain")


def resnet(blocks=4, channels=8, size=8):
    inp = keras.Input((size, size, 3))
    x = layers.Conv2D(channels, 3, padding="same")(inp)
    for _ in range(blocks):
        y = layers.Conv2D(channels, 3, padding="same")(x)
        y = layers.BatchNormalization()(y)
        y = layers.ReLU()(y)
        y = layers.Conv2D(channels, 3, padding="same")(y)
        y = layers.BatchNormalization()(y)
        x = layers.ReLU()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(3)(x), name="resnet")


def unet(size=16, channels=4, levels=3):
    inp = keras.Input((size, size, 2))
    x, skips = inp, []
    for i in range(levels):
        x = layers.Conv2D(channels * 2**i, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(channels * 2**i, 3, padding="same", activation="relu")(x)
        skips.append(x)
        x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(channels * 2**levels, 3, padding="same", activation="relu")(x)
    for i in reversed(range(levels)):
        x = layers.UpSampling2D()(x)
        x = layers.Concatenate()([x, skips[i]])
        x = layers.Conv2D(channels * 2**i, 3, padding="same", activation="relu")(x)
    return keras.Model(inp, layers.Conv2D(1, 1)(x), name="unet")


def densenet(blocks=2, layers_per_block=3, growth=4, size=8):
    inp = keras.Input((size, size, 3))
    x = layers.Conv2D(8, 3, padding="same")(inp)
    for b in range(blocks):
        for _ in range(layers_per_block):
            y = layers.BatchNormalization()(x)
            y = layers.Activation("relu")(y)
            y = layers.Conv2D(growth, 3, padding="same")(y)
            x = layers.Concatenate()([x, y])
        if b < blocks - 1:
            x = layers.Conv2D(8, 1)(x)
            x = layers.AveragePooling2D(2)(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(2)(x), name="densenet")


def inception(size=8):
    inp = keras.Input((size, size, 3))
    x = inp
    for _ in range(2):
        a = layers.Conv2D(4, 1, padding="same", activation="relu")(x)
        b = layers.Conv2D(4, 1, padding="same", activation="relu")(x)
        b = layers.Conv2D(4, 3, padding="same", activation="relu")(b)
        c = layers.Conv2D(4, 1, padding="same", activation="relu")(x)
        c = layers.Conv2D(4, 5, padding="same", activation="relu")(c)
        d = layers.MaxPooling2D(3, strides=1, padding="same")(x)
        d = layers.Conv2D(4, 1, padding="same")(d)
        x = layers.Concatenate()([a, b, c, d])
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(2)(x), name="inception")


def multi_io():
    """Two named inputs, a shared layer called twice, dict outputs."""
    a = keras.Input((6,), name="a")
    b = keras.Input((6,), name="b")
    shared = layers.Dense(8, activation="relu", name="shared")
    ha, hb = shared(a), shared(b)
    h = layers.Concatenate()([ha, hb])
    for _ in range(4):
        h = layers.Dense(8, activation="tanh")(h)
    h = layers.Dropout(0.2)(h)
    side = layers.Dense(3, name="side")(ha)
    main = layers.Dense(1, name="main")(layers.Add()([h, shared(layers.Dense(6)(h))]))
    return keras.Model({"a": a, "b": b}, {"main": main, "side": side}, name="multi_io")


def nested():
    """A functional block and a Sequential used as layers, the block twice."""
    inner_in = keras.Input((8,))
    inner = keras.Model(
        inner_in,
        layers.Dense(8, activation="relu")(layers.Dropout(0.3)(layers.Dense(8)(inner_in))),
        name="block",
    )
    seq = keras.Sequential([keras.Input((8,)), layers.Dense(8), layers.BatchNormalization()], name="seq")
    inp = keras.Input((8,))
    x = layers.Dense(8)(inp)
    x = inner(x)
    x = seq(x)
    x = inner(x)
    for _ in range(3):
        x = layers.Dense(8, activation="relu")(x)
    return keras.Model(inp, layers.Dense(1)(x), name="nested")


def masked_lstm(vocab=20, steps=7, mask_zero=True):
    inp = keras.Input((steps,), dtype="int32")
    x = layers.Embedding(vocab, 8, mask_zero=mask_zero)(inp)
    x = layers.LSTM(8, return_sequences=True)(x)
    x = layers.Dropout(0.2)(x)
    x = layers.LSTM(8, return_sequences=True)(x)
    x = layers.Dense(8)(x)
    x = layers.LSTM(6)(x)
    return keras.Model(inp, layers.Dense(1)(x), name="masked_lstm")


ALL = {
    "chain": lambda: chain(dropout=0.3, bn=True),
    "resnet": resnet,
    "unet": unet,
    "densenet": densenet,
    "inception": inception,
    "multi_io": multi_io,
    "nested": nested,
    "masked_lstm": masked_lstm,
}


def sample_inputs(model, batch=4, seed=0):
    """Random inputs matching `model`'s input structure."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def one(t):
        shape = (batch,) + tuple(t.shape[1:])
        if "int" in str(t.dtype):
            x = rng.integers(0, 20, size=shape).astype(str(t.dtype))
            x[..., -2:] = 0  # padding, so masks matter
            return x
        return rng.normal(size=shape).astype(str(t.dtype))

    return keras.tree.map_structure(one, model.input)
