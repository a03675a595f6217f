"""Subclassed Keras models written the way keras.io's examples write them,
for the fit flag's tracing (tests/test_subclassed_fit.py) and its
benchmark (benchmarks/subclassed.py): blocks as `keras.layers.Layer`
subclasses, models as `keras.Model` subclasses with their own `call`, one
with its own `train_step` on each backend."""

import keras
from keras import layers, ops


class Block(layers.Layer):
    """A pre-norm causal transformer block."""

    def __init__(self, dim, heads, ffn, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.ln1 = layers.LayerNormalization(epsilon=1e-6)
        self.att = layers.MultiHeadAttention(heads, dim // heads, dropout=rate)
        self.ln2 = layers.LayerNormalization(epsilon=1e-6)
        self.ff1 = layers.Dense(ffn, activation="gelu")
        self.ff2 = layers.Dense(dim)
        self.drop = layers.Dropout(rate)

    def call(self, x, training=None):
        h = self.ln1(x)
        x = x + self.att(h, h, use_causal_mask=True, training=training)
        return x + self.drop(self.ff2(self.ff1(self.ln2(x))), training=training)


class PositionEmbedding(layers.Layer):
    """Adds a learned embedding of each position (keras.io's
    `TokenAndPositionEmbedding`, positions half)."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.embedding = layers.Embedding(length, dim)

    def call(self, x):
        return x + self.embedding(ops.arange(ops.shape(x)[1]))


class GPT(keras.Model):
    """A GPT-style language model; `call` loops over its blocks in Python."""

    def __init__(self, vocab=1000, length=256, dim=128, heads=4, ffn=512, depth=8, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.tokens = layers.Embedding(vocab, dim)
        self.positions = PositionEmbedding(length, dim)
        self.blocks = [Block(dim, heads, ffn, rate) for _ in range(depth)]
        self.norm = layers.LayerNormalization(epsilon=1e-6)
        self.head = layers.Dense(vocab)

    def call(self, token_ids, training=None):
        x = self.positions(self.tokens(token_ids))
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.norm(x))


def gpt(seq_len=512, **kwargs):
    """A built `GPT` (for `graphckpt.measure`: 8 blocks x 128 by default)."""
    model = GPT(length=seq_len, **kwargs)
    model.build((None, seq_len))
    return model


class ResNet(keras.Model):
    """A small ResNet: BatchNormalization and residual adds in `call`."""

    def __init__(self, width=8, units=3, classes=4, **kwargs):
        super().__init__(**kwargs)
        self.stem = layers.Conv2D(width, 3, padding="same")
        self.units = [
            [layers.Conv2D(width, 3, padding="same"), layers.BatchNormalization(),
             layers.Conv2D(width, 3, padding="same"), layers.BatchNormalization()]
            for _ in range(units)
        ]
        self.pool = layers.GlobalAveragePooling2D()
        self.head = layers.Dense(classes)

    def call(self, images, training=None):
        x = self.stem(images)
        for conv1, bn1, conv2, bn2 in self.units:
            y = ops.relu(bn1(conv1(x), training=training))
            y = bn2(conv2(y), training=training)
            x = ops.relu(x + y)
        return self.head(self.pool(x))


class Sampling(layers.Layer):
    """z = mean + exp(log_var / 2) * eps, from its own seed generator."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        mean, log_var = inputs
        eps = keras.random.normal(ops.shape(mean), dtype=mean.dtype, seed=self.seed_generator)
        return mean + ops.exp(0.5 * log_var) * eps


class Encoder(keras.Model):
    def __init__(self, latent=4, width=32, depth=3, **kwargs):
        super().__init__(**kwargs)
        self.hidden = [layers.Dense(width, activation="relu") for _ in range(depth)]
        self.mean = layers.Dense(latent)
        self.log_var = layers.Dense(latent)

    def call(self, x):
        for dense in self.hidden:
            x = dense(x)
        return self.mean(x), self.log_var(x)


class Decoder(keras.Model):
    def __init__(self, features=16, width=32, depth=3, **kwargs):
        super().__init__(**kwargs)
        self.hidden = [layers.Dense(width, activation="relu") for _ in range(depth)]
        self.out = layers.Dense(features, activation="sigmoid")

    def call(self, z):
        for dense in self.hidden:
            z = dense(z)
        return self.out(z)


class VAE(keras.Model):
    """keras.io's VAE, on vectors: the KL term is added in `call`
    (`self.add_loss`), and `train_step` is its own, on each backend."""

    def __init__(self, features=16, latent=4, **kwargs):
        super().__init__(**kwargs)
        self.encoder = Encoder(latent)
        self.decoder = Decoder(features)
        self.sampling = Sampling()

    def call(self, x, training=None):
        mean, log_var = self.encoder(x)
        z = self.sampling([mean, log_var])
        self.add_loss(-0.5 * ops.mean(ops.sum(1 + log_var - ops.square(mean) - ops.exp(log_var), axis=1)))
        return self.decoder(z)

    def _loss(self, x, reconstruction, losses):
        return ops.mean(keras.losses.binary_crossentropy(x, reconstruction)) + sum(losses)

    def train_step(self, *args):
        backend = keras.backend.backend()
        if backend == "jax":
            return self._jax_train_step(*args)
        (x,) = args
        if backend == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self._loss(x, self(x, training=True), self.losses)
            grads = tape.gradient(loss, self.trainable_weights)
        else:
            self.zero_grad()
            loss = self._loss(x, self(x, training=True), self.losses)
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
        self.optimizer.apply(grads, self.trainable_weights)
        return {"loss": loss}

    def _jax_train_step(self, state, x):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state

        def loss_fn(trainable):
            outputs, new_non_trainable, losses = self.stateless_call(
                trainable, non_trainable, x, training=True, return_losses=True
            )
            return self._loss(x, outputs, losses), new_non_trainable

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class Tagger(keras.Model):
    """Branches on `training` in Python and takes a `mask` argument:
    token ids (0 is padding) -> 3 classes."""

    def __init__(self, vocab=50, dim=16, depth=4, **kwargs):
        super().__init__(**kwargs)
        self.embedding = layers.Embedding(vocab, dim, mask_zero=True)
        self.noise = layers.GaussianNoise(0.1)
        self.hidden = [layers.Dense(dim, activation="tanh") for _ in range(depth)]
        self.pool = layers.GlobalAveragePooling1D()
        self.head = layers.Dense(3)

    def call(self, token_ids, training=None, mask=None):
        x = self.embedding(token_ids)
        if training:
            x = self.noise(x, training=training)
        if mask is not None:  # a mask given by the caller wins over the padding's
            x = x * ops.expand_dims(ops.cast(mask, x.dtype), -1)
        for dense in self.hidden:
            x = dense(x)
        return self.head(self.pool(x))
