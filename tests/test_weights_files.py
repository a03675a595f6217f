"""A checkpointed model's weights files are its source model's, both ways, and
`keras.models.clone_model` of one keeps its shared layers shared.

Weights files: `ck.save_weights` writes the file the plain model writes
(`ModelCheckpoint(save_weights_only=True)` and `BackupAndRestore` call it), so
each model's file loads into the other, optimizer state included; a load that
fails changes nothing. Cloning: the clone is a checkpointed model with the
same plan over a clone of the source, one new layer per original layer.
"""

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from graphckpt.runtime.segment import Segment
from tests import models
from tests.helpers import BACKEND, compare_step, to_numpy


def shared_across_segments(dropout=0.3):
    """One Dense called first and last: with 3 segments, it is in two."""
    inp = keras.Input((8,), name="x")
    shared = layers.Dense(8, activation="tanh", name="shared")
    x = shared(inp)
    for _ in range(6):
        x = layers.Dense(8, activation="tanh")(x)
    x = layers.BatchNormalization()(x)
    x = shared(layers.Dropout(dropout)(x) if dropout else x)
    return keras.Model(inp, layers.Dense(1)(x), name="shared_model")


def sequential():
    return keras.Sequential([keras.Input((8,))] + [layers.Dense(8, activation="relu") for _ in range(5)], name="seq")


# multi_io: its checkpointed model would list its variables in another order
# (Keras lists them layer by layer, and those layers are segments).
BUILDERS = {
    "shared": shared_across_segments,
    "multi_io": models.multi_io,
    "nested": models.nested,
    "sequential": sequential,
}


def values(model):
    """What weights files hold: `model.weights` (seed states are not saved)."""
    return [to_numpy(v.value) for v in model.weights]


def assert_values_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def holders_of(ck, name):
    """The layer objects named `name` inside `ck`'s segments."""
    return [l for s in ck.layers if isinstance(s, Segment) for l in s.model.layers if l.name == name]


def segment_contents(ck):
    return [[l.name for l in s.model.layers[len(s.model.inputs) :]] for s in ck.layers if isinstance(s, Segment)]


# -- clone_model -------------------------------------------------------------


@pytest.mark.backends
def test_clone_model_keeps_a_layer_shared_across_segments_one_layer():
    model = shared_across_segments()
    ck = graphckpt.checkpoint_model(model, segments=3)
    assert len(holders_of(ck, "shared")) == 2  # in two segments

    clone = keras.models.clone_model(ck)
    assert type(clone) is graphckpt.CheckpointedModel
    assert segment_contents(clone) == segment_contents(ck)  # the same plan
    copies = holders_of(clone, "shared")
    assert len(copies) == 2 and copies[0] is copies[1]
    assert copies[0] is not model.get_layer("shared")
    # One new variable per original one: none shared with the original.
    assert len(clone.variables) == len(model.variables)
    assert not {id(v) for v in clone.variables} & {id(v) for v in model.variables}
    plain = graphckpt.uncheckpoint(clone)
    assert plain.get_layer("shared") is copies[0]

    # The clone trains with checkpointing, exactly like its own plain model.
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    segments = [s for s in clone.layers if isinstance(s, Segment)]
    compare_step(plain, clone, x, compiled=BACKEND == "jax")
    # Forward, then recompute; JAX traces the rematerialized function once.
    assert all(s.forward_calls >= (1 if BACKEND == "jax" else 2) for s in segments)


def test_clone_model_honours_clone_function_input_tensors_and_call_function():
    model = shared_across_segments()
    ck = graphckpt.checkpoint_model(model, segments=3)
    ck.compile(optimizer="sgd", loss="mse")

    def renamed(layer):
        return layer.__class__.from_config({**layer.get_config(), "name": f"copy_{layer.name}"})

    new_input = keras.Input((8,), name="new_input")
    calls = []

    def call_function(layer, *args, **kwargs):
        calls.append(layer.name)
        return layer(*args, **kwargs)

    clone = keras.models.clone_model(ck, clone_function=renamed, input_tensors=new_input, call_function=call_function)
    assert type(clone) is graphckpt.CheckpointedModel
    assert clone.inputs[0] is new_input
    assert segment_contents(clone) == [[f"copy_{n}" for n in seg] for seg in segment_contents(ck)]
    copies = holders_of(clone, "copy_shared")
    assert len(copies) == 2 and copies[0] is copies[1]
    assert calls.count("copy_shared") == 2 and len(calls) == ck.plan.num_layer_calls
    # clone_model compiles the clone as the original was; it fits.
    x = np.ones((8, 8), "float32")
    clone.fit(x, np.zeros((8, 1), "float32"), verbose=0)
    assert int(clone.optimizer.iterations) == 1


def test_clone_model_that_cannot_keep_the_plan_raises():
    ck = graphckpt.checkpoint_model(shared_across_segments(), segments=3)

    def add_dropout(layer, *args, **kwargs):
        out = layer(*args, **kwargs)
        return layers.Dropout(0.1)(out) if isinstance(layer, layers.Dense) else out

    with pytest.raises(graphckpt.UnsupportedModelError, match="clone the plain model and checkpoint"):
        keras.models.clone_model(ck, call_function=add_dropout)
    # Built from tensors alone, a CheckpointedModel has no source nor plan.
    inp = keras.Input((8,))
    with pytest.raises(graphckpt.InvalidArgumentError, match="checkpoint_model"):
        graphckpt.CheckpointedModel(inp, layers.Dense(1)(inp))


# -- weights files ----------------------------------------------------------


@pytest.mark.backends
@pytest.mark.parametrize("fmt", ["weights.h5", "weights.json"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_weights_files_load_into_each_other(name, fmt, tmp_path):
    build = BUILDERS[name]
    shards = {"max_shard_size": 0.0001} if fmt == "weights.json" else {}
    plain, other, third = build(), build(), build()  # same architecture, other weights
    ck = graphckpt.checkpoint_model(other, segments=3)
    ck2 = graphckpt.checkpoint_model(third, segments=2)

    # The plain model's file into a checkpointed model...
    plain.save_weights(tmp_path / f"plain.{fmt}", **shards)
    ck.load_weights(tmp_path / f"plain.{fmt}")
    assert_values_equal(values(other), values(plain))
    # ...and a checkpointed model's file into the plain model and into a
    # checkpointed model with another plan.
    fresh = build()
    ck.save_weights(tmp_path / f"ck.{fmt}", **shards)
    fresh.load_weights(tmp_path / f"ck.{fmt}")
    assert_values_equal(values(fresh), values(plain))
    ck2.load_weights(tmp_path / f"ck.{fmt}")
    assert_values_equal(values(third), values(plain))
    # Weight lists line up with the plain model's too.
    assert_values_equal(ck2.get_weights(), plain.get_weights())


def slots(model):
    return [to_numpy(v.value) for v in model.optimizer.variables]


def two_inputs():
    """`models.multi_io` without Dropout (weights files hold no seed states,
    so masks after a load would differ): a checkpointed model of it would
    list its variables, and so build its optimizer slots, in another order
    than it does, Keras listing them segment by segment."""
    a = keras.Input((6,), name="a")
    b = keras.Input((6,), name="b")
    shared = layers.Dense(8, activation="relu", name="shared")
    ha, hb = shared(a), shared(b)
    h = layers.Concatenate()([ha, hb])
    for _ in range(4):
        h = layers.Dense(8, activation="tanh")(h)
    side = layers.Dense(3, name="side")(ha)
    main = layers.Dense(1, name="main")(layers.Add()([h, shared(layers.Dense(6)(h))]))
    return keras.Model({"a": a, "b": b}, {"main": main, "side": side}, name="two_inputs")


@pytest.mark.backends
def test_optimizer_state_crosses_over_and_training_continues_the_same(tmp_path):
    x = models.sample_inputs(two_inputs(), batch=8)
    y = {"main": np.ones((8, 1), "float32"), "side": np.zeros((8, 3), "float32")}
    ck = graphckpt.checkpoint_model(two_inputs())
    source = graphckpt.uncheckpoint(ck)
    # Keras's own listing (segment by segment) differs from the source's.
    assert [id(v) for v in keras.layers.Layer.weights.fget(ck)] != [id(v) for v in source.weights]
    ck.compile(optimizer="adam", loss="mse")
    ck.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    ck.save_weights(tmp_path / "ck.weights.h5")

    plain = two_inputs()
    plain.compile(optimizer="adam", loss="mse")
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(tmp_path / "ck.weights.h5")
    assert_values_equal(values(plain), values(ck))
    assert_values_equal(slots(plain), slots(ck))
    # Each slot went to its own variable: a further epoch agrees.
    ck.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(values(plain), values(ck)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def wider_head():
    """`shared_across_segments` with a last Dense of 3 units, not 1."""
    model = shared_across_segments()
    return keras.Model(model.input, layers.Dense(3)(model.layers[-2].output), name="wider")


@pytest.mark.backends
def test_a_failed_load_changes_nothing(tmp_path):
    x = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")
    # A file that fits every layer but the last, with optimizer state.
    other = graphckpt.checkpoint_model(wider_head(), segments=3)
    other.compile(optimizer="adam", loss="mse")
    other.fit(x, np.ones((8, 3), "float32"), verbose=0)
    other.save_weights(tmp_path / "wider.weights.h5")

    model = shared_across_segments()
    ck = graphckpt.checkpoint_model(model, segments=3)
    ck.compile(optimizer="adam", loss="mse")
    ck.fit(x, np.ones((8, 1), "float32"), verbose=0)
    before = values(ck) + [to_numpy(v.value) for v in ck.optimizer.variables]
    with pytest.raises(graphckpt.InvalidArgumentError, match="Nothing was changed"):
        ck.load_weights(tmp_path / "wider.weights.h5")
    assert_values_equal(values(ck) + [to_numpy(v.value) for v in ck.optimizer.variables], before)


def test_keras_archives(tmp_path):
    plain = models.chain(bn=True)
    plain.save(tmp_path / "plain.keras")
    target = models.chain(bn=True)
    graphckpt.checkpoint_model(target, segments=3).load_weights(tmp_path / "plain.keras")
    assert_values_equal(values(target), values(plain))

    # An archive of a checkpointed model loads into one with the same plan...
    ck = graphckpt.checkpoint_model(plain, segments=3)
    ck.save(tmp_path / "ck.keras")
    same = models.chain(bn=True)
    graphckpt.checkpoint_model(same, segments=3).load_weights(tmp_path / "ck.keras")
    assert_values_equal(values(same), values(plain))
    # ...and is refused by one whose segments hold other layers.
    other = models.chain(bn=True)
    before = values(other)
    with pytest.raises(graphckpt.InvalidArgumentError, match="another plan"):
        graphckpt.checkpoint_model(other, segments=4).load_weights(tmp_path / "ck.keras")
    assert_values_equal(values(other), before)


def test_legacy_h5_files(tmp_path):
    plain = models.chain(bn=True)
    plain.save(tmp_path / "plain.h5")
    target = models.chain(bn=True)
    graphckpt.checkpoint_model(target, segments=3).load_weights(tmp_path / "plain.h5")
    assert_values_equal(values(target), values(plain))
    # The legacy file of a checkpointed model (which names its segments)
    # still loads into one with the same plan.
    graphckpt.checkpoint_model(plain, segments=3).save(tmp_path / "ck.h5")
    again = models.chain(bn=True)
    graphckpt.checkpoint_model(again, segments=3).load_weights(tmp_path / "ck.h5")
    assert_values_equal(values(again), values(plain))


# -- callbacks ---------------------------------------------------------------

X = np.random.default_rng(1).normal(size=(16, 8)).astype("float32")
Y = np.random.default_rng(2).normal(size=(16, 1)).astype("float32")


class _StopAt(keras.callbacks.Callback):
    """Interrupts training at the start of an epoch, as a crash would."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def _fresh(seed=5):
    # No Dropout: weights files do not hold seed states, so a resumed run
    # would draw other masks than an uninterrupted one, plain Keras alike.
    keras.utils.set_random_seed(seed)
    model = shared_across_segments(dropout=0)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def _fit(model, callbacks, epochs=3, **flag):
    keras.utils.set_random_seed(9)
    model.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks, **flag)


@pytest.mark.backends
def test_backup_of_a_checkpointed_model_resumes_the_plain_model(tmp_path):
    reference = _fresh()
    _fit(reference, [])

    # Epoch 0 with the checkpointed model, interrupted; the plain model
    # resumes from its backup (weights, momentum, epoch) and finishes.
    model = _fresh()
    ck = graphckpt.checkpoint_model(model, segments=3)
    ck.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(ck, [keras.callbacks.BackupAndRestore(tmp_path / "backup"), _StopAt(1)])
    plain = _fresh(seed=6)  # other initial weights: the backup must replace them
    _fit(plain, [keras.callbacks.BackupAndRestore(tmp_path / "backup")])
    assert int(plain.optimizer.iterations) == int(reference.optimizer.iterations) == 6
    for a, b in zip(values(plain), values(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fit_flag_callbacks_write_files_both_models_read(tmp_path):
    graphckpt.install()
    try:
        reference = _fresh()
        _fit(reference, [])
        model = _fresh()
        checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "last.weights.h5"), save_weights_only=True)
        backup = keras.callbacks.BackupAndRestore(tmp_path / "backup")
        with pytest.raises(RuntimeError, match="interrupted"):
            _fit(model, [checkpoint, backup, _StopAt(1)], gradient_checkpointing=3)
        after_one_epoch = values(model)
        # The backup restores the flagged run: it ends where the plain one does.
        resumed = _fresh(seed=6)
        _fit(resumed, [keras.callbacks.BackupAndRestore(tmp_path / "backup")], gradient_checkpointing=3)
        for a, b in zip(values(resumed), values(reference)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    finally:
        graphckpt.uninstall()
    # ModelCheckpoint's file loads into the plain model and a checkpointed one.
    plain = shared_across_segments(dropout=0)
    plain.load_weights(tmp_path / "last.weights.h5")
    assert_values_equal(values(plain), after_one_epoch)
    target = shared_across_segments(dropout=0)
    graphckpt.checkpoint_model(target, segments=2).load_weights(tmp_path / "last.weights.h5")
    assert_values_equal(values(target), after_one_epoch)


def test_a_checkpointed_model_still_saves_and_loads_whole(tmp_path):
    """`ck.save` keeps Keras's own walk, which `load_model` reads back; the
    loaded model lists its variables in its source's order."""
    model = models.multi_io()
    ck = graphckpt.checkpoint_model(model)
    ck.save(tmp_path / "ck.keras")
    loaded = keras.saving.load_model(tmp_path / "ck.keras")
    assert type(loaded) is graphckpt.CheckpointedModel
    assert_values_equal(values(loaded), values(ck))
    for attribute in ("variables", "weights", "trainable_variables", "non_trainable_weights"):
        mine, source = getattr(loaded, attribute), getattr(graphckpt.uncheckpoint(loaded), attribute)
        assert [id(v) for v in mine] == [id(v) for v in source], attribute
    assert_values_equal(loaded.get_weights(), graphckpt.uncheckpoint(loaded).get_weights())


@pytest.mark.backends
def test_weights_file_errors_have_the_types_keras_raises_for_the_plain_model(tmp_path):
    """What `load_weights` raises for a missing, a corrupt and a mismatched
    file is an instance of what Keras raises for the plain model (callbacks
    catch `OSError`), and changes nothing."""
    model = _fresh()
    ck = graphckpt.checkpoint_model(model, segments=3)
    model.save_weights(tmp_path / "good.weights.h5")
    (tmp_path / "corrupt.weights.h5").write_bytes((tmp_path / "good.weights.h5").read_bytes()[:500])
    keras.Sequential([keras.Input((8,)), layers.Dense(3)]).save_weights(tmp_path / "other.weights.h5")
    before = values(ck)
    for name in ("missing.weights.h5", "corrupt.weights.h5", "other.weights.h5", "missing.keras"):
        with pytest.raises(Exception) as plain_error:
            _fresh().load_weights(tmp_path / name)
        with pytest.raises(graphckpt.GraphckptError) as error:
            ck.load_weights(tmp_path / name)
        assert isinstance(error.value, type(plain_error.value)), (name, plain_error.value, error.value)
        assert name in str(error.value) and "Nothing was changed" in str(error.value)
        assert_values_equal(values(ck), before)


@pytest.mark.backends
def test_backup_and_restore_falls_back_from_a_corrupt_backup_of_a_checkpointed_model(tmp_path):
    """`BackupAndRestore` reloads its previous backup when the latest one
    cannot be read (`except OSError`): a checkpointed model resumes as the
    plain model does."""
    runs = []
    for checkpointed in (False, True):
        model = _fresh()
        if checkpointed:
            model = graphckpt.checkpoint_model(model, segments=3)
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        backup = tmp_path / f"backup{len(runs)}"
        with pytest.raises(RuntimeError, match="interrupted"):
            _fit(model, [keras.callbacks.BackupAndRestore(backup, double_checkpoint=True), _StopAt(2)])
        latest = backup / "latest.weights.h5"
        assert (backup / "latest.weights.h5.bkp").exists()
        latest.write_bytes(latest.read_bytes()[:500])  # a crash mid-write
        _fit(model, [keras.callbacks.BackupAndRestore(backup, double_checkpoint=True)])  # resumes from the previous one
        runs.append(values(model))
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
