"""The private Keras names attention in chunks reads
(`graphckpt.runtime.attention`): `MultiHeadAttention`'s core and its
parts, and the seed draws of `keras.random.dropout` per backend. A
`keras_compat` module of its own, for the same reason (no public way
serves, each function says what it reads), tested on the same Keras
versions (`make test`). Keras is imported lazily.
"""

import contextlib
import types

__all__ = [
    "own_core",
    "core_replaced",
    "parts",
    "draw_seed",
    "tf_cast_seed",
    "tf_key_counter_alg",
    "tf_uniform_run",
    "jax_draws_by_index",
    "jax_bernoulli_run",
    "torch_seed_generator",
    "native_torch_dropout",
]


def own_core(layer):
    """Whether `layer` is a `keras.layers.MultiHeadAttention` (or subclass)
    that keeps Keras's `_compute_attention`, the core chunks replace."""
    import keras

    attention = keras.layers.MultiHeadAttention
    return isinstance(layer, attention) and type(layer)._compute_attention is attention._compute_attention


@contextlib.contextmanager
def core_replaced(layer, compute):
    """`layer._compute_attention` is `compute(original, ...)` on the instance
    for the duration of the block, then what it was (restored on error
    too). Keras's `call` looks it up on the instance; its check for a
    subclass's own core looks at the class, which stays as it is."""
    original = layer._compute_attention
    had_own = "_compute_attention" in layer.__dict__
    object.__setattr__(layer, "_compute_attention", lambda *args, **kwargs: compute(original, *args, **kwargs))
    try:
        yield
    finally:
        if had_own:
            object.__setattr__(layer, "_compute_attention", original)
        else:
            object.__delattr__(layer, "_compute_attention")


def parts(layer):
    """What `MultiHeadAttention._compute_attention` (Keras 3.15) computes
    with: its equations, scale, masked softmax, dropout and flags."""
    return types.SimpleNamespace(
        dropout_rate=layer._dropout,
        dropout=layer._dropout_layer,
        masked_softmax=layer._masked_softmax,
        causal_mask=layer._compute_causal_mask,
        scale=layer._inverse_sqrt_key_dim,
        scores_equation=layer._dot_product_equation,
        combine_equation=layer._combine_equation,
        axes=tuple(layer._attention_axes),
        flash=layer._flash_attention,
    )


def draw_seed(seed_generator):
    """The seed a `keras.random` op draws from `seed_generator` (advancing
    it), as the backend's op gets it."""
    from keras.src.random.seed_generator import draw_seed as draw

    return draw(seed_generator)


def tf_cast_seed(seed):
    """A drawn seed as TensorFlow's stateless random ops take it (int32),
    as Keras's TensorFlow backend casts it."""
    from keras.src.backend.tensorflow.random import _cast_seed

    return _cast_seed(seed)


def torch_seed_generator(seed_generator):
    """The `torch.Generator` Keras's PyTorch backend seeds for one random op
    from `seed_generator` (advancing it)."""
    from keras.src.backend.torch.random import torch_seed_generator as generator

    return generator(seed_generator)


def native_torch_dropout(dropout):
    """Whether Keras's PyTorch dropout runs torch's own unseeded kernel for
    the Dropout layer `dropout`: its seed generator has no seed
    (`SeedGenerator._initial_seed`) and it has no noise shape."""
    return dropout.seed_generator._initial_seed is None and dropout.noise_shape is None


def tf_key_counter_alg(seed):
    """The Philox key, counter and algorithm `tf.random.stateless_uniform`
    derives from `seed` (its "auto_select" algorithm; raw ops, public)."""
    import tensorflow as tf

    return tf.raw_ops.StatelessRandomGetKeyCounterAlg(seed=seed)


def tf_uniform_run(key, counter, alg, start, n, dtype):
    """Elements `start` to `start + n` of the flattened
    `tf.random.stateless_uniform` draw with this key, counter and
    algorithm, drawn alone: Philox gives 4 float32s a counter value, in
    order, so the run starts `start // 4` counter values on (`start` a
    multiple of 4; the 128-bit counter's low word carries into its high
    word). Equal bit for bit to the same elements of the whole draw
    (tests/test_attention_chunks.py)."""
    import tensorflow as tf

    counter = tf.cast(counter, tf.uint64)
    low = counter[0] + tf.constant(start // 4, tf.uint64)
    high = counter[1] + tf.cast(low < counter[0], tf.uint64)
    offset = tf.stack([low, high])
    return tf.raw_ops.StatelessRandomUniformV2(shape=[n], key=key, counter=offset, alg=alg, dtype=dtype)


def jax_draws_by_index(key):
    """Whether `jax.random.bernoulli(key, ...)` draws each element from its
    own flat index (threefry, `jax_threefry_partitionable`, on a raw
    uint32 key of 2 words, as Keras's seed generators give), so a run of
    it can be drawn alone (`jax_bernoulli_run`)."""
    import jax

    return (
        jax.config.jax_threefry_partitionable
        and jax.config.jax_default_prng_impl == "threefry2x32"
        and tuple(key.shape) == (2,)
        and str(key.dtype) == "uint32"
    )


def jax_bernoulli_run(key, start, n, p):
    """Elements `start` to `start + n` of the flattened
    `jax.random.bernoulli(key, p, shape)` draw, drawn alone: JAX's
    partitionable threefry hashes each element's flat index (split into
    two 32-bit words), and `uniform` makes a float in [1, 2) of the bits'
    top 23, minus 1 (jax/_src/random/threefry2x32.py, jax/_src/random.py,
    JAX 0.10). Equal bit for bit to the same elements of the whole draw
    (tests/test_attention_chunks.py)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.extend.random import threefry2x32_p

    lo = jnp.arange(n, dtype=jnp.uint32) + jnp.uint32(start & 0xFFFFFFFF)
    hi = jnp.uint32(start >> 32) + (lo < jnp.uint32(start & 0xFFFFFFFF)).astype(jnp.uint32)
    bits1, bits2 = threefry2x32_p.bind(key[0], key[1], jnp.broadcast_to(hi, (n,)), lo)
    mantissa = lax.shift_right_logical(bits1 ^ bits2, jnp.uint32(32 - 23))
    floats = lax.bitcast_convert_type(mantissa | jnp.uint32(0x3F800000), jnp.float32) - jnp.float32(1.0)
    return lax.max(jnp.float32(0.0), floats * jnp.float32(1.0) + jnp.float32(0.0)) < jnp.float32(p)
