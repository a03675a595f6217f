"""Keras workflows that must train exactly as in plain Keras (issue 13):
freezing and unfreezing layers, crossentropy on softmax and sigmoid outputs,
mixed precision with a float32 output, and a few edge inputs.

Each test runs the workflow on the original model with plain Keras and on
the checkpointed route (`checkpoint_model`, or the `fit` flag) from the
same initial weights, and compares losses and weights.
"""

import warnings

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from graphckpt.runtime.segment import Segment
from graphckpt.training.flag import _CACHE_ATTR
from tests.helpers import BACKEND, to_numpy

X = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")
FIT = {"batch_size": 8, "epochs": 1, "shuffle": False, "verbose": 0}


def weights(model):
    return [to_numpy(v) for v in model.weights]


def assert_same_weights(actual, expected, atol=1e-6):
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-6)


# --- (1) freeze, train the head, unfreeze, recompile, fine-tune ------------


def _transfer_model(nested):
    """A base of three Dense layers (in a nested Sequential, or flat) and a
    head of four; `(model, base)`, where `base` is what gets frozen."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((8,))
    if nested:
        base = keras.Sequential([keras.Input((8,))] + [layers.Dense(8, activation="tanh") for _ in range(3)], name="base")
        x = base(inp)
    else:
        base, x = [], inp
        for i in range(3):
            base.append(layers.Dense(8, activation="tanh", name=f"base{i}"))
            x = base[-1](x)
    for i in range(3):
        x = layers.Dense(8, activation="tanh", name=f"head{i}")(x)
    return keras.Model(inp, layers.Dense(1, name="out")(x), name="transfer"), base


def _freezer(what, base, trainer):
    """`set_trainable(flag)` for what the test freezes."""

    def set_trainable(flag):
        if what == "layers":
            for layer in base:
                layer.trainable = flag
        elif what == "nested model":
            base.trainable = flag
        else:  # the model trained: the checkpointed one on that route
            trainer.trainable = flag

    return set_trainable


def _transfer_learning(trainer, set_trainable, fit_kwargs):
    """The Keras transfer-learning guide: freeze, compile, train; unfreeze,
    recompile, fine-tune. The weights after each phase."""
    set_trainable(False)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    trainer.fit(X, Y, **FIT, **fit_kwargs)
    frozen_phase = weights(trainer)
    set_trainable(True)
    trainer.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    trainer.fit(X, Y, **FIT, **fit_kwargs)
    return frozen_phase, weights(trainer)


@pytest.mark.backends
@pytest.mark.parametrize("what", ["layers", "nested model", "model"])
@pytest.mark.parametrize("route", ["checkpoint_model", "fit flag"])
def test_unfrozen_layers_train_again_as_in_keras(installed, route, what):
    nested = what == "nested model"
    reference, base = _transfer_model(nested)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no trainable weights" when all are frozen
        expected = _transfer_learning(reference, _freezer(what, base, reference), {})

        model, base = _transfer_model(nested)
        if route == "checkpoint_model":
            trainer, fit_kwargs = graphckpt.checkpoint_model(model, segments=3), {}
        else:
            trainer, fit_kwargs = model, {"gradient_checkpointing": 3}
        start = weights(model)
        frozen_phase, final = _transfer_learning(trainer, _freezer(what, base, trainer), fit_kwargs)

    assert_same_weights(frozen_phase, expected[0])
    assert_same_weights(final, expected[1])
    # Not vacuous: the first layer (frozen, then unfrozen) trained in the
    # second phase, and the checkpointed route recomputed.
    assert np.max(np.abs(final[0] - frozen_phase[0])) > 0
    assert np.max(np.abs(final[0] - start[0])) > 0
    # The fit flag plans each trainable state again: a twin per plan (on
    # PyTorch, frozen layers free no gradients, so the frozen phase's plan
    # may differ), each of 3 segments.
    per_model = [[l for l in trainer.layers if isinstance(l, Segment)]] if route == "checkpoint_model" else [
        twin.segments for twin in model.__dict__[_CACHE_ATTR].twins.values()
    ]
    assert per_model and all(len(segments) == 3 for segments in per_model)


# --- (2) softmax / sigmoid outputs with crossentropy -----------------------

# Only TensorFlow's crossentropy reads the logits attached to a softmax or
# sigmoid output; JAX and PyTorch compute from probabilities in both models.
READS_LOGITS = BACKEND == "tensorflow"
LABELS = np.random.default_rng(2).integers(0, 5, size=(32,))


def _big():
    # Large logits: saturated probabilities, which crossentropy clips.
    return keras.initializers.RandomNormal(stddev=100.0)


CLASSIFIERS = {
    # loss -> (output layers, targets)
    "sparse_categorical_crossentropy": (
        lambda x: layers.Activation("softmax")(layers.Dense(5, kernel_initializer=_big())(x)),
        LABELS,
    ),
    "categorical_crossentropy": (
        lambda x: layers.Dense(5, activation="softmax", kernel_initializer=_big())(x),
        np.eye(5, dtype="float32")[LABELS],
    ),
    "binary_crossentropy": (
        lambda x: layers.Dense(1, activation="sigmoid", kernel_initializer=_big())(x),
        (LABELS % 2).astype("float32")[:, None],
    ),
}


def _classifier(loss):
    """A classifier whose predictions saturate: crossentropy from its
    logits is much larger than from its clipped probabilities."""
    keras.utils.set_random_seed(3)
    head, _ = CLASSIFIERS[loss]
    inp = keras.Input((8,))
    x = inp
    for _ in range(4):
        x = layers.Dense(8, activation="tanh")(x)
    return keras.Model(inp, head(x))


def _train_once(trainer, loss, targets, fit_kwargs):
    trainer.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    history = trainer.fit(X, targets, batch_size=32, epochs=1, shuffle=False, verbose=0, **fit_kwargs)
    return history.history["loss"][0]


@pytest.mark.backends
@pytest.mark.parametrize("loss", sorted(CLASSIFIERS))
@pytest.mark.parametrize("route", ["checkpoint_model", "fit flag"])
def test_crossentropy_on_a_recomputed_output_reads_its_logits(installed, route, loss):
    targets = CLASSIFIERS[loss][1]
    reference = _classifier(loss)
    expected = _train_once(reference, loss, targets, {})

    model = _classifier(loss)
    if route == "checkpoint_model":
        trainer, fit_kwargs = graphckpt.checkpoint_model(model, segments=3), {}
        assert trainer.plan.segments[-1].remat  # the output is made in a recomputed segment
    else:
        trainer, fit_kwargs = model, {"gradient_checkpointing": 3}
    before = weights(model)
    actual = _train_once(trainer, loss, targets, fit_kwargs)
    np.testing.assert_allclose(actual, expected, rtol=1e-5)
    assert_same_weights(weights(model), weights(reference), atol=1e-5)

    # The checkpointed training output carries the original's logits.
    for v, w in zip(model.weights, before):
        v.assign(w)
    ck = trainer if route == "checkpoint_model" else graphckpt.checkpoint_model(model, segments=3)
    original_out, ck_out = model(X, training=True), ck(X, training=True)
    if READS_LOGITS:
        assert hasattr(original_out, "_keras_logits") and hasattr(ck_out, "_keras_logits")
        np.testing.assert_allclose(to_numpy(ck_out._keras_logits), to_numpy(original_out._keras_logits), atol=1e-5)
        # Not vacuous: from clipped probabilities the loss is another one.
        clipped = keras.losses.get(loss)(targets, keras.ops.convert_to_tensor(to_numpy(original_out)))
        logits_loss = keras.losses.get(loss)(targets, original_out)
        assert abs(float(np.mean(to_numpy(clipped))) - float(np.mean(to_numpy(logits_loss)))) > 1.0
    # evaluate (inference) and train_on_batch (training) agree, as in Keras.
    if route == "checkpoint_model":
        for v, w in zip(model.weights, before):
            v.assign(w)
        ck.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
        evaluated = ck.evaluate(X, targets, batch_size=32, verbose=0)
        np.testing.assert_allclose(float(ck.train_on_batch(X, targets)), evaluated, rtol=1e-5)


# --- (3) mixed precision with a float32 output -----------------------------


def _mixed_model(last, seed=9):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8,))
    x = inp
    for _ in range(4):
        x = layers.Dense(16, activation="tanh")(x)
    if last == "Activation":
        out = layers.Activation("linear", dtype="float32", name="out")(layers.Dense(1)(x))
    else:
        out = layers.Dense(1, dtype="float32", name="out")(x)
    return keras.Model(inp, out)


def _fit_steps(trainer, fit_kwargs=None):
    trainer.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = trainer.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, **(fit_kwargs or {}))
    return history.history["loss"]


@pytest.mark.backends
@pytest.mark.parametrize("last", ["Activation", "Dense"])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_float32_output_under_mixed_precision(policy, last):
    keras.config.set_dtype_policy(policy)
    reference, model = _mixed_model(last), _mixed_model(last)
    ck = graphckpt.checkpoint_model(model, segments=3)
    assert ck.plan.segments[-1].remat
    assert keras.backend.standardize_dtype(ck.outputs[0].dtype) == "float32"
    assert keras.backend.standardize_dtype(ck(X, training=True).dtype) == "float32"
    assert keras.backend.standardize_dtype(ck(X).dtype) == "float32"
    expected = _fit_steps(reference)
    actual = _fit_steps(ck)
    np.testing.assert_allclose(actual, expected, rtol=1e-5)
    assert_same_weights(weights(model), weights(reference), atol=1e-5)
    if policy == "mixed_float16":  # loss scaling skipped no step of the original
        assert int(to_numpy(ck.optimizer.iterations)) == int(to_numpy(reference.optimizer.iterations)) == 8


def _mixed_with_float32_inside(seed=10):
    """Mixed layers around a float32 Dense, frozen: its kernel is state a
    segment snapshots, and must read in full precision, as the original."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8,))
    x = layers.Dense(16, activation="tanh")(inp)
    frozen = layers.Dense(16, activation="tanh", dtype="float32", trainable=False, name="float32_frozen")
    x = layers.Dense(16, activation="tanh")(frozen(x))
    x = layers.Dense(16, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(1, dtype="float32")(x))


@pytest.mark.backends
def test_float32_layer_inside_a_mixed_precision_segment():
    keras.config.set_dtype_policy("mixed_float16")
    reference, model = _mixed_with_float32_inside(), _mixed_with_float32_inside()
    ck = graphckpt.checkpoint_model(model, segments=2)
    assert "float32_frozen" in [l.name for seg in ck.layers if isinstance(seg, Segment) for l in seg.model.layers]
    np.testing.assert_allclose(to_numpy(ck(X, training=True)), to_numpy(model(X, training=True)), atol=1e-6)
    expected = _fit_steps(reference)
    actual = _fit_steps(ck)
    np.testing.assert_allclose(actual, expected, rtol=1e-5)
    assert_same_weights(weights(model), weights(reference), atol=1e-5)


@pytest.mark.backends
def test_checkpointed_model_takes_its_sources_dtype_policy():
    keras.config.set_dtype_policy("mixed_float16")
    reference, model = _mixed_model("Dense"), _mixed_model("Dense")
    keras.config.set_dtype_policy("float32")  # back, before checkpointing
    ck = graphckpt.checkpoint_model(model, segments=3)
    assert ck.dtype_policy.name == "mixed_float16"
    for seg in (l for l in ck.layers if isinstance(l, Segment)):
        assert seg.dtype_policy.name == seg.model.dtype_policy.name == "mixed_float16"
    expected = _fit_steps(reference)
    actual = _fit_steps(ck)
    # `compile` scales the loss by the model's own policy, as the original's.
    assert isinstance(ck.optimizer, keras.optimizers.LossScaleOptimizer)
    np.testing.assert_allclose(actual, expected, rtol=1e-5)
    assert_same_weights(weights(model), weights(reference), atol=1e-5)


# --- smaller ones -----------------------------------------------------------


@pytest.mark.backends
def test_model_without_layer_calls_is_returned_unchanged():
    inp = keras.Input((4,))
    model = keras.Model(inp, inp)
    with pytest.warns(UserWarning, match="no layer calls"):
        assert graphckpt.checkpoint_model(model) is model
    with pytest.warns(UserWarning, match="no layer calls"):
        assert graphckpt.plan(model, segments=2).segments == ()


@pytest.mark.backends
def test_output_named_like_a_generated_layer_keeps_its_name():
    keras.utils.set_random_seed(4)
    inp = keras.Input((8,))
    x = inp
    for i in range(4):
        x = layers.Dense(8, activation="tanh", name=f"segment_{i}_in0" if i == 1 else None)(x)
    aux = layers.Dense(1, name="segment_0")(x)
    main = layers.Dense(1, name="segment_1")(layers.Dense(8, activation="tanh")(x))
    model = keras.Model(inp, {"segment_0": aux, "segment_1": main})
    ck = graphckpt.checkpoint_model(model, segments=2)
    assert ck.output_names == model.output_names
    names = [l.name for l in ck.layers]
    assert len(set(names)) == len(names)
    loss = {"segment_0": "mse", "segment_1": "mae"}
    targets = {"segment_0": Y, "segment_1": 2 * Y}
    start = weights(model)
    model.compile(optimizer="sgd", loss=loss)
    expected = model.train_on_batch(X, targets, return_dict=True)
    for v, w in zip(model.weights, start):
        v.assign(w)
    ck.compile(optimizer="sgd", loss=loss)
    actual = ck.train_on_batch(X, targets, return_dict=True)
    assert actual.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], rtol=1e-5)


@pytest.mark.backends
def test_policy_class_instead_of_a_policy_is_refused():
    model = _transfer_model(nested=False)[0]
    with pytest.raises(graphckpt.InvalidArgumentError, match="not a class"):
        graphckpt.checkpoint_model(model, policy=graphckpt.policies.save_these_layers)
    with pytest.raises(graphckpt.InvalidArgumentError, match="save_these_layers\\("):
        graphckpt.plan(model, policy=graphckpt.policies.save_these_layers, budget=0.9)


@pytest.mark.backends
def test_fit_flag_takes_numpy_integers(installed):
    model = _transfer_model(nested=False)[0]
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, **FIT, gradient_checkpointing=np.int64(3))
    twins = list(model.__dict__[_CACHE_ATTR].twins.values())
    assert len(twins) == 1 and len(twins[0].segments) == 3
    with pytest.raises(graphckpt.InvalidArgumentError, match="gradient_checkpointing"):
        model.fit(X, Y, **FIT, gradient_checkpointing=np.int64(0))
