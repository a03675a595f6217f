"""Reference model families for the benchmarks, each built in code.

Every builder returns a fresh, built functional `keras.Model` and takes only
JSON-friendly keyword arguments, so `graphckpt.measure` can rebuild it in a
child process from `"benchmarks/families.py:<name>"`. Default sizes train a
step in seconds on 2 CPU cores; the benchmark passes its own sizes.
"""

import keras
from keras import layers


def dense_chain(depth=64, width=1024, dropout_every=0, rate=0.1, activation="tanh", outputs=10, use_bias=True,
                kernel_initializer="glorot_uniform"):
    """`depth` x Dense(width, tanh), with a Dropout after every
    `dropout_every`-th Dense (none when 0), then Dense(outputs)."""
    inp = keras.Input((width,), name="x")
    x = inp
    for i in range(depth):
        x = layers.Dense(width, activation=activation, use_bias=use_bias, kernel_initializer=kernel_initializer)(x)
        if dropout_every and (i + 1) % dropout_every == 0:
            x = layers.Dropout(rate)(x)
    return keras.Model(inp, layers.Dense(outputs)(x), name=f"dense_chain_{depth}")


def resnet_cnn(size=64, channels=32, blocks_per_stage=3, stages=3, classes=10):
    """A ResNet-style CNN: conv stem, then `stages` stages of residual blocks
    (Conv-BN-ReLU-Conv-BN + shortcut, ReLU); each later stage halves the
    resolution and doubles the channels (1x1 strided projection shortcut)."""
    inp = keras.Input((size, size, 3), name="image")
    x = layers.Conv2D(channels, 3, padding="same", use_bias=False)(inp)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for s in range(stages):
        c = channels * 2**s
        for b in range(blocks_per_stage):
            stride = 2 if (s > 0 and b == 0) else 1
            y = layers.Conv2D(c, 3, strides=stride, padding="same", use_bias=False)(x)
            y = layers.ReLU()(layers.BatchNormalization()(y))
            y = layers.Conv2D(c, 3, padding="same", use_bias=False)(y)
            y = layers.BatchNormalization()(y)
            shortcut = x
            if stride != 1:
                shortcut = layers.BatchNormalization()(layers.Conv2D(c, 1, strides=stride, use_bias=False)(x))
            x = layers.ReLU()(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(classes)(x), name="resnet_cnn")


def transformer(seq_len=128, dim=256, heads=4, ffn=1024, depth=6, rate=0.1, classes=10):
    """A pre-norm Transformer encoder stack on float features: per block,
    LayerNorm -> MultiHeadAttention (with attention dropout) -> Dropout ->
    residual add, LayerNorm -> Dense(ffn, gelu) -> Dense(dim) -> Dropout ->
    residual add; then LayerNorm, mean over tokens, Dense(classes)."""
    inp = keras.Input((seq_len, dim), name="tokens")
    x = layers.Dense(dim)(inp)
    for _ in range(depth):
        h = layers.LayerNormalization()(x)
        h = layers.MultiHeadAttention(heads, dim // heads, dropout=rate)(h, h)
        x = layers.Add()([x, layers.Dropout(rate)(h)])
        h = layers.LayerNormalization()(x)
        h = layers.Dense(ffn, activation="gelu")(h)
        h = layers.Dense(dim)(h)
        x = layers.Add()([x, layers.Dropout(rate)(h)])
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(x))
    return keras.Model(inp, layers.Dense(classes)(x), name="transformer")


def unet(size=128, channels=16, levels=4, out_channels=1):
    """A U-Net: per level two 3x3 Conv(ReLU) then MaxPool; a bottleneck; per
    level back up UpSampling2D, a long skip Concatenate with the encoder
    output at that resolution, and two 3x3 Conv(ReLU); a 1x1 Conv head."""
    inp = keras.Input((size, size, 3), name="image")
    x, skips = inp, []
    for i in range(levels):
        c = channels * 2**i
        x = layers.Conv2D(c, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(c, 3, padding="same", activation="relu")(x)
        skips.append(x)
        x = layers.MaxPooling2D()(x)
    c = channels * 2**levels
    x = layers.Conv2D(c, 3, padding="same", activation="relu")(x)
    x = layers.Conv2D(c, 3, padding="same", activation="relu")(x)
    for i in reversed(range(levels)):
        c = channels * 2**i
        x = layers.UpSampling2D()(x)
        x = layers.Concatenate()([x, skips[i]])
        x = layers.Conv2D(c, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(c, 3, padding="same", activation="relu")(x)
    return keras.Model(inp, layers.Conv2D(out_channels, 1)(x), name="unet")


def resnet50v2(size=128, classes=10):
    """`keras.applications.ResNet50V2`, `weights=None`, at `size` x `size`."""
    return keras.applications.ResNet50V2(weights=None, input_shape=(size, size, 3), classes=classes)


def densenet121(size=128, classes=10):
    """`keras.applications.DenseNet121`, `weights=None`, at `size` x `size`."""
    return keras.applications.DenseNet121(weights=None, input_shape=(size, size, 3), classes=classes)


def nested_resnet50v2(size=128, classes=10, frozen_weights=False):
    """Keras's transfer-learning pattern: `keras.applications.ResNet50V2`
    (`include_top=False`, `weights=None`) called as one layer, then global
    average pooling and a Dense head. `frozen_weights`: the backbone's
    layers other than BatchNormalization are frozen (the same activations,
    almost no weight gradients; benchmarks/archive/nested_grads.py)."""
    base = keras.applications.ResNet50V2(include_top=False, weights=None, input_shape=(size, size, 3))
    if frozen_weights:
        for layer in base.layers:
            if not isinstance(layer, layers.BatchNormalization):
                layer.trainable = False
    inp = keras.Input((size, size, 3), name="image")
    x = layers.GlobalAveragePooling2D()(base(inp))
    return keras.Model(inp, layers.Dense(classes)(x), name="nested_resnet50v2")


def text_transformer(vocab=50257, dim=256, heads=4, ffn=1024, depth=12, rate=0.1):
    """A GPT-2-like decoder stack on token ids of shape (None, None), as
    keras_hub's `GPT2Backbone` takes them: Embedding, then per block
    LayerNorm -> causal MultiHeadAttention -> Dropout -> residual add,
    LayerNorm -> Dense(ffn, gelu) -> Dense(dim) -> Dropout -> residual add;
    a final LayerNorm; the hidden states are the output. The sequence
    length is known only from the data: plan and measure it with
    `input_shape=` (e.g. (8, 512))."""
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    x = layers.Embedding(vocab, dim)(tokens)
    for _ in range(depth):
        h = layers.LayerNormalization()(x)
        h = layers.MultiHeadAttention(heads, dim // heads, dropout=rate)(h, h, use_causal_mask=True)
        x = layers.Add()([x, layers.Dropout(rate)(h)])
        h = layers.LayerNormalization()(x)
        h = layers.Dense(ffn, activation="gelu")(h)
        h = layers.Dense(dim)(h)
        x = layers.Add()([x, layers.Dropout(rate)(h)])
    return keras.Model(tokens, layers.LayerNormalization()(x), name="text_transformer")


class UserTransformerBlock(layers.Layer):
    """keras.io's text-classification transformer block, a `Layer`
    subclass: MultiHeadAttention, a Sequential feed-forward, two
    LayerNormalizations, two Dropouts and `+` in `call`."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim // num_heads, dropout=rate)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.dropout1(self.att(inputs, inputs, training=training), training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)


def user_blocks(seq_len=512, dim=128, heads=4, ffn=256, depth=4, rate=0.1, classes=10):
    """`depth` `UserTransformerBlock`s on (seq_len, dim) inputs, pooled."""
    inp = keras.Input((seq_len, dim), name="x")
    x = inp
    for _ in range(depth):
        x = UserTransformerBlock(dim, heads, ffn, rate)(x)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inp, layers.Dense(classes)(x), name="user_blocks")


def vit_tiny(image_size=224, patch_size=16, depth=12, heads=3, dim=192, mlp=768, rate=0.1):
    """keras_hub's ViT-Tiny backbone (random init): every transformer block
    runs inside one `ViTEncoder` layer call."""
    import keras_hub

    return keras_hub.models.ViTBackbone(
        image_shape=(image_size, image_size, 3), patch_size=patch_size, num_layers=depth, num_heads=heads,
        hidden_dim=dim, mlp_dim=mlp, dropout_rate=rate, attention_dropout=rate,
    )
