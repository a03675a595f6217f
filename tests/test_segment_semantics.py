"""The checkpointed model computes the same function as the original:
outputs, gradients and state after a step, in eager mode and in tf.function."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import graphckpt
from graphckpt.segment import Segment
from tests import models
from tests.helpers import compare_inference, compare_step, state_of

MODES = pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])


@MODES
@pytest.mark.parametrize("name", sorted(models.ALL))
def test_same_outputs_gradients_and_state(name, graph):
    model = models.ALL[name]()
    ck = graphckpt.checkpoint_model(model)
    x = models.sample_inputs(model)
    compare_inference(model, ck, x)
    compare_step(model, ck, x, graph=graph)


def _random_chain(noise_layer):
    inp = keras.Input((6, 6, 4))
    x = inp
    for _ in range(4):
        x = layers.Conv2D(4, 3, padding="same", activation="tanh")(x)
        x = noise_layer()(x)
    return keras.Model(inp, layers.Dense(2)(layers.Flatten()(x)))


RANDOM_LAYERS = {
    "Dropout": lambda: layers.Dropout(0.5),
    "GaussianNoise": lambda: layers.GaussianNoise(0.7),
    "GaussianDropout": lambda: layers.GaussianDropout(0.5),
    "SpatialDropout2D": lambda: layers.SpatialDropout2D(0.5),
    "AlphaDropout": lambda: layers.AlphaDropout(0.5),
}


@MODES
@pytest.mark.parametrize("kind", sorted(RANDOM_LAYERS))
def test_random_layers_draw_the_same_masks_on_recompute(kind, graph):
    model = _random_chain(RANDOM_LAYERS[kind])
    ck = graphckpt.checkpoint_model(model, segments=2)
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 4)).astype("float32")
    compare_step(model, ck, x, graph=graph)


@MODES
def test_naive_remat_would_be_wrong(graph):
    """Guard for the test above: without the snapshot, the recompute draws a
    different mask and the gradients differ. If this stops failing, the
    exactness tests no longer prove anything."""
    model = _random_chain(RANDOM_LAYERS["Dropout"])
    naive_in = keras.Input((6, 6, 4))

    class NaiveRemat(layers.Layer):
        def call(self, x, training=None):
            return keras.remat(lambda t: model(t, training=training))(x)

    naive = keras.Model(naive_in, NaiveRemat()(naive_in))
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 4)).astype("float32")
    with pytest.raises(AssertionError, match="gradient"):
        compare_step(model, naive, x, graph=graph)


@MODES
def test_batchnorm_statistics_updated_exactly_once(graph):
    model = models.resnet(blocks=2)
    ck = graphckpt.checkpoint_model(model, segments=3)
    bn = [l for l in model.layers if isinstance(l, layers.BatchNormalization)][0]
    x = np.random.default_rng(1).normal(size=(4, 8, 8, 3)).astype("float32")
    before = np.array(bn.moving_mean)
    compare_step(model, ck, x, graph=graph)  # includes state after the step
    after_one = np.array(bn.moving_mean)
    # One update with momentum 0.99 moves the mean by 1% of the batch mean; two would be ~2%.
    assert not np.allclose(before, after_one)


class _AddsLoss(layers.Layer):
    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


@MODES
def test_layer_losses_are_kept(graph):
    inp = keras.Input((8,))
    x = inp
    for i in range(6):
        x = layers.Dense(8, activation="tanh", kernel_regularizer="l2", activity_regularizer="l1")(x)
        if i == 3:
            x = _AddsLoss()(x)
    model = keras.Model(inp, layers.Dense(1)(x))
    ck = graphckpt.checkpoint_model(model, segments=3)
    x = np.random.default_rng(2).normal(size=(5, 8)).astype("float32")
    compare_step(model, ck, x, graph=graph)
    model(x, training=True)
    own = sorted(float(v) for v in model.losses)
    ck(x, training=True)
    ours = sorted(float(v) for v in ck.losses)
    np.testing.assert_allclose(ours, own, rtol=1e-6)
    assert len(ours) == 6 + 6 + 1  # kernel l2, activity l1, add_loss


@MODES
def test_masks_cross_segment_boundaries(graph):
    model = models.masked_lstm()
    ck = graphckpt.checkpoint_model(model, segments=4)
    x = models.sample_inputs(model)
    compare_inference(model, ck, x)
    compare_step(model, ck, x, graph=graph)
    # The mask really matters here: the same weights without it differ.
    unmasked = models.masked_lstm(mask_zero=False)
    unmasked.set_weights(model.get_weights())
    assert not np.allclose(model.predict(x, verbose=0), unmasked.predict(x, verbose=0), atol=1e-4)


def test_inference_takes_no_remat_path():
    model = models.chain(dropout=0.3)
    ck = graphckpt.checkpoint_model(model, segments=3)
    segments = [l for l in ck.layers if isinstance(l, Segment)]
    x = np.ones((2, 16), "float32")
    ck(x, training=False)
    ck(x)
    ck.predict(x, verbose=0)
    assert [s.forward_calls for s in segments] == [0, 0, 0]


def test_recompute_really_happens_eager():
    """Each segment's function runs once forward and once more in backward."""
    model = models.chain()
    ck = graphckpt.checkpoint_model(model, segments=3)
    segments = [l for l in ck.layers if isinstance(l, Segment)]
    x = tf.ones((2, 16))
    with tf.GradientTape() as tape:
        y = ck(x, training=True)
    assert [s.forward_calls for s in segments] == [1, 1, 1]
    tape.gradient(y, ck.trainable_variables)
    assert [s.forward_calls for s in segments] == [2, 2, 2]


@MODES
def test_recompute_uses_the_weights_the_forward_pass_read(graph):
    """Weights written between the forward pass and the backward pass (an
    optimizer update the executor runs early) do not reach the recompute:
    it uses the forward pass's reads, as the plain model's backward pass
    does. Reading the variables again in the backward pass let TensorFlow's
    executor run a step's weight update before a recompute, now and then,
    under load: a wrong gradient (issue 14)."""
    model = models.chain(depth=6)
    ck = graphckpt.checkpoint_model(model, segments=3)
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 16)).astype("float32"))
    variables = model.trainable_variables
    start = [v.numpy() for v in variables]

    def grads_after_a_write(m):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x, training=True) ** 2)
        for v in variables:
            v.assign(v * 2.0)
        return tape.gradient(loss, variables)

    def run(m):
        for v, value in zip(variables, start):
            v.assign(value)
        step = tf.function(grads_after_a_write) if graph else grads_after_a_write
        return [g.numpy() for g in step(m)]

    want, got = run(model), run(ck)
    assert [s.forward_calls for s in ck.layers if isinstance(s, Segment)][0] == 2  # recomputed
    for v, a, b in zip(variables, got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"gradient of {v.path}")


def _count_ops(concrete, op_type):
    graphs = [concrete.graph] + [f.graph for f in concrete.graph._functions.values() if hasattr(f, "graph")]
    count = 0
    for g in graphs:
        count += sum(op.type == op_type for op in g.get_operations())
    return count


def test_recompute_really_happens_in_graph():
    """The traced training step holds more MatMuls: the recomputed forward."""

    def traced(model):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                y = model(x, training=True)
            return tape.gradient(y, model.trainable_variables)

        return step.get_concrete_function(tf.TensorSpec((2, 16)))

    model = models.chain(depth=12)
    ck = graphckpt.checkpoint_model(model, segments=3)
    plain = _count_ops(traced(model), "MatMul")
    ours = _count_ops(traced(ck), "MatMul")
    assert plain == 3 * 13 - 1  # forward + 2 backward per Dense, none for d(loss)/d(x)
    # Plus one recomputed forward per Dense, plus d/dx of the first segment,
    # which tf.recompute_grad computes for every argument.
    assert ours == plain + 13 + 1


@pytest.mark.parametrize("jit", [False, True])
def test_fit_gives_the_same_history_and_trains_the_original(jit):
    def fresh():
        keras.utils.set_random_seed(7)
        return models.resnet(blocks=2)

    x = np.random.default_rng(3).normal(size=(16, 8, 8, 3)).astype("float32")
    y = np.random.default_rng(4).normal(size=(16, 3)).astype("float32")
    plain = fresh()
    plain.compile(optimizer="adam", loss="mse", jit_compile=jit)
    h0 = plain.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0).history["loss"]

    model = fresh()
    ck = graphckpt.checkpoint_model(model)
    ck.compile(optimizer="adam", loss="mse", jit_compile=jit)
    h1 = ck.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(h1, h0, rtol=1e-4)
    for a, b in zip(state_of(model), state_of(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@MODES
def test_mixed_precision(policy, graph):
    keras.config.set_dtype_policy(policy)
    model = models.resnet(blocks=2)
    ck = graphckpt.checkpoint_model(model)
    x = np.random.default_rng(5).normal(size=(2, 8, 8, 3)).astype("float32")
    assert ck.compute_dtype == model.compute_dtype
    compare_step(model, ck, x, graph=graph, atol=2e-2, rtol=2e-2)


def test_weights_are_shared_by_identity():
    model = models.multi_io()
    ck = graphckpt.checkpoint_model(model)
    assert len(ck.trainable_variables) == len(model.trainable_variables)
    ids = {id(v) for v in model.trainable_variables}
    assert all(id(v) in ids for v in ck.trainable_variables)
    shared = model.get_layer("shared")
    inside = [l for seg in ck.layers if isinstance(seg, Segment) for l in seg.model.layers]
    assert any(l is shared for l in inside)
    # Changing the original's weights changes the checkpointed model's output.
    x = models.sample_inputs(model)
    before = ck.predict(x, verbose=0)["main"]
    shared.kernel.assign(shared.kernel * 2.0)
    assert not np.allclose(before, ck.predict(x, verbose=0)["main"])


class _UnseededNoise(layers.Layer):
    """Draws from Keras's global seed generator (`seed=None`)."""

    def call(self, x, training=None):
        if training:
            return x * keras.random.uniform(keras.ops.shape(x), 0.5, 1.5)
        return x


def _unseeded_model():
    keras.random.uniform((1,))  # the global generator exists before the rewrite
    inp = keras.Input((8,))
    x = inp
    for _ in range(6):
        x = _UnseededNoise()(layers.Dense(8, activation="tanh")(x))
    return keras.Model(inp, layers.Dense(1)(x))


@MODES
def test_unseeded_random_ops_are_exact(graph):
    model = _unseeded_model()
    ck = graphckpt.checkpoint_model(model, segments=3)
    compare_step(model, ck, np.ones((4, 8), "float32"), graph=graph)


def test_unseeded_random_ops_need_the_global_state(monkeypatch):
    """Guard: without the global generator in the snapshot the recompute
    draws again and the gradients differ."""
    monkeypatch.setattr("graphckpt.segment._global_seed_state", lambda: [])
    model = _unseeded_model()
    ck = graphckpt.checkpoint_model(model, segments=3)
    with pytest.raises(AssertionError):
        compare_step(model, ck, np.ones((4, 8), "float32"))
