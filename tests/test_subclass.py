"""Functional subclasses (issue 13, item 4): `class Custom(keras.Model)`
built as `Custom(inputs, outputs)`.

`checkpoint_model` returns a plain functional model, so a class that
overrides how the model is called or trained is refused, naming the
override. The fit flag trains the user's own object, so its `train_step`,
`compute_loss` and `compile` run; only an own `call`, which the flag's
recompute of the layer graph would skip, is refused.
"""

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from graphckpt.training.flag import _CACHE_ATTR
from tests.helpers import BACKEND, to_numpy

X = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")


def _graph():
    keras.utils.set_random_seed(3)
    inp = keras.Input((8,))
    x = inp
    for _ in range(6):
        x = layers.Dense(16, activation="tanh")(x)
    return inp, layers.Dense(1)(x)


class WithCall(keras.Model):
    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=training, mask=mask) * 2.0


class WithComputeLoss(keras.Model):
    """Adds the mean absolute output to the loss: trains other weights."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.5 * keras.ops.mean(keras.ops.abs(y_pred))


class OnlyBuilds(keras.Model):
    """Builds its graph in `__init__`, as keras_hub's backbones do."""

    def __init__(self, **kwargs):
        inp, out = _graph()
        super().__init__(inp, out, **kwargs)


def _weights(model):
    return [to_numpy(v) for v in model.weights]


def _inbound(model):
    return [len(layer._inbound_nodes) for layer in model.layers]


@pytest.mark.parametrize("cls, method", [(WithCall, "WithCall.call"), (WithComputeLoss, "WithComputeLoss.compute_loss")])
def test_checkpoint_model_refuses_an_override_and_names_it(cls, method):
    model = cls(*_graph())
    before = _inbound(model)
    with pytest.raises(graphckpt.UnsupportedModelError, match="gradient_checkpointing=True") as info:
        graphckpt.checkpoint_model(model, segments=3)
    assert method in str(info.value)
    assert _inbound(model) == before  # the original is untouched


def test_a_subclass_that_only_builds_its_graph_is_checkpointed():
    model = OnlyBuilds()
    ck = graphckpt.checkpoint_model(model, segments=3)
    np.testing.assert_allclose(to_numpy(ck(X)), to_numpy(model(X)), rtol=1e-6)


@pytest.mark.backends
def test_fit_flag_refuses_an_own_call_and_trains_nothing(installed):
    model = WithCall(*_graph())
    model.compile(optimizer="sgd", loss="mse")
    before = _weights(model)
    with pytest.raises(graphckpt.UnsupportedModelError, match=r"WithCall\.call") as info:
        model.fit(X, Y, epochs=1, verbose=0, gradient_checkpointing=3)
    assert "keras.remat" in str(info.value)
    for a, b in zip(_weights(model), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.backends
def test_fit_flag_keeps_an_overridden_compute_loss(installed):
    def fit(flag):
        model = WithComputeLoss(*_graph())
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, gradient_checkpointing=flag)
        return model, history.history["loss"]

    plain, want = fit(None)
    model, got = fit(3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(_weights(model), _weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The override mattered: plain mse from the same start trains elsewhere.
    reference = keras.Model(*_graph())
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    reference.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert not np.allclose(_weights(reference)[-1], _weights(model)[-1], atol=1e-4)
    (twin,) = model.__dict__[_CACHE_ATTR].twins.values()
    assert len(twin.segments) == 3 and all(s.forward_calls >= 1 for s in twin.segments)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the train_step is written with tf.GradientTape")
def test_fit_flag_keeps_an_overridden_train_step(installed):
    import tensorflow as tf

    class WithTrainStep(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"custom_loss": loss}

    def fit(flag):
        model = WithTrainStep(*_graph())
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, gradient_checkpointing=flag)
        return model, history.history

    plain, want = fit(None)
    model, got = fit(3)
    assert set(got) == set(want) == {"custom_loss"}
    np.testing.assert_allclose(got["custom_loss"], want["custom_loss"], rtol=1e-5)
    for a, b in zip(_weights(model), _weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    (twin,) = model.__dict__[_CACHE_ATTR].twins.values()
    assert all(s.forward_calls >= 2 for s in twin.segments)  # forward, then recompute (eager tape)
