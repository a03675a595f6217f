"""A `keras.applications` backbone called as one layer (Keras's
transfer-learning pattern, issue 12): flattened, cut inside, exact."""

import keras
import numpy as np
import pytest

import graphckpt
from graphckpt.runtime.segment import Segment
from tests.helpers import compare_step


def _transfer(trainable=True):
    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNetV2(alpha=0.35, include_top=False, weights=None, input_shape=(32, 32, 3))
    base.trainable = trainable
    inp = keras.Input((32, 32, 3), name="image")
    x = keras.layers.GlobalAveragePooling2D()(base(inp))
    return keras.Model(inp, keras.layers.Dense(3)(x)), base


def _images():
    return np.random.default_rng(0).normal(size=(4, 32, 32, 3)).astype("float32")


def test_a_backbone_called_as_a_layer_is_cut_inside_and_trains_exactly():
    model, base = _transfer()
    ck = graphckpt.checkpoint_model(model, segments=4)
    segments = [layer for layer in ck.layers if isinstance(layer, Segment)]
    base_layers = {id(layer) for layer in base.layers}
    holding = [s for s in segments if any(id(layer) in base_layers for layer in s.model.layers)]
    assert len(holding) >= 3  # the backbone's layers are spread over segments
    assert {id(v) for v in ck.weights} == {id(v) for v in model.weights}
    compare_step(model, ck, _images())  # BatchNorm statistics included
    assert all(s.forward_calls >= 2 for s in segments)
    rows = [name for _, _, names in ck._segment_rows() for name in names]
    assert f"{base.name}/block_1_expand" in rows


def test_a_frozen_backbone_stays_frozen_and_the_head_trains_exactly():
    model, base = _transfer(trainable=False)
    ck = graphckpt.checkpoint_model(model, segments=4)
    assert len(ck.trainable_variables) == len(model.trainable_variables) == 2  # the head's kernel and bias
    compare_step(model, ck, _images())  # frozen BatchNorm layers run in inference mode in both


def test_checkpoint_model_names_a_nested_model_it_cannot_cut_into():
    """A nested model that overrides `call` is recomputed whole: the
    checkpointed model is still exact, and a warning says which model and
    why (issue 12: it used to save nothing without a word)."""
    import pytest

    class Scaled(keras.Model):
        def call(self, inputs, training=None):
            return super().call(inputs, training=training) * 2.0

    keras.utils.set_random_seed(0)
    i = keras.Input((8,))
    block = Scaled(i, keras.layers.Dense(8, activation="tanh")(keras.layers.Dense(8)(i)), name="scaled")
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, activation="tanh")(inp)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(8)(block(h))))
    with pytest.warns(UserWarning, match=r"'scaled' \(its class Scaled has a `call` of its own\)"):
        ck = graphckpt.checkpoint_model(model, segments=2)
    compare_step(model, ck, np.random.default_rng(0).normal(size=(4, 8)).astype("float32"))


@pytest.mark.backends
def test_a_nested_call_with_its_own_training_argument_runs_as_keras_runs_it():
    """`inner(x, training=False)` holding a BatchNormalization recorded
    without `training=` and a Dropout recorded with `training=True`: which
    value each call runs with is the running Keras's rule (up to 3.15, the
    model's `training=True` wins everywhere; from 3.16, keras PR 23364, the
    recorded values win: the BatchNormalization runs in inference, the
    Dropout in training). Cut inside `inner`, the checkpointed model must
    run each call as the original does: statistics and masks equal."""
    keras.utils.set_random_seed(0)
    i = keras.Input((8,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8, activation="tanh")(i))
    h = keras.layers.Dropout(0.5, seed=1, name="drop")(keras.layers.Dense(8, activation="tanh")(h), training=True)
    inner = keras.Model(i, keras.layers.Dense(8, activation="tanh")(h), name="inner")
    inp = keras.Input((8,))
    x = inner(keras.layers.Dense(8, activation="tanh")(inp), training=False)
    model = keras.Model(inp, keras.layers.Dense(2)(x))
    ck = graphckpt.checkpoint_model(model, segments=3)
    segments = [layer for layer in ck.layers if isinstance(layer, Segment)]
    assert any(layer.name == "bn" for s in segments for layer in s.model.layers)  # cut inside `inner`
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    compare_step(model, ck, x)  # moving statistics and Dropout masks included
    # Recomputed before the nested call. (After it, Keras 3.16.dev's call
    # context leaks `inner`'s training=False to every later call of the
    # model, segments included, which then run as they are: see
    # docs/limitations.md.)
    assert segments[0].forward_calls >= 2
