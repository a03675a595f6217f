"""Masks across cuts (issue 36): Keras attaches a mask to a tensor
(`_keras_mask`), the layers after read it from there, and some change it
(MultiHeadAttention removes the masks of its inputs; a nested model's call
attaches the masks it is given). A checkpointed model must show every layer
call the masks it saw in the original, in the forward pass and in the
recompute alike, wherever the cuts fall.

- A `Segment` reads the masks its inputs carry when it runs, attaches them
  to the inputs of every run of its sub-model (the recompute's are new
  tensors), and hands back what its layers did to them.
- Calls that read a tensor with a mask keep Keras's order.
- A nested model called with the masks its inputs carry (as Keras fills
  them in) is flattened and cut inside; one called with a mask that a call
  before may have removed stays whole.
"""

import warnings

import keras
import numpy as np
import pytest
from keras import layers, ops

import graphckpt
from graphckpt import keras_compat
from graphckpt.graph.build import build_graph
from graphckpt.runtime.segment import Segment
from tests.helpers import BACKEND, compare_step, restore, state_of, to_numpy
from tests.test_exact_fit import assert_trains_alike
from tests.test_fit_flag import segments_of

pytestmark = pytest.mark.backends

# As in test_backends: tf.function and eager on TensorFlow, jax.jit on JAX.
MODES = pytest.mark.parametrize(
    "compiled",
    {"tensorflow": [False, True], "jax": [True], "torch": [False]}[BACKEND],
    ids=lambda c: "compiled" if c else "eager",
)

STEPS, FEATURES, VOCAB = 8, 6, 20


def _lengths(rng, n, steps):
    return rng.integers(2, steps, size=n)


def padded_floats(n, steps=STEPS, features=FEATURES, seed=0):
    """Float sequences whose trailing steps (1 or more per row) are zeros."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, steps, features)).astype("float32")
    x[np.arange(steps)[None, :] >= _lengths(rng, n, steps)[:, None]] = 0.0
    return x


def padded_tokens(n, steps=STEPS, seed=0):
    """Token ids in [1, VOCAB) with trailing 0s (1 or more per row)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(n, steps)).astype("int32")
    x[np.arange(steps)[None, :] >= _lengths(rng, n, steps)[:, None]] = 0
    return x


# -- Small models, a mask made before, inside and after the cuts ------------


def masking_first(masked=True):
    """Report 1's model, small: Masking -> 4 x Dense(16, tanh) -> LSTM(8) ->
    Dense(2). Dense passes the mask on only as the tensor's attachment."""
    inp = keras.Input((STEPS, FEATURES))
    x = layers.Masking()(inp) if masked else inp
    for _ in range(4):
        x = layers.Dense(16, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(2)(layers.LSTM(8)(x)), name="masking_first")


def embedding_first(masked=True):
    inp = keras.Input((STEPS,), dtype="int32")
    x = layers.Embedding(VOCAB, 8, mask_zero=masked)(inp)
    for _ in range(3):
        x = layers.Dense(16, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(1)(layers.LSTM(8)(x)), name="embedding_first")


def masking_late(masked=True):
    """The mask is made after three layers: bias-free tanh layers keep the
    zero-padded steps exactly zero, and Masking finds them there."""
    inp = keras.Input((STEPS, FEATURES))
    x = inp
    for _ in range(3):
        x = layers.Dense(16, activation="tanh", use_bias=False)(x)
    if masked:
        x = layers.Masking()(x)
    x = layers.Dense(16, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(1)(layers.LSTM(8)(x)), name="masking_late")


def padded_attention(masked=True):
    """An embedding's padding mask into self-attention (Keras fills in its
    query, value and key masks from the tensors), on as the query mask of a
    cross-attention over a float branch, then an LSTM and masked pooling."""
    tokens = keras.Input((STEPS,), dtype="int32", name="tokens")
    feats = keras.Input((STEPS, FEATURES), name="feats")
    e = layers.Dense(8, activation="tanh")(layers.Embedding(VOCAB, 8, mask_zero=masked)(tokens))
    s = layers.MultiHeadAttention(2, 4)(e, e)
    f = layers.Dense(8, activation="tanh")(layers.Dense(8, activation="tanh")(feats))
    x = layers.MultiHeadAttention(2, 4)(s, f)
    x = layers.LSTM(8, return_sequences=True)(layers.Dense(8, activation="tanh")(x))
    return keras.Model([tokens, feats], layers.Dense(1)(layers.GlobalAveragePooling1D()(x)), name="padded_attention")


SMALL = {
    "masking_first": (masking_first, lambda n: padded_floats(n)),
    "embedding_first": (embedding_first, lambda n: padded_tokens(n)),
    "masking_late": (masking_late, lambda n: padded_floats(n)),
    "padded_attention": (padded_attention, lambda n: [padded_tokens(n), padded_floats(n, seed=1)]),
}


@MODES
@pytest.mark.parametrize("name", sorted(SMALL))
def test_masks_made_before_inside_and_after_cuts(name, compiled):
    """2 segments, and one per layer call, so that cuts fall before, at and
    after the call that makes the mask, or around it. Before the fix, a
    segment whose input carried a mask only as an attachment ran its forward
    pass with it and its recompute without: "recomputed a different
    structure"."""
    build, data = SMALL[name]
    keras.utils.set_random_seed(0)
    model = build()
    x = data(4)
    unmasked = build(masked=False)
    unmasked.set_weights(model.get_weights())
    assert not np.allclose(to_numpy(model(x)), to_numpy(unmasked(x)), atol=1e-4)  # the masks matter
    n = len(graphckpt.plan(model, segments=1).order)
    for k in (2, n):
        ck = graphckpt.checkpoint_model(model, segments=k)
        compare_step(model, ck, x, compiled=compiled)
        assert all(s.forward_calls >= 2 for s in _with_weights(ck.layers)), k  # recomputed


def _with_weights(segments):
    """The `Segment`s among `segments` that hold trainable weights: each
    must recompute for their gradients. (A segment of Masking alone on the
    model's input, or of an embedding's mask op, has no backward pass.)"""
    return [s for s in segments if isinstance(s, Segment) and s.model.trainable_variables]


def _fit_three_ways(model, x, y, fit_kwargs, segments, compile_kwargs, input_shape=None):
    """Plain `fit`, `checkpoint_model(model, segments=..., input_shape=...)`
    then `fit`, and `fit(gradient_checkpointing=...)`, each from the same
    variables and seeds. Returns the reference (initial state, histories,
    final state), the two others, the checkpointed model and the fit flag's
    segments."""
    start = state_of(model)

    def fit(target, **flag):
        target.compile(**compile_kwargs())
        keras.utils.set_random_seed(11)  # the same Dropout masks
        history = target.fit(x, y, shuffle=False, verbose=0, **fit_kwargs, **flag)
        return start, [history.history], state_of(model)

    reference = fit(model)
    restore(model, start)
    ck = graphckpt.checkpoint_model(model, segments=segments, input_shape=input_shape)
    checkpointed = fit(ck)
    restore(model, start)
    graphckpt.install()
    try:
        flagged = fit(model, gradient_checkpointing=segments)
    finally:
        graphckpt.uninstall()
    return reference, checkpointed, flagged, ck, segments_of(model)


def report_model(masked=True):
    """Issue 36's report 1, as measured: Masking -> 8 x Dense(256, tanh) ->
    LSTM(8) -> Dense(2) on (64, 200, 64) inputs."""
    inp = keras.Input((200, 64))
    x = layers.Masking()(inp) if masked else inp
    for _ in range(8):
        x = layers.Dense(256, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(2)(layers.LSTM(8)(x)), name="report_model")


@pytest.mark.parametrize(
    "jit_compile", [False, True] if BACKEND == "tensorflow" else [False], ids=lambda j: "xla" if j else "default"
)
def test_the_default_plan_of_the_reported_model_trains_like_plain_fit(jit_compile):
    """Report 1: plain `fit` trained; the default plan failed at the first
    step, in `checkpoint_model(model)` and in the fit flag alike. Two steps
    of batch 64, on TensorFlow with and without XLA."""
    keras.utils.set_random_seed(0)
    model = report_model()
    x = padded_floats(64, steps=200, features=64)
    y = np.random.default_rng(1).normal(size=(64, 2)).astype("float32")
    unmasked = report_model(masked=False)
    unmasked.set_weights(model.get_weights())
    assert not np.allclose(to_numpy(model(x[:4])), to_numpy(unmasked(x[:4])), atol=1e-4)  # the mask matters

    def compile_kwargs():
        kwargs = {"jit_compile": jit_compile} if BACKEND == "tensorflow" else {}
        return {"optimizer": keras.optimizers.SGD(0.05), "loss": "mse", **kwargs}

    fit_kwargs = {"batch_size": 32, "epochs": 1}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        reference, checkpointed, flagged, ck, flag_segments = _fit_three_ways(
            model, x, y, fit_kwargs, "auto", compile_kwargs
        )
    # A segment's sub-model gets the masks as Keras's own nested calls do,
    # without Keras's warning that a functional model "does not support
    # masking" (Keras 3.16 also warns so of the LSTM, in plain `fit` too).
    warned = [str(w.message) for w in record if "does not support masking" in str(w.message)]
    assert not [m for m in warned if "(of type Functional)" in m], warned
    _, want_histories, want_state = reference
    assert_trains_alike(checkpointed, want_histories, want_state)
    assert_trains_alike(flagged, want_histories, want_state)
    # The mechanism: the default plan recomputes a segment that the mask
    # enters from outside (Masking is in an earlier segment), and every
    # recomputed segment ran its recompute.
    recomputed = _with_weights(ck.layers)
    masking = model.layers[1]
    assert any(masking not in s.model.layers for s in recomputed)
    assert recomputed and all(s.forward_calls >= 2 for s in recomputed)
    assert _with_weights(flag_segments) and all(s.forward_calls >= 2 for s in _with_weights(flag_segments))


# -- A decoder model called with a mask (keras.io's translation Transformer) --


class TransformerEncoder(layers.Layer):
    """keras.io's "English-to-Spanish translation with a sequence-to-sequence
    Transformer" (its Keras 3 version), as published."""

    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = ops.cast(mask[:, None, :], dtype="int32") if mask is not None else None
        attention_output = self.attention(query=inputs, value=inputs, key=inputs, attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        return self.layernorm_2(proj_input + self.dense_proj(proj_input))


class PositionalEmbedding(layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = layers.Embedding(input_dim=sequence_length, output_dim=embed_dim)

    def call(self, inputs):
        positions = ops.arange(0, ops.shape(inputs)[-1], 1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, encoder_outputs, mask=None):
        causal_mask = self.get_causal_attention_mask(inputs)
        if mask is not None:
            padding_mask = ops.minimum(ops.cast(mask[:, None, :], dtype="int32"), causal_mask)
        else:
            padding_mask = None
        attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs, attention_mask=causal_mask)
        out_1 = self.layernorm_1(inputs + attention_output_1)
        # Keras fills in the value and key masks from `encoder_outputs`: the
        # mask the decoder model's call attached to its input.
        attention_output_2 = self.attention_2(
            query=out_1, value=encoder_outputs, key=encoder_outputs, attention_mask=padding_mask
        )
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        return self.layernorm_3(out_2 + self.dense_proj(out_2))

    def get_causal_attention_mask(self, inputs):
        batch_size, sequence_length = ops.shape(inputs)[0], ops.shape(inputs)[1]
        i = ops.arange(sequence_length)[:, None]
        j = ops.arange(sequence_length)
        mask = ops.cast(i >= j, dtype="int32")
        return ops.broadcast_to(mask[None], (batch_size, sequence_length, sequence_length))


def translation_transformer(decoder_blocks=1, embed_dim=16, latent_dim=32, num_heads=2):
    """keras.io's model, small: the encoder's layers inline, the decoder a
    nested model called on the encoder's output, whose padding mask Keras
    passes to the call (`decoder(..., mask=[None, padding mask])`). keras.io
    has one decoder block; with two, the first one's cross-attention
    removes the mask from the encoder's output (Keras's MultiHeadAttention
    does so to its inputs), and the second attends over every position."""
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(STEPS, VOCAB, embed_dim)(encoder_inputs)
    encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    encoded_seq_inputs = keras.Input(shape=(None, embed_dim), name="decoder_state_inputs")
    x = PositionalEmbedding(STEPS, VOCAB, embed_dim)(decoder_inputs)
    for _ in range(decoder_blocks):
        x = TransformerDecoder(embed_dim, latent_dim, num_heads)(x, encoded_seq_inputs)
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(VOCAB, activation="softmax")(x)
    decoder = keras.Model([decoder_inputs, encoded_seq_inputs], decoder_outputs, name="decoder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: a Functional "does not support masking" (it applies them)
        decoder_outputs = decoder([decoder_inputs, encoder_outputs])
    return keras.Model([encoder_inputs, decoder_inputs], decoder_outputs, name="transformer")


def _translation_data(n):
    x = [padded_tokens(n).astype("int64"), padded_tokens(n, seed=1).astype("int64")]
    return x, padded_tokens(n, seed=2)


def _decoder_segments(ck, decoder):
    """The segments of `ck` that hold layers of the nested `decoder`."""
    inner = {id(layer) for layer in decoder.layers}
    return [s for s in ck.layers if isinstance(s, Segment) and any(id(layer) in inner for layer in s.model.layers)]


def _no_warning_of_kept_whole_models(record):
    messages = [str(w.message) for w in record]
    assert not [m for m in messages if "Nested models called as one layer" in m], messages


def test_a_decoder_called_with_a_mask_is_cut_inside_and_trains_like_plain_fit():
    """Report 2: keras.io's translation Transformer trained exactly through
    the flag, but its decoder, called with a mask, stayed whole (a warning
    said so). It is cut inside now, without a warning, and still exact."""
    keras.utils.set_random_seed(0)
    model = translation_transformer()
    decoder = model.get_layer("decoder")
    assert build_graph(model).kept_whole == {}
    x, y = _translation_data(32)

    def compile_kwargs():
        return {"optimizer": keras.optimizers.SGD(0.1), "loss": "sparse_categorical_crossentropy"}

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        reference, checkpointed, flagged, ck, flag_segments = _fit_three_ways(
            model, x, y, {"batch_size": 16, "epochs": 2}, 5, compile_kwargs, input_shape=[(16, STEPS)] * 2
        )
    _no_warning_of_kept_whole_models(record)
    _, want_histories, want_state = reference
    assert_trains_alike(checkpointed, want_histories, want_state)
    assert_trains_alike(flagged, want_histories, want_state)
    assert len(_decoder_segments(ck, decoder)) >= 2  # cuts inside the decoder
    assert all(s.forward_calls >= 2 for s in _with_weights(ck.layers))
    assert _with_weights(flag_segments) and all(s.forward_calls >= 2 for s in _with_weights(flag_segments))


def _splitting(model, paths, **plan_kwargs):
    """The least number of segments whose plan puts the calls of the layers
    at `paths` (as `"decoder/dense"`) in as many segments, or None."""
    n = len(graphckpt.plan(model, segments=1, **plan_kwargs).order)
    for k in range(2, n + 1):
        plan = graphckpt.plan(model, segments=k, **plan_kwargs)
        where = {node[0]: seg.index for seg in plan.segments for node in seg.nodes}
        if len({where.get(p) for p in paths} - {None}) == len(paths):
            return k
    return None


@MODES
def test_cuts_between_decoder_blocks_keep_the_masks_their_attention_removed(compiled):
    """Two decoder blocks: in the original the first one's cross-attention
    removes the mask from the encoder's output, so the second one's attends
    over the padding too. Cut between them, the second block's segment must
    see that: on JAX under jit its forward pass runs on new tensors, and it
    saw the mask the first segment had removed (outputs off by 5e-2)."""
    keras.utils.set_random_seed(0)
    model = translation_transformer(decoder_blocks=2)
    x, _ = _translation_data(4)
    decoder = model.get_layer("decoder")
    blocks = [f"decoder/{layer.name}" for layer in decoder.layers if isinstance(layer, TransformerDecoder)]
    shape = {"input_shape": [(4, STEPS)] * 2}
    k = _splitting(model, blocks, **shape)
    assert k is not None
    compare_step(model, graphckpt.checkpoint_model(model, segments=k, **shape), x, compiled=compiled)


class CrossAttention(layers.Layer):
    """Attends from `query` over `value`; Keras fills in the value mask from
    the one `value` carries."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = layers.MultiHeadAttention(2, 4)
        self.supports_masking = True

    def call(self, query, value):
        return self.mha(query=query, value=value)


def _cross_decoder(name):
    d, e = keras.Input((STEPS, 8)), keras.Input((STEPS, 8))
    y = CrossAttention()(layers.Dense(8)(d), e)
    return keras.Model([d, e], layers.Dense(8, activation="tanh")(y), name=name)


def two_decoders_on_one_masked_tensor():
    """`first` and `second` are both called with the embedding's padding
    mask (filled in by Keras). `first` reads the embedding first, so the
    mask is still attached; its attention then removes it, and `second`'s
    call attaches it again, which flattening would skip."""
    tokens = keras.Input((STEPS,), dtype="int32")
    feats = keras.Input((STEPS, FEATURES))
    h = layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: a Functional "does not support masking"
        a = _cross_decoder("first")([layers.Dense(8, activation="tanh")(feats), h])
        b = _cross_decoder("second")([a, h])
    return keras.Model([tokens, feats], layers.Dense(1)(layers.GlobalAveragePooling1D()(b)))


@MODES
def test_a_nested_call_is_cut_inside_only_where_its_masks_are_those_its_inputs_carry(compiled):
    """`second` stays whole where Keras records the masks it filled in on
    the call (3.15); Keras 3.16 records none, fills them in at run time from
    what the inputs carry then, and `second` is cut inside like `first`."""
    keras.utils.set_random_seed(0)
    model = two_decoders_on_one_masked_tensor()
    whole = build_graph(model).kept_whole
    recorded = keras_compat.inbound_nodes(model.get_layer("second"))[-1].arguments.kwargs.get("mask")
    if recorded is not None:
        assert whole == {"second": "it is called with a mask that its input may not carry then"}
    else:
        assert whole == {}
    x = [padded_tokens(4), padded_floats(4)]
    first = model.get_layer("first")
    inner = [f"first/{layer.name}" for layer in first.layers[-2:]]  # its CrossAttention and last Dense
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `second` is kept whole: checked above
        k = _splitting(model, inner)
        assert k is not None
        compare_step(model, graphckpt.checkpoint_model(model, segments=k), x, compiled=compiled)


def two_readers_of_a_masked_tensor():
    """A MultiHeadAttention (`A`) and a layer whose attention reads the mask
    `value` carries (`B`) read the same embedding. Keras runs A first (its
    query comes from a longer branch), which removes the embedding's mask,
    so B attends over the padding; the planner's as-soon-as-possible order
    ran B first, with the mask."""
    tokens = keras.Input((STEPS,), dtype="int32")
    h = layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
    q = h
    for i in range(3):
        q = layers.Dense(8, activation="tanh", name=f"long{i}")(q)
    a = layers.MultiHeadAttention(2, 4, name="A")(q, h)
    b = CrossAttention(name="B")(layers.Dense(8, name="short")(h), h)
    x = layers.GlobalAveragePooling1D()(layers.Add()([a, b]))
    return keras.Model(tokens, layers.Dense(1)(x))


@MODES
def test_calls_that_read_a_masked_tensor_keep_kerass_order(compiled):
    keras.utils.set_random_seed(0)
    model = two_readers_of_a_masked_tensor()
    order = [key[0] for key in graphckpt.plan(model, segments=1).order]
    assert order.index("A") < order.index("B")
    x = padded_tokens(4)
    for k in (1, 3):
        compare_step(model, graphckpt.checkpoint_model(model, segments=k), x, compiled=compiled)
