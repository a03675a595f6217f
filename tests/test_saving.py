"""A checkpointed model saves to `.keras` and loads back whole: same layers
(one object per layer, shared layers included), same predictions, same
segments, and it still trains with checkpointing."""

import json
import re
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import graphckpt
from graphckpt.graph.build import build_graph
from graphckpt.runtime.checkpointed import plan_to_config
from graphckpt.runtime.segment import Segment
from tests import models
from tests.helpers import compare_step


def save_and_load(model, tmp_path, name="ck.keras"):
    path = tmp_path / name
    model.save(path)
    return keras.saving.load_model(path), path


def segment_contents(model):
    return [[l.name for l in s.model.layers] for s in model.layers if isinstance(s, Segment)]


def plan_config(ck):
    return plan_to_config(build_graph(graphckpt.uncheckpoint(ck)), ck.plan)


def predict(model, x):
    return keras.tree.map_structure(np.asarray, model.predict(x, verbose=0))


def assert_same(a, b, **kwargs):
    for x, y in zip(keras.tree.flatten(a), keras.tree.flatten(b)):
        np.testing.assert_allclose(x, y, **kwargs)


@pytest.mark.parametrize("name", ["chain", "multi_io", "nested", "masked_lstm", "resnet"])
def test_round_trip(name, tmp_path):
    model = models.ALL[name]()
    ck = graphckpt.checkpoint_model(model)
    x = models.sample_inputs(model)
    loaded, path = save_and_load(ck, tmp_path)
    assert type(loaded) is graphckpt.CheckpointedModel
    assert segment_contents(loaded) == segment_contents(ck)
    assert plan_config(loaded) == plan_config(ck)
    assert len(loaded.weights) == len(ck.weights) == len(model.weights)
    assert_same(predict(loaded, x), predict(ck, x), rtol=1e-6, atol=1e-6)
    # The file holds the source model once, and the plan; no Segment configs.
    with zipfile.ZipFile(path) as z:
        config = json.loads(z.read("config.json"))
    assert config["registered_name"] == "graphckpt>CheckpointedModel"
    assert "Segment" not in json.dumps(config)


def _shared_across_segments():
    inp = keras.Input((8,))
    shared = layers.Dense(8, activation="tanh", name="shared")
    x = shared(inp)
    for _ in range(6):
        x = layers.Dense(8, activation="tanh")(x)
    x = shared(x)
    return keras.Model(inp, layers.Dense(1)(x), name="shared_model")


def test_a_layer_shared_across_segments_stays_one_layer(tmp_path):
    model = _shared_across_segments()
    ck = graphckpt.checkpoint_model(model, segments=3)
    holders = [s for s in ck.layers if isinstance(s, Segment) and "shared" in [l.name for l in s.model.layers]]
    assert [s.name for s in holders] == ["segment_0", "segment_2"]

    loaded, _ = save_and_load(ck, tmp_path)
    copies = [l for s in loaded.layers if isinstance(s, Segment) for l in s.model.layers if l.name == "shared"]
    assert len(copies) == 2 and copies[0] is copies[1]
    assert len(loaded.trainable_variables) == len(model.trainable_variables)
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    assert_same(predict(loaded, x), predict(ck, x), rtol=1e-6)
    # Training moves the one shared kernel; both segments see the move.
    plain = graphckpt.uncheckpoint(loaded)
    assert plain.get_layer("shared") is copies[0]
    compare_step(plain, loaded, x, compiled=True)


def test_the_loaded_model_trains_with_checkpointing(tmp_path):
    model = models.chain(dropout=0.3, bn=True)
    ck = graphckpt.checkpoint_model(model, segments=3)
    ck.compile(optimizer="adam", loss="mse", run_eagerly=True)
    x = np.random.default_rng(1).normal(size=(16, 16)).astype("float32")
    y = np.random.default_rng(2).normal(size=(16, 2)).astype("float32")
    ck.fit(x, y, batch_size=8, epochs=1, verbose=0)
    loaded, _ = save_and_load(ck, tmp_path)
    assert int(loaded.optimizer.iterations) == 2  # compile state and optimizer came back
    assert loaded.run_eagerly
    assert_same(predict(loaded, x), predict(ck, x), rtol=1e-6)

    segments = [l for l in loaded.layers if isinstance(l, Segment)]
    with tf.GradientTape() as tape:
        out = loaded(x, training=True)
    assert [s.forward_calls for s in segments] == [1, 1, 1]
    tape.gradient(out, loaded.trainable_variables)
    assert [s.forward_calls for s in segments] == [2, 2, 2]  # recomputed in backward

    # Exact against its own plain model; `fit` recomputes every step.
    compare_step(graphckpt.uncheckpoint(loaded), loaded, x, compiled=False)
    before = [s.forward_calls for s in segments]
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert [s.forward_calls - b for s, b in zip(segments, before)] == [4, 4, 4]  # 2 steps x (forward + recompute)
    assert int(loaded.optimizer.iterations) == 4


def test_layer_with_calls_outside_the_model(tmp_path):
    """A layer first called in another model has node index 1 inside this
    one; the saved plan must not depend on that."""
    dense = layers.Dense(8, name="reused")
    other_in = keras.Input((8,))
    keras.Model(other_in, dense(other_in))
    inp = keras.Input((8,))
    x = inp
    for _ in range(4):
        x = layers.Dense(8, activation="relu")(x)
    model = keras.Model(inp, layers.Dense(1)(dense(x)))
    ck = graphckpt.checkpoint_model(model, segments=2)
    loaded, _ = save_and_load(ck, tmp_path)
    assert segment_contents(loaded) == segment_contents(ck)
    assert plan_config(loaded) == plan_config(ck)
    assert ("reused", 1) in ck.plan.order  # node index 1 here...
    assert ("reused", 0) in loaded.plan.order  # ...and 0 after loading
    x = np.ones((2, 8), "float32")
    assert_same(predict(loaded, x), predict(ck, x), rtol=1e-6)


def test_budget_plan_with_segments_not_recomputed(tmp_path):
    model = models.chain(depth=12, width=16, dropout=0.3)
    ck = graphckpt.checkpoint_model(model, budget=0.6, batch_size=32)
    assert not all(s.remat for s in ck.plan.segments)  # some calls run inline
    loaded, _ = save_and_load(ck, tmp_path)
    assert plan_config(loaded) == plan_config(ck)
    assert [s.remat for s in loaded.plan.segments] == [s.remat for s in ck.plan.segments]
    assert loaded.plan.estimated_peak_bytes == ck.plan.estimated_peak_bytes
    assert [l.name for l in loaded.layers] == [l.name for l in ck.layers]
    lines = []
    loaded.summary(print_fn=lambda line, **_: lines.append(line))
    assert re.search(r"^  inline_\d+ \(\d+ layers?, not recomputed\): ", lines[-1], flags=re.M)
    x = np.random.default_rng(3).normal(size=(4, 16)).astype("float32")
    assert_same(predict(loaded, x), predict(ck, x), rtol=1e-6)
    compare_step(graphckpt.uncheckpoint(loaded), loaded, x, compiled=True)


def test_sequential_source(tmp_path):
    model = keras.Sequential([keras.Input((8,))] + [layers.Dense(8, activation="relu") for _ in range(5)])
    ck = graphckpt.checkpoint_model(model, segments=2)
    loaded, _ = save_and_load(ck, tmp_path)
    assert isinstance(graphckpt.uncheckpoint(loaded), keras.Sequential)
    x = np.ones((2, 8), "float32")
    assert_same(predict(loaded, x), predict(model, x), rtol=1e-6)


def test_uncheckpoint(tmp_path):
    model = models.multi_io()
    ck = graphckpt.checkpoint_model(model)
    assert graphckpt.uncheckpoint(ck) is model
    loaded, _ = save_and_load(ck, tmp_path)
    plain = graphckpt.uncheckpoint(loaded)
    assert not graphckpt.is_checkpointed(plain)
    segments = [s for s in loaded.layers if isinstance(s, Segment)]
    inside = {id(l) for s in segments for l in s.model.layers}
    inline = {id(l) for l in loaded.layers if not isinstance(l, Segment)}  # the last segment's calls
    assert segments and inside
    assert all(id(l) in inside | inline for l in plain.layers if not isinstance(l, keras.layers.InputLayer))
    x = models.sample_inputs(model)
    assert_same(predict(plain, x), predict(model, x), rtol=1e-6)
    # Exported as a plain model: loads without graphckpt's classes.
    again, _ = save_and_load(plain, tmp_path, "plain.keras")
    assert not isinstance(again, graphckpt.CheckpointedModel)
    with pytest.raises(graphckpt.InvalidArgumentError, match="checkpoint_model"):
        graphckpt.uncheckpoint(model)


def test_summary_names_segments_and_their_layers():
    model = models.chain(depth=6)
    ck = graphckpt.checkpoint_model(model, segments=3)
    lines = []
    ck.summary(print_fn=lambda line, **_: lines.append(line))
    text = "\n".join(lines)
    assert "segment_0 (Segment)" in text
    listing = text[text.index("Segments: 3 over 7 layer calls") :].splitlines()[1:]
    assert [line.split(" (")[0].strip() for line in listing] == ["segment_0", "segment_1", "segment_2"]
    named = [name for line in listing for name in line.split(": ", 1)[1].split(", ")]
    assert named == [l.name for l in model.layers[1:]]  # every layer, in order, once
