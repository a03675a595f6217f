"""`graphckpt.install()`: `model.fit(..., gradient_checkpointing=...)` trains
the user's own model exactly as plain `fit` would, with checkpointing."""

import gc
import weakref

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from graphckpt.training.flag import _CACHE_ATTR
from tests import models
from tests.helpers import state_of


def regularized(seed=7):
    """Dropout, activity and weight regularizers, an `add_loss` layer: every
    kind of layer loss a segment must hand back to the model."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8,), name="x")
    x = inp
    for i in range(8):
        x = layers.Dense(8, activation="tanh", kernel_regularizer="l2", activity_regularizer="l1")(x)
        if i % 3 == 2:
            x = layers.Dropout(0.3)(x)
    return keras.Model(inp, layers.Dense(1)(x), name="regularized")


def classifier(seed=7):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8,))
    x = inp
    for _ in range(6):
        x = layers.Dense(8, activation="relu")(x)
    return keras.Model(inp, layers.Dense(3, activation="softmax")(x), name="classifier")


X = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")
LABELS = np.random.default_rng(2).integers(0, 3, size=(32,))


def segments_of(model):
    cache = model.__dict__.get(_CACHE_ATTR)
    return [] if cache is None else [s for twin in cache.twins.values() for s in twin.segments]


def fit_twice(build, fit_kwargs, compile_kwargs=None, flag=True, **flag_kwargs):
    """Plain fit on one fresh model, flagged fit on another (`flag_kwargs`:
    more arguments of the flagged fit, e.g. `budget=`); same seeds."""
    compile_kwargs = compile_kwargs or {"optimizer": "adam", "loss": "mse", "metrics": ["mae"]}
    out = []
    for kwargs in ({}, {"gradient_checkpointing": flag, **flag_kwargs}):
        model = build()
        model.compile(**compile_kwargs)
        keras.utils.set_random_seed(11)  # same dropout masks in both runs
        history = model.fit(**fit_kwargs, **kwargs)
        out.append((model, history))
    return out


def test_loss_history_and_weights_equal_plain_fit(installed):
    """Dropout, activity regularizers and validation: the same numbers as
    plain fit. Were the segments' layer losses dropped, `loss` would differ."""
    fit = dict(x=X, y=Y, batch_size=8, epochs=3, shuffle=False, verbose=0, validation_data=(X[:8], Y[:8]))
    (plain, h0), (model, h1) = fit_twice(regularized, fit)
    assert set(h1.history) == {"loss", "mae", "val_loss", "val_mae"}
    for key in h0.history:
        np.testing.assert_allclose(h1.history[key], h0.history[key], rtol=1e-5, err_msg=key)
    assert h1.epoch == h0.epoch == [0, 1, 2]
    # The user's own variables were trained, with its own optimizer.
    for a, b in zip(state_of(model), state_of(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 12
    # The default plan for the data's batches of (8, 8); its last segment runs inline.
    expected = graphckpt.plan(model, input_shape=(8, 8))
    assert expected.strategy == "auto" and not expected.segments[-1].remat
    assert [s.name for s in segments_of(model)] == [f"segment_{s.index}" for s in expected.segments if s.remat]
    # After fit, the model is the plain model again.
    assert "call" not in model.__dict__
    np.testing.assert_allclose(model.predict(X, verbose=0), plain.predict(X, verbose=0), rtol=1e-4, atol=1e-6)


def test_segment_layer_losses_reach_model_losses():
    """The mechanism behind the test above: while training is routed through
    the segments, `model.losses` still holds every activity-regularizer term,
    with the values plain training gives."""
    from graphckpt.training.flag import _training_call, _twin_for
    from tests.helpers import restore

    model = regularized()
    start = state_of(model)
    model(X, training=True)
    expected = sorted(float(v) for v in model.losses)
    restore(model, start)
    twin = _twin_for(model, {})
    object.__setattr__(model, "call", _training_call(model, twin))
    try:
        model(X, training=True)
        ours = sorted(float(v) for v in model.losses)
    finally:
        del model.__dict__["call"]
    assert len(ours) == 8 + 8  # activity l1 (from the segments) + kernel l2
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


def test_class_weight_callbacks_and_checkpoint_file(installed, tmp_path):
    path = tmp_path / "best.keras"

    def fit_kwargs():
        return dict(
            x=X,
            y=LABELS,
            batch_size=8,
            epochs=4,
            shuffle=False,
            verbose=0,
            validation_split=0.25,
            class_weight={0: 1.0, 1: 3.0, 2: 0.5},
            callbacks=[
                keras.callbacks.ModelCheckpoint(str(path), monitor="loss"),
                # Stops after the second epoch, in both runs alike.
                keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1),
            ],
        )

    compile_kwargs = {"optimizer": "adam", "loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]}
    (plain, h0), (model, h1) = fit_twice(classifier, fit_kwargs(), compile_kwargs)
    for key in h0.history:
        np.testing.assert_allclose(h1.history[key], h0.history[key], rtol=1e-5, err_msg=key)
    assert h1.epoch == h0.epoch == [0, 1]
    # The file ModelCheckpoint wrote is the user's plain model, and loads.
    loaded = keras.saving.load_model(path)
    assert not graphckpt.is_checkpointed(loaded)
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=1e-5)


def test_tensorboard_callback(installed, tmp_path):
    """The callback sees the user's model: its loss and its own layers' weight
    histograms are logged, under the original layer names."""
    import tensorflow as tf

    model = regularized()
    model.compile(optimizer="adam", loss="mse")
    tb = keras.callbacks.TensorBoard(str(tmp_path), histogram_freq=1)
    model.fit(X, Y, epochs=2, verbose=0, validation_data=(X, Y), callbacks=[tb], gradient_checkpointing=True)
    tags = set()
    for path in tmp_path.rglob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            tags.update(v.tag for v in event.summary.value)
    assert "epoch_loss" in tags
    dense = model.layers[1]
    assert any(tag.startswith(dense.name) and "kernel" in tag for tag in tags), sorted(tags)
    assert not any("segment" in tag for tag in tags), sorted(tags)


def test_eager_flagged_fit_recomputes_each_step(installed):
    fit = dict(x=X, y=Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    compile_kwargs = {"optimizer": "adam", "loss": "mse", "run_eagerly": True}
    (_, h0), (model, h1) = fit_twice(regularized, fit, compile_kwargs, flag=3)
    np.testing.assert_allclose(h1.history["loss"], h0.history["loss"], rtol=1e-5)
    # 4 steps, each one forward and one recompute per segment.
    assert [s.forward_calls for s in segments_of(model)] == [8, 8, 8]


def test_sequential_and_multi_output_models(installed):
    def sequential():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((8,))] + [layers.Dense(8, activation="tanh") for _ in range(5)] + [layers.Dense(1)])

    fit = dict(x=X, y=Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    (_, h0), (model, h1) = fit_twice(sequential, fit)
    np.testing.assert_allclose(h1.history["loss"], h0.history["loss"], rtol=1e-5)
    expected = graphckpt.plan(model, input_shape=(16, 8))  # the plan for the data's batches
    assert len(segments_of(model)) == sum(s.remat for s in expected.segments) >= 1

    inputs = {"a": X[:, :6], "b": X[:, 2:]}
    targets = {"main": Y, "side": np.repeat(Y, 3, axis=1)}
    fit = dict(x=inputs, y=targets, batch_size=16, epochs=2, shuffle=False, verbose=0)
    compile_kwargs = {"optimizer": "adam", "loss": {"main": "mse", "side": "mae"}}
    (_, h0), (model, h1) = fit_twice(models.multi_io, fit, compile_kwargs)
    assert set(h1.history) == set(h0.history)
    for key in h0.history:
        np.testing.assert_allclose(h1.history[key], h0.history[key], rtol=1e-5, err_msg=key)


def test_budget_flag(installed):
    """`budget=` alone turns checkpointing on; the budget planner decides."""
    fit = dict(x=X, y=Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    out = []
    for kwargs in ({}, {"budget": 0.7}):
        model = regularized()
        model.compile(optimizer="adam", loss="mse")
        keras.utils.set_random_seed(11)
        out.append((model, model.fit(**fit, **kwargs).history["loss"]))
    (_, h0), (model, h1) = out
    np.testing.assert_allclose(h1, h0, rtol=1e-5)
    (twin,) = model.__dict__[_CACHE_ATTR].twins.values()
    assert twin.model.plan.strategy == "budget"
    assert twin.model.plan.batch_size == 8  # fit's batch size
    assert twin.model.plan.estimated_peak_bytes <= 0.7 * twin.model.plan.baseline_peak_bytes
    with pytest.raises(graphckpt.InvalidArgumentError, match="budget"):
        model.fit(**fit, gradient_checkpointing=False, budget=0.5)
    with pytest.raises(graphckpt.InvalidArgumentError, match="segments"):
        model.fit(**fit, gradient_checkpointing=2, budget=0.5)


def test_rewrite_once_no_retrace_and_plain_fit_stays_plain(installed):
    model = regularized()
    model.compile(optimizer="adam", loss="mse")
    fit = dict(x=X, y=Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.fit(**fit, gradient_checkpointing=True)
    cache = model.__dict__[_CACHE_ATTR]
    (twin,) = cache.twins.values()
    segments = twin.segments
    # `forward_calls` counts Python runs: in graph mode, only while tracing.
    traced = [s.forward_calls for s in segments]
    assert min(traced) > 0

    model.fit(**fit)  # plain fit in between: its own train function, no segments
    assert [s.forward_calls for s in segments] == traced
    assert model.train_function is not twin.train_function

    model.fit(**fit, gradient_checkpointing="auto")  # the same plan (True means "auto")
    assert list(cache.twins.values()) == [twin]
    assert [s.forward_calls for s in segments] == traced  # no rewrite, no retrace

    model.compile(optimizer="adam", loss="mse")  # a new optimizer: must retrace
    model.fit(**fit, gradient_checkpointing=True)
    assert list(cache.twins.values()) == [twin]
    assert all(a > b for a, b in zip([s.forward_calls for s in segments], traced))

    model.fit(**fit, gradient_checkpointing=2)  # another plan, another twin
    assert len(cache.twins) == 2


def test_without_the_flag_fit_is_untouched(installed):
    model = regularized()
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, Y, epochs=1, verbose=0)
    model.fit(X, Y, epochs=1, verbose=0, gradient_checkpointing=False)
    model.fit(X, Y, epochs=1, verbose=0, gradient_checkpointing=None)
    assert _CACHE_ATTR not in model.__dict__


def test_the_cache_dies_with_the_model(installed):
    model = regularized()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, epochs=1, verbose=0, gradient_checkpointing=True)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_the_override_does_not_leak_when_fit_raises(installed):
    model = regularized()
    with pytest.raises(ValueError, match="compile"):
        model.fit(X, Y, epochs=1, verbose=0, gradient_checkpointing=True)  # not compiled
    assert "call" not in model.__dict__
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError):
        model.fit(X[:, :5], Y, epochs=1, verbose=0, gradient_checkpointing=True)  # bad shape
    assert "call" not in model.__dict__
    assert model.train_function is None
    model.fit(X, Y, epochs=1, verbose=0)  # and plain fit still works


@pytest.mark.parametrize("bad", ["fast", 0, -2, 2.5, [2]])
def test_bad_flag_values(installed, bad):
    model = regularized()
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(graphckpt.InvalidArgumentError, match="gradient_checkpointing"):
        model.fit(X, Y, epochs=1, verbose=0, gradient_checkpointing=bad)
    assert _CACHE_ATTR not in model.__dict__


def test_a_subclassed_model_of_one_layer_call_trains_plainly_with_a_warning(installed):
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = layers.Dense(1)

        def call(self, x):
            return self.d(x)

    model = Sub()
    model.compile(optimizer="adam", loss="mse")
    model(X)
    with pytest.warns(graphckpt.GraphckptWarning, match="nothing to recompute"):
        model.fit(X, Y, epochs=1, verbose=0, gradient_checkpointing=True)
    with pytest.raises(graphckpt.UnsupportedModelError, match="subclassed"):
        graphckpt.checkpoint_model(model)
    assert "call" not in model.__dict__


def test_uninstall_restores_the_exact_original_fit():
    original = keras.Model.fit
    assert "fit" not in vars(keras.Model)  # inherited from the backend trainer
    graphckpt.install()
    graphckpt.install()  # idempotent
    assert keras.Model.fit is not original
    assert keras.Model.fit.__wrapped__ is original
    assert "gradient_checkpointing" in str(keras.Model.fit.__signature__)
    graphckpt.uninstall()
    graphckpt.uninstall()  # idempotent
    assert keras.Model.fit is original
    assert "fit" not in vars(keras.Model)
    model = regularized()
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(TypeError, match="gradient_checkpointing"):
        model.fit(X, Y, epochs=1, verbose=0, gradient_checkpointing=True)


def unbuilt_sequential(seed=7):
    """A Sequential without an `Input`, as keras.io's examples write them:
    plain `fit` builds it on its first batch."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [layers.Dense(8, activation="tanh") for _ in range(6)] + [layers.Dropout(0.2), layers.Dense(1)],
        name="unbuilt",
    )


@pytest.mark.backends
@pytest.mark.parametrize("as_dataset", [False, True], ids=["arrays", "dataset"])
def test_an_unbuilt_sequential_is_built_as_fit_builds_it_then_trained_exactly(installed, as_dataset):
    """The flag builds the model from the data's first batch as plain `fit`
    does (the same input shape, batch dimension included), then plans and
    trains it with recomputed segments: history and weights equal."""
    if as_dataset:
        tf = pytest.importorskip("tensorflow")
        fit = dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8), epochs=3, verbose=0)
    else:
        fit = dict(x=X, y=Y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    (plain, h0), (model, h1) = fit_twice(unbuilt_sequential, fit)
    np.testing.assert_allclose(h1.history["loss"], h0.history["loss"], rtol=1e-5)
    for a, b in zip(state_of(model), state_of(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    if as_dataset:
        # Where Keras reads the batch size from the first batch it draws
        # (JAX, PyTorch; TensorFlow from Keras 3.16), the flag builds before
        # fit draws any and leaves it unknown (limitations.md).
        assert model.inputs[0].shape[1:] == plain.inputs[0].shape[1:]
        assert model.inputs[0].shape[0] in (None, plain.inputs[0].shape[0])
    else:
        assert model.inputs[0].shape == plain.inputs[0].shape
    assert [s for s in segments_of(model) if s.forward_calls] != []  # planned and recomputed


def test_an_unbuilt_sequential_on_a_generator_is_refused_with_what_to_do(installed):
    model = unbuilt_sequential()
    model.compile(optimizer="sgd", loss="mse")

    def batches():
        while True:
            yield X[:8], Y[:8]

    with pytest.raises(graphckpt.UnsupportedModelError) as info:
        model.fit(batches(), steps_per_epoch=2, verbose=0, gradient_checkpointing=True)
    message = str(info.value)
    assert "'unbuilt' is not built" in message and "generator" in message
    assert "keras.Input(shape)" in message and "model.build(" in message
    assert "checkpoint_model" not in message  # the flag's message, not the function's
    assert not model.built


def test_a_flagged_fit_plans_once_per_model_and_data_shapes(installed, monkeypatch):
    """Three flagged fits on the same model and data plan once; other batch
    shapes, another flag value, or a frozen layer plan again."""
    from graphckpt import api

    calls = []
    planned = api.planned
    monkeypatch.setattr(api, "planned", lambda *a, **k: calls.append(k) or planned(*a, **k))
    model = regularized()
    model.compile(optimizer="sgd", loss="mse")
    for _ in range(3):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, gradient_checkpointing=True)
    assert len(calls) == 1 and calls[0]["input_shape"] == (8, 8)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, gradient_checkpointing=True)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, gradient_checkpointing=2)
    model.layers[1].trainable = False
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, gradient_checkpointing=2)
    assert len(calls) == 4


def test_graphckpt_fit_trains_as_the_flag_does_without_patching_keras():
    """`graphckpt.fit(model, ...)`: the flag's training with `keras.Model.fit`
    left as it is (no `install()`)."""
    original = keras.Model.fit
    fit = dict(x=X, y=Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    histories = []
    for train in (lambda m: m.fit(**fit), lambda m: graphckpt.fit(m, **fit)):
        model = regularized()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        keras.utils.set_random_seed(11)  # same dropout masks in both runs
        histories.append(train(model))
    h0, h1 = histories
    assert keras.Model.fit is original
    assert segments_of(model), "trained through the checkpointed twin"
    for key in h0.history:
        np.testing.assert_allclose(h1.history[key], h0.history[key], rtol=1e-5, err_msg=key)


def test_graphckpt_fit_refuses_a_class_whose_fit_it_would_skip():
    class OwnFit(keras.Model):
        def fit(self, *args, **kwargs):
            return super().fit(*args, **kwargs)

    inp = keras.Input((8,))
    model = OwnFit(inp, layers.Dense(1)(layers.Dense(8)(inp)))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(graphckpt.UnsupportedModelError, match=r"overrides .*OwnFit.fit.*graphckpt.install\(\)"):
        graphckpt.fit(model, X, Y, verbose=0)


def test_forgetting_install_ends_in_a_note_that_names_it(tmp_path):
    """Python rejects the unknown keyword before graphckpt can act; the
    uncaught error a script ends with says what to do."""
    import os
    import subprocess
    import sys

    script = (
        "import keras, numpy as np, graphckpt\n"
        "inp = keras.Input((4,))\n"
        "model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(4)(inp)))\n"
        "model.compile(optimizer='sgd', loss='mse')\n"
        "model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0, gradient_checkpointing=True)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "unexpected keyword argument 'gradient_checkpointing'" in proc.stderr
    assert "Tip: call `graphckpt.install()` first, or `graphckpt.fit(model, x, y, ..., gradient_checkpointing=True)`" in proc.stderr


def test_a_verbose_flagged_fit_says_what_it_planned(installed, capsys):
    model = regularized()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=8, epochs=1, verbose=2, gradient_checkpointing=True)
    expected = graphckpt.plan(model, input_shape=(8, 8))
    recomputed = [s for s in expected.segments if s.remat]
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("graphckpt:")]
    assert line.startswith(
        f"graphckpt: model 'regularized', planned for batches of 8: {len(expected.segments)} segments, "
        f"{len(recomputed)} recomputed ({sum(len(s.nodes) for s in recomputed)} of {expected.num_layer_calls} layer calls"
    )
    assert f"(x{expected.estimated_peak_bytes / expected.baseline_peak_bytes:.2f})" in line
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, gradient_checkpointing=True)
    assert "graphckpt:" not in capsys.readouterr().out


@pytest.mark.backends
def test_float16_attention_model_trains_as_plain_fit(installed):
    """Planning and rewriting run layers symbolically; under float16 on
    PyTorch's CPU some symbolic calls run on real tensors and draw from
    torch's global generator. The flag keeps that state, so training draws
    the same Dropout masks as plain fit."""
    from tests.subclassed_models import Block

    def build():
        keras.utils.set_random_seed(5)
        inp = keras.Input((16,), dtype="int32")
        x = layers.Embedding(50, 16)(inp)
        for _ in range(3):
            x = Block(16, 2, 32)(x)
        return keras.Model(inp, layers.Dense(50, dtype="float32")(x))

    tokens = np.random.default_rng(0).integers(0, 50, size=(16, 16))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        (plain, h0), (model, h1) = fit_twice(
            build, dict(x=tokens, y=tokens, batch_size=8, epochs=2, shuffle=False, verbose=0),
            {"optimizer": "sgd", "loss": loss}, flag=2,
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    rtol = 2e-3 if keras.backend.backend() == "jax" else 0.0  # JAX: one float16 ulp where XLA fuses otherwise
    np.testing.assert_allclose(h1.history["loss"], h0.history["loss"], rtol=rtol)
    assert segments_of(model)
