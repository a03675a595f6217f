"""Opening composite layers (`open_layers=True`): a transformer block
written as a `keras.layers.Layer` subclass, as keras.io's examples write
them, and Keras's `MultiHeadAttention` inside it, are cut inside, with the
same layer objects, and train exactly like the original."""

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from graphckpt.graph.build import build_graph
from graphckpt.runtime.segment import Segment
from tests.helpers import compare_step, to_numpy

pytestmark = pytest.mark.backends


class TransformerBlock(layers.Layer):
    """keras.io's text-classification transformer block."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim // num_heads, dropout=rate)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs, training=training)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)


def blocks_model(n=3, seq=8, dim=16, block=TransformerBlock):
    keras.utils.set_random_seed(0)
    inp = keras.Input((seq, dim))
    x = inp
    for _ in range(n):
        x = block(dim, 4, 2 * dim)(x)
    return keras.Model(inp, layers.Dense(1)(layers.GlobalAveragePooling1D()(x)))


def _x(seq=8, dim=16):
    return np.random.default_rng(0).normal(size=(4, seq, dim)).astype("float32")


def test_blocks_and_their_attention_are_cut_inside_and_train_exactly():
    model = blocks_model()
    ck = graphckpt.checkpoint_model(model, segments=6, open_layers=True)
    assert ck.plan.open_layers
    segments = [layer for layer in ck.layers if isinstance(layer, Segment)]
    # Cuts fall inside the blocks and inside their attention layers: no
    # segment holds a whole block, and some segment starts inside an MHA.
    names = [key[0] for seg in ck.plan.segments for key in seg.nodes]
    assert not any(name.startswith("transformer_block") and "/" not in name for name in names)
    firsts = [seg.nodes[0][0] for seg in ck.plan.segments]
    assert any("multi_head_attention" in name for name in firsts[1:]) or any(
        "multi_head_attention" in seg.nodes[-1][0] for seg in ck.plan.segments[:-1]
    )
    assert {id(v) for v in ck.weights} == {id(v) for v in model.weights}
    worst = compare_step(model, ck, _x(), atol=2e-6)  # Dropout masks included
    assert worst < 2e-6
    assert all(s.forward_calls >= 2 for s in segments)  # recomputed


def test_fit_equals_plain_fit():
    x, y = _x(), np.random.default_rng(1).normal(size=(4, 1)).astype("float32")
    runs = []
    for opened in (False, True):
        model = blocks_model()
        target = graphckpt.checkpoint_model(model, segments=6, open_layers=True) if opened else model
        target.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        keras.utils.set_random_seed(3)
        history = target.fit(x, y, batch_size=2, epochs=3, shuffle=False, verbose=0)
        runs.append((history.history["loss"], [to_numpy(v.value) for v in model.weights]))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    for a, b in zip(runs[1][1], runs[0][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class OwnWeight(layers.Layer):
    """A block whose `call` reads a variable of its own."""

    def __init__(self, dim, *args, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(dim)

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return self.dense(x) * self.scale


class BranchesOnTraining(layers.Layer):
    """A block whose `call` takes another path in training."""

    def __init__(self, dim, *args, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(dim)
        self.drop = layers.Dropout(0.5)

    def call(self, x, training=None):
        h = self.dense(x)
        return self.drop(h, training=training) if training else h


@pytest.mark.parametrize(
    "block, why",
    [(OwnWeight, "variables or seed generators of its own"), (BranchesOnTraining, "computes other values")],
    ids=["own variable", "branch on training"],
)
def test_a_block_that_cannot_be_opened_exactly_stays_one_call_and_says_why(block, why):
    model = blocks_model(n=2, block=block)
    graph = build_graph(model, open_layers=True)
    assert len(graph.not_opened) == 2
    assert all(why in reason for reason in graph.not_opened.values())
    ck = graphckpt.checkpoint_model(model, segments=2, open_layers=True)
    compare_step(model, ck, _x())


def test_the_trace_is_made_once_and_leaves_the_layers_as_they_were():
    """Building the graph again reuses the opened graph (same keys, no new
    calls recorded on the sublayers), and the source model's own config is
    unchanged."""
    model = blocks_model(n=2)
    config = model.get_config()
    first = build_graph(model, open_layers=True)
    block = model.layers[1]
    calls = [len(sub._inbound_nodes) for sub in block._flatten_layers()]
    second = build_graph(model, open_layers=True)
    assert set(first.nodes) == set(second.nodes)
    assert [len(sub._inbound_nodes) for sub in block._flatten_layers()] == calls
    assert model.get_config() == config


def test_mixed_precision_blocks_open_and_train_exactly():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = blocks_model(n=2)
    ck = graphckpt.checkpoint_model(model, segments=4, open_layers=True)
    # The blocks open (their inputs are cast to bfloat16 first, as
    # `Layer.__call__` does); Keras 3.16's MultiHeadAttention calls the
    # backend's functions, which no trace records, and stays one call there.
    closed = build_graph(model, open_layers=True).not_opened
    assert not [path for path in closed if "/" not in path]
    # Each opened block computes what the block does to float32 rounding
    # (`graphckpt.graph.opening._verify`, outputs and gradients). Across the
    # model, a tensor with consumers on both sides of a cut gets its
    # gradient summed in another grouping, and in bfloat16 that rounds
    # differently: a few bfloat16 ulps (measured: 1.2e-4 on 5.8e-3), where
    # float32 differs by 1e-7 (the tests above). A wrong mask or a missing
    # cast would be off by far more.
    compare_step(model, ck, _x(), atol=3e-3, rtol=3e-2)


def test_a_saved_opened_plan_loads_with_the_same_segments(tmp_path):
    keras.saving.get_custom_objects()["TransformerBlock"] = TransformerBlock
    try:
        model = blocks_model(n=2)
        ck = graphckpt.checkpoint_model(model, segments=4, open_layers=True)
        ck.save(tmp_path / "ck.keras")
        loaded = keras.saving.load_model(tmp_path / "ck.keras")
    finally:
        del keras.saving.get_custom_objects()["TransformerBlock"]
    assert loaded.plan.open_layers
    assert [len(s.nodes) for s in loaded.plan.segments] == [len(s.nodes) for s in ck.plan.segments]
    x = _x()
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(ck(x)), rtol=1e-6, atol=1e-6)


def test_a_vit_classifier_through_the_fit_flag_trains_as_plain_fit(installed):
    """keras_hub's ViT runs every block inside one `ViTEncoder` call: with
    `open_layers=True` the flag cuts between and inside them, and trains
    the task model's own weights as plain `fit` does: within the noise
    plain `fit` itself shows between its graph and eager runs (TensorFlow's
    graph rewrites round the two graphs differently; tests/test_onednn.py)."""
    # keras-hub 0.32 fails to import on keras-nightly (a name it imports moved).
    keras_hub = pytest.importorskip("keras_hub", exc_type=ImportError)

    def build(**compile_kwargs):
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.ViTBackbone(
            image_shape=(32, 32, 3), patch_size=8, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32,
            dropout_rate=0.1, attention_dropout=0.1,
        )
        model = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy", **compile_kwargs)
        return model

    x = np.random.default_rng(0).normal(size=(8, 32, 32, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, size=(8,))
    runs = {}
    for name, compile_kwargs, flag in [
        ("plain", {}, {}),
        ("eager", {"run_eagerly": True}, {}),
        ("opened", {}, {"gradient_checkpointing": 5, "open_layers": True}),
    ]:
        model = build(**compile_kwargs)
        keras.utils.set_random_seed(3)
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, **flag)
        runs[name] = (np.array(history.history["loss"]), [to_numpy(v.value) for v in model.weights], model)
    plain, eager, opened = runs["plain"], runs["eager"], runs["opened"]
    np.testing.assert_allclose(opened[0], plain[0], rtol=1e-4)
    for p, e, o in zip(plain[1], eager[1], opened[1]):
        assert np.max(np.abs(o - p)) <= 2 * np.max(np.abs(e - p)) + 1e-6
    from graphckpt.training.flag import _CACHE_ATTR

    cache = opened[2].__dict__[_CACHE_ATTR]
    ((twin, plan),) = cache.plans.values()
    assert plan.open_layers and any("vit_encoder/" in seg.nodes[0][0] for seg in plan.segments[1:])
    assert all(s.forward_calls >= 2 for s in twin.segments)


def _gpt2_lm(keras_hub):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.1,
        max_sequence_length=16,
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    return model


def gpt2_fits_alike(keras_hub, data, flag):
    """Fits the small GPT-2 LM plainly and with the fit flag's `flag`
    (3 epochs, the same seeds), asserts the same loss history and weights,
    and returns the flag's model."""
    runs = []
    for kwargs in ({}, flag):
        model = _gpt2_lm(keras_hub)
        keras.utils.set_random_seed(3)
        history = model.fit(data, epochs=3, verbose=0, **kwargs)
        runs.append((history.history["loss"], [to_numpy(v.value) for v in model.weights], model))
    (plain_loss, plain_weights, _), (loss, weights, model) = runs
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    for a, b in zip(weights, plain_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
    return model


def _tokens(n, seq=8):
    rng = np.random.default_rng(0)
    mask = np.ones((n, seq), "int32")
    mask[::2, -3:] = 0  # padded examples
    return {"token_ids": rng.integers(1, 50, size=(n, seq)).astype("int32"), "padding_mask": mask}, rng.integers(
        0, 50, size=(n, seq)
    )


def test_a_gpt2_causal_lm_opens_its_decoders_at_the_data_shapes_and_trains_as_plain_fit(installed):
    """keras_hub's `TransformerDecoder` builds its causal mask with Python
    arithmetic on the sequence length and batch size, and calls its
    `CachedMultiHeadAttention` with `cache=None`: it opens only when traced
    at the shapes the flag plans for, and then trains the task model's own
    weights as plain `fit` does, padding mask included."""
    keras_hub = pytest.importorskip("keras_hub", exc_type=ImportError)
    import tensorflow as tf

    # keras_hub's task `fit` batches arrays into a dataset whose batch
    # dimension is unknown; a dataset of full batches gives it.
    data = tf.data.Dataset.from_tensor_slices(_tokens(8)).batch(4, drop_remainder=True)
    model = gpt2_fits_alike(keras_hub, data, {"gradient_checkpointing": 6, "open_layers": True})
    from graphckpt.training.flag import _CACHE_ATTR

    ((twin, plan),) = model.__dict__[_CACHE_ATTR].plans.values()
    assert plan.opened_at is not None and plan.opened_at[0] == (4, 8)
    inside = [seg for seg in plan.segments if "transformer_layer_0/" in seg.nodes[0][0]]
    assert inside and all(s.forward_calls >= 2 for s in twin.segments)


def test_a_decoder_that_needs_a_fixed_batch_stays_whole_with_a_warning_where_batches_vary(installed):
    keras_hub = pytest.importorskip("keras_hub", exc_type=ImportError)
    model = _gpt2_lm(keras_hub)
    with pytest.warns(graphckpt.GraphckptWarning, match="transformer_layer_0.*cannot be traced.*fixed batch size"):
        the_plan = graphckpt.plan(model, open_layers=True, input_shape=[(None, 8), (None, 8)], batch_size=4)
    names = [name for seg in the_plan.segments for name, _ in seg.nodes]
    assert f"{model.backbone.name}/transformer_layer_0" in names
    assert not [name for name in names if "transformer_layer_0/" in name]


def test_a_backbone_opened_at_fixed_shapes_saves_and_loads_opened_at_them(installed, tmp_path):
    keras_hub = pytest.importorskip("keras_hub", exc_type=ImportError)
    backbone = _gpt2_lm(keras_hub).backbone
    ck = graphckpt.checkpoint_model(backbone, segments=6, open_layers=True, input_shape=[(4, 8), (4, 8)])
    assert ck.plan.opened_at == ((4, 8), (4, 8))
    assert any("transformer_layer_1/" in seg.nodes[0][0] for seg in ck.plan.segments)
    ck.save(tmp_path / "ck.keras")
    loaded = keras.saving.load_model(tmp_path / "ck.keras")
    assert loaded.plan.opened_at == ck.plan.opened_at
    assert [len(s.nodes) for s in loaded.plan.segments] == [len(s.nodes) for s in ck.plan.segments]
    x, _ = _tokens(4)
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(ck(x)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(to_numpy(ck(x)), to_numpy(backbone(x)), rtol=1e-6, atol=1e-6)


def test_save_projections_keeps_the_projections_and_recomputes_the_attention_core():
    """Megatron's selective recompute as a policy: with the blocks opened,
    the calls of layers with kernels run inline, kept (never recomputed),
    and the attention core's ops (scores, softmax, dropout, weighted sum)
    are in recomputed segments; the model trains exactly."""
    model = blocks_model(n=2)
    closed = build_graph(model, open_layers=True).not_opened
    if closed:  # Keras 3.16's MultiHeadAttention calls backend functions, which no trace records
        pytest.skip(f"this Keras's MultiHeadAttention stays whole: {next(iter(closed.values()))}")
    ck = graphckpt.checkpoint_model(model, policy="save_projections", open_layers=True)
    remat_of = {key: seg.remat for seg in ck.plan.segments for key in seg.nodes}
    kernels = [key for key in remat_of if key[0].rsplit("/", 1)[-1] in ("query", "key", "value", "attention_output")]
    assert len(kernels) == 8 and not any(remat_of[k] for k in kernels)
    core = [key for key in remat_of if key[0].rsplit("/", 1)[-1].startswith(("softmax", "dropout"))
            and "multi_head_attention" in key[0]]
    assert core and all(remat_of[k] for k in core)
    # Only the recomputed segments became Segment layers; the kept calls run inline.
    segments = [layer for layer in ck.layers if isinstance(layer, Segment)]
    assert len(segments) == sum(seg.remat for seg in ck.plan.segments)
    compare_step(model, ck, _x(), atol=2e-6)
    assert segments and all(s.forward_calls >= 2 for s in segments)


def test_a_model_opened_at_fixed_shapes_refuses_other_shapes(installed):
    """A decoder traced at the planned shapes bakes its causal mask in:
    called on other shapes, the checkpointed model raises, never computes
    with the wrong mask."""
    keras_hub = pytest.importorskip("keras_hub", exc_type=ImportError)
    backbone = _gpt2_lm(keras_hub).backbone
    ck = graphckpt.checkpoint_model(backbone, segments=6, open_layers=True, input_shape=[(4, 8), (4, 8)])
    for n, seq in [(4, 6), (2, 8), (1, 8)]:
        x, _ = _tokens(n, seq)
        with pytest.raises(graphckpt.InvalidArgumentError, match=r"at input shapes \[\(4, 8\), \(4, 8\)\]"):
            ck(x)
    np.testing.assert_allclose(to_numpy(ck(_tokens(4)[0])), to_numpy(backbone(_tokens(4)[0])), rtol=1e-6, atol=1e-6)


def test_input_shape_alone_does_not_tie_an_opened_model_to_it():
    """Layers that trace on symbolic shapes serve any shape: planning with
    `input_shape=` (for the estimate) records no `opened_at`."""
    model = blocks_model(n=2)
    ck = graphckpt.checkpoint_model(model, segments=4, open_layers=True, input_shape=(4, 8, 16))
    assert ck.plan.open_layers and ck.plan.opened_at is None
    x = _x()[:2]  # another batch size
    np.testing.assert_allclose(to_numpy(ck(x)), to_numpy(model(x)), rtol=1e-6, atol=1e-6)


def test_a_predicate_opens_only_the_layers_it_says_and_the_plan_keeps_that(tmp_path, installed):
    """`open_layers=callable` opens the blocks but keeps their attention
    layers whole; the plan records which (`kept_closed`), a saved model
    reopens the same way, and the fit flag takes the predicate too."""
    keras.saving.get_custom_objects()["TransformerBlock"] = TransformerBlock
    try:
        model = blocks_model(n=2)
        keep_attention = lambda layer: not isinstance(layer, layers.MultiHeadAttention)  # noqa: E731
        ck = graphckpt.checkpoint_model(model, segments=4, open_layers=keep_attention)
        names = [key[0] for seg in ck.plan.segments for key in seg.nodes]
        attention = [n for n in names if "multi_head_attention" in n]
        assert len(attention) == 2 and all(n.count("/") == 1 for n in attention)  # inside a block, whole
        assert any("/layer_normalization" in n for n in names)  # the blocks opened
        assert len(ck.plan.kept_closed) == 2
        # The estimate rebuilds the plan's graph with those layers whole.
        assert graphckpt.estimate(model, ck.plan).peak_bytes == ck.plan.estimated_peak_bytes
        compare_step(model, ck, _x(), atol=2e-6)
        ck.save(tmp_path / "ck.keras")
        loaded = keras.saving.load_model(tmp_path / "ck.keras")
    finally:
        del keras.saving.get_custom_objects()["TransformerBlock"]
    assert loaded.plan.kept_closed == ck.plan.kept_closed
    assert [len(s.nodes) for s in loaded.plan.segments] == [len(s.nodes) for s in ck.plan.segments]
    with pytest.raises(graphckpt.InvalidArgumentTypeError, match="open_layers"):
        graphckpt.plan(model, open_layers="yes")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(_x(), np.zeros((4, 1)), epochs=1, verbose=0, gradient_checkpointing=4, open_layers=keep_attention)
    from graphckpt.training.flag import _CACHE_ATTR

    ((_, flag_plan),) = model.__dict__[_CACHE_ATTR].plans.values()
    assert flag_plan.kept_closed == ck.plan.kept_closed
